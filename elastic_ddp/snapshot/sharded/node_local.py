"""Sharded snapshots on each node's own disk: committed per node, replicated to another node.

When the ranks' `--checkpoint_dir`s are not all one place (tested with `exchange.replication`'s
probe files, at every worker-group start; on shared storage none of this runs), each node writes
its own ranks' DCP files into its own directory, and no directory alone holds the step. Then, at
each snapshot (a collective, on the training thread, after every rank's DCP write):

1. every rank checksums the files it wrote (`__RANK_*.distcp`; rank 0 also DCP's `.metadata` and
   `trainer.snap`) and all ranks all-gather them: every rank knows the step's whole manifest;
2. with `--snapshot_replicas` 1 or more, each rank's files go to its *holder*: its memory-copy buddy
   (ring.py), or the next rank along the ring whose directory is another place; `.metadata` and
   `trainer.snap` go to every other directory. Each file is one frame of the snapshot transport over
   a gloo group of its own (file_frames.py: free disk space checked before a byte is sent, the bytes
   checked against the manifest, written atomically, a verdict from every rank, each collective
   bounded by `SEND_DEADLINE`);
3. the lowest rank of each directory writes the whole manifest (`checksums.json`, every file of the
   step with its size and checksum) into it and renames it to the step's name
   (step_directories.seal): a committed directory lists every file of the step and holds those of
   its node and the copies it received (one of the same step with another manifest, left by an
   abandoned trajectory, is replaced). A copy refused (no room, damaged) is reported
   (`replication_failed`, the node and the reason), the step is committed without it, and training
   goes on; the step then is not *replicated* (every file on two directories).
4. pruning keeps `--keep_last` steps and, beyond those, the newest replicated step: the last step
   that survives the loss of any one node is never removed.

A restore (node_local_restore.py) gathers what every directory holds and fetches what is missing.

Not guaranteed: more than one copy per file (`--snapshot_replicas` above 1 counts as 1 here; said
once); a replicated step when a holder's disk is full (the event log says so); a step at all when a
node is lost during the transfers (the snapshot fails with the group, and the restart takes the
newest step whose files are all on surviving nodes, or the memory copies). Sending costs the sender
one copy per receiver and, with more than two ranks, every rank of the group sees every frame.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.exchange.replica_transfer import SEND_DEADLINE, verdict_deadline
from elastic_ddp.snapshot.exchange.replication import SIDE_GROUP_TIMEOUT, shared_places
from elastic_ddp.snapshot.exchange.transport import ProcessGroupTransport
from elastic_ddp.snapshot.files.backends import StorageBackend, fsync_path
from elastic_ddp.snapshot.sharded import file_frames
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.ring import node_of_each_rank, ring_partners

logger = logging.getLogger(__name__)

SMALL_FILES = (".metadata", steps.TRAINER_FILE)  # rank 0's, needed by every directory that holds any file


@dataclass(frozen=True)
class Layout:
    """Where every rank's files are and go, the same on every rank."""

    directory_of: list[int]  # per rank: the lowest rank whose checkpoint directory is the same place
    nodes: list[int]  # per rank: its node (GROUP_RANK)
    holder_of: list[int | None]  # per rank: the rank that keeps a copy of its files (None: no copy)

    @property
    def leaders(self) -> list[int]:
        """The lowest rank of each directory: the one that commits it and receives for it."""
        return sorted(set(self.directory_of))

    def receivers(self, owner: int, name: str) -> list[int]:
        """The ranks that keep a copy of `owner`'s file `name`."""
        if name in SMALL_FILES:
            return [leader for leader in self.leaders if leader != self.directory_of[owner]] if any(
                holder is not None for holder in self.holder_of) else []
        holder = self.holder_of[owner]
        return [] if holder is None else [holder]


def holder_of(rank: int, nodes: list[int], directory_of: list[int]) -> int | None:
    """The rank that keeps `rank`'s files: its buddy (ring.py), or the next one along the same ring
    whose directory is another place; None when every directory is `rank`'s."""
    partners = ring_partners(rank, nodes)
    if partners is None:
        return None
    order = sorted(range(len(nodes)), key=lambda other: (nodes[other], other))
    start = order.index(partners[0])
    for offset in range(len(order)):
        other = order[(start + offset) % len(order)]
        if directory_of[other] != directory_of[rank]:
            return other
    return None


class NodeLocalSteps:
    """This rank's part in the sharded steps of node-local directories (see the module docstring)."""

    def __init__(self, root: Path, context: DistributedContext, events: EventLog, layout: Layout,
                 group: dist.ProcessGroup, keep_last: int, incarnation: int):
        self.root, self.context, self.events, self.layout = root, context, events, layout
        self.group, self.keep_last, self.incarnation = group, keep_last, incarnation
        self.transport = ProcessGroupTransport(group, deadline=SEND_DEADLINE)
        self.last_replicated_step: int | None = None  # never pruned (set by a restore and by each commit)

    @classmethod
    def start(cls, storage: StorageBackend, context: DistributedContext, events: EventLog, replicas: int,
              keep_last: int, incarnation: int) -> NodeLocalSteps | None:
        """The node-local steps of this worker group in `storage` (the checkpoint directory, local), or
        None when every rank's directory is one place (shared storage: step_directories' plain
        commit). A collective."""
        if not context.in_process_group or context.world_size < 2:
            return None
        directory_of, _ = shared_places(storage, context)
        if len(set(directory_of)) == 1:
            return None
        nodes = node_of_each_rank(context)
        holders = [holder_of(rank, nodes, directory_of) if replicas else None for rank in range(context.world_size)]
        layout = Layout(directory_of=directory_of, nodes=nodes, holder_of=holders)
        group = dist.new_group(list(range(context.world_size)), backend="gloo", timeout=SIDE_GROUP_TIMEOUT)
        if context.is_main:
            if replicas:
                logger.info("sharded snapshots on %d node-local directories; each rank's files are copied to the "
                            "directory of rank(s) %s", len(layout.leaders), holders)
            else:
                logger.warning("sharded snapshots on %d node-local directories without copies "
                               "(--snapshot_replicas 0): the loss of a node loses every durable step",
                               len(layout.leaders))
            if replicas > 1:
                logger.warning("--snapshot_replicas %d: sharded snapshots keep one copy of each file on another "
                               "node", replicas)
        return cls(storage.local_directory, context, events, layout, group, keep_last, incarnation)

    def commit(self, step: int, temporary: Path) -> tuple[Path, str, int]:
        """Checksum this rank's files, copy every file to its holders, commit each directory (every
        rank; collectives). Returns (committed directory, manifest checksum, bytes of the step)."""
        started = time.monotonic()
        mine = self._own_files(temporary)
        gathered: list[Any] = [None] * self.context.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        files = {name: entry for owned in gathered for name, entry in owned.items()}
        held: dict[str, set[int]] = {name: {self.layout.directory_of[owner]}
                                     for owner, owned in enumerate(gathered) for name in owned}
        refusals: list[tuple[str, int, int]] = []  # (file, rank, verdict code)
        for owner, owned in enumerate(gathered):
            for name in sorted(owned):
                receivers = self.layout.receivers(owner, name)
                if not receivers:
                    continue
                codes = self.transfer(owner, receivers, step, temporary, name, files)
                held[name] |= {self.layout.directory_of[rank] for rank, code in enumerate(codes)
                               if code == file_frames.STORED}
                refusals += [(name, rank, codes[rank]) for rank in receivers if codes[rank] != file_frames.STORED]
        result = steps.committed_directory(self.root, step), "", 0
        if self.layout.directory_of[self.context.rank] == self.context.rank:
            result = steps.seal(temporary, step, files, replace=True)
        replicated = all(len(directories) >= 2 for directories in held.values())
        if replicated:
            self.last_replicated_step = step
        if self.context.is_main:
            self._report(step, result[1], held, refusals, replicated, time.monotonic() - started)
        return result

    def transfer(self, source: int, receivers: list[int], step: int, directory: Path | None, name: str,
                 manifest: dict[str, dict]) -> list[int]:
        """One file from `source` (in its `directory`) to `receivers` (into theirs); every rank's
        verdict code. A collective over the side group."""
        rank = self.context.rank
        if rank == source:
            assert directory is not None
            file_frames.send_file(self.transport, source, step, directory / name, manifest[name])
            code = file_frames.NOT_ASKED
        else:
            code = file_frames.receive_file(self.transport, source, step, manifest,
                                            directory if rank in receivers else None)
        return file_frames.verdicts(self.group, code, verdict_deadline(SEND_DEADLINE, manifest[name]["size"]))

    def prune(self) -> None:
        """Each directory's lowest rank removes its steps beyond `keep_last`, never the newest replicated one."""
        if self.layout.directory_of[self.context.rank] == self.context.rank:
            keep = () if self.last_replicated_step is None else (self.last_replicated_step,)
            steps.prune(self.root, self.keep_last, self.incarnation, keep)

    def _own_files(self, temporary: Path) -> dict[str, dict[str, Any]]:
        """The files this rank wrote into `temporary`, checksummed from the disk and made durable."""
        rank = self.context.rank
        names = [path.name for path in temporary.iterdir() if path.name.startswith(f"__{rank}_")]
        names += [name for name in SMALL_FILES if rank == 0]
        own = {}
        for name in sorted(names):
            path = temporary / name
            fsync_path(path)
            own[name] = {"size": os.path.getsize(path), "checksum": steps.file_checksum(path)}
        return own

    def _report(self, step: int, checksum: str, held: dict[str, set[int]], refusals: list[tuple[str, int, int]],
                replicated: bool, seconds: float) -> None:
        nodes = self.layout.nodes
        for name, rank, code in refusals:
            error = f"{name} {file_frames.REASONS.get(code, 'not kept')}"
            logger.warning("sharded step %d: %s by node %d (rank %d)", step, error, nodes[rank], rank)
            self.events.emit(schema.REPLICATION_FAILED, global_step=step, node=nodes[rank], error=error)
        receiving = sorted({nodes[directory] for name, directories in held.items() for directory in directories}
                           - {nodes[0]})
        if replicated:
            self.events.emit(schema.SNAPSHOT_REPLICATED, global_step=step, checksum=checksum,
                             nodes=receiving, seconds=round(seconds, 4))
