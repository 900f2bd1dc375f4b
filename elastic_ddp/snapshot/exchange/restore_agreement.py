"""Restore on start: the whole group agrees on the newest state that any rank can offer.

Each rank looks at two sources: its own `--checkpoint_dir` (the same directory on a shared
filesystem, each node's local disk, or an object-store URL) for its newest snapshot that verifies
(size and checksum), loads with weights_only=True, was written by a compatible run and is finite;
and its node's memory copies (`snapshot.memory_copies`: the state a worker of this node kept as
its group stopped; the same checks). Newer ones that fail are skipped with a warning naming the
file and the reason, and the restore says which and why (`RestoredSnapshot.refused`, the `refused`
of the `restore` event): a state with a NaN or an infinity (a diverged run, kept by a version that
did not check) never wins, whatever its step. Each rank
offers the better of the two; the ranks exchange (step, incarnation, source, checksum, size); the
highest step wins, then the later incarnation that committed it (after a rollback, the retrained
step N, not the old trajectory's), and a memory copy wins a tie (it is the state the survivors
committed, nothing older). If some
ranks lack it, the lowest rank that holds it sends the bytes to them through the snapshot
transport (`exchange.transport`: a broadcast, no pickle, sizes checked before anything is
allocated), and every receiver checks the checksum before loading. So all ranks restore the same
state, and a node that never saw it (a new node, a node with a disk of its own) still resumes
from it.

Memory copies of the same step and incarnation held by several ranks are the same state (DDP keeps
every rank's model and optimizer identical; only their own RNG stream differs, and a restore from a
memory copy derives every rank's stream afresh): each holder loads its own, the others receive one.
Snapshot files count as the same only with the same checksum.

Memory and the GIL at size: a rank ranks its two sources by what their files say about
themselves (copy names, the manifest, the newest file's header) and loads the better one first,
the other only if it may still win; a local file is verified with a streamed checksum and loaded
through a window onto the open file (`files.verified_file`), so a rank holds one loaded state
beside its model in the common case (two at most, when the better source's newest is refused)
and no copy of the bytes; these stay in the file, mapped, until served or written. A memory copy
is mapped privately and hashed where it lies, on every core (nothing trains yet), and the model's
tensors are views onto the mapping (`serialization.load_model_as_views`): the restore copies them
into the model, one pass, where they were loaded into new memory and then copied. Bytes received
from a peer are hashed once, on every core, and loaded the same way: a receiver holds them and the
rest of the state (the optimizer's), not a second copy of the model. No step of this holds the GIL
for long, so the peer watchdog's heartbeat goes on during a restore
(tests/unit/test_large_state_restore.py, docs/benchmarks.md).

When no rank has a usable state but some rank found only snapshots of an incompatible run, every
rank raises `IncompatibleSnapshotError` (naming the file and the differences) rather than silently
starting from scratch over someone else's checkpoints.

Not guaranteed: "newest" is by global step. A node that rejoins holding a newer snapshot of a
trajectory the group has since rolled back from makes the group jump to it; that is a consistent
state of the same run, only not the most recent work.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.exchange.transport import FrameError, FrameLimits, FrameRefused, ProcessGroupTransport
from elastic_ddp.snapshot.files.errors import (
    IncompatibleSnapshotError,
    NonFiniteStateError,
    SnapshotError,
    SnapshotStoreError,
)
from elastic_ddp.snapshot.files.file_layout import FORMAT_VERSION, Seal, file_matches, format_of, verify
from elastic_ddp.snapshot.files.manifest import ManifestEntry
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.snapshot.files.verified_file import map_file
from elastic_ddp.snapshot.memory_copies import MemoryTier
from elastic_ddp.snapshot.serialization import check_compatible, snapshot_from_bytes, snapshot_from_file
from elastic_ddp.snapshot.training_state import Snapshot, check_finite

logger = logging.getLogger(__name__)

FILE, MEMORY = "file", "memory"
Buffer = bytes | bytearray | mmap.mmap  # a snapshot file's bytes
REASON_CHARS = 300  # of a refusal's reason in the `restore` event


@dataclass(frozen=True)
class RestoredSnapshot:
    snapshot: Snapshot
    entry: ManifestEntry | None  # the file this rank read; None when it came from memory or a peer
    checksum: str
    source: str  # FILE or MEMORY: where the state was kept
    source_rank: int  # the rank that offered it (and served it to those that lacked it)
    source_host: str
    description: str  # the file it was read from, or where it came from, for messages
    data: Buffer  # its bytes: a file mapped read-only, or what arrived from a peer
    refused: list[dict[str, Any]] = field(default_factory=list)  # newer copies any rank refused, and why


@dataclass(frozen=True)
class Offer:
    """What one rank can restore from, as all ranks exchange it."""

    step: int  # -1: nothing
    source: str  # FILE, MEMORY or "" (nothing)
    checksum: str
    size_bytes: int
    host: str = ""
    refusal: str = ""  # why this rank found only incompatible snapshots
    refused: tuple[tuple[str, int, str], ...] = ()  # (source, step, reason) of the copies it skipped
    incarnation: int = 0  # the incarnation that committed the step (its header's)

    @property
    def rank(self) -> tuple[int, int, int]:
        """How good the offer is: the step, the incarnation that committed it, then a memory copy
        before a file."""
        return self.step, self.incarnation, 1 if self.source == MEMORY else 0

    def same_state(self, other: Offer) -> bool:
        """Whether loading `other` instead of this gives the same state (see the module docstring)."""
        if (self.step, self.incarnation, self.source) != (other.step, other.incarnation, other.source):
            return False
        return self.source == MEMORY or self.checksum == other.checksum


@dataclass(frozen=True)
class _Local:
    offer: Offer
    data: Buffer  # the file's bytes: mapped, so nothing is read unless it is sent or written
    snapshot: Snapshot
    entry: ManifestEntry | None
    description: str


def newest_usable_snapshot(store: SnapshotStore, fingerprint: dict[str, Any] | None = None,
                           on_skipped: Callable[[ManifestEntry, Exception], object] | None = None,
                           ) -> tuple[ManifestEntry, Buffer, Snapshot] | None:
    """This rank's newest snapshot file that verifies, loads safely, matches `fingerprint` and is
    finite (a file of a version that did not check may hold a diverged state); every newer one is
    passed to `on_skipped(entry, error)`. Files are tried one at a time, newest first, and a local
    format-2 file is verified and loaded in place: at most one loaded state is held, and no copy of
    a file's bytes (they come back mapped).

    Raises IncompatibleSnapshotError (the newest refusal) when every snapshot that verified came
    from an incompatible run. Returns None when there is nothing usable otherwise.
    """
    refusals: list[IncompatibleSnapshotError] = []

    def accept(found: tuple[Buffer, Snapshot], path: str) -> None:
        snapshot = found[1]
        if fingerprint is not None:
            try:
                check_compatible(snapshot, fingerprint, path)
            except IncompatibleSnapshotError as exc:
                refusals.append(exc)
                raise
        check_finite(snapshot.states, path)

    found = store.latest_valid(accept=accept, on_skipped=on_skipped, read=lambda entry: _read_file(store, entry))
    if found is None:
        if refusals:
            raise refusals[0]
        return None
    entry, (data, snapshot) = found
    return entry, data, snapshot


def _read_file(store: SnapshotStore, entry: ManifestEntry) -> tuple[Buffer, Snapshot]:
    """The bytes (mapped) and the loaded snapshot of `entry`'s file once it matches its entry's size
    and checksum; SnapshotStoreError or SnapshotError otherwise. A remote file, or one of format 1,
    is read whole (`read_verified`)."""
    where = store.describe(entry.file)
    directory = store.storage.local_directory
    try:
        in_place = directory is not None and format_of(store.storage.read_range(entry.file, 0, 8)) == FORMAT_VERSION
    except OSError as exc:
        raise SnapshotStoreError(f"{where}: cannot be read ({exc.strerror or exc})") from exc
    if not in_place:
        data = store.read_verified(entry)
        return data, snapshot_from_bytes(data, where)

    def matches_entry(seal: Seal) -> None:
        if (seal.size_bytes, seal.checksum) != (entry.size_bytes, entry.checksum):
            raise SnapshotStoreError(f"{where}: {seal.size_bytes} bytes of checksum {seal.checksum[:20]}..., the "
                                     f"index says {entry.size_bytes} bytes of {entry.checksum[:20]}...")

    try:
        snapshot, _ = snapshot_from_file(directory / entry.file, where, matches_entry)
        return map_file(directory / entry.file), snapshot
    except OSError as exc:
        raise SnapshotStoreError(f"{where}: cannot be read ({exc.strerror or exc})") from exc


def _file_rank(store: SnapshotStore) -> tuple[float, float, int]:
    """The best rank a snapshot file of this rank can have, from the manifest and the newest file's
    header alone (unknown parts count as unbeatable, so that the files are tried)."""
    entries = store.manifest_entries()
    if not entries:
        return math.inf, math.inf, 0
    try:
        incarnation: float = store.read_seal(entries[-1].file).header.incarnation
    except (OSError, SnapshotError):
        incarnation = math.inf
    return entries[-1].global_step, incarnation, 0


def _local_candidates(store: SnapshotStore, memory: MemoryTier | None,
                      fingerprint: dict[str, Any] | None,
                      ) -> tuple[_Local | None, str, tuple[tuple[str, int, str], ...]]:
    """The best state this rank itself can restore from, why it found only incompatible snapshots,
    and the newer copies it refused (source, step, reason).

    The two sources are ranked by what their files say about themselves (names, manifest, header)
    before anything is loaded; the better one is loaded first, and the other only if it may still
    beat what that gave (its newest was refused, or it is newer): so a rank holds one loaded state
    in the common case, two at most, and never their bytes beside them."""
    host = socket.gethostname()
    refusal, refused = "", []

    def from_files() -> _Local | None:
        nonlocal refusal
        try:
            found = newest_usable_snapshot(
                store, fingerprint, lambda entry, exc: refused.append((FILE, entry.global_step, refusal_reason(exc))))
        except IncompatibleSnapshotError as exc:
            refusal = str(exc)
            return None
        if found is None:
            return None
        entry, data, snapshot = found
        return _Local(Offer(entry.global_step, FILE, entry.checksum, entry.size_bytes, host,
                            incarnation=snapshot.incarnation), data, snapshot, entry, store.describe(entry.file))

    def from_memory() -> _Local | None:
        copy = memory.newest(on_refused=lambda step, exc: refused.append((MEMORY, step, refusal_reason(exc))))
        if copy is None:
            return None
        return _Local(Offer(copy.global_step, MEMORY, copy.checksum, copy.size_bytes, host,
                            incarnation=copy.incarnation), map_file(copy.path), copy.snapshot, None,
                      f"memory copy {copy.path}")

    listed = memory.newest_listed() if memory is not None else None
    sources = [(_file_rank(store), from_files)]
    if listed is not None:
        sources.append(((*listed, 1), from_memory))
    best = None
    for rank, load in sorted(sources, key=lambda source: source[0], reverse=True):
        if best is not None and rank <= best.offer.rank:
            continue  # cannot beat what this rank holds already: not even read
        candidate = load()
        if candidate is not None and (best is None or candidate.offer.rank > best.offer.rank):
            best = candidate
    return best, refusal, tuple(refused)


def refusal_reason(exc: Exception) -> str:
    """Why a copy was refused, short enough for the `restore` event."""
    if isinstance(exc, NonFiniteStateError):
        return exc.reason
    return str(exc)[:REASON_CHARS]


def _refused_newer(offers: list[Offer], restored_step: int) -> list[dict[str, Any]]:
    """The copies newer than the restored one that some rank refused, newest first: each (source,
    step, reason) once, with the host of the lowest rank that refused it."""
    seen, refused = set(), []
    for offer in offers:
        for source, step, reason in offer.refused:
            if step > restored_step and (source, step, reason) not in seen:
                seen.add((source, step, reason))
                refused.append({"source": source, "global_step": step, "host": offer.host, "reason": reason})
    return sorted(refused, key=lambda item: item["global_step"], reverse=True)


def agree_on_latest_snapshot(store: SnapshotStore, context: DistributedContext,
                             fingerprint: dict[str, Any] | None = None,
                             memory: MemoryTier | None = None) -> RestoredSnapshot | None:
    """The state every rank restores, or None when no rank has one. Collective over the group."""
    local, refusal, refused = _local_candidates(store, memory, fingerprint)
    mine = local.offer if local is not None else Offer(-1, "", "", 0, host=socket.gethostname(), refusal=refusal)
    mine = dataclasses.replace(mine, refused=refused)
    offers = _exchange(mine, context)
    best = max(offers, key=lambda offer: offer.rank)
    if best.step < 0:
        refusals = [offer.refusal for offer in offers if offer.refusal]
        if refusals:  # every rank raises the same error, so none starts from scratch alone
            raise IncompatibleSnapshotError(refusals[0])
        refused = _refused_newer(offers, -1)
        if refused:
            logger.warning("every state the group holds was refused (%s): starting from scratch",
                           "; ".join(f"{item['source']} of step {item['global_step']}: {item['reason']}"
                                     for item in refused))
        return None
    source_rank = next(rank for rank, offer in enumerate(offers) if offer.rank == best.rank)
    best = offers[source_rank]
    holds_it = mine.same_state(best)
    data, seal = (local.data if holds_it else None), None
    if not all(offer.same_state(best) for offer in offers):
        data, seal = _share(data, source_rank, best, context, [offer.same_state(best) for offer in offers])
    if holds_it:
        snapshot, entry, description = local.snapshot, local.entry, local.description
    else:
        entry = None
        description = f"{best.source} state of step {best.step} received from rank {source_rank} on {best.host}"
        snapshot = snapshot_from_bytes(data, description, verified=seal, model_as_views=True)
    return RestoredSnapshot(snapshot=snapshot, entry=entry, checksum=mine.checksum if holds_it else best.checksum,
                            source=best.source, source_rank=source_rank, source_host=best.host,
                            description=description, data=data, refused=_refused_newer(offers, best.step))


def _exchange(mine: Offer, context: DistributedContext) -> list[Offer]:
    if not context.in_process_group:
        return [mine]
    offers: list[Any] = [None] * context.world_size
    dist.all_gather_object(offers, mine)
    return offers


def _share(data: Buffer | None, source_rank: int, offer: Offer, context: DistributedContext,
           holders: list[bool]) -> tuple[Buffer, Seal | None]:
    """The bytes of `source_rank`'s state on every rank that lacks it, checked against the offer's
    checksum (collective over the default group: every rank takes part, holders drop what arrives),
    and, where they arrived, their verified seal (None for a format-1 file, and where nothing arrived)."""
    transport = ProcessGroupTransport(device=context.collective_device)
    if context.rank == source_rank:
        accepted = transport.send(source_rank, {"global_step": offer.step, "checksum": offer.checksum}, data)
        refused = [rank for rank, took in enumerate(accepted) if not took and not holders[rank]]
        if refused:
            raise SnapshotError(f"rank(s) {refused} refused the state of step {offer.step} ({offer.size_bytes} "
                                f"bytes) that rank {source_rank} serves (see their logs)")
        return data, None
    if holders[context.rank]:  # takes part, keeps nothing: its own copy is the same state
        try:
            transport.receive(source_rank, FrameLimits(max_payload_bytes=0))
        except FrameRefused:
            return data, None
        raise SnapshotError(f"rank {context.rank} was sent the state of step {offer.step} it holds")
    try:
        received = transport.receive(source_rank, FrameLimits(max_payload_bytes=offer.size_bytes)).payload
    except FrameError as exc:
        raise SnapshotError(f"the state of step {offer.step} from rank {source_rank} was refused ({exc})") from exc
    damaged = SnapshotError(f"the state of step {offer.step} from rank {source_rank} arrived damaged "
                            f"(its checksum is not {offer.checksum[:20]}...)")
    if len(received) != offer.size_bytes:
        raise damaged
    if format_of(bytes(received[:8])) != FORMAT_VERSION:
        if not file_matches(received, offer.checksum):
            raise damaged
        return received, None
    try:  # hashed once, on every core (nothing trains yet): the load below takes this seal
        seal = verify(received, f"the state of step {offer.step} from rank {source_rank}", all_cores=True)
    except SnapshotError as exc:
        raise damaged from exc
    if seal.checksum != offer.checksum:
        raise damaged
    return received, seal
