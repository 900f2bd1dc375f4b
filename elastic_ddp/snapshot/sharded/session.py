"""Snapshots of a sharded run (`--sharding fsdp`): every rank writes its shards through DCP.

The same contract as `snapshot.manager.SnapshotSession` (start, restore, save, keep_in_memory,
finish, forget_memory_copies, close), for a model and optimizer sharded by FSDP2:

- save (a collective, on the DDP session's schedule, `exchange.cadence_agreement`: the overhead
  budget or --snapshot_every_steps): every rank writes its shards of the model and optimizer state
  into a temporary step directory with `torch.distributed.checkpoint` (tensors only); rank 0 adds
  `trainer.snap` (the unsharded rest: LR schedule, sampler position, step, grad scaler, optimizer
  hyper-parameters, every rank's RNG, the run's fingerprint) and commits the step
  (step_directories.py). Training waits for the whole write: the budget spaces snapshots by that
  cost. A step whose state holds a non-finite value is not written and does not move the schedule.
- restore (a collective): the memory state (below) is weighed first against the newest committed
  step, by name (and size on node-local disks), so that a memory state at least as new wins without
  a durable file read. Otherwise rank 0 picks the newest committed step that verifies and fits this
  run (shared_choice.py), every rank learns it, and DCP reads the shards this rank now owns,
  whatever the world size that wrote them (resharding); the rest loads from `trainer.snap` as a
  format-2 snapshot.

- memory copies (`--memory_copies`, on by default): at each committed step and after a restore,
  every rank keeps its part of the state in memory and a copy goes to a rank on another node
  (memory_session.py, memory_shards.py), on a thread of its own while the next step computes; a
  step counts (`counted_step`: its `step` event, its audit line, a state a restore or a durable
  save may take) once that exchange ended, a step after its commit while training runs, and
  `wait_until_counted` ends it at a drain or the end; a worker that stops early writes what it holds to its
  node's memory directory, and the next group restores the newest step whose parts its nodes
  still hold, resharded, when it is at least as new as the newest durable step (memory_restore.py);
  a memory state that fails to load is refused with its reason and the durable step taken. A
  failure of one node then costs no committed step.

- node-local disks (the ranks' checkpoint directories are not all one place; probed at start):
  each node commits its own directory of the step and every rank's files are copied to a node of
  another directory (--snapshot_replicas, node_local.py); a restore takes the newest step whose
  files the group holds and fetches what a node lacks before DCP loads (node_local_restore.py).

Limits (docs/sharding.md): durable writes and their copies are synchronous; when a part and its
copy are both lost the restart falls back to the newest durable step (the restore event says why).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.exchange.restore_agreement import FILE, MEMORY, RestoredSnapshot
from elastic_ddp.snapshot.exchange.rng_gather import gather_rng_states
from elastic_ddp.snapshot.exchange.schedule import SnapshotSchedule
from elastic_ddp.snapshot.files.backends import open_storage
from elastic_ddp.snapshot.files.manifest import ManifestEntry
from elastic_ddp.snapshot.memory_copies import open_memory_tier
from elastic_ddp.snapshot.serialization import (
    check_compatible,
    snapshot_from_bytes,
    snapshot_from_file,
    snapshot_to_bytes,
)
from elastic_ddp.snapshot.sharded import node_local_restore, shared_choice
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.divergence import any_rank_diverged
from elastic_ddp.snapshot.sharded.memory_restore import MemoryState
from elastic_ddp.snapshot.sharded.memory_session import MemoryCopies
from elastic_ddp.snapshot.sharded.node_local import NodeLocalSteps
from elastic_ddp.snapshot.sharded.safe_reader import SafeFileSystemReader
from elastic_ddp.snapshot.training_state import (
    Snapshot,
    TrainingState,
    capture_rng_state,
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
        self.storage = open_storage(config.checkpoint_dir)
        self.root = self.storage.local_directory  # a directory: TrainingConfig refuses a URL with --sharding fsdp
        self.schedule = SnapshotSchedule.from_config(config)
        self.last_durable_step: int | None = None
        self.memory: MemoryCopies | None = None
        self.local: NodeLocalSteps | None = None  # node-local directories (None: one place for every rank)
        self._kept_step: int | None = None  # the step whose part this rank last kept (and exchanged)
        self._committed_in = incarnation  # the incarnation that committed the state held (a restored one's)
        self._group_names: list[list[str]] = []  # the parameter names of each optimizer group
        self._hooks: list[Any] = []  # on the optimizer's step: `before_update`, `_after_optimizer_step`

    def start(self) -> None:
        self.storage.make_location()
        self.local = NodeLocalSteps.start(self.storage, self.context, self.events, self.config.snapshot_replicas,
                                          self.config.keep_last, self.incarnation)
        if self.config.memory_copies:
            tier = open_memory_tier(self.config.memory_dir, self.storage, self.context, self.fingerprint)
            self.memory = MemoryCopies(tier, self.context, self.events)

    # ------------------------------------------------------------------------------- restore

    def restore(self, state: TrainingState) -> RestoredSnapshot | None:
        """Load into `state` the memory state or the newest committed step that verifies, whichever
        is newer (collective); None: from scratch. The memory state is weighed first against the
        newest step there is, by name and size: one at least as new wins and no durable file is read.
        Otherwise the durable step is checked, and if the newest was refused the memory state is
        weighed again against the one taken."""
        surveyed = node_local_restore.survey(self.local) if self.local is not None else None
        newest = (surveyed.newest_held() if surveyed is not None
                  else shared_choice.on_every_rank(self.context, lambda: shared_choice.newest_step(self.root)))
        restored, refused = self._from_memory(state, newest)
        durable, local_choice, file_refused = None, None, []
        if restored is None:
            if surveyed is not None:
                local_choice, file_refused = node_local_restore.agree(self.local, self.fingerprint, surveyed)
                durable = local_choice and (local_choice.name, local_choice.checksum, local_choice.step)
            else:
                durable = shared_choice.on_every_rank(
                    self.context, lambda: shared_choice.newest_that_verifies(self.root, self.fingerprint))
            if (durable and durable[2]) != newest:  # the newest step was refused: the memory state may win now
                restored, again = self._from_memory(state, durable and durable[2])
                refused += [item for item in again if item not in refused]
        refused = sorted(refused + file_refused, key=lambda item: -item["global_step"])  # newest first
        if restored is None and durable is not None:
            refused = [item for item in refused if item["global_step"] >= durable[2]]
            fetched = node_local_restore.fetch(self.local, local_choice) if local_choice is not None else None
            restored = self._restore_from_file(state, durable[0], durable[1], refused, fetched)
        elif restored is None:
            if refused:
                logger.warning("no sharded snapshot in %s and no whole memory state (%s): starting from scratch",
                               self.root, "; ".join(f"step {item['global_step']}: {item['reason']}" for item in refused))
            else:
                logger.info("no sharded snapshot in %s: starting from scratch", self.root)
            seed_rng_for_step(self.config.seed, 0, self.context.rank)
            restored = None
        if restored is not None:
            self._keep_part(state)  # the restored state is in two nodes' memory before a step is trained
            self.wait_until_counted()
        self._hook_optimizer(state)
        if self.memory is not None:
            self.memory.remove_all_but((state.global_step, self._committed_in))
        return restored

    def _from_memory(self, state: TrainingState, durable_step: int | None) -> tuple[RestoredSnapshot | None, list]:
        """The memory state loaded if it is at least as new as `durable_step` (memory_session.py)."""
        if self.memory is None:
            return None, []
        return self.memory.restore(state, durable_step, self._check_fits, self._restore_from_memory)

    def _restore_from_file(self, state: TrainingState, name: str, checksum: str, refused: list[dict[str, Any]],
                           fetched: tuple[str, int, str] | None = None) -> RestoredSnapshot:
        """`fetched` (node-local directories): what was fetched from where, the rank that served and its host."""
        directory = self.root / name
        plain, _ = snapshot_from_file(directory / steps.TRAINER_FILE, str(directory / steps.TRAINER_FILE))
        with state.updating():
            self._load_shards(state, directory, plain.states["optimizer"])
            same_world = len(plain.rng_per_rank) == self.context.world_size
            self._load_rest(state, plain, plain.rng_per_rank[self.context.rank] if same_world else None)
        self.schedule.last_saved_step = self.last_durable_step = plain.global_step
        self._committed_in = plain.incarnation
        where, source_rank, source_host = fetched or (None, 0, socket.gethostname())
        entry = where and ManifestEntry(where, plain.global_step, plain.epoch, plain.samples_consumed, checksum, 0,
                                        plain.wall_time)
        return RestoredSnapshot(snapshot=plain, entry=entry, checksum=checksum, source=FILE, source_rank=source_rank,
                                source_host=source_host, description=str(directory), data=b"", refused=refused)

    def _restore_from_memory(self, state: TrainingState, in_memory: MemoryState, received: int) -> RestoredSnapshot:
        """The unsharded rest of `in_memory`, once its shards are loaded (inside `state.updating()`)."""
        description = f"the memory state of step {in_memory.step} (parts of {in_memory.world_size} ranks)"
        plain = snapshot_from_bytes(in_memory.rest, description)  # it fits: agree_on_memory_state checked
        mine = in_memory.offers[self.context.rank].plain if in_memory.world_size == self.context.world_size else b""
        self._load_rest(state, plain, snapshot_from_bytes(mine, description).rng_per_rank[0] if mine else None)
        logger.info("restored %s from memory (%d bytes received from peers)", description, received)
        self.schedule.last_saved_step = self.last_durable_step = plain.global_step
        self._committed_in = in_memory.incarnation
        source_rank = in_memory.source_rank
        return RestoredSnapshot(snapshot=plain, entry=None, checksum=in_memory.checksum, source=MEMORY,
                                source_rank=source_rank, source_host=in_memory.hosts[source_rank],
                                description=description, data=b"", refused=in_memory.refused)

    def _check_fits(self, rest: bytes, description: str) -> Snapshot:
        plain = snapshot_from_bytes(rest, description)
        check_compatible(plain, self.fingerprint, description)
        return plain

    def _load_rest(self, state: TrainingState, plain: Snapshot, rng: dict[str, Any] | None) -> None:
        """The unsharded components from `plain`, and this rank's `rng` (None: seeded for the step)."""
        for component, value in plain.states.items():
            if component not in SHARDED:
                getattr(state, component).load_state_dict(value)
        if rng is not None:
            restore_rng_state(rng)
        else:
            seed_rng_for_step(self.config.seed, plain.global_step, self.context.rank)

    def _load_shards(self, state: TrainingState, directory: Path, optimizer_plain: dict[str, Any]) -> None:
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
        tensors = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
        dcp.load(tensors, storage_reader=SafeFileSystemReader(directory))
        set_state_dict(state.model, state.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict={"state": tensors["optimizer"]["state"],
                                         "param_groups": optimizer_plain["param_groups"]})

    # ------------------------------------------------------------------------------- save

    def save(self, state: TrainingState, *, epoch_ended: bool = False, final: bool = False) -> bool:
        """As `SnapshotSession.save`: on the cadence, at the end of training, and on `final`. A step
        saved durably counts first (its exchange is waited for): a restore never takes a step that
        did not count."""
        if self.memory is not None and self._kept_step == state.global_step:
            # A copy now, the bytes only if the part is ever written (keep): no serialising per step.
            # The RNG state is captured afresh and the fingerprint never changes: only the states are copied.
            rest = self._plain_snapshot(state, [capture_rng_state()], self._named_groups(state), self._committed_in)
            rest = dataclasses.replace(rest, states=copy.deepcopy(rest.states))
            self.memory.add_rest(state.global_step, functools.partial(snapshot_to_bytes, rest))
        elif self._kept_step != state.global_step:  # the optimizer step was skipped: no part taken yet
            self._committed_in = self.incarnation
            self._keep_part(state)
        due = self.schedule.due(state, epoch_ended=epoch_ended, final=final)
        if due:
            self.wait_until_counted()
            self._save_now(state)
        return due

    def counted_step(self, state: TrainingState) -> int:
        """The newest committed step that counts: with memory copies, one whose parts are on two
        nodes (`state.global_step - 1` while the exchange of the newest is in flight); else the newest."""
        return state.global_step - 1 if self.memory is not None and self.memory.uncounted == state.global_step \
            else state.global_step

    def wait_until_counted(self) -> None:
        """Wait until the newest committed step counts (the exchange in flight; its own collectives,
        on every rank alike). PartExchangeError when it failed."""
        if self.memory is not None:
            self.memory.wait()

    def _save_now(self, state: TrainingState) -> None:
        started = time.monotonic()
        step = state.global_step
        rng_per_rank = (gather_rng_states(self.context.world_size, self.context.device)
                        if self.context.in_process_group else [capture_rng_state()])
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
        tensors = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
        diverged = any_rank_diverged(tensors, self.context)
        if diverged:  # never made the newest durable state: the last good one stays the one restored
            if self.context.is_main:
                self.events.emit(schema.SNAPSHOT_FAILED, global_step=step,
                                 error=f"non-finite values in {', '.join(diverged[:3])}: not saved")
            return
        temporary = steps.temporary_directory(self.root, step, self.incarnation)
        dcp.save(tensors, storage_writer=FileSystemWriter(temporary, sync_files=True))
        self._commit(state, step, temporary, rng_per_rank, optimizer_state["param_groups"], started)
        if self.context.in_process_group:
            dist.barrier()  # no rank reads or prunes a step before it is committed
        self.schedule.after_save(step, time.monotonic() - started, self.context, self.events)

    def _keep_part(self, state: TrainingState, rest: bool = True) -> None:
        """This rank's part of the state, kept and exchanged with its ring partners (memory_shards.py;
        collectives). Without `rest`, the tensors only: from inside the commit, right after the
        optimizer step (`_after_optimizer_step`); `save` adds the rest once the step is committed."""
        if self.memory is None:
            return
        step = state.global_step if rest else state.global_step + 1
        self._group_names = self.memory.take(state, step, self._committed_in)
        if rest:
            made = self._rest_of(state, self._group_names)
            self.memory.add_rest(step, lambda: made)
        self._kept_step = step

    def _rest_of(self, state: TrainingState, group_names: list[list[str]] | None = None) -> bytes:
        """The unsharded rest of `state` with this rank's RNG, as a format-2 snapshot."""
        return snapshot_to_bytes(self._plain_snapshot(state, [capture_rng_state()],
                                                      self._named_groups(state, group_names), self._committed_in))

    def _named_groups(self, state: TrainingState, group_names: list[list[str]] | None = None) -> list[dict[str, Any]]:
        """The optimizer's parameter groups as get_state_dict gives them (parameters by name), without its cost."""
        return [{**{key: value for key, value in group.items() if key != "params"}, "params": names}
                for group, names in zip(state.optimizer.param_groups, group_names or self._group_names, strict=True)]

    def _hook_optimizer(self, state: TrainingState) -> None:
        if self.memory is not None and not self._hooks:
            memory = self.memory
            self._hooks = [state.optimizer.register_step_pre_hook(lambda *_: memory.before_update()),
                           state.optimizer.register_step_post_hook(
                               lambda optimizer, args, kwargs:
                               self._after_optimizer_step(state) if not state.consistent else None)]
            # Only a step inside the trainer's commit counts: get_state_dict steps a stateless
            # optimizer (plain SGD) with zero gradients to initialise it, outside any commit.

    def _after_optimizer_step(self, state: TrainingState) -> None:
        """Inside the commit, before the state changes again: the exchange of the step before ends
        (that step now counts: its `step` event, its audit line, see `counted_step`), and this
        step's part is taken and its exchange started. A failure here ends training; the restart
        takes a step that counted."""
        self._committed_in = self.incarnation
        self._keep_part(state, rest=False)

    def _plain_snapshot(self, state: TrainingState, rng_per_rank: list[dict[str, Any]],
                        param_groups: list[dict[str, Any]], incarnation: int) -> Snapshot:
        """The unsharded rest of `state` (what DCP does not write)."""
        plain_states = {name: component.state_dict() for name, component in state.components().items()
                        if name not in SHARDED}
        plain_states["optimizer"] = {"param_groups": param_groups}
        plain_states["model"] = {}
        return Snapshot(states=plain_states, rng_per_rank=rng_per_rank, fingerprint=self.fingerprint,
                        world_size=self.context.world_size, incarnation=incarnation, wall_time=time.time())

    def _commit(self, state: TrainingState, step: int, temporary: Path, rng_per_rank: list[dict[str, Any]],
                param_groups: list[dict[str, Any]], started: float) -> None:
        """Rank 0 adds trainer.snap and commits the step; on node-local directories every rank takes part
        (the files copied to their holders, each directory committed: node_local.py)."""
        if self.context.is_main:
            plain = self._plain_snapshot(state, rng_per_rank, param_groups, self._committed_in)
            (temporary / steps.TRAINER_FILE).write_bytes(snapshot_to_bytes(plain))
        if self.local is not None:
            directory, checksum, size = self.local.commit(step, temporary)
            self.local.prune()
        elif self.context.is_main:
            directory, checksum, size = steps.commit(temporary, step)
            steps.prune(self.root, self.config.keep_last, self.incarnation)
        self.last_durable_step = step
        if self.context.is_main:
            seconds = time.monotonic() - started
            self.events.emit(schema.SNAPSHOT_CAPTURED, global_step=step, blocked_seconds=round(seconds, 4))
            self.events.emit(schema.SNAPSHOT, global_step=step, epoch=state.sampler.epoch, file=directory.name,
                             checksum=checksum, size_bytes=size, write_seconds=round(seconds, 4))

    # ------------------------------------------------------------------------------- the rest

    def keep_in_memory(self, state: TrainingState, reason: str, wait_s: float | None = None,
                       after_silence: bool = False) -> None:
        """Write the parts this rank holds (its own and its ring partner's, memory_shards.py) into
        its node's memory directory, without a collective: the group may be broken. A bound
        (`wait_s`: the watchdog's thread) or `after_silence` (a peer silent for the watchdog's
        timeout) waits for no exchange in flight: one that could end has ended by then."""
        if self.memory is not None:
            self.memory.keep(reason, settle=wait_s is None and not after_silence)

    def finish(self) -> bool | None:
        """Whether the last save is durable (writes are synchronous); None off rank 0."""
        return self.last_durable_step == self.schedule.last_saved_step if self.context.is_main else None

    def forget_memory_copies(self) -> None:
        """The run finished: its parts in memory are removed."""
        if self.memory is not None:
            self.memory.forget()

    def staging_to_reuse(self) -> None:
        """Nothing is carried to the next incarnation: the parts' buffers are this session's."""

    def close(self, superseded: bool = False) -> None:
        """The optimizer hooks are removed; an exchange still in flight (training raised) is waited
        for a moment and its failure logged. `superseded` (`SnapshotSession.close`) changes nothing:
        no file is written in the background here."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.memory is not None:
            self.memory.close()
