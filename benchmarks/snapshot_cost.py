"""What a snapshot costs training: time blocked per snapshot against a synchronous save, and the
slowdown of a run that snapshots every 50 steps against the same run without snapshots.

    python -m benchmarks.snapshot_cost               # 68 MB snapshots, 3 repetitions (~4 min on 2 cores)
    python -m benchmarks.snapshot_cost --quick       # CI smoke: 5 MB snapshots, 1 repetition (~20 s)
    python -m benchmarks.snapshot_cost --dir /mnt/local-ssd/bench   # where the snapshots go

(run from the repository root). Everything runs in this process, through `elastic_ddp.Trainer` on a
world of one (the snapshot path is rank 0's alone): a wide MLP (`--hidden 2560`: 8.5 M parameters;
with SGD momentum, 68 MB per snapshot) on the synthetic dataset, one intra-op thread (as the shipped
launch settings give each worker), snapshots to a local directory. Each repetition trains the same
steps three times, interleaved and in alternating order:

- none:  no snapshot in the measured window;
- async: a snapshot every `--every` steps, written in the background (the default);
- sync:  the same snapshots, with training waiting for each durable write (`--no-snapshot_async`).

Blocked time per snapshot is the `blocked_seconds` of the `snapshot_captured` events: in the async
run, waiting for a previous write plus the copy into the staging buffers; in the sync run, the whole
save (copy, serialise, sha256, write, fsync, manifest). The slowdown is the wall time of the measured
window (steps `--warmup` + 1 to `--warmup` + `--steps`, inside one epoch) of async over none, as the
median over repetitions of the paired ratios. On a shared machine other processes' load swamps a
few per cent, so a second estimate is printed: per step index, the shortest duration seen over the
repetitions, summed over the window (a lower envelope that filters bursts of foreign load and keeps
what recurs at the same steps, such as the snapshot steps and the steps during background writes).
The load average is printed with the results.

Targets (issue 5): blocked < 10% of the synchronous save; slowdown < 3%. Another runner can call
`measure_snapshot_cost(SnapshotCostOptions(...))` and `rows(result)` (benchmarks.table rows).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # `python benchmarks/snapshot_cost.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.table import Row, render_markdown  # noqa: E402
from elastic_ddp.config import TrainingConfig  # noqa: E402
from elastic_ddp.data import IMAGE_SHAPE, NUM_CLASSES, SyntheticImageDataset  # noqa: E402
from elastic_ddp.events import read_events  # noqa: E402
from elastic_ddp.trainer import Trainer  # noqa: E402

MODES = ("none", "async", "sync")


@dataclass
class SnapshotCostOptions:
    hidden: int = 2560  # width of the MLP's two hidden layers: 2560 -> 68 MB snapshots
    warmup: int = 10  # steps before the measured window
    steps: int = 200  # steps in the measured window
    every: int = 50  # snapshot interval in the async and sync runs
    repetitions: int = 3
    batch: int = 64
    threads: int = 1
    directory: str | None = None  # where snapshots go; a fresh temporary directory when None

    @classmethod
    def quick(cls) -> SnapshotCostOptions:
        return cls(hidden=768, warmup=5, steps=100, every=50, repetitions=1)


@dataclass
class RunResult:
    mode: str
    window_seconds: float
    step_seconds: list[float]  # duration of each step of the window
    blocked_seconds: list[float]  # per snapshot in the window
    write_seconds: list[float]  # background write time per snapshot (async only)
    snapshot_bytes: int


@dataclass
class SnapshotCostResult:
    options: SnapshotCostOptions
    runs: list[RunResult] = field(default_factory=list)
    load_average: float = 0.0  # the 1-minute load average, averaged over the runs' ends

    def of(self, mode: str) -> list[RunResult]:
        return [run for run in self.runs if run.mode == mode]

    def per_repetition(self, mode: str, figure) -> list[float]:
        return [figure(run) for run in self.of(mode)]

    @property
    def blocked_ratio(self) -> float:
        """Median blocked time per async snapshot over the median synchronous save."""
        return statistics.median(self.all_blocked("async")) / statistics.median(self.all_blocked("sync"))

    @property
    def slowdown(self) -> float:
        """Median over repetitions of (async window time / no-snapshot window time) - 1."""
        pairs = zip(self.of("async"), self.of("none"))
        return statistics.median(a.window_seconds / n.window_seconds for a, n in pairs) - 1

    def all_blocked(self, mode: str) -> list[float]:
        return [seconds for run in self.of(mode) for seconds in run.blocked_seconds]

    def envelope_seconds(self, mode: str) -> float:
        """Sum over the window's steps of each step's shortest duration over the repetitions."""
        return sum(min(steps) for steps in zip(*(run.step_seconds for run in self.of(mode))))

    def envelope_slowdown(self, mode: str = "async") -> float:
        return self.envelope_seconds(mode) / self.envelope_seconds("none") - 1


class WideMLP(nn.Module):
    """An MLP with two wide hidden layers: a model of realistic snapshot size that trains on a CPU."""

    def __init__(self, hidden: int):
        super().__init__()
        inputs = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _WindowEnd(Exception):
    """Raised from `after_step` to end a run once the measured window is done."""


def _run(options: SnapshotCostOptions, mode: str, directory: Path) -> RunResult:
    checkpoint_dir = directory / mode
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    last_step = options.warmup + options.steps
    config = TrainingConfig(
        model="mlp", epochs=1, dataset_size=(last_step + 1) * options.batch, global_batch_size=options.batch,
        micro_batch_size=options.batch, augment=False, checkpoint_dir=str(checkpoint_dir), device="cpu",
        snapshot_every_steps=0 if mode == "none" else options.every, snapshot_async=mode != "sync",
        log_interval=10 * last_step, snapshot_replicas=0)
    torch.manual_seed(0)
    step_times: dict[int, float] = {}

    def after_step(trainer: Trainer) -> None:
        step_times[trainer.global_step] = time.perf_counter()
        if trainer.global_step == last_step:
            raise _WindowEnd

    trainer = Trainer(model=WideMLP(options.hidden), dataset=SyntheticImageDataset(config.dataset_size),
                      config=config, after_step=after_step)
    try:
        trainer.fit()
    except _WindowEnd:
        pass
    events = read_events(checkpoint_dir / "events.jsonl")
    in_window = lambda e: options.warmup < e["global_step"] <= last_step  # noqa: E731
    blocked = [e["blocked_seconds"] for e in events if e["event"] == "snapshot_captured" and in_window(e)]
    written = [e for e in events if e["event"] == "snapshot" and in_window(e)]
    window = [step_times[step] for step in range(options.warmup, last_step + 1)]
    return RunResult(mode=mode, window_seconds=window[-1] - window[0],
                     step_seconds=[end - start for start, end in zip(window, window[1:])],
                     blocked_seconds=blocked, write_seconds=[e["write_seconds"] for e in written],
                     snapshot_bytes=written[0]["size_bytes"] if written else 0)


def measure_snapshot_cost(options: SnapshotCostOptions) -> SnapshotCostResult:
    """Run every repetition (modes interleaved, order alternating) and return the raw figures."""
    torch.set_num_threads(options.threads)
    result = SnapshotCostResult(options)
    loads: list[float] = []
    owned = options.directory is None
    directory = Path(options.directory or tempfile.mkdtemp(prefix="snapshot-cost-"))
    try:
        for repetition in range(options.repetitions):
            order = MODES if repetition % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                result.runs.append(_run(options, mode, directory))
                loads.append(os.getloadavg()[0])
        result.load_average = statistics.mean(loads)
    finally:
        if owned:
            shutil.rmtree(directory, ignore_errors=True)
    return result


def rows(result: SnapshotCostResult) -> list[Row]:
    """The results as rows of the shared benchmark table."""
    size_mb = max(run.snapshot_bytes for run in result.runs) / 1e6
    every = result.options.every
    return [
        Row("snapshot", "training blocked per snapshot (s)",
            elastic=result.per_repetition("async", lambda run: statistics.median(run.blocked_seconds)),
            baseline=result.per_repetition("sync", lambda run: statistics.median(run.blocked_seconds)),
            baseline_name="synchronous save", target="< 0.10",
            note=f"{size_mb:.0f} MB snapshots; blocked = wait + copy to staging buffers"),
        Row("snapshot", f"run time, snapshot every {every} steps (s)",
            elastic=result.per_repetition("async", lambda run: run.window_seconds),
            baseline=result.per_repetition("none", lambda run: run.window_seconds),
            baseline_name="no snapshots", target="< 1.03", note=f"{result.options.steps} steps"),
        Row("snapshot", f"run time, synchronous snapshot every {every} steps (s)",
            elastic=result.per_repetition("sync", lambda run: run.window_seconds),
            baseline=result.per_repetition("none", lambda run: run.window_seconds),
            baseline_name="no snapshots", note="what background writing saves"),
    ]


def summary(result: SnapshotCostResult) -> str:
    sync_save = statistics.median(result.all_blocked("sync"))
    blocked = statistics.median(result.all_blocked("async"))
    writes = [s for run in result.of("async") for s in run.write_seconds]
    size_mb = max(run.snapshot_bytes for run in result.runs) / 1e6
    slowdown_sync = statistics.median(
        s.window_seconds / n.window_seconds for s, n in zip(result.of("sync"), result.of("none"))) - 1
    return "\n".join([
        f"snapshot size: {size_mb:.1f} MB; {len(result.all_blocked('async'))} async and "
        f"{len(result.all_blocked('sync'))} sync snapshots over {result.options.repetitions} repetition(s)",
        f"synchronous save (median):            {sync_save * 1000:8.1f} ms",
        f"blocked per async snapshot (median):  {blocked * 1000:8.1f} ms   "
        f"ratio {result.blocked_ratio:.3f} (target < 0.10)",
        f"background write per snapshot (median): {statistics.median(writes) * 1000 if writes else 0:6.1f} ms",
        f"slowdown, async every {result.options.every} steps:  {result.slowdown * 100:+6.2f} %   (target < 3 %); "
        f"lower envelope {result.envelope_slowdown('async') * 100:+6.2f} %",
        f"slowdown, sync every {result.options.every} steps:   {slowdown_sync * 100:+6.2f} %; "
        f"lower envelope {result.envelope_slowdown('sync') * 100:+6.2f} %",
        f"load average during the runs: {result.load_average:.1f} on {os.cpu_count()} CPUs "
        f"({result.options.threads} intra-op thread(s) for training)",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke size")
    parser.add_argument("--dir", help="directory for the snapshots (default: a temporary directory)")
    parser.add_argument("--repetitions", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    options = SnapshotCostOptions.quick() if args.quick else SnapshotCostOptions()
    for name in ("repetitions", "hidden", "steps", "threads"):
        if getattr(args, name) is not None:
            setattr(options, name, getattr(args, name))
    options.directory = args.dir
    result = measure_snapshot_cost(options)
    print(summary(result))
    print()
    print(render_markdown(rows(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
