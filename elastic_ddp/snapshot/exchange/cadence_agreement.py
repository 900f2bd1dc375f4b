"""Every rank learns when the next budgeted snapshot is due: rank 0 chooses, one broadcast.

`snapshot/cadence.py` says how rank 0 spaces snapshots on the overhead budget; this is the small
collective that makes every rank decide the same at every step, and the `snapshot_cadence` event.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.cadence import SnapshotCadence


def agree_on_next_snapshot(cadence: SnapshotCadence, global_step: int, blocked_seconds: float,
                           context: DistributedContext, events: EventLog, writer_cpu_seconds: float = 0.0) -> None:
    """After the snapshot of `global_step`, which blocked rank 0's training `blocked_seconds` (and
    whose write takes `writer_cpu_seconds` of the cores training runs on): rank 0 chooses the step of
    the next one and every rank learns it (a collective: call it on every rank)."""
    next_due = cadence.next_due(global_step, blocked_seconds, writer_cpu_seconds) if context.is_main else 0
    if context.in_process_group:
        agreed = torch.tensor([next_due], dtype=torch.int64, device=context.collective_device)
        dist.broadcast(agreed, src=0)
        next_due = int(agreed.item())
    cadence.agree(next_due)
    interval = cadence.interval
    if context.is_main and interval is not None:
        events.emit(schema.SNAPSHOT_CADENCE, global_step=global_step, every_steps=interval.every_steps,
                    interval_s=round(interval.seconds, 3), blocked_seconds=round(blocked_seconds, 4),
                    writer_cpu_seconds=round(writer_cpu_seconds, 4), budget=cadence.budget)
