"""`python -m elastic_ddp.train`, plus one `BENCH_RESULT` line per rank at exit.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m benchmarks.elastic_worker --model mlp

(run from the repository root). Training, timing and logging are those of `elastic_ddp.train.main`:
the harness reads the step times from the run's event log. The wrapper adds two things: when rank 0
writes a `step` event it also notes `time.process_time()` (under a microsecond per step), for the
CPU-time figure that the bare loop reports too; and after training it reads the peak resident
memory. With `BENCH_PROFILE_DIR` set, training runs under cProfile (see `benchmarks.measure`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.measure import emit_result, peak_rss_mb, run_maybe_profiled
from elastic_ddp import train
from elastic_ddp.runtime.distributed import exit_worker
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog


def record_cpu_time_of_steps(cpu_times: list[float]) -> None:
    """Make every `EventLog` note the process CPU time when it writes a `step` event."""
    emit = EventLog.emit

    def emit_noting_cpu_time(self: EventLog, kind: schema.EventKind, **fields: Any) -> None:
        if kind is schema.STEP:
            cpu_times.append(time.process_time())
        emit(self, kind, **fields)

    EventLog.emit = emit_noting_cpu_time


def main(argv: Sequence[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    cpu_times: list[float] = []
    if rank == 0:  # only rank 0's event log writes, as in the bare loop only rank 0 records
        record_cpu_time_of_steps(cpu_times)
    exit_code = run_maybe_profiled("elastic_ddp", lambda: train.main(argv))
    record: dict[str, Any] = {"side": "elastic_ddp", "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", 1)),
                              "peak_rss_mb": round(peak_rss_mb(), 1)}
    if rank == 0:
        record["cpu_times"] = cpu_times
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record["peak_cuda_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    emit_result(record)
    return exit_code


if __name__ == "__main__":
    exit_worker(main())  # as `python -m elastic_ddp.train` ends: no interpreter teardown
