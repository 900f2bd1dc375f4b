"""Snapshot cost by size (10 MB, 100 MB, 1 GB) and snapshot write bandwidth against the disk's.

    python -m benchmarks.snapshot_sweep              # 10 MB, 100 MB and 1 GB; about 10 minutes on 2 cores
    python -m benchmarks.snapshot_sweep --quick      # 10 MB only, one repetition
    python -m benchmarks.snapshot_sweep --dir /mnt/local-ssd/bench

(run from the repository root). Each size is one `benchmarks.snapshot_cost` measurement (the
snapshot helper's: elastic_ddp's Trainer on a world of one training a wide MLP, runs without
snapshots, with background snapshots and with synchronous ones, interleaved), with the MLP's width
chosen so that parameters plus SGD momentum make a snapshot of that size. Steps are few and
batches small for the big models (a 1 GB MLP takes most of a second per step on one core). Two
snapshots are taken, an interval apart: the first falls in the warm-up (it also allocates the
staging buffers, once per run), the second is measured. The interval is long enough for the first
write to end before the second snapshot (1.3 x the snapshot size at `WRITE_MB_PER_S`, the speed of
background writes on the 2-core machine, and at least a second; the step is timed first), so the
measured snapshot blocks training for its copy only: the regime of a run whose snapshot interval
is longer than a write. Rows:

- training blocked per snapshot (copy into the staging buffers, plus any wait) against the time of
  a synchronous save of the same snapshot;
- background write bandwidth (snapshot bytes over the writer's time: serialise, sha256, write,
  fsync, manifest; the write ends after the window, while the trainer closes) against the disk's
  sequential write bandwidth, measured with a plain file write of the same size in the same
  directory after each repetition (`benchmarks.disk`).

Memory: the 1 GB case holds the model, its gradients and momentum (1.5 GB) plus the staging copy
and the serialised bytes: about 5 GB at its peak.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/snapshot_sweep.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.disk import sequential_write_mb_per_s  # noqa: E402
from benchmarks.table import Row, render_markdown  # noqa: E402

INPUTS, CLASSES = 3 * 16 * 16, 10  # the synthetic images and labels the wide MLP is trained on


def hidden_for_snapshot_bytes(size_bytes: float) -> int:
    """Width of `snapshot_cost.WideMLP` whose parameters plus momentum (fp32) take `size_bytes`.

    Parameters: inputs*h + h + h*h + h + h*classes + classes; each has a value and a momentum.
    """
    linear = INPUTS + 2 + CLASSES
    parameters = size_bytes / 8
    return round((-linear + math.sqrt(linear ** 2 + 4 * parameters)) / 2)


@dataclass(frozen=True)
class SizeCase:
    label: str
    size_bytes: float
    batch: int
    repetitions: int
    min_interval_s: float = 1.0  # the shortest time between the two snapshots (snapshot_interval_steps)


FULL = (SizeCase("10 MB", 10e6, batch=64, repetitions=3), SizeCase("100 MB", 100e6, batch=16, repetitions=3),
        SizeCase("1 GB", 1e9, batch=4, repetitions=3))
# --quick (a smoke run, whose figures are only checked to parse): 0.25 s between the snapshots, still
# above 1.3 x the 10 MB write at WRITE_MB_PER_S (0.22 s); 1 s made this case 6 s of a 25 s run.
QUICK = (SizeCase("10 MB", 10e6, batch=16, repetitions=1, min_interval_s=0.25),)


def seconds_per_step(hidden: int, batch: int, steps: int = 3) -> float:
    """Forward, backward and SGD step of the wide MLP on one batch (one warm-up step untimed)."""
    import torch

    from benchmarks.snapshot_cost import WideMLP

    model = WideMLP(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inputs, targets = torch.randn(batch, 3, 16, 16), torch.randint(CLASSES, (batch,))
    timings = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings[1:])


# Background snapshot writes on the 2-core machine: 45-80 MB/s while it was busy, about 220 MB/s idle.
# The busy figure keeps the interval long enough for the first write to end on either.
WRITE_MB_PER_S = 60


def snapshot_interval_steps(step_seconds: float, size_bytes: float, min_seconds: float = 1.0) -> int:
    """Steps between the two snapshots: long enough for the first write to end (`min_seconds` at
    least), at least 5."""
    seconds = max(min_seconds, 1.3 * size_bytes / 1e6 / WRITE_MB_PER_S)
    return max(5, math.ceil(seconds / step_seconds))


def measure(cases: tuple[SizeCase, ...], directory: Path,
            progress: Callable[[str], None] | None = None) -> list[Row]:
    """One snapshot_cost measurement per size, then its rows; disk bandwidth between repetitions."""
    import torch

    from benchmarks import snapshot_cost  # the snapshot helper's benchmark; imported when used

    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as snapshot_cost trains, and as one worker of the shipped launch runs
    try:
        for case in cases:
            rows += _measure_size(case, directory, snapshot_cost, progress)
    finally:
        torch.set_num_threads(threads)
    return rows


def _measure_size(case: SizeCase, directory: Path, snapshot_cost, progress) -> list[Row]:
    hidden = hidden_for_snapshot_bytes(case.size_bytes)
    every = snapshot_interval_steps(seconds_per_step(hidden, case.batch), case.size_bytes, case.min_interval_s)
    # Snapshots at steps `every` (warm-up) and 2 x `every` (the measured window's only one).
    options = snapshot_cost.SnapshotCostOptions(
        hidden=hidden, warmup=every, steps=every, every=every, repetitions=1, batch=case.batch,
        directory=str(directory / "snapshots"))
    results, disk = [], []
    for repetition in range(case.repetitions):
        results.append(snapshot_cost.measure_snapshot_cost(options))
        disk.append(sequential_write_mb_per_s(directory / "disk", max(64, round(case.size_bytes / 2**20))))
        if progress is not None:
            progress(f"snapshot {case.label} #{repetition + 1}: every {every} steps, blocked "
                     f"{_blocked(results[-1], 'async'):.3f} s, sync save {_blocked(results[-1], 'sync'):.3f} s, "
                     f"write {_write_mb_per_s(results[-1]):.0f} MB/s, disk {disk[-1]:.0f} MB/s")
    size = max(run.snapshot_bytes for result in results for run in result.runs) / 1e6
    note = f"{size:.0f} MB snapshot, {every} steps of batch {case.batch} after the previous one"
    return [Row("snapshot", f"{case.label}: training blocked per snapshot, s",
                [_blocked(r, "async") for r in results], [_blocked(r, "sync") for r in results],
                "synchronous save", target="< 0.10", note=note),
            Row("snapshot", f"{case.label}: write bandwidth, MB/s",
                [_write_mb_per_s(r) for r in results], disk, "plain file write + fsync", note=note)]


def cadence_rows(result, label: str) -> list[Row]:
    """Slowdown rows of one `snapshot_cost` result: run time with snapshots against without."""
    every, steps = result.options.every, result.options.steps
    size = max(run.snapshot_bytes for run in result.runs) / 1e6
    note = f"{size:.0f} MB snapshots, {steps} steps"
    return [
        Row("snapshot", f"{label}: run time with a snapshot every {every} steps, s",
            result.per_repetition("async", lambda run: run.window_seconds),
            result.per_repetition("none", lambda run: run.window_seconds), "no snapshots",
            target="< 1.03", note=note),
        Row("snapshot", f"{label}: run time with a synchronous snapshot every {every} steps, s",
            result.per_repetition("sync", lambda run: run.window_seconds),
            result.per_repetition("none", lambda run: run.window_seconds), "no snapshots",
            note=note + "; what background writing saves"),
    ]


def _blocked(result, mode: str) -> float:
    return statistics.median(result.all_blocked(mode))


def _write_mb_per_s(result) -> float:
    runs = [run for run in result.of("async") if run.write_seconds]
    return statistics.median(run.snapshot_bytes / 1e6 / seconds for run in runs for seconds in run.write_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 MB only, one repetition")
    parser.add_argument("--dir", type=Path, default=None, help="where snapshots go (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="snapshot-sweep-") as temporary:
        rows = measure(QUICK if args.quick else FULL, args.dir or Path(temporary),
                       progress=lambda line: print(line, file=sys.stderr))
    print(render_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
