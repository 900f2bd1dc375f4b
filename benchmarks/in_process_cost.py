"""What being able to re-form in process costs a steady step: `in_process=1` against `in_process=0`.

    python -m benchmarks.in_process_cost --sharding fsdp --pairs 4   # FSDP2: interruptible collectives
    python -m benchmarks.in_process_cost --pairs 4                   # DDP: the comm hook, the vote's guard

(run from the repository root). The MLP workload of `benchmarks.throughput` (2 CPU workers on one
node, snapshots on the budget) under plain torchrun with `--rdzv_backend elastic-c10d`, the same
command with `--rdzv_conf in_process=0` beside it, alternated pair by pair (`benchmarks.throughput`
itself runs torch's `c10d`, under which nothing re-forms in process, so it cannot see this cost).
With `in_process=1` the workers run what a re-form needs on every step: under DDP, the all-reduce
through a comm hook waited for through the alarm; under `--sharding fsdp`, FSDP2's all-gathers and
reduce-scatters through `InterruptibleFSDPCollectives` (the reduce-scatter as an all-reduce).
Prints, per pair, samples/s and rank 0's CPU ms per step of each side, then the paired ratios
(on / off): their median and spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/in_process_cost.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import RunResult, run_elastic, workloads_for
from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.agent.rendezvous.rounds import IN_PROCESS_KEY
from elastic_ddp.testbed.local_cluster import RDZV_CONF

SIDES = {"on": f"{RDZV_CONF},{IN_PROCESS_KEY}=1", "off": f"{RDZV_CONF},{IN_PROCESS_KEY}=0"}
TIMEOUT_S = 900


def paired_ratios(on: Sequence[RunResult], off: Sequence[RunResult]) -> dict[str, list[float]]:
    """Per pair, on / off: of samples/s and of rank 0's CPU ms per step."""
    return {"samples_per_second": [a.samples_per_second / b.samples_per_second for a, b in zip(on, off, strict=True)],
            "cpu_ms_per_step": [a.cpu_ms_per_step / b.cpu_ms_per_step for a, b in zip(on, off, strict=True)]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharding", choices=("none", "fsdp"), default="none")
    parser.add_argument("--pairs", type=int, default=4, help="alternated pairs of runs (default 4)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs: got {args.pairs}; expected at least 1")
    [workload] = workloads_for(False, ["mlp"], "cpu", False, 2, args.sharding)
    root = Path(tempfile.mkdtemp(prefix="in-process-cost-"))
    results: dict[str, list[RunResult]] = {side: [] for side in SIDES}
    for pair in range(args.pairs):
        for side, conf in SIDES.items():
            result = run_elastic(workload, None, root / f"{side}{pair}", TIMEOUT_S, rendezvous=(BACKEND_NAME, conf))
            results[side].append(result)
            print(f"pair {pair + 1}, in_process {side}: {result.samples_per_second:.0f} samples/s, "
                  f"{result.cpu_ms_per_step:.2f} CPU ms per step", flush=True)
    for name, ratios in paired_ratios(results["on"], results["off"]).items():
        print(f"{name}, on / off: {statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}] "
              f"(n = {len(ratios)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
