"""Steady-state throughput and peak memory: `elastic_ddp.train` against the bare DDP loop.

    python -m benchmarks.throughput                 # full size, CPU, gloo, 2 workers, 5 repetitions
    python -m benchmarks.throughput --quick         # CI-sized
    python -m benchmarks.throughput --device cuda --use_amp   # GPU: nccl, AMP, one worker per GPU

(run from the repository root). Both sides run under the same torchrun command (plain torchrun,
one agent, `--nproc_per_node` workers, the shipped rendezvous settings, `OMP_NUM_THREADS=1` and
the rest of the agent environment elastic_ddp ships), with
the same model, data, optimizer, schedule, global batch and world size, and `--micro_batch_size`
equal to the per-rank share so neither side accumulates gradients. elastic_ddp runs twice per
repetition: snapshots on the overhead budget (the default: `--snapshot_budget` 1 %, no
`--snapshot_every_steps`) and every 50 steps (`--snapshot_every_steps 50`, the default before the
budget). On the budget, the share of the measured window that snapshots blocked the training
thread (the `blocked_seconds` of its `snapshot_captured` events) is a row of its own, against the
budget. Runs are interleaved, and the order is reversed every other repetition (A B C, C B A, ...)
so that a drift in machine load falls on both sides alike.

Throughput is measured from the end of the first epoch to the end of the last step, from rank 0's
step end times: the `step` events of elastic_ddp's event log, the list the bare loop prints (see
`benchmarks.measure`). Start-up (processes, `import torch`, rendezvous) is left out; snapshots,
epoch boundaries and logging inside the window count. Beside each rate, rank 0's CPU time per step (all threads, over
the same window; `time.process_time()` at each step end on both sides), which other load on the
machine disturbs far less. Every cell is the median [min..max] of the repetitions, and the ratio
is paired: one per repetition, whose median and spread are shown. Peak memory is each worker's
VmHWM at exit, the largest over the ranks, from the runs with the default snapshot cadence.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/throughput.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import (
    PROFILE_DIR_ENV,
    parse_results,
    steady_state_cpu_ms_per_step,
    steady_state_samples_per_second,
)
from benchmarks.table import Row, render_markdown
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.testbed.local_cluster import (
    AGENT_ENV,
    RDZV_CONF,
    STOCK_LAUNCHER,
    free_port,
    signal_tree,
    torchrun_command,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGET_MODE = "default snapshots, on the budget"
SNAPSHOT_MODES: dict[str, int | None] = {BUDGET_MODE: None, "snapshots every 50 steps": 50}
TARGETS = {BUDGET_MODE: ">= 0.98", "snapshots every 50 steps": ">= 0.98"}  # issues 17 and 28
SNAPSHOT_BUDGET = 0.01  # elastic_ddp's default --snapshot_budget


def snapshot_args(snapshot_every_steps: int | None) -> list[str]:
    """The flags of a snapshot mode: none on the budget."""
    return [] if snapshot_every_steps is None else ["--snapshot_every_steps", str(snapshot_every_steps)]


class BenchmarkRunError(RuntimeError):
    """A benchmark job failed or ran past its deadline; the message ends with its log."""


@dataclass(frozen=True)
class Workload:
    """One training job, run identically by both sides."""

    model: str
    epochs: int
    dataset_size: int = 4096
    global_batch_size: int = 64
    world_size: int = 2
    device: str = "cpu"
    use_amp: bool = False
    sharding: str = "none"  # fsdp: both sides shard the model with FSDP2 (the bare side: a bare FSDP2 loop)

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch_size

    def shared_args(self) -> list[str]:
        return ["--model", self.model, "--epochs", str(self.epochs), "--dataset_size", str(self.dataset_size),
                "--global_batch_size", str(self.global_batch_size), "--device", self.device,
                "--use_amp" if self.use_amp else "--no-use_amp", "--sharding", self.sharding]


FULL_WORKLOADS = (Workload("mini_resnet", epochs=4), Workload("mlp", epochs=24))
QUICK_WORKLOADS = (Workload("mini_resnet", epochs=3, dataset_size=512), Workload("mlp", epochs=4, dataset_size=1024))


@dataclass(frozen=True)
class RunResult:
    samples_per_second: float
    cpu_ms_per_step: float  # rank 0's process CPU time per step, over the same window
    peak_rss_mb: float  # the largest over all ranks
    peak_cuda_mb: float | None  # the largest CUDA memory allocated by a rank (None on CPU)
    seconds: float  # wall time of the whole torchrun job, start-up included
    snapshot_share: float | None = None  # elastic_ddp: share of the window snapshots blocked training


def start_torchrun(module: str, args: Sequence[str], run_dir: Path, world_size: int,
                   env: dict[str, str] | None = None,
                   rendezvous: tuple[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start `module` under one torchrun agent in a session of its own; (the agent, its log path).

    Plain torchrun for both sides, with the shipped rendezvous settings and agent environment: the
    steady state does not depend on how workers start. `rendezvous`: (backend, `--rdzv_conf`) in
    place of torch's `c10d` and the shipped settings. The caller ends the job (`signal_tree`).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    backend, conf = rendezvous or ("c10d", RDZV_CONF)
    command = torchrun_command(nnodes="1", nproc_per_node=world_size, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                               rdzv_id=run_dir.name, max_restarts=0, module=module, training_args=args,
                               launcher=STOCK_LAUNCHER, rdzv_backend=backend, rdzv_conf=conf)
    log_path = run_dir / "torchrun.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                 env={**os.environ, **AGENT_ENV, **(env or {})}, start_new_session=True)
    return agent, log_path


def run_torchrun(module: str, args: Sequence[str], run_dir: Path, world_size: int, timeout: float,
                 profile_dir: Path | None = None,
                 rendezvous: tuple[str, str] | None = None) -> tuple[list[dict], float]:
    """Run `module` under one torchrun agent; return its `BENCH_RESULT` records and its wall time.

    With `profile_dir`, the workers run under cProfile and leave their profiles in a subdirectory
    named after `run_dir`.
    """
    started = time.monotonic()
    env = {PROFILE_DIR_ENV: str(profile_dir / run_dir.name)} if profile_dir is not None else None
    process, log_path = start_torchrun(module, args, run_dir, world_size, env, rendezvous)
    try:
        exit_code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        exit_code = None
    finally:  # a timeout, or this harness interrupted: leave no job behind
        if process.poll() is None:
            signal_tree(process.pid, signal.SIGKILL)
            process.wait()
    seconds = time.monotonic() - started
    output = log_path.read_text(errors="replace")
    if exit_code != 0:
        what = f"ran past {timeout:.0f} s" if exit_code is None else f"exited with {exit_code}"
        raise BenchmarkRunError(f"{module} {' '.join(args)} {what}; log {log_path}:\n{output[-3000:]}")
    records = parse_results(output)
    if len(records) != world_size:
        raise BenchmarkRunError(f"{module}: expected {world_size} result lines, got {len(records)}; log {log_path}")
    return records, seconds


def run_bare(workload: Workload, run_dir: Path, timeout: float, profile_dir: Path | None = None) -> RunResult:
    records, seconds = run_torchrun("benchmarks.bare_ddp", workload.shared_args(), run_dir, workload.world_size,
                                    timeout, profile_dir)
    rank0 = next(record for record in records if record["rank"] == 0)
    return _result(workload, rank0["step_times"], rank0["cpu_times"], records, seconds)


def run_elastic(workload: Workload, snapshot_every_steps: int | None, run_dir: Path, timeout: float,
                profile_dir: Path | None = None, rendezvous: tuple[str, str] | None = None) -> RunResult:
    checkpoint_dir = run_dir / "ck"
    args = [*workload.shared_args(), "--micro_batch_size", str(workload.global_batch_size // workload.world_size),
            *snapshot_args(snapshot_every_steps), "--checkpoint_dir", str(checkpoint_dir)]
    records, seconds = run_torchrun("benchmarks.elastic_worker", args, run_dir, workload.world_size, timeout,
                                    profile_dir, rendezvous)
    events = read_events(checkpoint_dir / EVENT_LOG_NAME)
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["global_step"])
    cpu_times = next(record["cpu_times"] for record in records if record["rank"] == 0)
    result = _result(workload, [e["time"] for e in steps], cpu_times, records, seconds)
    # The same window as the throughput: from the end of the first epoch to the last step.
    start, end = steps[workload.steps_per_epoch - 1]["time"], steps[-1]["time"]
    blocked = sum(e["blocked_seconds"] for e in events
                  if e["event"] == "snapshot_captured" and start < e["time"] <= end)
    return dataclasses.replace(result, snapshot_share=blocked / max(end - start, 1e-9))


def _result(workload: Workload, step_times: list[float], cpu_times: list[float], records: list[dict],
            seconds: float) -> RunResult:
    expected_steps = workload.epochs * workload.steps_per_epoch
    if not len(step_times) == len(cpu_times) == expected_steps:
        raise BenchmarkRunError(f"{workload}: {len(step_times)} step times and {len(cpu_times)} CPU times "
                                f"recorded, expected {expected_steps}")
    skip = workload.steps_per_epoch
    return RunResult(steady_state_samples_per_second(step_times, workload.global_batch_size, skip_steps=skip),
                     steady_state_cpu_ms_per_step(cpu_times, skip_steps=skip),
                     max(record["peak_rss_mb"] for record in records),
                     max((record["peak_cuda_allocated_mb"] for record in records if "peak_cuda_allocated_mb" in record),
                         default=None), seconds)


def measure(workloads: Sequence[Workload], repetitions: int, work_dir: Path, timeout: float = 600,
            progress: Callable[[str], None] | None = None, profile_dir: Path | None = None) -> list[Row]:
    """Interleaved runs of every workload; throughput rows per snapshot cadence, then memory rows."""
    bare: dict[str, list[RunResult]] = {w.model: [] for w in workloads}
    elastic: dict[tuple[str, str], list[RunResult]] = {
        (w.model, mode): [] for w in workloads for mode in SNAPSHOT_MODES}
    for repetition in range(repetitions):
        for workload in workloads:
            sides = ["bare", *SNAPSHOT_MODES]
            if repetition % 2:
                sides.reverse()
            for side in sides:
                run_dir = work_dir / f"{workload.model}-{side.replace(' ', '_')}-{repetition}"
                if side == "bare":
                    result = run_bare(workload, run_dir, timeout, profile_dir)
                    bare[workload.model].append(result)
                else:
                    result = run_elastic(workload, SNAPSHOT_MODES[side], run_dir, timeout, profile_dir)
                    elastic[(workload.model, side)].append(result)
                if progress is not None:
                    progress(f"throughput {workload.model} {side} #{repetition + 1}: "
                             f"{result.samples_per_second:.0f} samples/s, {result.cpu_ms_per_step:.2f} CPU ms/step, "
                             f"{result.peak_rss_mb:.0f} MiB, "
                             f"{result.seconds:.1f} s")
    return _rows(workloads, bare, elastic)


def _rows(workloads: Sequence[Workload], bare: dict[str, list[RunResult]],
          elastic: dict[tuple[str, str], list[RunResult]]) -> list[Row]:
    rows = []
    for workload in workloads:
        for mode in SNAPSHOT_MODES:  # each rate beside its CPU time per step: the steadier figure on a shared machine
            rows.append(Row("throughput", f"{workload.model}, {mode}: samples/s",
                            [r.samples_per_second for r in elastic[(workload.model, mode)]],
                            [r.samples_per_second for r in bare[workload.model]], "bare DDP",
                            target=TARGETS[mode], note=_describe(workload)))
            rows.append(Row("throughput", f"{workload.model}, {mode}: CPU ms per step, rank 0",
                            [r.cpu_ms_per_step for r in elastic[(workload.model, mode)]],
                            [r.cpu_ms_per_step for r in bare[workload.model]], "bare DDP",
                            note="all threads; robust to other load"))
        budgeted = elastic[(workload.model, BUDGET_MODE)]
        rows.append(Row("throughput", f"{workload.model}, {BUDGET_MODE}: share of training time snapshots blocked",
                        [r.snapshot_share for r in budgeted], [SNAPSHOT_BUDGET] * len(budgeted), "the budget",
                        target="<= 1", note="blocked_seconds of snapshot_captured over the measured window"))
    default_mode = BUDGET_MODE
    for workload in workloads:
        rows.append(Row("memory", f"{workload.model}: peak RSS per worker, MiB",
                        [r.peak_rss_mb for r in elastic[(workload.model, default_mode)]],
                        [r.peak_rss_mb for r in bare[workload.model]], "bare DDP"))
        if all(r.peak_cuda_mb is not None for r in bare[workload.model] + elastic[(workload.model, default_mode)]):
            rows.append(Row("memory", f"{workload.model}: peak CUDA memory allocated per worker, MiB",
                            [r.peak_cuda_mb for r in elastic[(workload.model, default_mode)]],
                            [r.peak_cuda_mb for r in bare[workload.model]], "bare DDP"))
    return rows


def _describe(workload: Workload) -> str:
    amp = ", AMP" if workload.use_amp else ""
    amp += ", FSDP2 (both sides)" if workload.sharding == "fsdp" else ""
    return (f"{workload.world_size} workers, {workload.device}{amp}, batch {workload.global_batch_size}, "
            f"{workload.epochs} epochs of {workload.steps_per_epoch} steps")


def workloads_for(quick: bool, models: Sequence[str] | None = None, device: str = "cpu", use_amp: bool = False,
                  world_size: int | None = None, sharding: str = "none") -> list[Workload]:
    """The quick or full workloads, for `models` (all by default), on `device` with `world_size` workers."""
    chosen = QUICK_WORKLOADS if quick else FULL_WORKLOADS
    # A GPU step is much shorter: more epochs keep the measured window long enough.
    epochs_scale = 4 if device == "cuda" and not quick else 1
    result = []
    for workload in chosen:
        if models and workload.model not in models:
            continue
        result.append(Workload(workload.model, workload.epochs * epochs_scale, workload.dataset_size,
                               workload.global_batch_size, world_size or workload.world_size, device, use_amp,
                               sharding))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized runs, one repetition")
    parser.add_argument("--repetitions", type=int, default=None, help="default: 1 with --quick, else 5")
    parser.add_argument("--models", nargs="+", choices=("mini_resnet", "mlp"), default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--use_amp", action="store_true", help="mixed precision (fp16 + GradScaler on CUDA)")
    parser.add_argument("--sharding", choices=("none", "fsdp"), default="none",
                        help="fsdp: elastic_ddp --sharding fsdp against a bare FSDP2 loop (default: DDP on both)")
    parser.add_argument("--world_size", type=int, default=None,
                        help="workers (default 2; with --device cuda, the number of GPUs)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="run the workers under cProfile (CPU time), keep the profiles in DIR and print "
                             "the top functions of rank 0 of each run (profiling slows both sides)")
    args = parser.parse_args(argv)
    world_size = args.world_size
    if args.device == "cuda" and world_size is None:
        import torch

        world_size = torch.cuda.device_count()
    repetitions = args.repetitions or (1 if args.quick else 5)
    workloads = workloads_for(args.quick, args.models, args.device, args.use_amp, world_size, args.sharding)
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-throughput-") as work_dir:
        rows = measure(workloads, repetitions, Path(work_dir), progress=lambda line: print(line, file=sys.stderr),
                       profile_dir=args.profile)
    print(render_markdown(rows))
    if args.profile is not None:
        print_profiles(args.profile)
    return 0


def print_profiles(profile_dir: Path, top: int = 30) -> None:
    """The functions with the most CPU time of their own, for rank 0 of every profiled run."""
    for path in sorted(profile_dir.glob("*/*-rank0.prof")):
        print(f"\n===== {path.parent.name} ({path.name})")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    sys.exit(main())
