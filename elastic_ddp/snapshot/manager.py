"""One worker group's snapshots, as the trainer sees them: restore, save, finish, close.

    session = SnapshotSession(config, context, events, fingerprint, incarnation)
    session.start()                       # collective: replica targets
    restored = session.restore(state)     # collective: the newest state any rank can read
    session.save(state, epoch_ended=...)  # after every step: saves when its cadence says so
    session.counted_step(state)           # the newest step that counts (reported as such)
    session.wait_until_counted()          # at a drain or the end, on every rank: the newest counts
    session.keep_in_memory(state, why)    # training stopped early: this node keeps the last step
    session.finish()                      # the last snapshot durable and replicated
    session.close()                       # always, also when training raised

Behind it: the store (`files.snapshot_store`, on `files.backends`), rank 0's background writer
(`background_writer`), the node's memory copies (`memory_copies`), the restore agreement
(`exchange.restore_agreement`) and replication (`exchange.replication`), which move bytes through
`exchange.transport`. It owns the schedule (`exchange.cadence_agreement`, shared with the sharded
session): the trainer calls `save` after every step. The session emits the snapshot events
(`snapshot_captured`, `snapshot`, `snapshot_failed`, `memory_copy`) to the event log it is given;
nothing calls back into the trainer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext, rank_0s
from elastic_ddp.snapshot.background_writer import SnapshotWriter
from elastic_ddp.snapshot.exchange.replication import Replication
from elastic_ddp.snapshot.exchange.restore_agreement import RestoredSnapshot, agree_on_latest_snapshot
from elastic_ddp.snapshot.exchange.rng_gather import gather_rng_states
from elastic_ddp.snapshot.exchange.schedule import SnapshotSchedule
from elastic_ddp.snapshot.files.manifest import ManifestEntry
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.snapshot.memory_copies import HEADROOM, KeptCopy, open_memory_tier, state_bytes
from elastic_ddp.snapshot.staging import StagingBuffers, settled_device_work
from elastic_ddp.snapshot.training_state import Snapshot, TrainingState, capture_rng_state, seed_rng_for_step

if TYPE_CHECKING:  # at run time only under --sharding fsdp: DCP imports sympy, ~0.9 s of CPU per worker
    from elastic_ddp.snapshot.sharded.session import ShardedSnapshotSession

logger = logging.getLogger(__name__)


class SnapshotSession:
    """Snapshots of one incarnation (see the module docstring). Rank 0 writes; all ranks take part."""

    def __init__(self, config: TrainingConfig, context: DistributedContext, events: EventLog,
                 fingerprint: dict[str, Any], incarnation: int, staging: StagingBuffers | None = None):
        """`staging`: an earlier session's (`staging_to_reuse`), for rank 0's writer to copy into."""
        self.config = config
        self.context = context
        self.events = events
        self.fingerprint = fingerprint
        self.incarnation = incarnation
        self.store = SnapshotStore(config.checkpoint_dir, config.keep_last)
        self.writer: SnapshotWriter | None = None
        if context.is_main:
            self.writer = SnapshotWriter(self.store, on_written=self._written, on_failed=self._failed,
                                         asynchronous=config.snapshot_async, write_timeout_s=config.snapshot_timeout_s,
                                         staging=staging)
        self.replication = Replication()  # the real one is agreed on in start()
        self.memory = (open_memory_tier(config.memory_dir, self.store.storage, context, fingerprint)
                       if config.memory_copies else None)
        self.schedule = SnapshotSchedule.from_config(config)
        self._kept_in_memory: int | None = None  # the step this worker kept in memory
        self._restored: tuple[int, int] | None = None  # (step, incarnation that committed it) restored

    def _warn_if_no_room(self, state: TrainingState) -> None:
        """Local rank 0: say at the start when the memory directory cannot hold one copy of `state`
        (a container's default /dev/shm is 64 MiB), rather than at the first failure."""
        if self.memory is None or self.context.local_rank != 0:
            return
        needed = state_bytes(state.state_dicts()) * HEADROOM
        try:
            free = self.memory.free_bytes()
        except OSError:
            return
        if needed > free:
            logger.warning("--memory_dir %s has %.3f GB free and cannot hold a memory copy of this state (%.3f GB): "
                           "a failure will resume from the snapshot files instead. Give it room (Kubernetes: an "
                           "emptyDir volume with medium: Memory and a sizeLimit mounted at /dev/shm; Docker: "
                           "--shm-size) or pass --no-memory_copies", self.memory.root, free / 1e9, needed / 1e9)

    def start(self) -> None:
        """Agree on replica targets and start replication (collective)."""
        self.replication = Replication.start(self.store, self.context, self.config.snapshot_replicas, self.events)

    def restore(self, state: TrainingState) -> RestoredSnapshot | None:
        """Load the newest state the group can offer into `state` (collective); None: from scratch."""
        restored = agree_on_latest_snapshot(self.store, self.context, self.fingerprint, self.memory)
        self._warn_if_no_room(state)
        if restored is None:
            logger.info("no snapshot in %s: starting from scratch", self.config.checkpoint_dir)
            seed_rng_for_step(self.config.seed, 0, self.context.rank)
            return None
        with state.updating():
            restored.snapshot.restore_into(state, self.context.rank, self.context.world_size, self.config.seed)
        self.schedule.last_saved_step = restored.snapshot.global_step
        self._restored = (restored.snapshot.global_step, restored.snapshot.incarnation)
        self._keep_restored_copies(restored)
        return restored

    def resume_live(self, state: TrainingState, committed_in: int) -> bool:
        """After an in-process re-form (training/in_process.py): whether every rank of the new group
        holds the same committed step, consistent, in its own memory; then nothing is loaded or sent,
        this rank's RNG is derived for that step and its new rank, as a restore into another world
        derives it, and the state is snapshotted (rank 0 writes it in the background). Collective. False: restore as usual, from copies kept first (the ranks of a
        broken all-reduce may have committed different steps). `committed_in`: the incarnation that
        committed `state`'s step, which the next memory copies of it carry."""
        mine = (state.global_step, state.consistent, committed_in)
        offers: list[Any] = [mine]
        if self.context.in_process_group:
            offers = [None] * self.context.world_size
            torch.distributed.all_gather_object(offers, mine)
        if not state.consistent or any(tuple(offer) != mine for offer in offers):
            return False
        seed_rng_for_step(self.config.seed, state.global_step, self.context.rank)
        self._restored = (state.global_step, committed_in)
        self.schedule.last_saved_step = state.global_step
        # Written durably, as a restore from memory writes what it took: the lost node may have been
        # the one whose disk holds the newest file.
        self._save_now(state, final=False)
        return True

    def _keep_restored_copies(self, restored: RestoredSnapshot) -> None:
        """Rank 0: write the restored state here if it came from memory or a peer, and to the
        replicas, so that losing the node it came from next (or the whole job) does not lose it."""
        if self.writer is None:
            return
        if restored.entry is None:
            snapshot = restored.snapshot
            self.writer.submit_serialized(snapshot.global_step, snapshot.epoch, snapshot.samples_consumed,
                                          restored.data)
        else:
            self.replication.offer(restored.entry)

    def save(self, state: TrainingState, *, epoch_ended: bool = False, final: bool = False) -> bool:
        """Snapshot `state` when its schedule says so (`SnapshotSchedule.due`: the overhead budget
        or --snapshot_every_steps, the end of training, and `final`, a drain). Call it after every
        committed step on every rank: when it saves it is a collective (every rank's RNG), and rank
        0 queues the write. Returns whether it saved."""
        due = self.schedule.due(state, epoch_ended=epoch_ended, final=final,
                                write_in_flight=self._writing_everywhere)
        if due:
            self._save_now(state, final)
        return due

    def _writing_everywhere(self) -> bool:
        """Whether rank 0's writer is still writing a snapshot that is not yet slow (`writing`), as
        every rank learns it (one broadcast): the cadence's probe then moves rather than wait for
        it. After an in-process re-form it is the write of the snapshot taken at once, which the
        probe 10 steps later would wait for at large states (docs/benchmarks.md)."""
        return bool(rank_0s(self.context, int(self.writer is not None and self.writer.writing())))

    def counted_step(self, state: TrainingState) -> int:
        """The newest committed step that counts (its `step` event, its audit line, a state a
        restore may take): every rank holds the whole state, so each step as soon as it is committed."""
        return state.global_step

    def wait_until_counted(self) -> None:
        """Nothing to wait for: a step counts once committed (see `counted_step`)."""

    def _save_now(self, state: TrainingState, final: bool) -> None:
        started = time.monotonic()
        if self.context.in_process_group:
            rng_per_rank = gather_rng_states(self.context.world_size, self.context.device)
        else:
            rng_per_rank = [capture_rng_state()]
        if self.writer is not None:
            self._submit(state, rng_per_rank, final)
        self.schedule.after_save(state.global_step, time.monotonic() - started, self.context, self.events,
                                 self._writer_cpu_taken_from_training())

    def _writer_cpu_taken_from_training(self) -> float:
        """Rank 0: the CPU time of the last background write (this one's estimate), where the
        writer's thread has no core of its own: as many training threads on this node as cores."""
        if self.writer is None:
            return 0.0
        training_threads = self.context.local_world_size * torch.get_num_threads()
        return self.writer.last_write_cpu_seconds if len(os.sched_getaffinity(0)) <= training_threads else 0.0

    def _submit(self, state: TrainingState, rng_per_rank: list[dict[str, Any]], final: bool) -> None:
        """Rank 0: copy `state` into staging and queue its write."""
        def capture(staging: StagingBuffers) -> Snapshot:
            return Snapshot(states=staging.copy(state.state_dicts(), "states"), rng_per_rank=rng_per_rank,
                            fingerprint=self.fingerprint, world_size=self.context.world_size,
                            incarnation=self.incarnation, wall_time=time.time())

        # A final snapshot (a drain) waits for a slow write in flight; any other skips a hung one.
        blocked_seconds = self.writer.submit(capture, final=final, global_step=state.global_step)
        self.events.emit(schema.SNAPSHOT_CAPTURED, global_step=state.global_step,
                         blocked_seconds=round(blocked_seconds, 4))

    def keep_in_memory(self, state: TrainingState, reason: str, wait_s: float | None = None,
                       committed_by: tuple[int, int] | None = None, after_silence: bool = False) -> KeptCopy | None:
        """Keep the last committed step of `state` in this node's memory, as training stops early
        (not a collective: the group may be broken). Nothing when the state is half updated or
        holds a NaN or an infinity, nor when the state is not free within `wait_s` seconds (None:
        wait as long as it takes; another thread than the training thread must bound it, as the
        training thread may be stuck inside a commit), nor, with a bound, when the device's work of
        that step does not end within it either. A refusal is logged and emitted. `committed_by`:
        (incarnation, world size) of the group that committed the step, when not this session's
        (a group re-formed in process keeps the step its previous group committed). `after_silence`
        changes nothing here (the sharded session's: no exchange of parts to wait for)."""
        if self.memory is None or self._kept_in_memory == state.global_step:
            return None
        # No step is applied while the state is copied, from whatever thread this is called.
        if not state.lock.acquire(timeout=-1 if wait_s is None else wait_s):
            self._not_kept(state.global_step, reason, (
                f"the training thread has been applying step {state.global_step + 1} for over {wait_s:g} s (under "
                "NCCL an optimizer step may wait for ever on a collective that a silent peer never joins): the state "
                "cannot be copied without waiting"))
            return None
        try:
            if not state.consistent:
                self._not_kept(state.global_step, reason,
                               f"stopped in the middle of applying step {state.global_step + 1}: that state is not kept")
                return None
            states = state.state_dicts()
            with contextlib.nullcontext(True) if wait_s is None else settled_device_work(states, wait_s) as settled:
                if not settled:
                    self._not_kept(state.global_step, reason, (
                        f"the device has not finished the work of step {state.global_step} within {wait_s:g} s (a "
                        "collective that never ends blocks its stream): the state cannot be copied without waiting"))
                    return None
                incarnation, world_size = committed_by or (self.committed_in(state.global_step),
                                                           self.context.world_size)
                snapshot = Snapshot(states=states, rng_per_rank=[], fingerprint=self.fingerprint,
                                    world_size=world_size, incarnation=incarnation, wall_time=time.time())
                kept = self.memory.keep(snapshot)
        finally:
            state.lock.release()
        if kept is None:
            self.events.emit(schema.MEMORY_COPY_FAILED, global_step=state.global_step, reason=reason,
                             error=self.memory.refusal or "see this rank's log")
            return None
        self._kept_in_memory = state.global_step
        logger.info("%s: kept the state of step %d in memory (%s, %.1f MB, %.2f s)", reason, state.global_step,
                    kept.path if kept.written else "written by a sibling rank", kept.size_bytes / 1e6, kept.seconds)
        self.events.emit(schema.MEMORY_COPY, global_step=state.global_step, reason=reason,
                         size_bytes=kept.size_bytes, seconds=round(kept.seconds, 4), written=kept.written)
        return kept

    def committed_in(self, global_step: int) -> int:
        """The incarnation that committed `global_step`: the restored state's, until a step is trained
        (so that a copy of it is the same state as the one restored, see memory_copies)."""
        if self._restored is not None and self._restored[0] == global_step:
            return self._restored[1]
        return self.incarnation

    def _not_kept(self, global_step: int, reason: str, error: str) -> None:
        logger.error("%s: the state of step %d is not kept in memory: %s", reason, global_step, error)
        self.events.emit(schema.MEMORY_COPY_FAILED, global_step=global_step, reason=reason, error=error)

    def finish(self) -> bool | None:
        """Wait until the last snapshot is durable (at most --snapshot_timeout_s) and replicated (at
        most half the collective timeout). Returns whether the last save is durable; None off rank 0."""
        durable = None
        if self.writer is not None:
            if not self.writer.wait(self.config.snapshot_timeout_s):
                logger.error("the snapshot of step %s is still being written after %.0f s (storage hung?): not "
                             "waiting longer", self.schedule.last_saved_step, self.config.snapshot_timeout_s)
            last = self.writer.last_written
            durable = last is not None and last.global_step == self.schedule.last_saved_step
        self.replication.finish(timeout=self.config.collective_timeout_s / 2)
        return durable

    def forget_memory_copies(self) -> None:
        """The run is complete: remove this node's memory copies (its local rank 0 does)."""
        if self.memory is not None and self.context.local_rank == 0:
            self.memory.clear()

    def staging_to_reuse(self) -> StagingBuffers | None:
        """After `close`: rank 0's staging buffers, for the next incarnation of this process (an
        in-process re-form), whose first snapshot, taken at once, then copies into warm pages rather
        than faulting in a new state's worth (0.4-0.5 s per GB here); None off rank 0 or while a
        write still reads them."""
        return self.writer.staging_to_reuse() if self.writer is not None else None

    def close(self, superseded: bool = False) -> None:
        """Finish a write in flight (so that a clean exit keeps it) and stop every thread.
        `superseded`: the next session of this run snapshots a state at least as new at once (an
        in-process re-form: `resume_live`, or the restore's own write), so a write in flight stops
        instead; the listed snapshots stay as they were."""
        try:
            if self.writer is not None:
                self.writer.close(superseded=superseded)
        finally:
            self.replication.close()

    def _written(self, entry: ManifestEntry, write_seconds: float) -> None:
        self.events.emit(schema.SNAPSHOT, global_step=entry.global_step, epoch=entry.epoch, file=entry.file,
                         checksum=entry.checksum, size_bytes=entry.size_bytes, write_seconds=round(write_seconds, 4))
        self.replication.offer(entry)

    def _failed(self, global_step: int, reason: str) -> None:
        self.events.emit(schema.SNAPSHOT_FAILED, global_step=global_step, error=reason)


def open_snapshot_session(config: TrainingConfig, context: DistributedContext, events: EventLog,
                          fingerprint: dict[str, Any], incarnation: int,
                          staging: StagingBuffers | None = None) -> SnapshotSession | ShardedSnapshotSession:
    """The snapshot session of one incarnation: rank 0's single files, or every rank's shards
    under `--sharding fsdp` (snapshot/sharded/session.py). Both keep the same contract. `staging`:
    the last session's `staging_to_reuse()` (rank 0's single files only)."""
    if config.sharding == "fsdp":
        from elastic_ddp.snapshot.sharded.session import ShardedSnapshotSession
        return ShardedSnapshotSession(config, context, events, fingerprint, incarnation)
    return SnapshotSession(config, context, events, fingerprint, incarnation, staging)
