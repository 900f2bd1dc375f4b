"""Where a step's CPU goes, per thread of rank 0: elastic_ddp against the bare DDP loop.

    python -m benchmarks.thread_cpu                       # MLP, 2 repetitions, 8 s windows
    python -m benchmarks.thread_cpu --model mini_resnet --repetitions 3

(run from the repository root). The throughput benchmark's "CPU ms per step" counts every thread
of the process, and cProfile sees only the training thread; this splits the figure. Each run starts
the same torchrun job as `benchmarks.throughput` (plain torchrun, 2 workers, the MLP of its full
workload, more epochs so the window fits), waits until 200 steps are done, then reads the CPU time
(user + system) of every thread of rank 0 from /proc at the start and the end of a window, and
the steps done in between (elastic_ddp: `step` events of its event log; bare loop: its `step N`
log lines, every 10 steps). Threads are grouped as the training thread (`main`), gloo's
(`gloo`: its names start with gloo or pt_gloo) and the rest (Python threads: elastic_ddp's snapshot
writer). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/thread_cpu.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import SNAPSHOT_MODES, Workload, snapshot_args, start_torchrun  # noqa: E402
from elastic_ddp.testbed.local_cluster import signal_tree, wait_for  # noqa: E402
from elastic_ddp.runtime.procfs import read_stat  # noqa: E402
from elastic_ddp.runlog.reader import EventFollower  # noqa: E402
from elastic_ddp.runlog.schema import EVENT_LOG_NAME  # noqa: E402

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
WARM_UP_STEPS = 200
BARE_STEP_LINE = re.compile(r"step (\d+) loss")


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """{thread id: (name, user + system CPU seconds)} of every thread of `pid` still alive."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = read_stat(pid, thread=int(tid))
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            stat = None
        if stat is not None:  # None: the thread ended meanwhile
            threads[int(tid)] = (name, (stat.user_ticks + stat.system_ticks) / TICKS_PER_SECOND)
    return threads


def thread_group(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "main"
    return "gloo" if name.startswith(("gloo", "pt_gloo")) else "other"


def cpu_ms_per_step_by_group(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                             steps: int) -> dict[str, float]:
    """CPU milliseconds per step of each thread group between two `thread_cpu_seconds` readings."""
    groups: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        group = thread_group(pid, tid, name)
        groups[group] = groups.get(group, 0.0) + seconds - before.get(tid, (name, 0.0))[1]
    return {group: 1000 * seconds / steps for group, seconds in groups.items()}


def measure_side(side: str, workload: Workload, window_s: float, work_dir: Path) -> tuple[int, dict[str, float]]:
    """(steps in the window, CPU ms per step by thread group) of rank 0 of one run of `side`."""
    args = workload.shared_args()
    if side == "bare":
        module, step_counter = "benchmarks.bare_ddp", _bare_steps
    else:
        module, step_counter = "elastic_ddp.train", _elastic_steps
        args += ["--micro_batch_size", str(workload.global_batch_size // workload.world_size),
                 *snapshot_args(SNAPSHOT_MODES[side]), "--checkpoint_dir", str(work_dir / "ck")]
    agent, log_path = start_torchrun(module, args, work_dir, workload.world_size)
    try:
        steps = step_counter(work_dir)
        wait_for(lambda: steps() >= WARM_UP_STEPS or agent.poll() is not None, 120, f"{WARM_UP_STEPS} steps of {side}")
        if agent.poll() is not None:
            raise RuntimeError(f"{side}: torchrun exited with {agent.returncode} before the window; log {log_path}")
        rank0 = _rank0_worker(agent.pid)
        before, first = thread_cpu_seconds(rank0), steps()
        time.sleep(window_s)  # the measurement window itself
        after, last = thread_cpu_seconds(rank0), steps()
        if agent.poll() is not None or last <= first:
            raise RuntimeError(f"{side}: the job ended or stalled within the window; log {log_path}")
        return last - first, cpu_ms_per_step_by_group(rank0, before, after, last - first)
    finally:
        signal_tree(agent.pid, signal.SIGKILL)
        agent.wait()


def _rank0_worker(agent_pid: int) -> int:
    children = subprocess.run(["pgrep", "-P", str(agent_pid)], capture_output=True, text=True).stdout.split()
    for child in children:
        if b"\0RANK=0\0" in b"\0" + Path(f"/proc/{child}/environ").read_bytes():
            return int(child)
    raise RuntimeError(f"no worker with RANK=0 among the children {children} of agent {agent_pid}")


def _bare_steps(work_dir: Path) -> Callable[[], int]:
    """The bare loop's newest step, read from the `step N loss` lines it prints."""
    def steps() -> int:
        found = BARE_STEP_LINE.findall((work_dir / "torchrun.log").read_text(errors="replace"))
        return int(found[-1]) if found else 0
    return steps


def _elastic_steps(work_dir: Path) -> Callable[[], int]:
    """elastic_ddp's newest step, from its event log (read incrementally: polled every 0.1 s)."""
    follower = EventFollower(work_dir / "ck" / EVENT_LOG_NAME)

    def steps() -> int:
        follower.poll()
        return follower.newest_step()
    return steps


def measure(model: str, repetitions: int, window_s: float, work_dir: Path,
            progress: Callable[[str], None] = print) -> list[tuple[str, int, dict[str, float]]]:
    """Interleaved runs: the bare loop, then elastic_ddp with each snapshot cadence, per repetition."""
    workload = Workload(model, epochs=200)  # long enough for any window; the run is cut after it
    results = []
    for repetition in range(repetitions):
        for side in ("bare", *SNAPSHOT_MODES):
            steps, groups = measure_side(side, workload, window_s,
                                         work_dir / f"{side.replace(' ', '_')}-{repetition}")
            results.append((side, steps, groups))
            progress(f"{side:>26}: {steps:5d} steps, CPU ms per step " +
                     ", ".join(f"{group} {value:.2f}" for group, value in sorted(groups.items()))
                     + f", all {sum(groups.values()):.2f}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.thread_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mini_resnet", "mlp"), default="mlp")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--window", type=float, default=8.0, help="seconds of each measurement window")
    args = parser.parse_args(argv)
    if args.repetitions < 1 or args.window <= 0:
        parser.error(f"--repetitions must be at least 1 and --window positive; got {args.repetitions} and "
                     f"{args.window}")
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-thread-cpu-") as work_dir:
        measure(args.model, args.repetitions, args.window, Path(work_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
