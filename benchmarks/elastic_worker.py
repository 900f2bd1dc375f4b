"""`python -m elastic_ddp.train`, unchanged, plus one `BENCH_RESULT` line with its peak memory at exit.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m benchmarks.elastic_worker --model mlp

(run from the repository root). Training, timing and logging are exactly those of
`elastic_ddp.train.main`: the harness reads step times from the run's event log. This wrapper only
adds, after training has returned, the read of the process's peak resident memory (and cProfile
around training when `BENCH_PROFILE_DIR` is set, see `benchmarks.measure`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch

from benchmarks.measure import emit_result, peak_rss_mb, run_maybe_profiled
from elastic_ddp import train


def main(argv: Sequence[str] | None = None) -> int:
    exit_code = run_maybe_profiled("elastic_ddp", lambda: train.main(argv))
    record = {"side": "elastic_ddp", "rank": int(os.environ.get("RANK", 0)),
              "world_size": int(os.environ.get("WORLD_SIZE", 1)), "peak_rss_mb": round(peak_rss_mb(), 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record["peak_cuda_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    emit_result(record)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
