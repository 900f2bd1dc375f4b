"""Moving one snapshot from rank 0 to its replica targets, and storing it there.

`SnapshotReplicator` is rank 0's sender thread, `ReplicaReceiver` a target's; both go through the
snapshot transport (`exchange.transport`) over the side process group `replication` forms. Per
snapshot: one frame (a `ReplicaOffer` header and the file's bytes) broadcast to every target at
once, then one all-gather of the targets' verdicts. A frame whose header says `close` ends the
targets' threads. What is checked, what is bounded and what is not guaranteed: `replication`.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.snapshot.exchange.transport import FrameError, FrameLimits, FrameRefused, ProcessGroupTransport
from elastic_ddp.snapshot.files.checksum import parse_checksum
from elastic_ddp.snapshot.files.errors import SnapshotWriteError
from elastic_ddp.snapshot.files.file_layout import file_matches
from elastic_ddp.snapshot.files.manifest import ManifestEntry
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore

logger = logging.getLogger(__name__)

# Each collective of a transfer, on rank 0's side, must complete within this (a chunk of the payload
# is at most 64 MiB); the verdicts also wait for the target to check and store the whole file.
SEND_DEADLINE = timedelta(seconds=60)
STORE_BYTES_PER_S = 50e6  # the slowest target disk we wait for (checksum, write, fsync): 200 s for 10 GB
# What a transfer's collectives raise when their group broke (RuntimeError, TimeoutError) or was
# destroyed under them (ValueError: a group re-formed in process, training/in_process.py).
GROUP_GONE = (RuntimeError, TimeoutError, ValueError)


def verdict_deadline(send_deadline: timedelta, size_bytes: int) -> timedelta:
    """How long the verdicts on a replica of `size_bytes` may take: the target checks and writes it
    whole before it answers, so the bound grows with the file."""
    return send_deadline + timedelta(seconds=size_bytes / STORE_BYTES_PER_S)


class ReplicationError(Exception):
    """A replica could not be delivered to or stored by a target."""


@dataclass(frozen=True)
class ReplicaTarget:
    """A target as the sender needs it: its global rank and its node (GROUP_RANK)."""

    rank: int
    node: int


@dataclass(frozen=True)
class ReplicaOffer:
    """The header of a replication frame: which snapshot the payload is (or `close`: no more)."""

    close: bool
    global_step: int = 0
    epoch: int = 0
    samples_consumed: int = 0
    checksum: str = ""  # "algorithm:hex" of the payload

    def to_header(self) -> dict[str, Any]:
        if self.close:
            return {"kind": "close"}
        return {"kind": "snapshot", "global_step": self.global_step, "epoch": self.epoch,
                "samples_consumed": self.samples_consumed, "checksum": self.checksum}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> ReplicaOffer:
        """Check a received header field by field; FrameError names the first bad one."""
        kind = header.get("kind")
        if kind == "close" and len(header) == 1:
            return cls(close=True)
        if kind != "snapshot" or set(header) != {"kind", "global_step", "epoch", "samples_consumed", "checksum"}:
            raise FrameError(f"not a replication header (kind {str(kind)[:40]!r}, {len(header)} keys)")
        for name in ("global_step", "epoch", "samples_consumed"):
            value = header[name]
            if type(value) is not int or not 0 <= value < 2**62:
                raise FrameError(f"replication header: {name} must be a non-negative integer")
        try:
            parse_checksum(header["checksum"])
        except ValueError as exc:
            raise FrameError(f"replication header: {exc}") from exc
        return cls(close=False, global_step=header["global_step"], epoch=header["epoch"],
                   samples_consumed=header["samples_consumed"], checksum=header["checksum"])


def free_bytes(store: SnapshotStore) -> int:
    """What the filesystem under `store` can still take (0 when it cannot be asked)."""
    directory = store.storage.local_directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def _report_round(group: dist.ProcessGroup, group_size: int, stored: bool, deadline: timedelta | None) -> list[bool]:
    """Every member's verdict on the frame just sent, in group-rank order (a collective)."""
    mine = torch.tensor([1 if stored else 0], dtype=torch.int64)
    verdicts = [torch.zeros(1, dtype=torch.int64) for _ in range(group_size)]
    work = dist.all_gather(verdicts, mine, group=group, async_op=True)
    if deadline is None:
        work.wait()
    elif not work.wait(timeout=deadline):
        raise TimeoutError(f"replica verdicts did not arrive within {deadline.total_seconds():g} s")
    return [bool(verdict.item()) for verdict in verdicts]


class SnapshotReplicator:
    """Rank 0's sender thread: the newest durable snapshot goes to every target at once.

    The file is read back from `store` when it is sent (from the page cache, as a rule), so
    nothing waiting to be sent holds a copy of a snapshot in memory.
    """

    def __init__(self, store: SnapshotStore, group: dist.ProcessGroup, targets: list[ReplicaTarget],
                 group_ranks: list[int], events: EventLog, send_deadline: timedelta = SEND_DEADLINE):
        self.store = store
        self.group = group
        self.targets = {target.rank: target for target in targets}
        self.group_ranks = group_ranks
        self.events = events
        self.send_deadline = send_deadline
        self.transport = ProcessGroupTransport(group, deadline=send_deadline)
        self.superseded = 0
        self.broken = False  # a transfer failed mid-way: the group is unusable for this incarnation
        self._pending: ManifestEntry | None = None
        self._busy = False
        self._closed = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="snapshot-replicator", daemon=True)
        self._thread.start()

    def offer(self, entry: ManifestEntry) -> None:
        """Queue `entry` for replication; dropped, and reported, once replication has stopped."""
        with self._condition:  # (the sender sets `broken` before it clears what is pending, under this lock)
            if self.broken:  # nobody would send it: say so now, rather than let `finish` wait for it
                self._report_dropped(entry)
                return
            if self._pending is not None:
                self.superseded += 1
                logger.info("replication of step %d superseded by step %d before it was sent",
                            self._pending.global_step, entry.global_step)
            self._pending = entry
            self._condition.notify_all()

    def finish(self, timeout: float) -> None:
        """Send what is pending (up to `timeout` s), then tell the targets there is no more. Returns
        at once when replication has stopped (a failed transfer): nothing would be sent."""
        with self._condition:
            drained = self._condition.wait_for(lambda: not self._busy and (self.broken or self._pending is None),
                                               timeout)
            self._closed = True
            self._condition.notify_all()
        if not drained:
            logger.warning("the last snapshot was not replicated within %.0f s", timeout)
        self._thread.join(timeout=max(1.0, timeout))

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._pending = None
            self._condition.notify_all()
        self._thread.join(timeout=1.0)  # a transfer in flight ends at its deadline at the latest

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed and self._pending is None:
                    break
                job, self._pending, self._busy = self._pending, None, True
            try:
                self._replicate(job)
            except Exception:  # a bug here must not end replication silently
                logger.exception("replication of step %d failed unexpectedly", job.global_step)
            finally:
                with self._condition:
                    self._busy = False
                    self._condition.notify_all()
            if self.broken:
                with self._condition:
                    dropped, self._pending = self._pending, None  # offered while the failed transfer ran
                if dropped is not None:
                    self._report_dropped(dropped)
                return
        self._send_close()

    def _report_dropped(self, entry: ManifestEntry) -> None:
        logger.warning("snapshot of step %d NOT replicated: replication stopped for this worker group after a "
                       "failed transfer (the next worker group forms it again)", entry.global_step)
        self.events.emit(schema.REPLICATION_FAILED, global_step=entry.global_step, node=None,
                         error="replication stopped for this worker group after a failed transfer")

    def _send_close(self) -> None:
        try:
            self.transport.send(0, ReplicaOffer(close=True).to_header(), b"")
        except GROUP_GONE as exc:
            logger.warning("could not tell the replica targets that replication is done (%s)", exc)

    def _replicate(self, entry: ManifestEntry) -> None:
        started = time.monotonic()
        try:
            data = self.store.storage.read_bytes(entry.file)
        except OSError as exc:  # pruned or replaced meanwhile: a newer snapshot is on its way
            logger.warning("snapshot of step %d NOT replicated: %s cannot be read (%s)", entry.global_step,
                           self.store.describe(entry.file), exc)
            self.events.emit(schema.REPLICATION_FAILED, global_step=entry.global_step, node=None, error=str(exc))
            return
        offer = ReplicaOffer(close=False, global_step=entry.global_step, epoch=entry.epoch,
                             samples_consumed=entry.samples_consumed, checksum=entry.checksum)
        sent = False
        try:
            accepted = self.transport.send(0, offer.to_header(), data)
            sent = sum(accepted) > 1
            verdicts = (_report_round(self.group, len(self.group_ranks), True,
                                      verdict_deadline(self.send_deadline, len(data))) if sent else accepted)
        except GROUP_GONE as exc:
            self.broken = True
            logger.warning("replication stops for this worker group: a transfer to %s failed (%s)",
                           self._nodes(self.targets), exc)
            verdicts = [False] * len(self.group_ranks)
            # Every byte went out: the replica may well have landed, only its verdict is late.
            reason = f"sent, not confirmed: {exc}" if sent else f"transfer failed: {exc}"
        else:
            reason = "the target refused it (too little room, or a bad frame: see its log)"
        delivered = []
        for group_rank, rank in enumerate(self.group_ranks):
            if rank not in self.targets:
                continue
            node = self.targets[rank].node
            if verdicts[group_rank]:
                delivered.append(node)
            elif sent and self.broken:
                logger.warning("snapshot of step %d sent to node %d, which did not confirm storing it (%s): it may "
                               "hold the replica (a restore checks it anyway)", entry.global_step, node, reason)
                self.events.emit(schema.REPLICATION_FAILED, global_step=entry.global_step, node=node, error=reason)
            else:
                logger.warning("snapshot of step %d NOT replicated to node %d: %s", entry.global_step, node, reason)
                self.events.emit(schema.REPLICATION_FAILED, global_step=entry.global_step, node=node, error=reason)
        if delivered:
            self.events.emit(schema.SNAPSHOT_REPLICATED, global_step=entry.global_step, checksum=entry.checksum,
                             nodes=delivered, seconds=round(time.monotonic() - started, 4))

    @staticmethod
    def _nodes(targets: dict[int, ReplicaTarget]) -> str:
        return "node(s) " + ", ".join(str(target.node) for target in targets.values())


class ReplicaReceiver:
    """A target's thread that stores the replicas rank 0 sends into its own checkpoint store."""

    def __init__(self, store: SnapshotStore, group: dist.ProcessGroup, group_ranks: list[int]):
        self.store = store
        self.group = group
        self.group_ranks = group_ranks
        self.transport = ProcessGroupTransport(group)
        self.stored = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="snapshot-replica-receiver", daemon=True)
        self._thread.start()

    def finish(self, timeout: float) -> None:
        """Wait (up to `timeout` s) until rank 0 said there is no more."""
        if not self._done.wait(timeout):
            logger.warning("rank 0 did not finish replicating within %.0f s", timeout)

    def _serve(self) -> None:
        try:
            while self._receive_one():
                pass
        except GROUP_GONE as exc:  # rank 0 is gone or its group broke
            logger.info("snapshot replicas: stopped receiving (%s)", exc)
        finally:
            self._done.set()

    def _receive_one(self) -> bool:
        """Take part in one frame; False once rank 0 said there is no more."""
        group_size = len(self.group_ranks)
        try:
            frame = self.transport.receive(0, FrameLimits(max_payload_bytes=free_bytes(self.store)))
            offer = ReplicaOffer.from_header(frame.header)
        except FrameRefused as exc:
            logger.warning("refused a snapshot replica: %s", exc)
            if exc.others_accepted:  # the others report on it: so does this rank
                _report_round(self.group, group_size, False, None)
            return True
        except FrameError as exc:  # its bytes arrived, but its header is not a replica's
            logger.warning("refused a snapshot replica: %s", exc)
            _report_round(self.group, group_size, False, None)
            return True
        if offer.close:
            return False
        size = len(frame.payload)
        stored = False
        try:
            self._store(offer, frame.payload)
            stored = True
        except (ReplicationError, SnapshotWriteError) as exc:
            logger.warning("refused a snapshot replica: %s", exc)
        del frame  # not held while rank 0 is waited for
        # Bounded like rank 0's wait: if rank 0 gave up meanwhile this ends the thread (TimeoutError).
        _report_round(self.group, group_size, stored, verdict_deadline(SEND_DEADLINE, size))
        return True

    def _store(self, offer: ReplicaOffer, data: bytes) -> None:
        if not file_matches(data, offer.checksum):
            raise ReplicationError(f"the payload does not match the sender's checksum {offer.checksum[:20]}...")
        entry = self.store.write(offer.global_step, offer.epoch, offer.samples_consumed, data, checksum=offer.checksum)
        self.stored += 1
        logger.info("stored replica %s", self.store.describe(entry.file))
