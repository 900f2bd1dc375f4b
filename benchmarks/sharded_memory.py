"""Memory per rank: `--sharding fsdp` against DDP, the same model, world sizes 2 and 4.

    python -m benchmarks.sharded_memory                        # worlds 2 and 4, 3 repetitions
    python -m benchmarks.sharded_memory --worlds 2 --repetitions 1 --hidden 1024
    python -m benchmarks.sharded_memory --no-memory-copies     # both modes without memory copies
    python -m benchmarks.sharded_memory --phases --worlds 2 --repetitions 1   # where the peak comes from

(run from the repository root, one job at a time on the machine). Each run is one torchrun agent
with `--nproc_per_node` workers (`benchmarks.throughput.run_torchrun`: plain torchrun, the shipped
agent environment, one thread per worker) training `elastic_ddp.train` through
`benchmarks.elastic_worker` (which reports each worker's peak resident memory, VmHWM, at exit) on
`wide_mlp` below: a model whose state dwarfs the interpreter and torch, so that what sharding
saves shows. AdamW, so the optimizer holds two moments per parameter. Both modes run with the
defaults, memory copies included (DDP's memory copy of the whole state, the sharded mode's parts
and their buddies' copies), so the figures are what a user gets; `--no-memory-copies` runs both
without them, to see what they cost. The two modes alternate within a
repetition, the order reversed every other one, so that a drift in machine load falls on both.

Per run it records:
- `peak_rss_mb`: each worker's VmHWM at exit (the table gives the largest over the ranks);
- `state_mb`: the state each rank holds, read from the run's last snapshot: DDP's snapshot file
  (the whole model and optimizer, the same on every rank), or the largest of the sharded step's
  `__<rank>_*.distcp` files (the rank's shards of the model and optimizer).

With `--phases` the workers are `benchmarks.memory_phases` (probes at the entry and exit of the
calls that allocate: building, sharding, a step, a memory part, a snapshot), and the largest rank's
growth of its peak per interval between two probes is printed under the table.

Not measured: the transient peak inside a step (VmHWM includes it: it is the peak), CUDA memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from benchmarks.table import Row, render_markdown
from benchmarks.throughput import run_torchrun
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.sharded import step_directories
from elastic_ddp.workload.data import IMAGE_SHAPE, NUM_CLASSES

MODES = ("fsdp", "none")  # --sharding values; none is DDP
HIDDEN = 2048  # 14.2 M parameters with LAYERS: 54 MiB of weights, 162 MiB with AdamW's two moments
LAYERS = 4
MIB = 2**20


class WideMLP(nn.Module):
    """An MLP of `layers` hidden layers of `hidden` units over the built-in images."""

    def __init__(self, hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__()
        inputs = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
        widths = [inputs, *[hidden] * layers]
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x):
        x = x.flatten(1)
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)

    def sharding_blocks(self) -> list[nn.Module]:
        return [*self.blocks, self.head]


def wide_mlp() -> nn.Module:
    """`--model benchmarks.sharded_memory:wide_mlp` (width from BENCH_HIDDEN, default HIDDEN)."""
    return WideMLP(int(os.environ.get("BENCH_HIDDEN", HIDDEN)))


def training_args(mode: str, checkpoint_dir: Path, memory_copies: bool = True) -> list[str]:
    return [*([] if memory_copies else ["--no-memory_copies"]), "--model", "benchmarks.sharded_memory:wide_mlp", "--optimizer", "adamw", "--sharding", mode, "--lr", "0.001",
            "--epochs", "2", "--dataset_size", "512", "--global_batch_size", "64", "--snapshot_every_steps", "8",
            "--log_interval", "8", "--checkpoint_dir", str(checkpoint_dir)]


def state_mb_per_rank(mode: str, checkpoint_dir: Path) -> float:
    """The state one rank holds, from the run's last snapshot (module docstring)."""
    if mode == "fsdp":
        (_, newest), *_ = step_directories.committed_steps(checkpoint_dir)
        return max(path.stat().st_size for path in newest.glob("__*_*.distcp")) / MIB
    snapshots = [e for e in read_events(checkpoint_dir / "events.jsonl") if e["event"] == "snapshot"]
    return snapshots[-1]["size_bytes"] / MIB


def measure_once(mode: str, world_size: int, run_dir: Path, timeout: float, memory_copies: bool,
                 phases: bool = False) -> dict[str, Any]:
    checkpoint_dir = run_dir / "ck"
    worker = "benchmarks.memory_phases" if phases else "benchmarks.elastic_worker"
    records, seconds = run_torchrun(worker, training_args(mode, checkpoint_dir, memory_copies), run_dir,
                                    world_size, timeout)
    record = {"mode": mode, "world_size": world_size, "seconds": round(seconds, 1),
              "peak_rss_mb": sorted(r["peak_rss_mb"] for r in records),
              "state_mb": round(state_mb_per_rank(mode, checkpoint_dir), 2)}
    if phases:
        largest = max(records, key=lambda r: r["peak_rss_mb"])
        record["phases"] = {key: largest[key] for key in ("rank", "first_hwm_mb", "hwm_growth", "rss")}
    return record


def print_phases(record: dict[str, Any]) -> None:
    """The largest rank's growth of its peak per interval between probes (benchmarks.memory_phases)."""
    phases = record["phases"]
    print(f"\n{record['mode']} world {record['world_size']}, rank {phases['rank']}: peak "
          f"{max(record['peak_rss_mb'])} MiB, {phases['first_hwm_mb']} MiB at the first probe; its growth:")
    for interval, mib in phases["hwm_growth"].items():
        if mib >= 1:
            print(f"  {mib:7.1f} MiB  {interval}")
    print("  largest VmRSS at: " + ", ".join(f"{mark} {mib}" for mark, mib in phases["rss"].items()
                                              if mark.startswith("exit")))


def measure(worlds: list[int], repetitions: int, work_dir: Path, timeout: float,
            memory_copies: bool = True, phases: bool = False) -> list[dict]:
    records = []
    for repetition in range(repetitions):
        for world_size in worlds:
            modes = MODES if repetition % 2 == 0 else MODES[::-1]
            for mode in modes:
                record = measure_once(mode, world_size, work_dir / f"{mode}-{world_size}-{repetition}", timeout,
                                      memory_copies, phases)
                records.append(record)
                print(f"{mode} world {world_size} #{repetition + 1}: peak RSS per worker {record['peak_rss_mb']} MiB, "
                      f"state per rank {record['state_mb']} MiB, {record['seconds']} s", file=sys.stderr, flush=True)
    return records


def rows(records: list[dict]) -> list[Row]:
    """Sharded over DDP, paired per repetition, per world size."""
    table = []
    for world_size in dict.fromkeys(r["world_size"] for r in records):
        of = {mode: [r for r in records if r["world_size"] == world_size and r["mode"] == mode] for mode in MODES}
        note = f"{world_size} workers, one agent, AdamW"
        table.append(Row("memory", f"world {world_size}: peak RSS per worker (largest rank), MiB",
                         [max(r["peak_rss_mb"]) for r in of["fsdp"]], [max(r["peak_rss_mb"]) for r in of["none"]],
                         "DDP", note=note))
        table.append(Row("memory", f"world {world_size}: state held per rank, MiB",
                         [r["state_mb"] for r in of["fsdp"]], [r["state_mb"] for r in of["none"]], "DDP",
                         note="model + optimizer, from the last snapshot"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="Width of wide_mlp's hidden layers.")
    parser.add_argument("--no-memory-copies", dest="memory_copies", action="store_false",
                        help="Run both modes with --no-memory_copies.")
    parser.add_argument("--phases", action="store_true",
                        help="Probe where each worker's peak comes from (benchmarks.memory_phases).")
    parser.add_argument("--timeout", type=float, default=600, help="Seconds one run may take.")
    parser.add_argument("--json", type=Path, help="Also write the raw records here.")
    args = parser.parse_args(argv)
    os.environ["BENCH_HIDDEN"] = str(args.hidden)  # the workers inherit it through torchrun
    with tempfile.TemporaryDirectory(prefix="sharded-memory-") as work_dir:
        records = measure(args.worlds, args.repetitions, Path(work_dir), args.timeout, args.memory_copies,
                          args.phases)
    print(render_markdown(rows(records)))
    for record in records:
        if "phases" in record:
            print_phases(record)
    for world_size in args.worlds:
        medians = {mode: statistics.median(max(r["peak_rss_mb"]) for r in records
                                           if r["world_size"] == world_size and r["mode"] == mode) for mode in MODES}
        print(f"world {world_size}: median peak RSS, fsdp {medians['fsdp']:.0f} MiB, DDP {medians['none']:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
