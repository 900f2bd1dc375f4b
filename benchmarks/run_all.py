"""Every benchmark of elastic_ddp against its baseline, printed as one markdown table.

    python benchmarks/run_all.py                # full size (about 30 minutes on 2 cores)
    python benchmarks/run_all.py --quick        # CI-sized smoke run (under a minute on a quiet machine)
    python benchmarks/run_all.py --only throughput data_path
    python benchmarks/run_all.py --device cuda  # throughput on GPUs: nccl, AMP, one worker per GPU

Sections (each module's docstring says exactly what it measures and how):

- throughput, memory  `benchmarks.throughput`: `elastic_ddp.train` against the bare DDP loop
  (`benchmarks.bare_ddp`) under torchrun, interleaved; snapshots at epoch ends and every 50 steps.
- data_path           `benchmarks.data_path`: the input pipeline alone against the model step, and
  with a collate of variable-length samples against a plain DataLoader (0 and 2 workers).
- snapshot            `benchmarks.snapshot_sweep` (10 MB, 100 MB, 1 GB against a synchronous save
  and the disk's own bandwidth) and `benchmarks.snapshot_cost` (slowdown of snapshots every 50 steps).
- checksums           `benchmarks.checksums`: the snapshot writer (BLAKE3, and sha256 of format 1)
  against the disk's own write + fsync at 100 MB and 1 GB, and each checksum candidate alone.
- rendezvous          `benchmarks.rendezvous_scale`: 8 and 64 simulated agents through a first round,
  a kill and a join, on our elastic-c10d and etcd-v3 backends (our rendezvous). The growth
  from 8 to 64 (goal <= 2x), writes per agent per phase (goal <= 4) and the 64-agent phases (goal
  < 3 s) against their goals.
- recovery            `benchmarks.recovery`: SIGKILL of a node to the first resumed step, and a new
  node to its first step, with the shipped launch settings against stock torchrun's; and the
  committed steps each redoes, against periodic snapshots alone and the tutorial's per-epoch one.
- sharded             `--sharding fsdp` (docs/sharding.md): `benchmarks.throughput --sharding fsdp`
  (the MLP against a bare FSDP2 loop), `benchmarks.sharded_memory` (memory per rank against DDP
  for the same model, worlds 2 and 4) and `benchmarks.recovery --settings fsdp ours` (a SIGKILL, a
  join and a SIGSTOP to the first step, and the committed steps redone, against the same launch in
  DDP mode).

Each cell is `median [min..max]` over the repetitions; the ratio is elastic_ddp over the baseline
(per repetition when the two were measured in pairs). The table is preceded by a description of
the machine. `--quick` shrinks every section (rendezvous: 2 and 4 agents, elastic-c10d only) and
leaves recovery out (one stock-torchrun kill alone waits out its 30 s rendezvous timeout) and sharded
(its three benchmarks run torchrun jobs for minutes: 260 s with `--repetitions 1` on 2 cores;
`--only sharded` runs it alone). A section that fails is reported in the table and makes the
exit code 1; the other sections still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run_all.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.table import Row, render_markdown

SECTIONS = ("throughput", "data_path", "snapshot", "checksums", "rendezvous", "recovery", "sharded")
RECOVERY_SETTINGS = ("ours", "stock", "tutorial")
SHARDED_RECOVERY_SETTINGS = ("fsdp", "ours")  # sharded, then the same launch in DDP mode (its baseline)
SHARDED_MEMORY_WORLDS = [2, 4]
# One cadence run of benchmarks.snapshot_cost in --quick (its own default is the full one).
QUICK_CADENCE = {"hidden": 512, "warmup": 2, "steps": 40, "every": 20, "repetitions": 1}


class SectionSkipped(Exception):
    """A section that does not run in this mode; the message says why."""


Progress = Callable[[str], None]


def run_throughput(quick: bool, repetitions: int | None, work_dir: Path, progress: Progress,
                   device: str, use_amp: bool) -> list[Row]:
    from benchmarks import throughput

    world_size = None
    if device == "cuda":
        import torch

        world_size = torch.cuda.device_count()
    # --quick measures the MLP only: every torchrun job costs seconds of start-up.
    models = ["mlp"] if quick else None
    workloads = throughput.workloads_for(quick, models, device, use_amp, world_size)
    return throughput.measure(workloads, repetitions or (1 if quick else 5), work_dir / "throughput",
                              progress=progress)


def run_data_path(quick: bool, repetitions: int | None, work_dir: Path, progress: Progress, **_) -> list[Row]:
    from benchmarks import data_path

    repetitions = repetitions or (1 if quick else 5)
    return (data_path.measure(data_path.QUICK if quick else data_path.FULL, repetitions, progress=progress)
            + data_path.measure_tokens(data_path.QUICK_TOKENS if quick else data_path.FULL_TOKENS, repetitions,
                                       progress=progress))


def run_snapshot(quick: bool, repetitions: int | None, work_dir: Path, progress: Progress, **_) -> list[Row]:
    from benchmarks import snapshot_cost, snapshot_sweep

    rows = snapshot_sweep.measure(snapshot_sweep.QUICK if quick else snapshot_sweep.FULL, work_dir / "snapshot",
                                  progress=progress)
    options = snapshot_cost.SnapshotCostOptions(**QUICK_CADENCE) if quick else snapshot_cost.SnapshotCostOptions()
    if repetitions and not quick:
        options.repetitions = repetitions
    options.directory = str(work_dir / "snapshot" / "cadence")
    started = time.monotonic()
    result = snapshot_cost.measure_snapshot_cost(options)
    progress(f"snapshot cadence: {len(result.runs)} runs in {time.monotonic() - started:.0f} s")
    return rows + snapshot_sweep.cadence_rows(result, "wide MLP")


def run_checksums(quick: bool, repetitions: int | None, work_dir: Path, progress: Progress, **_) -> list[Row]:
    from benchmarks import checksums

    directory = work_dir / "checksums"
    directory.mkdir(parents=True, exist_ok=True)
    return checksums.measure([10] if quick else [100, 1000], repetitions or (1 if quick else 5), 32 if quick else 256,
                             directory, progress=progress)


def run_rendezvous(quick: bool, repetitions: int | None, work_dir: Path, progress: Progress, **_) -> list[Row]:
    from benchmarks import rendezvous_scale

    counts = [2, 4] if quick else [8, 64]
    backends = ["elastic-c10d"] if quick else list(rendezvous_scale.DEFAULT_BACKENDS)
    records = rendezvous_scale.measure_with_etcd(backends, counts, repetitions or 1, progress=progress)
    return rendezvous_scale.rows(records, baseline_agents=counts[0])


def run_recovery(quick: bool, repetitions: int | None, work_dir: Path, progress: Progress, **_) -> list[Row]:
    if quick:
        raise SectionSkipped("left out of --quick: one kill under stock torchrun settings alone waits out "
                             "the 30 s last-call timeout; run without --quick")
    from benchmarks import recovery

    records = recovery.measure(list(RECOVERY_SETTINGS), repetitions or 3, work_dir / "recovery")
    return recovery_rows(records)


def recovery_rows(records: list[dict]) -> list[Row]:
    """Rows from `benchmarks.recovery.measure` records: ours against stock, paired per round."""
    rows = []
    note = "3 torchrun agents of 1 worker on 127.0.0.1, MLP, 64 steps per epoch"
    titles = {"kill": ("SIGKILL of 1 of 3 nodes -> first step without it, s", "< 5"),
              "join": ("new node started -> first step with it (world 2 -> 3), s", "< 8")}

    def of(setting: str, event: str, key: str) -> list[float]:
        return [r[event][key] for r in records if r["setting"] == setting and r[event].get(key) is not None]

    for event, (figure, target) in titles.items():
        rows.append(Row("recovery", figure, of("ours", event, "seconds"), of("stock", event, "seconds"),
                        "stock torchrun settings", target=target, target_on="elastic", note=note))
    for event, what in (("kill", "a SIGKILL of 1 of 3 nodes"), ("join", "a join")):
        for baseline, name in (("stock", "stock torchrun, a snapshot every 20 steps"),
                               ("tutorial", "stock torchrun, a snapshot per epoch (tutorial)")):
            ours, theirs = of("ours", event, "lost_steps"), of(baseline, event, "lost_steps")
            if ours and theirs:
                rows.append(Row("recovery", f"committed steps redone after {what}", ours, theirs, name,
                                target="<= 1", target_on="elastic", note=note))
    return rows


def run_sharded(quick: bool, repetitions: int | None, work_dir: Path, progress: Progress, **_) -> list[Row]:
    if quick:
        raise SectionSkipped("left out of --quick: its three benchmarks run torchrun jobs for minutes (260 s with "
                             "--repetitions 1 on 2 cores); run without --quick, or `--only sharded`")
    from benchmarks import recovery, sharded_memory, throughput

    repetitions = repetitions or 3
    workloads = throughput.workloads_for(False, ["mlp"], sharding="fsdp")
    rows = [sharded_row(row) for row in throughput.measure(workloads, repetitions, work_dir / "sharded-throughput",
                                                           progress=progress)]
    started = time.monotonic()
    records = sharded_memory.measure(SHARDED_MEMORY_WORLDS, repetitions, work_dir / "sharded-memory", timeout=600)
    progress(f"sharded memory: {len(records)} runs in {time.monotonic() - started:.0f} s")
    rows += [sharded_row(row) for row in sharded_memory.rows(records)]
    records = recovery.measure(list(SHARDED_RECOVERY_SETTINGS), repetitions, work_dir / "sharded-recovery")
    return rows + sharded_recovery_rows(records)


def sharded_row(row: Row) -> Row:
    """A row of a benchmark run with `--sharding fsdp`, under the `sharded` heading; the bare loop it
    is measured against is then a bare FSDP2 loop."""
    baseline_name = "bare FSDP2" if row.baseline_name == "bare DDP" else row.baseline_name
    return dataclasses.replace(row, benchmark="sharded", baseline_name=baseline_name)


def sharded_recovery_rows(records: list[dict]) -> list[Row]:
    """Rows from `benchmarks.recovery.measure` records of SHARDED_RECOVERY_SETTINGS: sharded against
    DDP, the same launch, paired per round."""
    note = "3 torchrun agents of 1 worker on 127.0.0.1, MLP, the shipped launcher; the same with DDP"
    titles = {"kill": "SIGKILL of 1 of 3 nodes -> first step without it, s",
              "join": "new node started -> first step with it (world 2 -> 3), s",
              "freeze": "SIGSTOP of a node -> first step without it, s"}

    def of(setting: str, event: str, key: str) -> list[float]:
        return [r[event][key] for r in records if r["setting"] == setting and r[event].get(key) is not None]

    rows = [Row("sharded", figure, of("fsdp", event, "seconds"), of("ours", event, "seconds"), "DDP",
                note=note) for event, figure in titles.items()]
    for event in ("kill", "freeze"):
        rows.append(Row("sharded", f"committed steps redone after a {'SIGKILL' if event == 'kill' else 'SIGSTOP'}",
                        of("fsdp", event, "lost_steps"), of("ours", event, "lost_steps"), "DDP",
                        target="<= 0", target_on="elastic", note=note))
    return rows


RUNNERS = {"throughput": run_throughput, "data_path": run_data_path, "snapshot": run_snapshot,
           "checksums": run_checksums, "rendezvous": run_rendezvous, "recovery": run_recovery,
           "sharded": run_sharded}


def machine_description() -> str:
    """CPU model, cores, memory, OS, Python and torch: what the numbers were measured on."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    memory_kb = next((int(line.split()[1]) for line in _read_lines("/proc/meminfo") if line.startswith("MemTotal")), 0)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} cores, {memory_kb / 2**20:.0f} GiB; {platform.platform()}; "
            f"Python {platform.python_version()}, torch {torch.__version__}; "
            f"GPU: {', '.join(gpus) if gpus else 'none'}; load average at start {load:.2f}")


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def run(sections: Sequence[str], quick: bool, repetitions: int | None, work_dir: Path, progress: Progress,
        device: str = "cpu", use_amp: bool = False) -> tuple[list[Row], list[tuple[str, str]], bool]:
    """Run `sections` in order; returns (rows, (section, reason) for those without rows, all ok)."""
    rows: list[Row] = []
    missing: list[tuple[str, str]] = []
    ok = True
    for section in sections:
        started = time.monotonic()
        try:
            rows += RUNNERS[section](quick, repetitions, work_dir, progress, device=device, use_amp=use_amp)
        except SectionSkipped as exc:
            missing.append((section, str(exc)))
        except ImportError as exc:  # a section whose module has not landed yet
            missing.append((section, f"not available yet ({exc})"))
        except Exception as exc:  # noqa: BLE001 - report it in the table and go on with the others
            ok = False
            progress(traceback.format_exc())
            missing.append((section, f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
        progress(f"{section}: {time.monotonic() - started:.0f} s")
    return rows, missing, ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/run_all.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: small runs, one repetition, no recovery and no sharded section")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                        help=f"run these sections only ({', '.join(SECTIONS)})")
    parser.add_argument("--repetitions", type=int, default=None,
                        help="repetitions per figure (default: each section's own; 1 with --quick)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device of the throughput section")
    parser.add_argument("--use_amp", action="store_true", help="mixed precision in the throughput section")
    parser.add_argument("--work_dir", type=Path, default=None,
                        help="where runs write (default: a temporary directory, removed at the end)")
    parser.add_argument("--output", type=Path, default=None, help="also write the report (markdown) to this file")
    args = parser.parse_args(argv)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    description = machine_description()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-bench-") as temporary:
        rows, missing, ok = run(args.only, args.quick, args.repetitions, args.work_dir or Path(temporary), progress,
                                args.device, args.use_amp)
    mode = "--quick" if args.quick else "full size"
    report = (f"Machine: {description}\n\nMode: {mode}; {time.monotonic() - started:.0f} s in all.\n\n"
              + render_markdown(rows, missing) + "\n")
    print(report, end="")
    if args.output is not None:
        args.output.write_text(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
