"""Measurement helpers shared by the benchmark workers and the harness.

Both sides of a throughput comparison are measured the same way: rank 0 notes the wall-clock time
(`time.time()`) when each optimizer step is done, and `steady_state_samples_per_second` turns those
timestamps into a rate over a window that leaves out start-up (process start, `import torch`,
process-group set-up, the first epoch). For elastic_ddp the timestamps are the `step` events of its
event log; the bare loop records them in a list and reports them the same way.

Workers report to the harness with one line on stdout, `BENCH_RESULT {json}`, per rank. With
`BENCH_PROFILE_DIR` set in their environment, workers run under cProfile (CPU time, so that other
load on the machine does not blur where the time goes) and leave `SIDE-rankR.prof` there.
"""

from __future__ import annotations

import cProfile
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

RESULT_PREFIX = "BENCH_RESULT "
PROFILE_DIR_ENV = "BENCH_PROFILE_DIR"

T = TypeVar("T")


def run_maybe_profiled(side: str, function: Callable[[], T]) -> T:
    """Call `function`; under cProfile (CPU time) when `BENCH_PROFILE_DIR` is set."""
    directory = os.environ.get(PROFILE_DIR_ENV)
    if not directory:
        return function()
    profiler = cProfile.Profile(time.process_time)
    try:
        return profiler.runcall(function)
    finally:
        Path(directory).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(Path(directory) / f"{side}-rank{os.environ.get('RANK', 0)}.prof")


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # the kernel reports kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def emit_result(record: dict[str, Any]) -> None:
    """Print one machine-readable result line (the harness greps stdout for it).

    In one `write` call: every worker of a job shares torchrun's stdout, and a line of tens of
    kilobytes printed through Python's buffer could be split by another worker's line."""
    line = RESULT_PREFIX + json.dumps(record) + "\n"
    sys.stdout.flush()
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stdout (tests): nobody else writes to it
        print(line, end="", flush=True)
        return
    data = memoryview(line.encode())
    while data:
        data = data[os.write(descriptor, data):]


def parse_results(text: str) -> list[dict[str, Any]]:
    """Every `BENCH_RESULT` record in `text` (the output of a torchrun job), in order."""
    records = []
    for line in text.splitlines():
        position = line.find(RESULT_PREFIX)
        if position >= 0:
            records.append(json.loads(line[position + len(RESULT_PREFIX):]))
    return records


def steady_state_cpu_ms_per_step(cpu_times: Sequence[float], skip_steps: int) -> float:
    """Process CPU milliseconds (all threads) per step over the same window as the rate.

    `cpu_times[k]` is `time.process_time()` when step k+1 was done. Less sensitive than wall time
    to other load on the machine, so it shows a per-step overhead even when throughput is noisy.
    """
    if len(cpu_times) < skip_steps + 2:
        raise ValueError(f"{len(cpu_times)} steps recorded; need more than {skip_steps + 1}")
    start = cpu_times[skip_steps - 1] if skip_steps else cpu_times[0]
    return 1000 * (cpu_times[-1] - start) / (len(cpu_times) - max(skip_steps, 1))


def steady_state_samples_per_second(step_times: Sequence[float], samples_per_step: int, skip_steps: int) -> float:
    """Samples per second from the end of step `skip_steps` to the end of the last step.

    `step_times[k]` is the time step k+1 was done. Everything that happens between the two ends
    counts (snapshots, epoch boundaries, logging): it is the rate a long run sees.
    """
    if len(step_times) < skip_steps + 2:
        raise ValueError(f"{len(step_times)} steps recorded; need more than {skip_steps + 1} to measure "
                         "a steady state")
    start, end = step_times[skip_steps - 1] if skip_steps else step_times[0], step_times[-1]
    measured_steps = len(step_times) - max(skip_steps, 1)
    if end <= start:
        raise ValueError("step times do not increase; cannot measure a rate")
    return measured_steps * samples_per_step / (end - start)
