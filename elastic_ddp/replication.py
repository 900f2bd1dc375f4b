"""Copies of every snapshot on other nodes' local disks, so no shared filesystem is needed.

After rank 0 has made a snapshot durable in its own `--checkpoint_dir`, a background thread on
rank 0 sends the file to the local rank 0 of `--snapshot_replicas` other nodes, each of which
verifies it (size, sha256) and writes it into its own `--checkpoint_dir` through a
`CheckpointStore` (same atomic write, manifest and pruning). If rank 0's node is then lost, the
restore agreement (`recovery`) finds the replica on a surviving node and serves it to the others.

Who holds replicas is decided at every worker-group start from the current membership: all ranks
exchange (GROUP_RANK, LOCAL_RANK, the identity of their checkpoint directory, a receiver address),
and every rank computes the same targets: the local rank 0 of the nodes that follow rank 0's node
in group-rank order, skipping directories rank 0 already writes (a shared filesystem has one
identity, so a job on shared storage replicates nothing; so does an fsspec URL).

The transfer is a side channel, off the training path: a TCP connection from rank 0 to a small
server thread on each target, never the training process group, whose collectives must not
interleave with DDP's. Each transfer carries a per-incarnation token (sent to the group through
the process group at start), so a stray connection cannot plant a snapshot. If replication falls
behind, a newer snapshot replaces the one waiting to be sent (only the newest matters); failures
are retried briefly, then logged and recorded as `replication_failed` events; training goes on.

Not guaranteed: a replica of the very last snapshot when the job ends by a failure, and a replica
at all when a target's disk is full or it cannot be reached (the event log says so). The transfer
is not encrypted; like torch.distributed itself it assumes a trusted network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from elastic_ddp.checkpoint import CheckpointStore, ManifestEntry, SnapshotWriteError
from elastic_ddp.distributed import DistributedContext

logger = logging.getLogger(__name__)

EventCallback = Callable[..., None]  # EventLog.emit(kind, **fields)
IO_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
_HEADER_LENGTH = struct.Struct("!I")


class ReplicationError(Exception):
    """A replica could not be delivered to or stored by a target."""


@dataclass(frozen=True)
class Member:
    """What one rank tells the group at start, for choosing replica targets."""

    rank: int
    group_rank: int
    local_rank: int
    store_id: str
    receiver: tuple[str, int] | None  # where this node accepts replicas (its local rank 0 only)
    token: str  # rank 0's secret for this incarnation ("" elsewhere)


def choose_replica_targets(members: list[Member], replicas: int) -> list[Member]:
    """Up to `replicas` receivers on nodes after rank 0's in group-rank order, one per directory.

    A pure function of the membership, so every rank computes the same answer.
    """
    source = members[0]
    node_count = max(member.group_rank for member in members) + 1
    seen = {source.store_id}
    targets: list[Member] = []
    for member in sorted(members, key=lambda m: ((m.group_rank - source.group_rank) % node_count, m.rank)):
        if len(targets) == replicas:
            break
        if member.receiver is not None and member.store_id not in seen:
            seen.add(member.store_id)
            targets.append(member)
    return targets


class Replication:
    """This rank's part in replication for one worker-group incarnation.

    Rank 0 holds a `SnapshotReplicator` (when there are targets); target nodes' local rank 0 hold
    a `ReplicaReceiver`; other ranks hold nothing but still take part in `start` and `finish`.
    """

    def __init__(self, receiver: ReplicaReceiver | None = None, replicator: SnapshotReplicator | None = None,
                 active: bool = False):
        self.receiver = receiver
        self.replicator = replicator
        self.active = active

    @classmethod
    def start(cls, store: CheckpointStore, context: DistributedContext, replicas: int,
              on_event: EventCallback) -> Replication:
        """Agree on the targets and start the threads. Collective over the group (one all_gather)."""
        if replicas == 0 or not (context.is_distributed and dist.is_initialized()):
            return cls()
        receiver = None
        try:
            store_id = store.storage.identity()
        except OSError as exc:  # e.g. a read-only directory: this node can hold no replica
            logger.warning("checkpoint directory %s has no identity (%s); this node will hold no replica",
                           store.describe(), exc)
            store_id = f"unidentified-{secrets.token_hex(8)}"
        else:
            if context.local_rank == 0 and context.rank != 0 and store.storage.local_directory is not None:
                receiver = ReplicaReceiver.listen(store)
        me = Member(rank=context.rank, group_rank=int(os.environ.get("GROUP_RANK", "0")),
                    local_rank=context.local_rank, store_id=store_id,
                    receiver=receiver.address if receiver else None,
                    token=secrets.token_hex(16) if context.rank == 0 else "")
        members: list[Any] = [None] * context.world_size
        dist.all_gather_object(members, me)
        targets = choose_replica_targets(members, replicas)
        token = members[0].token
        if receiver is not None:
            if any(target.rank == context.rank for target in targets):
                receiver.serve(token)
            else:
                receiver.close()
                receiver = None
        replicator = None
        if context.rank == 0:
            cls._announce(members, targets, replicas, on_event)
            if targets:
                replicator = SnapshotReplicator(store, targets, token, on_event)
        return cls(receiver, replicator, active=bool(targets))

    @staticmethod
    def _announce(members: list[Member], targets: list[Member], replicas: int, on_event: EventCallback) -> None:
        nodes = sorted(target.group_rank for target in targets)
        on_event("replication", replicas=replicas, target_nodes=nodes,
                 target_ranks=[target.rank for target in targets])
        source = members[0]
        other_directories = {m.store_id for m in members if m.group_rank != source.group_rank} - {source.store_id}
        if targets:
            logger.info("snapshots are replicated to the checkpoint directory of node(s) %s", nodes)
        if len(targets) < min(replicas, len(other_directories)):
            logger.warning("snapshots get %d of the %d replicas asked for (--snapshot_replicas): the other nodes "
                           "could not open a port for them (see their logs)", len(targets), replicas)
        elif not other_directories:
            logger.info("no snapshot replicas: no other node has a checkpoint directory of its own "
                        "(a single node, or shared storage)")
        elif len(other_directories) < replicas:
            logger.info("%d snapshot replica(s) of the %d asked for: only %d other node(s) right now",
                        len(targets), replicas, len(other_directories))

    def offer(self, entry: ManifestEntry) -> None:
        """Rank 0: replicate this durable snapshot of rank 0's store (returns at once)."""
        if self.replicator is not None:
            self.replicator.offer(entry)

    def finish(self, timeout: float) -> None:
        """End of training, all ranks: rank 0 waits up to `timeout` s for the last snapshot to
        reach its replicas; the others wait for rank 0, so the receivers are still there for it."""
        if not self.active:
            return
        if self.replicator is not None and not self.replicator.drain(timeout):
            logger.warning("the last snapshot was not replicated within %.0f s", timeout)
        dist.barrier()

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()
        if self.receiver is not None:
            self.receiver.close()


class SnapshotReplicator:
    """Rank 0's sender thread: the newest durable snapshot goes to every target, one at a time.

    The file is read back from `store` when it is sent (from the page cache, as a rule), so
    nothing waiting to be sent holds a copy of a snapshot in memory.
    """

    def __init__(self, store: CheckpointStore, targets: list[Member], token: str, on_event: EventCallback,
                 attempts: int = 3):
        self.store = store
        self.targets = targets
        self.token = token
        self.on_event = on_event
        self.attempts = attempts
        self.superseded = 0
        self._pending: ManifestEntry | None = None
        self._busy = False
        self._closed = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="snapshot-replicator", daemon=True)
        self._thread.start()

    def offer(self, entry: ManifestEntry) -> None:
        with self._condition:
            if self._pending is not None:
                self.superseded += 1
                logger.info("replication of step %d superseded by step %d before it was sent",
                            self._pending.global_step, entry.global_step)
            self._pending = entry
            self._condition.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is pending or being sent; False if `timeout` passed first."""
        with self._condition:
            return self._condition.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._pending = None
            self._condition.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                job, self._pending, self._busy = self._pending, None, True
            try:
                self._replicate(job)
            except Exception:  # a bug here must not end replication silently
                logger.exception("replication of step %d failed unexpectedly", job.global_step)
            finally:
                with self._condition:
                    self._busy = False
                    self._condition.notify_all()

    def _replicate(self, entry: ManifestEntry) -> None:
        started = time.monotonic()
        try:
            data = self.store.storage.read_bytes(entry.file)
        except OSError as exc:  # pruned or replaced meanwhile: a newer snapshot is on its way
            logger.warning("snapshot of step %d NOT replicated: %s cannot be read (%s)", entry.global_step,
                           self.store.describe(entry.file), exc)
            self.on_event("replication_failed", global_step=entry.global_step, node=None, error=str(exc))
            return
        delivered = []
        for target in self.targets:
            try:
                retrying = Retrying(retry=retry_if_exception_type(OSError), stop=stop_after_attempt(self.attempts),
                                    wait=wait_exponential(multiplier=0.2, max=2.0), reraise=True)
                retrying(send_snapshot, target.receiver, self.token, entry, data)
                delivered.append(target.group_rank)
            except (OSError, ReplicationError) as exc:
                logger.warning("snapshot of step %d NOT replicated to node %d (%s:%d): %s", entry.global_step,
                               target.group_rank, *target.receiver, exc)
                self.on_event("replication_failed", global_step=entry.global_step, node=target.group_rank,
                              error=str(exc))
        if delivered:
            self.on_event("snapshot_replicated", global_step=entry.global_step, sha256=entry.sha256,
                          nodes=delivered, seconds=round(time.monotonic() - started, 4))


def send_snapshot(address: tuple[str, int], token: str, entry: ManifestEntry, data: bytes) -> None:
    """Deliver one snapshot to a `ReplicaReceiver`; returns once the replica is durable there."""
    header = json.dumps({"token": token, "global_step": entry.global_step, "epoch": entry.epoch,
                         "samples_consumed": entry.samples_consumed, "sha256": entry.sha256,
                         "size_bytes": entry.size_bytes}).encode()
    with socket.create_connection(address, timeout=CONNECT_TIMEOUT_S) as connection:
        connection.settimeout(IO_TIMEOUT_S)
        connection.sendall(_HEADER_LENGTH.pack(len(header)) + header)
        connection.sendall(memoryview(data))
        reply = json.loads(_receive_message(connection))
    if not reply.get("ok"):
        raise ReplicationError(reply.get("error", "refused"))


class ReplicaReceiver:
    """A node's server thread that stores replicas sent by rank 0 into its own checkpoint store."""

    def __init__(self, store: CheckpointStore, server: socket.socket):
        self.store = store
        self._server = server
        self.address: tuple[str, int] = server.getsockname()[:2]
        self._token = ""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="snapshot-replica-receiver", daemon=True)

    @classmethod
    def listen(cls, store: CheckpointStore) -> ReplicaReceiver | None:
        """Listen on the interface this node uses to reach rank 0's node; None if that fails."""
        try:
            host = interface_towards(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")))
            server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except (OSError, KeyError, ValueError) as exc:
            logger.warning("this node cannot receive snapshot replicas (%s); it will hold none", exc)
            return None
        server.settimeout(0.2)  # so that close() is noticed without a connection arriving
        return cls(store, server)

    def serve(self, token: str) -> None:
        self._token = token
        self._thread.start()

    def close(self) -> None:
        """Stop accepting. A replica still arriving is abandoned (its temporary file is removed by
        the next write); `Replication.finish` makes sure the last one has landed before this."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        self._server.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with connection:
                self._receive(connection)

    def _receive(self, connection: socket.socket) -> None:
        connection.settimeout(IO_TIMEOUT_S)
        try:
            header = json.loads(_receive_message(connection))
            if not secrets.compare_digest(str(header.get("token", "")), self._token):
                raise ReplicationError("wrong token: not from this job's rank 0")
            data = _receive_exactly(connection, int(header["size_bytes"]))
            digest = hashlib.sha256(data).hexdigest()
            if digest != header["sha256"]:
                raise ReplicationError(f"sha256 {digest[:12]}... does not match the sender's {header['sha256'][:12]}...")
            entry = self.store.write(header["global_step"], header["epoch"], header["samples_consumed"], data,
                                     sha256=digest)
            reply = {"ok": True}
            logger.info("stored replica %s", self.store.describe(entry.file))
        except (OSError, ValueError, KeyError, ReplicationError, SnapshotWriteError) as exc:
            logger.warning("refused a snapshot replica: %s", exc)
            reply = {"ok": False, "error": str(exc)}
        try:
            message = json.dumps(reply).encode()
            connection.sendall(_HEADER_LENGTH.pack(len(message)) + message)
        except OSError:
            pass  # the sender is gone; it will count this replica as failed


def interface_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach `host` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _receive_message(connection: socket.socket) -> bytes:
    (length,) = _HEADER_LENGTH.unpack(_receive_exactly(connection, _HEADER_LENGTH.size))
    if length > 1 << 20:
        raise ReplicationError(f"header of {length} bytes: not a replication message")
    return _receive_exactly(connection, length)


def _receive_exactly(connection: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = connection.recv_into(view[received:])
        if count == 0:
            raise ReplicationError(f"connection closed after {received} of {size} bytes")
        received += count
    return buffer
