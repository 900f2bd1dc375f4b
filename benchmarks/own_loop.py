"""Throughput and peak memory of a loop of the user's own: docs/examples/gpt_own_loop.py (`ElasticRun`)
against the same loop in bare PyTorch DDP (`benchmarks.bare_gpt_loop`).

    python -m benchmarks.own_loop                                   # 3 interleaved pairs, ~20-40 s a pair on 2 cores
    python -m benchmarks.own_loop --repetitions 1 --corpus_bytes 60000   # a smoke run (`--repeats` works too)
    python -m benchmarks.own_loop --example_args="--snapshot_every_steps 0"   # where a gap comes from

(run from the repository root). Each side is one job of plain torchrun on one node, 2 CPU workers,
gloo, the agent environment elastic_ddp ships (`OMP_NUM_THREADS=1`), started as a subprocess the
way benchmarks.throughput starts its jobs (`run_torchrun`). Ours is the example
itself, unchanged, run through a thin wrapper (`-m benchmarks.own_loop --worker ours ARGS`: it
imports the example's file, calls its `main()`, then prints each worker's peak memory), with its
defaults: snapshots on the overhead budget, memory copies on; only `--checkpoint_dir` and
`--memory_dir` point into a temporary directory (removed at the end), and `--log_interval` is
beyond the run, as the bare loop logs nothing. The bare loop does the same work (its docstring
lists what is the same) with nothing of the fault tolerance, over the token file that the
example's own `write_corpus` wrote (linked into each of our runs' checkpoint directory, so neither
side spends its start-up writing it).

Pairs are interleaved (ours then bare, bare then ours on the next, ...) so that a drift in machine
load falls on both sides alike. Tokens/s is measured the same way on both: from the end of step
`--skip_steps` to the end of the last step, from rank 0's step end times (the `step` events of the
example's event log, the list the bare loop prints), counting the tokens of the steps in between
(the epoch's last step may be short). Start-up is left out; snapshots and epoch boundaries inside
the window count; the last step's snapshot (at the end of the last epoch) falls after it. Peak
memory is each worker's VmHWM at exit, the largest over the ranks.

`--example_args` passes more flags to the example (never to the bare loop), to find where a gap
comes from (e.g. snapshots only at the end); the comparison itself is the one without.

Prints a table of the pairs (tokens/s, ratio, peak RSS), then the summary rows in the table of every
benchmark (`benchmarks.table`): `median [min..max]` of each side and of the per-pair ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from benchmarks.measure import emit_result, peak_rss_mb
from benchmarks.table import Row, format_number, render_markdown
from benchmarks.throughput import BenchmarkRunError, run_torchrun
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.runtime.distributed import exit_worker

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = REPO_ROOT / "docs" / "examples" / "gpt_own_loop.py"
OURS, BARE = "ours", "bare"
BASELINE_NAME = "bare DDP loop"
NO_LOGGING = 10**9  # a --log_interval beyond any run here


@dataclass(frozen=True)
class Workload:
    """One training job, run identically by both sides."""

    corpus_bytes: int = 400_000
    block_size: int = 64
    global_batch_size: int = 32
    micro_batch_size: int = 8
    epochs: int = 1
    gpt_layers: int = 2
    gpt_heads: int = 2
    gpt_embed: int = 64
    lr: float = 1e-3
    seed: int = 0
    world_size: int = 2
    skip_steps: int = 10  # steps left out of the measured window (start-up)
    example_args: tuple[str, ...] = ()  # more flags for ours (a diagnosis, not the comparison: see --example_args)

    @property
    def windows(self) -> int:
        """Samples in the corpus: TokenWindows' count for `corpus_bytes` byte tokens."""
        return (self.corpus_bytes - 1) // self.block_size

    def step_samples(self) -> list[int]:
        """Global samples of every step of the run, in order (the epoch's last step may be short)."""
        return step_samples(self.windows, self.global_batch_size, self.epochs)

    def shared_args(self) -> list[str]:
        """The flags both sides take, with the same names."""
        return ["--epochs", str(self.epochs), "--block_size", str(self.block_size),
                "--gpt_layers", str(self.gpt_layers), "--gpt_heads", str(self.gpt_heads),
                "--gpt_embed", str(self.gpt_embed), "--global_batch_size", str(self.global_batch_size),
                "--micro_batch_size", str(self.micro_batch_size), "--lr", str(self.lr), "--seed", str(self.seed)]

    def describe(self) -> str:
        steps = len(self.step_samples())
        extra = f", ours with {' '.join(self.example_args)}" if self.example_args else ""
        return (f"{self.world_size} CPU workers, GPT {self.gpt_layers}x{self.gpt_embed}, block {self.block_size}, "
                f"batch {self.global_batch_size} in micro-batches of {self.micro_batch_size}, {steps} steps, "
                f"first {self.skip_steps} left out{extra}")


@dataclass(frozen=True)
class RunResult:
    tokens_per_second: float  # over steps (skip_steps, last]
    peak_rss_mb: float  # the largest over all ranks
    seconds: float  # wall time of the whole torchrun job, start-up included
    snapshot_blocked_s: float = 0.0  # ours: time snapshots blocked training within the measured window
    snapshots: int = 0  # ours: snapshots captured within the measured window


# ------------------------------------------------------------------------------------------ pure parts


def step_samples(windows: int, global_batch_size: int, epochs: int) -> list[int]:
    """Global samples per step: every epoch is `windows` samples in batches of `global_batch_size`,
    its last one short when they do not divide (elastic_ddp's default, without --drop_last)."""
    if windows < 1 or global_batch_size < 1:
        raise ValueError(f"got {windows} windows and a global batch of {global_batch_size}; expected both >= 1")
    full, rest = divmod(windows, global_batch_size)
    return ([global_batch_size] * full + ([rest] if rest else [])) * epochs


def steady_state_tokens_per_second(step_times: Sequence[float], step_samples: Sequence[int], block_size: int,
                                   skip_steps: int) -> float:
    """Tokens per second from the end of step `skip_steps` to the end of the last step.

    `step_times[k]` is the time step k+1 was done, `step_samples[k]` its global samples of
    `block_size` tokens. As `benchmarks.measure.steady_state_samples_per_second`, but for steps of
    unequal size (an epoch's short last batch), counting the samples of the steps in the window.
    """
    if len(step_times) != len(step_samples):
        raise ValueError(f"{len(step_times)} step times for {len(step_samples)} steps")
    if len(step_times) < skip_steps + 2:
        raise ValueError(f"{len(step_times)} steps recorded; need more than {skip_steps + 1} to measure a steady state")
    first = max(skip_steps, 1)  # with none skipped, the window starts at the end of the first step
    start, end = step_times[first - 1], step_times[-1]
    if end <= start:
        raise ValueError("step times do not increase; cannot measure a rate")
    return sum(step_samples[first:]) * block_size / (end - start)


def step_times_from_events(events: Sequence[dict[str, Any]]) -> list[float]:
    """The end time of every step, in step order, from the `step` events of one run's event log.

    Refuses a log that is not one uninterrupted run (two incarnations, a step missing or twice):
    its times would not measure a steady state."""
    steps = [event for event in events if event.get("event") == "step"]
    incarnations = {event.get("incarnation") for event in steps}
    if len(incarnations) > 1:
        raise ValueError(f"step events of {len(incarnations)} incarnations; expected one uninterrupted run")
    steps.sort(key=lambda event: event["global_step"])
    numbers = [event["global_step"] for event in steps]
    if numbers != list(range(1, len(steps) + 1)):
        raise ValueError(f"step events for steps {numbers[:3]}...{numbers[-3:]}; expected 1 to {len(steps)}, "
                         "each once")
    return [event["time"] for event in steps]


def snapshots_in_window(events: Sequence[dict[str, Any]], start: float, end: float) -> tuple[int, float]:
    """(snapshots captured, seconds they blocked training) within (start, end]."""
    captured = [event for event in events
                if event.get("event") == "snapshot_captured" and start < event["time"] <= end]
    return len(captured), sum(event["blocked_seconds"] for event in captured)


def pair_orders(repetitions: int) -> list[tuple[str, str]]:
    """The order of the two sides in each pair: ours first, then bare first, and so on."""
    return [(OURS, BARE) if repetition % 2 == 0 else (BARE, OURS) for repetition in range(repetitions)]


def rows(workload: Workload, ours: Sequence[RunResult], bare: Sequence[RunResult]) -> list[Row]:
    """The summary rows: tokens/s and peak RSS, ours against bare, paired per repetition."""
    return [Row("own loop", "docs/examples/gpt_own_loop.py: tokens/s", [r.tokens_per_second for r in ours],
                [r.tokens_per_second for r in bare], BASELINE_NAME, note=workload.describe()),
            Row("memory", "gpt_own_loop.py: peak RSS per worker, MiB", [r.peak_rss_mb for r in ours],
                [r.peak_rss_mb for r in bare], BASELINE_NAME)]


def render_pairs(ours: Sequence[RunResult], bare: Sequence[RunResult], orders: Sequence[tuple[str, str]]) -> str:
    """A markdown table with one line per pair: each side's figures and their ratios, ours over bare."""
    header = ("pair", "order", "ours tokens/s", "bare tokens/s", "ours/bare", "ours RSS MiB", "bare RSS MiB",
              "RSS ours/bare", "ours snapshots (blocked s)")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for number, (mine, theirs, order) in enumerate(zip(ours, bare, orders), start=1):
        cells = (str(number), " then ".join(order), format_number(mine.tokens_per_second),
                 format_number(theirs.tokens_per_second), f"{mine.tokens_per_second / theirs.tokens_per_second:.3f}",
                 format_number(mine.peak_rss_mb), format_number(theirs.peak_rss_mb),
                 f"{mine.peak_rss_mb / theirs.peak_rss_mb:.3f}", f"{mine.snapshots} ({mine.snapshot_blocked_s:.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(ours: Sequence[RunResult], bare: Sequence[RunResult]) -> str:
    """The median per-pair ratios with their spread, in words."""
    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"
    speed = [a.tokens_per_second / b.tokens_per_second for a, b in zip(ours, bare)]
    memory = [a.peak_rss_mb / b.peak_rss_mb for a, b in zip(ours, bare)]
    return (f"ours/bare over {len(speed)} pair(s): tokens/s {spread(speed)}, peak RSS per worker {spread(memory)} "
            "(median [min..max])")


# ------------------------------------------------------------------------------------------ the jobs


def load_example() -> ModuleType:
    """docs/examples/gpt_own_loop.py as a module (registered, so that its dataclass resolves)."""
    spec = importlib.util.spec_from_file_location("gpt_own_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_ours_worker(example_args: Sequence[str]) -> NoReturn:
    """One worker of our side: the example's `main()` with `example_args`, then a `BENCH_RESULT` line."""
    example = load_example()
    sys.argv = [str(EXAMPLE), *example_args]  # the example's GPTConfig.from_args() reads them
    code = example.main()
    emit_result({"side": OURS, "rank": int(os.environ.get("RANK", "0")),
                 "world_size": int(os.environ.get("WORLD_SIZE", "1")), "peak_rss_mb": round(peak_rss_mb(), 1)})
    exit_worker(code)  # as the example ends


def run_ours(workload: Workload, corpus: Path, run_dir: Path, timeout: float) -> RunResult:
    checkpoint_dir = run_dir / "ck"
    (checkpoint_dir / "data").mkdir(parents=True)
    _link_or_copy(corpus, checkpoint_dir / "data" / corpus.name)  # the example finds it written
    args = ["benchmarks.own_loop", "--worker", OURS, *workload.shared_args(), "--corpus_bytes",
            str(workload.corpus_bytes), "--device", "cpu", "--checkpoint_dir", str(checkpoint_dir),
            "--memory_dir", str(run_dir / "memory"), "--log_interval", str(NO_LOGGING), *workload.example_args]
    records, seconds = run_torchrun(args[0], args[1:], run_dir, workload.world_size, timeout)
    events = read_events(checkpoint_dir / EVENT_LOG_NAME)
    step_times = _checked(workload, step_times_from_events(events))
    start, end = step_times[max(workload.skip_steps, 1) - 1], step_times[-1]
    snapshots, blocked = snapshots_in_window(events, start, end)
    return RunResult(_tokens_per_second(workload, step_times), max(r["peak_rss_mb"] for r in records), seconds,
                     blocked, snapshots)


def run_bare(workload: Workload, corpus: Path, run_dir: Path, timeout: float) -> RunResult:
    args = ["benchmarks.bare_gpt_loop", *workload.shared_args(), "--token_file", str(corpus)]
    records, seconds = run_torchrun(args[0], args[1:], run_dir, workload.world_size, timeout)
    step_times = _checked(workload, next(r["step_times"] for r in records if r["rank"] == 0))
    return RunResult(_tokens_per_second(workload, step_times), max(r["peak_rss_mb"] for r in records), seconds)


def _checked(workload: Workload, step_times: list[float]) -> list[float]:
    expected = len(workload.step_samples())
    if len(step_times) != expected:
        raise BenchmarkRunError(f"{len(step_times)} steps recorded; expected {expected} ({workload.describe()})")
    return step_times


def _tokens_per_second(workload: Workload, step_times: list[float]) -> float:
    return steady_state_tokens_per_second(step_times, workload.step_samples(), workload.block_size,
                                          workload.skip_steps)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def measure(workload: Workload, repetitions: int, work_dir: Path, timeout: float = 600,
            progress: Callable[[str], None] | None = None) -> tuple[list[RunResult], list[RunResult]]:
    """Interleaved pairs of runs; (ours, bare), one result per repetition each."""
    corpus = load_example().write_corpus(work_dir / "data", workload.corpus_bytes)  # the example's own file
    if corpus.stat().st_size // 2 != workload.corpus_bytes:
        raise BenchmarkRunError(f"the standard library gave {corpus.stat().st_size // 2} bytes, fewer than "
                                f"--corpus_bytes {workload.corpus_bytes}")
    results: dict[str, list[RunResult]] = {OURS: [], BARE: []}
    for repetition, order in enumerate(pair_orders(repetitions)):
        for side in order:
            run_dir = work_dir / f"{side}-{repetition}"
            run = run_ours if side == OURS else run_bare
            result = run(workload, corpus, run_dir, timeout)
            results[side].append(result)
            if progress is not None:
                progress(f"own loop {side} #{repetition + 1}: {result.tokens_per_second:.0f} tokens/s, "
                         f"{result.peak_rss_mb:.0f} MiB, {result.seconds:.1f} s")
    return results[OURS], results[BARE]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["--worker", OURS]:  # inside torchrun: the rest are the example's own flags
        return run_ours_worker(argv[2:])
    defaults = Workload()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.own_loop", description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", "--repeats", type=int, default=3, help="interleaved pairs (default 3)")
    parser.add_argument("--corpus_bytes", type=int, default=defaults.corpus_bytes)
    parser.add_argument("--block_size", type=int, default=defaults.block_size)
    parser.add_argument("--global_batch_size", type=int, default=defaults.global_batch_size)
    parser.add_argument("--micro_batch_size", type=int, default=defaults.micro_batch_size)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--gpt_layers", type=int, default=defaults.gpt_layers)
    parser.add_argument("--gpt_heads", type=int, default=defaults.gpt_heads)
    parser.add_argument("--gpt_embed", type=int, default=defaults.gpt_embed)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--nproc_per_node", type=int, default=defaults.world_size, help="CPU workers per side")
    parser.add_argument("--skip_steps", type=int, default=defaults.skip_steps,
                        help="steps left out of the measured window (start-up)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one torchrun job may take")
    parser.add_argument("--example_args", default="", metavar="FLAGS",
                        help="more flags for the example, in one string (e.g. '--snapshot_every_steps 0'): to find "
                             "where a gap comes from; the comparison itself runs the example with its defaults")
    args = parser.parse_args(argv)
    workload = Workload(args.corpus_bytes, args.block_size, args.global_batch_size, args.micro_batch_size,
                        args.epochs, args.gpt_layers, args.gpt_heads, args.gpt_embed, args.lr, args.seed,
                        args.nproc_per_node, args.skip_steps, tuple(shlex.split(args.example_args)))
    if args.repetitions < 1:
        parser.error(f"--repetitions: got {args.repetitions}; expected at least 1")
    steps = len(workload.step_samples())
    if steps < workload.skip_steps + 2:
        parser.error(f"{steps} steps in all; need more than --skip_steps + 1 = {workload.skip_steps + 1}")
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-own-loop-") as work_dir:
        ours, bare = measure(workload, args.repetitions, Path(work_dir), args.timeout,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render_pairs(ours, bare, pair_orders(args.repetitions)))
    print()
    print(summary_line(ours, bare))
    print()
    print(render_markdown(rows(workload, ours, bare)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
