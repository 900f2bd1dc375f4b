"""Snapshots of a sharded run (`--sharding fsdp`): every rank writes its shards through DCP.

The same contract as `snapshot.manager.SnapshotSession` (start, restore, save, keep_in_memory,
finish, forget_memory_copies, close), for a model and optimizer sharded by FSDP2:

- save (a collective, on the same cadence: the overhead budget or --snapshot_every_steps): every
  rank writes its shards of the model and optimizer state into a temporary step directory with
  `torch.distributed.checkpoint` (tensors only); rank 0 adds `trainer.snap` (the unsharded rest: LR
  schedule, sampler position, step, grad scaler, optimizer hyper-parameters, every rank's RNG, the
  run's fingerprint) and commits the step (step_directories.py). Training waits for the whole write:
  the budget spaces snapshots by that cost.
- restore (a collective): rank 0 picks the newest committed step that verifies and fits this run,
  every rank learns it, and DCP reads the shards this rank now owns, whatever the world size that
  wrote them (resharding); the rest loads from `trainer.snap` as a format-2 snapshot.

Limits of this first version (docs/sharding.md): the checkpoint directory must be one filesystem
that every node reads (no replication to other nodes' disks); there are no memory copies, so a
failure resumes from the newest sharded snapshot and loses the steps since (the restore event says
so with `source: file` and `lost_steps`); writes are synchronous.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from elastic_ddp.config import TrainingConfig
from elastic_ddp.locations import local_path
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.cadence import SnapshotCadence
from elastic_ddp.snapshot.exchange.cadence_agreement import agree_on_next_snapshot
from elastic_ddp.snapshot.exchange.restore_agreement import FILE, RestoredSnapshot
from elastic_ddp.snapshot.exchange.rng_gather import gather_rng_states
from elastic_ddp.snapshot.serialization import check_compatible, snapshot_from_file, snapshot_to_bytes
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.safe_reader import SafeFileSystemReader
from elastic_ddp.snapshot.training_state import (
    Snapshot,
    TrainingState,
    capture_rng_state,
    non_finite_tensors,
    restore_rng_state,
    seed_rng_for_step,
)

logger = logging.getLogger(__name__)

SHARDED = ("model", "optimizer")  # the components DCP writes; the rest goes to trainer.snap


class ShardedSnapshotSession:
    """Snapshots of one incarnation of a sharded run (see the module docstring)."""

    def __init__(self, config: TrainingConfig, context: DistributedContext, events: EventLog,
                 fingerprint: dict[str, Any], incarnation: int):
        self.config, self.context, self.events = config, context, events
        self.fingerprint, self.incarnation = fingerprint, incarnation
        self.root = local_path(config.checkpoint_dir)
        self.cadence = SnapshotCadence(config.snapshot_every_steps, config.snapshot_budget,
                                       config.snapshot_max_interval_s)
        self.last_saved_step: int | None = None
        self.last_durable_step: int | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.context.is_main and (self.config.snapshot_replicas or self.config.memory_copies):
            logger.info("--sharding fsdp: snapshots are sharded files in %s, which every node must read; no replicas "
                        "on other nodes' disks and no memory copies yet (a failure resumes from the newest one)",
                        self.root)

    # ------------------------------------------------------------------------------- restore

    def restore(self, state: TrainingState) -> RestoredSnapshot | None:
        """Load the newest committed step that verifies into `state` (collective); None: from scratch."""
        choice = [self._choose() if self.context.is_main else None]
        if self.context.in_process_group:
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            logger.info("no sharded snapshot in %s: starting from scratch", self.root)
            seed_rng_for_step(self.config.seed, 0, self.context.rank)
            return None
        name, checksum = choice[0]
        directory = self.root / name
        plain, _ = snapshot_from_file(directory / steps.TRAINER_FILE, str(directory / steps.TRAINER_FILE))
        with state.updating():
            self._load_shards(state, directory, plain.states["optimizer"])
            for component, value in plain.states.items():
                if component not in SHARDED:
                    getattr(state, component).load_state_dict(value)
            if len(plain.rng_per_rank) == self.context.world_size:
                restore_rng_state(plain.rng_per_rank[self.context.rank])
            else:
                seed_rng_for_step(self.config.seed, plain.global_step, self.context.rank)
        self.last_saved_step = self.last_durable_step = plain.global_step
        return RestoredSnapshot(snapshot=plain, entry=None, checksum=checksum, source=FILE, source_rank=0,
                                source_host=socket.gethostname(), description=str(directory), data=b"")

    def _choose(self) -> tuple[str, str] | None:
        """Rank 0: (directory name, manifest checksum) of the newest step that verifies and fits."""
        for step, directory in steps.committed_steps(self.root):
            try:
                checksum = steps.verify(directory)
                SafeFileSystemReader(directory).read_metadata()  # refuses an index that would run code
                plain, _ = snapshot_from_file(directory / steps.TRAINER_FILE, str(directory / steps.TRAINER_FILE))
                check_compatible(plain, self.fingerprint, str(directory))
            except Exception as exc:  # noqa: BLE001 - any reason to refuse it is a reason to try the next
                logger.warning("sharded snapshot of step %d refused: %s", step, exc)
                continue
            return directory.name, checksum
        return None

    def _load_shards(self, state: TrainingState, directory: Path, optimizer_plain: dict[str, Any]) -> None:
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
        tensors = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
        dcp.load(tensors, storage_reader=SafeFileSystemReader(directory))
        set_state_dict(state.model, state.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict={"state": tensors["optimizer"]["state"],
                                         "param_groups": optimizer_plain["param_groups"]})

    # ------------------------------------------------------------------------------- save

    def save(self, state: TrainingState, *, epoch_ended: bool = False, final: bool = False) -> bool:
        """As `SnapshotSession.save`: on the cadence, at the end of training, and on `final`."""
        due = self.cadence.save_due(state.global_step, self.last_saved_step, epoch_ended=epoch_ended, final=final,
                                    training_done=state.sampler.epoch >= self.config.epochs)
        if due:
            self._save_now(state)
        return due

    def _save_now(self, state: TrainingState) -> None:
        started = time.monotonic()
        step = self.last_saved_step = state.global_step
        rng_per_rank = (gather_rng_states(self.context.world_size, self.context.device)
                        if self.context.in_process_group else [capture_rng_state()])
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
        tensors = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
        diverged = _any_rank_diverged(tensors, self.context)
        if diverged:  # never made the newest durable state: the last good one stays the one restored
            if self.context.is_main:
                self.events.emit(schema.SNAPSHOT_FAILED, global_step=step,
                                 error=f"non-finite values in {', '.join(diverged[:3])}: not saved")
            return
        temporary = steps.temporary_directory(self.root, step, self.incarnation)
        dcp.save(tensors, storage_writer=FileSystemWriter(temporary, sync_files=True))
        if self.context.is_main:
            self._commit(state, step, temporary, rng_per_rank, optimizer_state["param_groups"], started)
        if self.context.in_process_group:
            dist.barrier()  # no rank reads or prunes a step before it is committed
        if self.cadence.on_budget:
            agree_on_next_snapshot(self.cadence, step, time.monotonic() - started, self.context, self.events)

    def _commit(self, state: TrainingState, step: int, temporary: Path, rng_per_rank: list[dict[str, Any]],
                param_groups: list[dict[str, Any]], started: float) -> None:
        plain_states = {name: value for name, value in state.state_dicts().items() if name not in SHARDED}
        plain_states["optimizer"] = {"param_groups": param_groups}
        plain_states["model"] = {}
        plain = Snapshot(states=plain_states, rng_per_rank=rng_per_rank, fingerprint=self.fingerprint,
                         world_size=self.context.world_size, incarnation=self.incarnation, wall_time=time.time())
        (temporary / steps.TRAINER_FILE).write_bytes(snapshot_to_bytes(plain))
        directory, checksum, size = steps.commit(temporary, step)
        self.last_durable_step = step
        seconds = time.monotonic() - started
        self.events.emit(schema.SNAPSHOT_CAPTURED, global_step=step, blocked_seconds=round(seconds, 4))
        self.events.emit(schema.SNAPSHOT, global_step=step, epoch=state.sampler.epoch, file=directory.name,
                         checksum=checksum, size_bytes=size, write_seconds=round(seconds, 4))
        steps.prune(self.root, self.config.keep_last, self.incarnation)

    # ------------------------------------------------------------------------------- the rest

    def keep_in_memory(self, state: TrainingState, reason: str, wait_s: float | None = None) -> None:
        """No memory copies of sharded states yet: the next group resumes from the newest snapshot."""
        if self.context.is_main:
            self.events.emit(schema.MEMORY_COPY_FAILED, global_step=state.global_step, reason=reason,
                             error="--sharding fsdp keeps no memory copies yet")

    def finish(self) -> bool | None:
        """Whether the last save is durable (writes are synchronous); None off rank 0."""
        return self.last_durable_step == self.last_saved_step if self.context.is_main else None

    def forget_memory_copies(self) -> None:
        """Nothing to forget: see `keep_in_memory`."""

    def close(self) -> None:
        """Nothing runs in the background."""



def _local_shards(value: Any) -> Any:
    """`value` with every DTensor replaced by this rank's shard of it."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {key: _local_shards(item) for key, item in value.items()}
    return value


def _any_rank_diverged(tensors: dict[str, Any], context: DistributedContext) -> list[str]:
    """Where this rank's shards hold a NaN or an infinity, or ["another rank's shards"] when only
    another rank's do; [] when every shard is finite (a collective)."""
    mine = non_finite_tensors(_local_shards(tensors))
    if not context.in_process_group:
        return mine
    flag = torch.tensor([1 if mine else 0], dtype=torch.int64, device=context.collective_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return mine or (["another rank's shards"] if flag.item() else [])
