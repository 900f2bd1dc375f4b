"""Copies of every snapshot on other nodes' local disks, so no shared filesystem is needed.

After rank 0 has made a snapshot durable in its own `--checkpoint_dir`, a background thread on
rank 0 sends the file to the local rank 0 of `--snapshot_replicas` other nodes, each of which
verifies it (size, checksum) and writes it into its own `--checkpoint_dir` through a
`SnapshotStore` (same atomic write, manifest and pruning). If rank 0's node is then lost, the
restore agreement (`restore_agreement`) finds the replica on a surviving node and serves it to the others.

Who holds replicas is decided at every worker-group start from the current membership: all ranks
exchange (GROUP_RANK, LOCAL_RANK, whether they can hold one, and which checkpoint directories are
the same place), and every rank computes the same targets: the local rank 0 of the nodes that
follow rank 0's node in group-rank order, skipping directories rank 0 already writes (so a job on
shared storage replicates nothing; neither does one on a URL). Whether two ranks' directories are
the same place is tested, not assumed: each rank writes a probe file with a fresh random name into
its own directory, and two ranks share a directory exactly when each sees the other's probe. (A
directory copied from another, identity files and all, is still another place.)

The bytes ride the snapshot transport (`exchange.transport`) over a process group of their own,
rank 0 and its targets (`dist.new_group`, gloo, created at every start): its collectives never
interleave with DDP's on the training group, and no port of ours is opened. Rank 0 broadcasts one
frame per snapshot to every target at once, each target checks and writes it, then all report
(one all-gather). A target refuses a frame larger than its free disk before any byte is sent,
without stopping the others. Each collective of rank 0's must complete within `send_deadline`
(60 s; a chunk of the payload is at most 64 MiB), and the targets' verdicts, which come once each
has checked and stored the whole file, within that plus the file's size at 50 MB/s (a slow disk:
200 s more for 10 GB). A target that stops answering (frozen, partitioned) ends replication for the
rest of this worker group (logged, and `replication_failed` events: "sent, not confirmed" when
every byte went out and only the verdict was late, as the replica may have landed); the snapshots
offered after that are reported as not replicated at once, `finish` does not wait for them (a
drain's SIGTERM grace is not spent on a replication that stopped), and a target gives up waiting
for rank 0's verdicts within the same bound, without holding the payload meanwhile. The next worker
group re-forms replication. If replication falls behind, a newer snapshot replaces the one waiting
to be sent (only the newest matters). Training never waits for replication, except at the end
(`finish`).

Not guaranteed: a replica of the very last snapshot when the job ends by a failure, and a replica
at all when a target's disk is full or it stopped answering (the event log says so).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.exchange.replica_transfer import ReplicaReceiver, ReplicaTarget, SnapshotReplicator
from elastic_ddp.snapshot.files.backends import StorageBackend
from elastic_ddp.snapshot.files.manifest import ManifestEntry
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore

logger = logging.getLogger(__name__)

# Probe files that tell which ranks' checkpoint directories are the same place (see the docstring).
PROBE_PREFIX = ".probe-"

# The side group's own timeout: targets wait for the next snapshot for as long as training lasts.
SIDE_GROUP_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Member:
    """One rank's part in choosing replica targets."""

    rank: int
    group_rank: int
    local_rank: int
    directory: int  # the lowest rank whose checkpoint directory is the same place as this rank's
    can_receive: bool  # its node's local rank 0, with a local checkpoint directory of its own


def choose_replica_targets(members: list[Member], replicas: int) -> list[Member]:
    """Up to `replicas` receivers on nodes after rank 0's in group-rank order, one per directory.

    A pure function of the membership, so every rank computes the same answer.
    """
    source = members[0]
    node_count = max(member.group_rank for member in members) + 1
    seen = {source.directory}
    targets: list[Member] = []
    for member in sorted(members, key=lambda m: ((m.group_rank - source.group_rank) % node_count, m.rank)):
        if len(targets) == replicas:
            break
        if member.can_receive and member.directory not in seen:
            seen.add(member.directory)
            targets.append(member)
    return targets


class Replication:
    """This rank's part in replication for one worker-group incarnation.

    Rank 0 holds a `SnapshotReplicator` (when there are targets), the targets a `ReplicaReceiver`;
    every rank takes part in `start`; rank 0 and the targets in `finish`.
    """

    def __init__(self, receiver: ReplicaReceiver | None = None, replicator: SnapshotReplicator | None = None):
        self.receiver = receiver
        self.replicator = replicator

    @classmethod
    def start(cls, store: SnapshotStore, context: DistributedContext, replicas: int,
              events: EventLog) -> Replication:
        """Agree on the targets, form their group and start the threads. Collective over the job."""
        if replicas == 0 or not context.in_process_group:
            return cls()
        directories, writable = shared_directories(store, context)
        can_receive = (context.local_rank == 0 and context.rank != 0 and writable
                       and store.storage.local_directory is not None)
        me = Member(rank=context.rank, group_rank=int(os.environ.get("GROUP_RANK", "0")),
                    local_rank=context.local_rank, directory=directories[context.rank], can_receive=can_receive)
        members: list[Any] = [None] * context.world_size
        dist.all_gather_object(members, me)
        targets = choose_replica_targets(members, replicas)
        if context.rank == 0:
            _announce(members, targets, replicas, events)
        if not targets:
            return cls()
        group_ranks = sorted([0, *(target.rank for target in targets)])
        group = dist.new_group(group_ranks, backend="gloo", timeout=SIDE_GROUP_TIMEOUT)
        if context.rank == 0:
            targets_by_rank = [ReplicaTarget(rank=target.rank, node=target.group_rank) for target in targets]
            return cls(replicator=SnapshotReplicator(store, group, targets_by_rank, group_ranks, events))
        if context.rank in group_ranks:
            return cls(receiver=ReplicaReceiver(store, group, group_ranks))
        return cls()

    def offer(self, entry: ManifestEntry) -> None:
        """Rank 0: replicate this durable snapshot of rank 0's store (returns at once)."""
        if self.replicator is not None:
            self.replicator.offer(entry)

    def finish(self, timeout: float) -> None:
        """End of training: rank 0 waits up to `timeout` s for the last snapshot to reach its
        targets and tells them it is done; each target waits for that, as long."""
        if self.replicator is not None:
            self.replicator.finish(timeout)
        if self.receiver is not None:
            self.receiver.finish(timeout)

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()


def shared_directories(store: SnapshotStore, context: DistributedContext) -> tuple[list[int], bool]:
    """For every rank, the lowest rank whose checkpoint directory is the same place as its own; and
    whether this rank could write its own. A collective (two all-gathers)."""
    return shared_places(store.storage, context)


def shared_places(storage: StorageBackend, context: DistributedContext) -> tuple[list[int], bool]:
    """`shared_directories` for any storage (the sharded snapshots' directory too)."""
    probe = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    try:
        storage.make_location()  # (not prepare_for_writing: it clears other writers' temporaries)
        storage.write_atomically(probe, b"")
        written = True
    except OSError as exc:  # e.g. a read-only directory: this node can hold no replica
        logger.warning("cannot write to checkpoint directory %s (%s); this node will hold no replica",
                       storage.describe("").rstrip("/"), exc)
        written = False
    probes: list[Any] = [None] * context.world_size
    dist.all_gather_object(probes, probe if written else None)
    try:
        present = set(storage.list_names())
    except OSError:
        present = set()
    seen = [rank for rank, name in enumerate(probes) if name is not None and name in present]
    seen_by: list[Any] = [None] * context.world_size
    dist.all_gather_object(seen_by, seen)
    if written:
        try:
            storage.delete(probe)
        except OSError as exc:
            logger.warning("could not delete %s: %s", storage.describe(probe), exc)
    sharing = [{other for other in seen_by[rank] if rank in seen_by[other]} | {rank}
               for rank in range(context.world_size)]
    return [min(group) for group in sharing], written


def _announce(members: list[Member], targets: list[Member], replicas: int, events: EventLog) -> None:
    nodes = sorted(target.group_rank for target in targets)
    events.emit(schema.REPLICATION, replicas=replicas, target_nodes=nodes, target_ranks=[t.rank for t in targets])
    source = members[0]
    other_directories = {m.directory for m in members if m.group_rank != source.group_rank} - {source.directory}
    if targets:
        logger.info("snapshots are replicated to the checkpoint directory of node(s) %s", nodes)
    if len(targets) < min(replicas, len(other_directories)):
        logger.warning("snapshots get %d of the %d replicas asked for (--snapshot_replicas): the other nodes "
                       "cannot hold one (see their logs)", len(targets), replicas)
    elif not other_directories:
        logger.info("no snapshot replicas: no other node has a checkpoint directory of its own "
                    "(a single node, or shared storage)")
    elif len(other_directories) < replicas:
        logger.info("%d snapshot replica(s) of the %d asked for: only %d other node(s) right now",
                    len(targets), replicas, len(other_directories))


