"""Restore on start: the whole group agrees on the newest snapshot that any rank can read.

Each rank looks in its own `--checkpoint_dir` (the same directory on a shared filesystem, or each
node's local disk) for its newest snapshot that verifies. The ranks exchange (step, sha256); the
newest wins; if some ranks lack it, the lowest rank that holds it sends the bytes to everyone as a
tensor broadcast (no pickle), and every receiver checks the sha256 before loading. So all ranks
restore the same snapshot, and a node that never saw the snapshot's file still resumes from it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import CheckpointStore, ManifestEntry
from elastic_ddp.distributed import DistributedContext
from elastic_ddp.snapshot import Snapshot, SnapshotError

logger = logging.getLogger(__name__)

NO_SNAPSHOT = (-1, "")


@dataclass(frozen=True)
class RestoredSnapshot:
    snapshot: Snapshot
    entry: ManifestEntry | None  # None on ranks that received the bytes from a peer
    sha256: str
    source_rank: int


def _accept_loadable(data: bytes, path: str) -> None:
    Snapshot.from_bytes(data, path)


def agree_on_latest_snapshot(store: CheckpointStore, context: DistributedContext) -> RestoredSnapshot | None:
    """The snapshot every rank restores, or None when no rank has one. Collective over the group."""
    local = store.latest_valid(accept=_accept_loadable)
    mine = (local[0].global_step, local[0].sha256) if local else NO_SNAPSHOT
    if not (context.is_distributed and dist.is_initialized()):
        offers = [mine]
    else:
        offers = [NO_SNAPSHOT] * context.world_size
        dist.all_gather_object(offers, mine)
    best = max(offers)
    if best == NO_SNAPSHOT:
        return None
    source_rank = offers.index(best)
    holders = sum(1 for offer in offers if offer == best)
    data = local[1] if mine == best else None
    if holders < len(offers):
        data = _broadcast_bytes(data, source_rank, context)
        digest = hashlib.sha256(data).hexdigest()
        if digest != best[1]:
            raise SnapshotError(f"snapshot of step {best[0]} from rank {source_rank} arrived with sha256 "
                                f"{digest[:12]}..., expected {best[1][:12]}...")
    snapshot = Snapshot.from_bytes(data, f"snapshot of step {best[0]} (sha256 {best[1][:12]}...)")
    entry = local[0] if mine == best else None
    return RestoredSnapshot(snapshot=snapshot, entry=entry, sha256=best[1], source_rank=source_rank)


def _broadcast_bytes(data: bytes | None, source_rank: int, context: DistributedContext) -> bytes:
    """Send `data` from `source_rank` to every rank (over the default group's device)."""
    device = context.device
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=source_rank)
    if context.rank == source_rank:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=source_rank)
    return data if context.rank == source_rank else payload.cpu().numpy().tobytes()
