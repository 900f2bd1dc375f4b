"""What a snapshot costs training: time blocked per snapshot against a synchronous save, and the
slowdown of a run that snapshots every 50 steps against the same run without snapshots.

    python -m benchmarks.snapshot_cost               # 68 MB snapshots, 3 repetitions (~7 min on 2 cores)
    python -m benchmarks.snapshot_cost --quick       # CI smoke: 10 MB snapshots, 1 repetition (~40 s)
    python -m benchmarks.snapshot_cost --dir /mnt/local-ssd/bench   # where the snapshots go
    python -m benchmarks.snapshot_cost --device cuda --hidden 3200   # on a GPU: pinned staging, ~100 MB

(run from the repository root). Everything runs in this process, through `elastic_ddp.Trainer` on a
world of one (the snapshot path is rank 0's alone): a wide MLP (`--hidden 2560`: 8.5 M parameters;
with SGD momentum, 68 MB per snapshot) on the synthetic dataset, one intra-op thread (as the shipped
launch settings give each worker), snapshots to a local directory. Each repetition trains the same
steps several times, interleaved and in alternating order:

- none:  no snapshot in the measured window;
- async: a snapshot every `--every` steps, written in the background (the default);
- sync:  the same snapshots, with training waiting for each durable write (`--no-snapshot_async`);
- alternating (with `--pairs` > 0): one longer async run with a snapshot every 2 x `--every`
  steps, measured as pairs of adjacent `--every`-step segments, the first starting with a snapshot
  (its blocked time and its whole background write fall inside it), the second free of snapshots.

Blocked time per snapshot is the `blocked_seconds` of the `snapshot_captured` events: in the async
run, waiting for a previous write plus the copy into the staging buffers; in the sync run, the whole
save (copy, serialise, sha256, write, fsync, manifest).

The slowdown of snapshotting every `--every` steps is estimated twice. Paired segments (the
headline figure): median over pairs of (segment with a snapshot / segment without) - 1; the two
segments of a pair are seconds apart, so drifts in the machine's load cancel out, which whole runs
a minute apart do not on a shared machine. It holds while a background write ends within `--every`
steps (compare the printed write time with the segment time). Whole runs: median over repetitions
of (async window / none window) - 1, the window being steps `--warmup` + 1 to `--warmup` +
`--steps`, inside one epoch. A third view does not depend on other load at all: CPU time. The
training thread's CPU time over the window shows whether snapshots add work to training (they
should not, beyond the copy); the process's extra CPU time per snapshot is the writer's cost. With
a core free for the writer, only the blocked time slows training; with none (a CPU-bound machine)
the writer's CPU time is taken from training too; both predictions are printed. The load average
is printed with the results.

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
from elastic_ddp.workload.data import IMAGE_SHAPE, NUM_CLASSES, SyntheticImageDataset  # noqa: E402
from elastic_ddp.runlog.reader import read_events  # noqa: E402
from elastic_ddp.runlog.schema import EVENT_LOG_NAME  # noqa: E402
from elastic_ddp.training.trainer import Trainer  # noqa: E402

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
    pairs: int = 0  # segment pairs of the alternating run per repetition (0: no alternating run)
    device: str = "cpu"  # cuda: the model on the GPU, captured through pinned staging buffers

    @classmethod
    def full(cls) -> SnapshotCostOptions:
        return cls(pairs=4)

    @classmethod
    def quick(cls) -> SnapshotCostOptions:
        return cls(hidden=768, warmup=5, steps=100, every=50, repetitions=1, pairs=2)


@dataclass
class RunResult:
    mode: str
    window_seconds: float
    step_seconds: list[float]  # duration of each step of the window
    blocked_seconds: list[float]  # per snapshot in the window
    write_seconds: list[float]  # background write time per snapshot (async only)
    snapshot_bytes: int
    # Alternating run: (seconds of the segment starting with a snapshot, of the next one without).
    segment_pairs: list[tuple[float, float]] = field(default_factory=list)
    # CPU time over the window (first_step, last_step]: the training thread's, and the whole process's.
    training_cpu_seconds: float = 0.0
    process_cpu_seconds: float = 0.0


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

    def cpu_accounting(self) -> dict[str, float]:
        """Load-independent figures from CPU time (medians over repetitions, async against none).

        training_cpu_ratio: the training thread's CPU time with snapshots over without (its work);
        writer_cpu_per_snapshot: extra process CPU time per snapshot (writer thread, kernel time);
        interval_cpu: the training thread's CPU time for one snapshot interval;
        with_idle_core / without_idle_core: the slowdown these predict when a core is free for the
        writer (only the blocked time counts) and when none is (the writer's CPU is taken from training).
        """
        pairs = list(zip(self.of("async"), self.of("none")))
        steps = self.options.steps
        writer = statistics.median(
            ((a.process_cpu_seconds - a.training_cpu_seconds) - (n.process_cpu_seconds - n.training_cpu_seconds))
            / max(1, len(a.blocked_seconds)) for a, n in pairs)
        interval = statistics.median(n.training_cpu_seconds for _, n in pairs) / steps * self.options.every
        blocked = statistics.median(self.all_blocked("async"))
        return {"training_cpu_ratio": statistics.median(a.training_cpu_seconds / n.training_cpu_seconds
                                                        for a, n in pairs),
                "writer_cpu_per_snapshot": writer, "interval_cpu": interval,
                "with_idle_core": blocked / interval, "without_idle_core": (blocked + writer) / interval}

    def whole_run_slowdown(self, mode: str = "async") -> float:
        """Median over repetitions of (`mode` window time / no-snapshot window time) - 1."""
        pairs = zip(self.of(mode), self.of("none"))
        return statistics.median(a.window_seconds / n.window_seconds for a, n in pairs) - 1

    @property
    def segment_pairs(self) -> list[tuple[float, float]]:
        return [pair for run in self.of("alternating") for pair in run.segment_pairs]

    @property
    def segment_ratios(self) -> list[float]:
        return [with_snapshot / without for with_snapshot, without in self.segment_pairs]

    @property
    def slowdown(self) -> float:
        """The paired-segment estimate when there is one, else the whole-run one."""
        return statistics.median(self.segment_ratios) - 1 if self.segment_ratios else self.whole_run_slowdown()

    def all_blocked(self, mode: str) -> list[float]:
        return [seconds for run in self.of(mode) for seconds in run.blocked_seconds]


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
    alternating = mode == "alternating"
    # The alternating run's window starts at its first snapshot (step 2 * every) and holds `pairs` cycles.
    first_step = 2 * options.every if alternating else options.warmup
    last_step = first_step + (2 * options.every * options.pairs if alternating else options.steps)
    every = {"none": 0, "alternating": 2 * options.every}.get(mode, options.every)
    config = TrainingConfig(
        model="mlp", epochs=1, dataset_size=(last_step + 1) * options.batch, global_batch_size=options.batch,
        micro_batch_size=options.batch, augment=False, checkpoint_dir=str(checkpoint_dir), device=options.device,
        snapshot_every_steps=every, snapshot_async=mode != "sync", log_interval=10 * last_step,
        snapshot_replicas=0, memory_copies=False)  # the window ends by an exception, which is no failure
    torch.manual_seed(0)
    step_times: dict[int, float] = {}
    cpu_times: dict[int, tuple[float, float]] = {}  # (training thread, whole process) at the window's ends

    def after_step(trainer: Trainer) -> None:
        step_times[trainer.global_step] = time.perf_counter()
        if trainer.global_step in (first_step, last_step):
            cpu_times[trainer.global_step] = (time.thread_time(), time.process_time())
        if trainer.global_step == last_step:
            raise _WindowEnd

    trainer = Trainer(model=WideMLP(options.hidden), dataset=SyntheticImageDataset(config.dataset_size),
                      config=config, after_step=after_step)
    try:
        trainer.fit()
    except _WindowEnd:
        pass
    # Step s's duration ends after its snapshot was captured (after_step runs after it). The
    # alternating run's cycles begin with a snapshot step; the other windows follow the warm-up.
    steps = range(first_step, last_step) if alternating else range(first_step + 1, last_step + 1)
    step_seconds = [step_times[step] - step_times[step - 1] for step in steps]
    events = [e for e in read_events(checkpoint_dir / EVENT_LOG_NAME) if e.get("global_step") in steps]
    written = [e for e in events if e["event"] == "snapshot"]
    (thread_start, process_start), (thread_end, process_end) = cpu_times[first_step], cpu_times[last_step]
    return RunResult(mode=mode, window_seconds=sum(step_seconds), step_seconds=step_seconds,
                     training_cpu_seconds=thread_end - thread_start, process_cpu_seconds=process_end - process_start,
                     blocked_seconds=[e["blocked_seconds"] for e in events if e["event"] == "snapshot_captured"],
                     write_seconds=[e["write_seconds"] for e in written],
                     snapshot_bytes=written[0]["size_bytes"] if written else 0,
                     segment_pairs=_segment_pairs(step_seconds, options.every) if alternating else [])


def _segment_pairs(step_seconds: list[float], every: int) -> list[tuple[float, float]]:
    """(segment starting with a snapshot, the next segment without) for each cycle of 2 x every steps."""
    cycles = [step_seconds[start:start + 2 * every] for start in range(0, len(step_seconds), 2 * every)]
    return [(sum(cycle[:every]), sum(cycle[every:])) for cycle in cycles]


def measure_snapshot_cost(options: SnapshotCostOptions) -> SnapshotCostResult:
    """Run every repetition (modes interleaved, order alternating) and return the raw figures."""
    torch.set_num_threads(options.threads)
    result = SnapshotCostResult(options)
    loads: list[float] = []
    owned = options.directory is None
    directory = Path(options.directory or tempfile.mkdtemp(prefix="snapshot-cost-"))
    try:
        modes = MODES + (("alternating",) if options.pairs else ())
        for repetition in range(options.repetitions):
            order = modes if repetition % 2 == 0 else tuple(reversed(modes))
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
    pairs = result.segment_pairs
    table = [
        Row("snapshot", "training blocked per snapshot (s)",
            elastic=result.per_repetition("async", lambda run: statistics.median(run.blocked_seconds)),
            baseline=result.per_repetition("sync", lambda run: statistics.median(run.blocked_seconds)),
            baseline_name="synchronous save", target="< 0.10",
            note=f"{size_mb:.0f} MB snapshots; blocked = wait + copy to staging buffers"),
    ]
    if pairs:
        table.append(Row("snapshot", f"{every} steps starting with a background snapshot (s)",
                         elastic=[with_snapshot for with_snapshot, _ in pairs],
                         baseline=[without for _, without in pairs], baseline_name=f"the next {every} steps",
                         target="< 1.03", note=f"{size_mb:.0f} MB snapshots; paired adjacent segments"))
    table += [
        Row("snapshot", f"run time, snapshot every {every} steps (s)",
            elastic=result.per_repetition("async", lambda run: run.window_seconds),
            baseline=result.per_repetition("none", lambda run: run.window_seconds),
            baseline_name="no snapshots", target="" if pairs else "< 1.03",
            note=f"{result.options.steps} steps, whole runs"),
        Row("snapshot", f"run time, synchronous snapshot every {every} steps (s)",
            elastic=result.per_repetition("sync", lambda run: run.window_seconds),
            baseline=result.per_repetition("none", lambda run: run.window_seconds),
            baseline_name="no snapshots", note="whole runs; what background writing saves"),
    ]
    return table


def summary(result: SnapshotCostResult) -> str:
    """Human-readable results: the two ratios the targets are about, and what they rest on."""
    every = result.options.every
    sync_save = statistics.median(result.all_blocked("sync"))
    blocked = statistics.median(result.all_blocked("async"))
    writes = [s for run in result.of("async") for s in run.write_seconds]
    size_mb = max(run.snapshot_bytes for run in result.runs) / 1e6
    lines = [
        (f"snapshot size: {size_mb:.1f} MB; {len(result.all_blocked('async'))} async and "
         f"{len(result.all_blocked('sync'))} sync snapshots over {result.options.repetitions} repetition(s)"),
        f"synchronous save (median):               {sync_save * 1000:8.1f} ms",
        (f"blocked per async snapshot (median):     {blocked * 1000:8.1f} ms   "
         f"ratio {result.blocked_ratio:.3f} (target < 0.10)"),
        f"background write per snapshot (median): {statistics.median(writes) * 1000 if writes else 0:8.1f} ms",
    ]
    if result.segment_pairs:
        segment = statistics.median(without for _, without in result.segment_pairs)
        lines.append(f"slowdown, snapshot every {every} steps:    {result.slowdown * 100:+8.2f} %   (target < 3 %; "
                     f"median of {len(result.segment_pairs)} paired {every}-step segments of {segment:.1f} s)")
    cpu = result.cpu_accounting()
    lines += [
        f"  whole runs, async / none:             {result.whole_run_slowdown('async') * 100:+8.2f} %",
        f"  whole runs, sync / none:              {result.whole_run_slowdown('sync') * 100:+8.2f} %",
        (f"CPU accounting (independent of other load): training thread's CPU with / without snapshots "
         f"{cpu['training_cpu_ratio']:.3f}; writer CPU per snapshot {cpu['writer_cpu_per_snapshot'] * 1000:.0f} ms; "
         f"one {every}-step interval = {cpu['interval_cpu']:.2f} s of training CPU"),
        (f"  predicted slowdown: {cpu['with_idle_core'] * 100:.2f} % with a core free for the writer, "
         f"{cpu['without_idle_core'] * 100:.2f} % with none"),
        (f"load average during the runs: {result.load_average:.1f} on {os.cpu_count()} CPUs "
         f"({result.options.threads} intra-op thread(s) for training)"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke size")
    parser.add_argument("--dir", help="directory for the snapshots (default: a temporary directory)")
    parser.add_argument("--repetitions", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--pairs", type=int, help="segment pairs per repetition in the alternating run (0: none)")
    parser.add_argument("--every", type=int, help="steps between snapshots in the async and sync runs")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="where the model trains (default cpu)")
    args = parser.parse_args(argv)
    options = SnapshotCostOptions.quick() if args.quick else SnapshotCostOptions.full()
    for name in ("repetitions", "hidden", "steps", "threads", "pairs", "every", "device"):
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
