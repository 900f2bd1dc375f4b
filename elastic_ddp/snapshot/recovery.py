"""Restore on start: the whole group agrees on the newest snapshot that any rank can read.

Each rank looks in its own `--checkpoint_dir` (the same directory on a shared filesystem, each
node's local disk, or an object-store URL) for its newest snapshot that verifies (size and
checksum), loads with weights_only=True and, when a fingerprint is given, was written by a
compatible run; newer ones that fail are skipped with a warning naming the file and the reason.
The ranks exchange (step, checksum, size); the newest wins; if some ranks lack it, the lowest rank
that holds it sends the bytes to everyone through the snapshot transport (`snapshot.transport`: a
broadcast, no pickle, sizes checked before anything is allocated), and every receiver checks the
checksum before loading. So all ranks restore the same snapshot, and a node that never saw the
snapshot's file (its checkpoint directory is local and was not a replica) still resumes from it.

When no rank has a usable snapshot but some rank found only snapshots of an incompatible run,
every rank raises `IncompatibleSnapshotError` (naming the file and the differences) rather than
silently starting from scratch over someone else's checkpoints.

Not guaranteed: "newest" is by global step. A node that rejoins holding a newer snapshot of a
trajectory the group has since rolled back from makes the group jump to it; that is a consistent
state of the same run, only not the most recent work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastic_ddp.distributed import DistributedContext
from elastic_ddp.snapshot.container import file_matches
from elastic_ddp.snapshot.errors import IncompatibleSnapshotError, SnapshotError
from elastic_ddp.snapshot.format import check_compatible, snapshot_from_bytes
from elastic_ddp.snapshot.state import Snapshot
from elastic_ddp.snapshot.store import CheckpointStore, ManifestEntry
from elastic_ddp.snapshot.transport import FrameLimits, ProcessGroupTransport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoredSnapshot:
    snapshot: Snapshot
    entry: ManifestEntry | None  # None on ranks that received the bytes from a peer
    checksum: str
    source_rank: int
    source: str  # the file it was read from, or where it came from, for messages
    data: bytes


@dataclass(frozen=True)
class Offer:
    """What one rank can restore from, as all ranks exchange it."""

    step: int  # -1: nothing
    checksum: str
    size_bytes: int
    refusal: str = ""  # why this rank found only incompatible snapshots

    @property
    def key(self) -> tuple[int, str]:
        return self.step, self.checksum


NOTHING = Offer(-1, "", 0)


def newest_usable_snapshot(store: CheckpointStore, fingerprint: dict[str, Any] | None = None,
                           ) -> tuple[ManifestEntry, bytes, Snapshot] | None:
    """This rank's newest snapshot that verifies, loads safely and matches `fingerprint`.

    Raises IncompatibleSnapshotError (the newest refusal) when every snapshot that verified came
    from an incompatible run. Returns None when there is nothing usable otherwise.
    """
    loaded: dict[str, Snapshot] = {}
    refusals: list[IncompatibleSnapshotError] = []

    def accept(data: bytes, path: str) -> None:
        snapshot = snapshot_from_bytes(data, path)
        if fingerprint is not None:
            try:
                check_compatible(snapshot, fingerprint, path)
            except IncompatibleSnapshotError as exc:
                refusals.append(exc)
                raise
        loaded[path] = snapshot

    found = store.latest_valid(accept=accept)
    if found is None:
        if refusals:
            raise refusals[0]
        return None
    entry, data = found
    return entry, data, loaded[store.describe(entry.file)]


def agree_on_latest_snapshot(store: CheckpointStore, context: DistributedContext,
                             fingerprint: dict[str, Any] | None = None) -> RestoredSnapshot | None:
    """The snapshot every rank restores, or None when no rank has one. Collective over the group."""
    refusal = ""
    try:
        local = newest_usable_snapshot(store, fingerprint)
    except IncompatibleSnapshotError as exc:
        local, refusal = None, str(exc)
    mine = Offer(local[0].global_step, local[0].checksum, local[0].size_bytes) if local else \
        Offer(NOTHING.step, NOTHING.checksum, NOTHING.size_bytes, refusal)
    offers = _exchange(mine, context)
    best = max(offers, key=lambda offer: offer.key)
    if best.step == NOTHING.step:
        refusals = [offer.refusal for offer in offers if offer.refusal]
        if refusals:  # every rank raises the same error, so none starts from scratch alone
            raise IncompatibleSnapshotError(refusals[0])
        return None
    source_rank = next(rank for rank, offer in enumerate(offers) if offer.key == best.key)
    holds_it = mine.key == best.key
    data = local[1] if holds_it else None
    if any(offer.key != best.key for offer in offers):
        data = _share(data, source_rank, best, context)
    if holds_it:
        entry, snapshot = local[0], local[2]
        source = store.describe(entry.file)
    else:
        entry = None
        source = f"snapshot of step {best.step} received from rank {source_rank} ({best.checksum[:20]}...)"
        snapshot = snapshot_from_bytes(data, source)
    return RestoredSnapshot(snapshot=snapshot, entry=entry, checksum=best.checksum, source_rank=source_rank,
                            source=source, data=data)


def _exchange(mine: Offer, context: DistributedContext) -> list[Offer]:
    if not (context.is_distributed and dist.is_initialized()):
        return [mine]
    offers: list[Any] = [None] * context.world_size
    dist.all_gather_object(offers, mine)
    return offers


def _share(data: bytes | None, source_rank: int, offer: Offer, context: DistributedContext) -> bytes:
    """The bytes of `source_rank`'s snapshot on every rank, checked against the offer's checksum
    (collective over the default group)."""
    transport = ProcessGroupTransport(device=context.device)
    if context.rank == source_rank:
        accepted = transport.send(source_rank, {"global_step": offer.step, "checksum": offer.checksum}, data)
        if not all(accepted):
            raise SnapshotError(f"{accepted.count(False)} rank(s) refused the snapshot of step {offer.step} "
                                f"({offer.size_bytes} bytes) that rank {source_rank} serves (see their logs)")
        return data
    received = transport.receive(source_rank, FrameLimits(max_payload_bytes=offer.size_bytes)).payload
    if len(received) != offer.size_bytes or not file_matches(received, offer.checksum):
        raise SnapshotError(f"the snapshot of step {offer.step} from rank {source_rank} arrived damaged "
                            f"(its checksum is not {offer.checksum[:20]}...)")
    return received
