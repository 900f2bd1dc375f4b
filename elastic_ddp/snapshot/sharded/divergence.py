"""Whether a sharded state has diverged: a NaN or an infinity in any rank's shards.

A diverged state is never kept as the newest, restored or made durable (docs/failure-semantics.md,
the promises), in any tier: the durable snapshots (session.py) and the restores from memory ask all the ranks
(`any_rank_diverged`, a collective); the memory parts are checked by each rank at each step
(`local_shards` with training_state.non_finite_tensors, no collective), and a diverged part is not
kept (memory_shards.py). The check itself is training_state's, as in DDP mode.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.training_state import non_finite_tensors


def local_shards(value: Any) -> Any:
    """`value` with every DTensor replaced by this rank's shard of it."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {key: local_shards(item) for key, item in value.items()}
    return value


def any_rank_diverged(tensors: dict[str, Any], context: DistributedContext) -> list[str]:
    """Where this rank's shards hold a NaN or an infinity, or ["another rank's shards"] when only
    another rank's do; [] when every shard is finite (a collective)."""
    mine = non_finite_tensors(local_shards(tensors))
    if not context.in_process_group:
        return mine
    flag = torch.tensor([1 if mine else 0], dtype=torch.int64, device=context.collective_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return mine or (["another rank's shards"] if flag.item() else [])
