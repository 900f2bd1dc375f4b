"""One worker group's snapshots, as the trainer sees them: restore, save, finish, close.

    session = SnapshotSession(config, context, events, fingerprint, incarnation)
    session.start()                       # collective: replica targets
    restored = session.restore(state)     # collective: the newest state any rank can read
    ... session.save(state) at the trainer's cadence (collective: every rank's RNG) ...
    session.finish()                      # the last snapshot durable and replicated
    session.close()                       # always, also when training raised

Behind it: the store (`store`, on `storage`), rank 0's background writer (`writer`), the restore
agreement (`recovery`) and replication (`replication`), which move bytes through `transport`.
The session emits the snapshot events (`snapshot_captured`, `snapshot`, `snapshot_failed`) to the
event log it is given; nothing calls back into the trainer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from elastic_ddp.config import TrainingConfig
from elastic_ddp.distributed import DistributedContext
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.snapshot.recovery import RestoredSnapshot, agree_on_latest_snapshot
from elastic_ddp.snapshot.replication import Replication
from elastic_ddp.snapshot.staging import StagingBuffers
from elastic_ddp.snapshot.state import Snapshot, TrainingState, capture_rng_state, seed_rng_for_step
from elastic_ddp.snapshot.store import CheckpointStore, ManifestEntry
from elastic_ddp.snapshot.writer import SnapshotWriter

logger = logging.getLogger(__name__)


class SnapshotSession:
    """Snapshots of one incarnation (see the module docstring). Rank 0 writes; all ranks take part."""

    def __init__(self, config: TrainingConfig, context: DistributedContext, events: EventLog,
                 fingerprint: dict[str, Any], incarnation: int):
        self.config = config
        self.context = context
        self.events = events
        self.fingerprint = fingerprint
        self.incarnation = incarnation
        self.store = CheckpointStore(config.checkpoint_dir, config.keep_last)
        self.writer: SnapshotWriter | None = None
        if context.is_main:
            self.writer = SnapshotWriter(self.store, on_written=self._written, on_failed=self._failed,
                                         asynchronous=config.snapshot_async, write_timeout_s=config.snapshot_timeout_s)
        self.replication = Replication()  # the real one is agreed on in start()
        self.last_saved_step: int | None = None

    @property
    def _distributed(self) -> bool:
        return self.context.is_distributed and dist.is_initialized()

    def start(self) -> None:
        """Agree on replica targets and start replication (collective)."""
        self.replication = Replication.start(self.store, self.context, self.config.snapshot_replicas, self.events)

    def restore(self, state: TrainingState) -> RestoredSnapshot | None:
        """Load the newest state the group can read into `state` (collective); None: from scratch."""
        restored = agree_on_latest_snapshot(self.store, self.context, self.fingerprint)
        if restored is None:
            logger.info("no snapshot in %s: starting from scratch", self.config.checkpoint_dir)
            seed_rng_for_step(self.config.seed, 0, self.context.rank)
            return None
        restored.snapshot.restore_into(state, self.context.rank, self.context.world_size, self.config.seed)
        self.last_saved_step = restored.snapshot.global_step
        self._keep_restored_copies(restored)
        return restored

    def _keep_restored_copies(self, restored: RestoredSnapshot) -> None:
        """Rank 0: write the restored snapshot here if it came from a peer, and to the replicas, so
        that losing the node it came from next does not lose it (local checkpoint directories)."""
        if self.writer is None:
            return
        if restored.entry is None:
            snapshot = restored.snapshot
            self.writer.submit_serialized(snapshot.global_step, snapshot.epoch, snapshot.samples_consumed,
                                          restored.data)
        else:
            self.replication.offer(restored.entry)

    def save(self, state: TrainingState) -> None:
        """Snapshot `state` now (collective: every rank's RNG); rank 0 queues the write."""
        self.last_saved_step = state.global_step
        rng_per_rank = [capture_rng_state()]
        if self._distributed:
            rng_per_rank = [None] * self.context.world_size
            dist.all_gather_object(rng_per_rank, capture_rng_state())
        if self.writer is None:
            return

        def capture(staging: StagingBuffers) -> Snapshot:
            return Snapshot(states=staging.copy(state.state_dicts(), "states"), rng_per_rank=rng_per_rank,
                            fingerprint=self.fingerprint, world_size=self.context.world_size,
                            incarnation=self.incarnation, wall_time=time.time())

        blocked_seconds = self.writer.submit(capture)
        self.events.emit(schema.SNAPSHOT_CAPTURED, global_step=state.global_step,
                         blocked_seconds=round(blocked_seconds, 4))

    def finish(self) -> bool | None:
        """Wait until the last snapshot is durable (at most --snapshot_timeout_s) and replicated (at
        most half the collective timeout). Returns whether the last save is durable; None off rank 0."""
        durable = None
        if self.writer is not None:
            if not self.writer.wait(self.config.snapshot_timeout_s):
                logger.error("the snapshot of step %s is still being written after %.0f s (storage hung?): not "
                             "waiting longer", self.last_saved_step, self.config.snapshot_timeout_s)
            last = self.writer.last_written
            durable = last is not None and last.global_step == self.last_saved_step
        self.replication.finish(timeout=self.config.collective_timeout_s / 2)
        return durable

    def close(self) -> None:
        """Finish a write in flight (so that a clean exit keeps it) and stop every thread."""
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self.replication.close()

    def _written(self, entry: ManifestEntry, write_seconds: float) -> None:
        self.events.emit(schema.SNAPSHOT, global_step=entry.global_step, epoch=entry.epoch, file=entry.file,
                         checksum=entry.checksum, size_bytes=entry.size_bytes, write_seconds=round(write_seconds, 4))
        self.replication.offer(entry)

    def _failed(self, global_step: int, reason: str) -> None:
        self.events.emit(schema.SNAPSHOT_FAILED, global_step=global_step, error=reason)
