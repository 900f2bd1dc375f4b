"""Where a worker's peak resident memory comes from: `benchmarks.elastic_worker` with probes.

    python -m benchmarks.sharded_memory --phases --worlds 2 --repetitions 1

(`benchmarks.sharded_memory --phases` runs this module as the worker instead of
`benchmarks.elastic_worker`.) tracemalloc does not see tensors, so the probes read the kernel's
figures instead: at the entry and the exit of each probed call (building the workload, placing and
sharding the model, building the training state, forward/backward, the commit, the optimizer step,
a memory part taken, laid out and exchanged, a DCP save, DDP's snapshot and memory copy) they read
`/proc/self/status` (VmHWM, VmRSS: 0.05 ms a read). The peak (VmHWM) only grows; each growth is
put down to the interval between the two marks that saw it (`enter X` .. `exit X`: inside X, and
inside none of the calls X made that are probed too). The intervals' growths add up to the peak at
exit minus the peak at the first mark (the interpreter and torch's import). Each rank adds to its
`BENCH_RESULT` line: `hwm_growth` (interval -> MiB, largest first), `rss` (mark -> the largest
VmRSS seen there, MiB) and `first_hwm_mb`.

Not measured: memory that is allocated and freed between two marks without raising the peak
(it is not part of the peak), CUDA memory.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import elastic_worker
from elastic_ddp.runtime.distributed import exit_worker

# (module, attribute path) of each probed call, patched where it is looked up at call time
PROBES = (
    ("elastic_ddp.train", "build_workload"),
    ("elastic_ddp.training.elastic_run", "place_model"),
    ("elastic_ddp.training.elastic_run", "build_training_state"),
    ("elastic_ddp.training.elastic_run", "Step.backward"),
    ("elastic_ddp.training.elastic_run", "Step.commit"),
    ("elastic_ddp.training.elastic_run", "ElasticRun._after_commit"),
    ("torch.optim", "AdamW.step"),
    ("torch.distributed.checkpoint", "save"),
    ("elastic_ddp.snapshot.manager", "SnapshotSession.save"),
    ("elastic_ddp.snapshot.manager", "SnapshotSession.restore"),
    ("elastic_ddp.snapshot.manager", "SnapshotSession.keep_in_memory"),
    ("elastic_ddp.snapshot.sharded.session", "ShardedSnapshotSession.restore"),
    ("elastic_ddp.snapshot.sharded.memory_session", "MemoryCopies.take"),
    ("elastic_ddp.snapshot.sharded.memory_session", "get_state_dict"),
    ("elastic_ddp.snapshot.sharded.memory_checkpoint", "PartWriter.save"),
    ("elastic_ddp.snapshot.sharded.memory_shards", "ShardMemory.wait"),
    ("elastic_ddp.snapshot.sharded.memory_shards", "ShardMemory.exchange"),
)  # the exchange itself runs on a thread of its own: its allocations show in the intervals around these
MIB = 1024  # /proc/self/status says kB


def read_status() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process, in kB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    return fields["VmHWM"], fields["VmRSS"]


class Probe:
    """The marks seen so far: HWM growth per interval, the largest RSS per mark."""

    def __init__(self) -> None:
        self.last_hwm, _ = read_status()
        self.first_hwm = self.last_hwm
        self.last_mark = "start"
        self.growth: dict[str, int] = {}
        self.rss: dict[str, int] = {}

    def mark(self, label: str) -> None:
        hwm, rss = read_status()
        if hwm > self.last_hwm:
            interval = f"{self.last_mark} .. {label}"
            self.growth[interval] = self.growth.get(interval, 0) + hwm - self.last_hwm
            self.last_hwm = hwm
        self.rss[label] = max(self.rss.get(label, 0), rss)
        self.last_mark = label

    def record(self) -> dict[str, Any]:
        self.mark("exit")
        return {"first_hwm_mb": round(self.first_hwm / MIB, 1),
                "hwm_growth": {k: round(v / MIB, 1) for k, v in sorted(self.growth.items(), key=lambda kv: -kv[1])},
                "rss": {k: round(v / MIB, 1) for k, v in self.rss.items()}}


def install(probe: Probe) -> None:
    for module_name, path in PROBES:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is None or not hasattr(owner, name):
            continue
        setattr(owner, name, _probed(getattr(owner, name), path, probe))


def _probed(function: Any, label: str, probe: Probe) -> Any:
    @functools.wraps(function)
    def probed(*args: Any, **kwargs: Any) -> Any:
        probe.mark(f"enter {label}")
        try:
            return function(*args, **kwargs)
        finally:
            probe.mark(f"exit {label}")
    return probed


def main(argv: Sequence[str] | None = None) -> int:
    probe = Probe()
    install(probe)
    emit = elastic_worker.emit_result
    elastic_worker.emit_result = lambda record: emit({**record, **probe.record()})
    return elastic_worker.main(argv)


if __name__ == "__main__":
    exit_worker(main())
