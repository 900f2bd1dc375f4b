"""How an `ElasticRun`'s group lives: its incarnations, the in-process re-form, the sharded rebuild, counting.

`GroupLifecycle` is the base behind `ElasticRun` (elastic_run.py, the face a loop of the user's
sees). It owns what happens to the worker group under the loop:

- an *incarnation* per process group: agree on its number, open its run log and snapshot session,
  start the peer watchdog, restore the newest state the group can read, wrap the model (DDP, or
  FSDP2's collectives made interruptible), and on the way out keep the last committed step;
- the *in-process re-form* (in_process.py): a peer lost under a step marks the group broken
  (`_owned_collective`), the watchdog hands a silent peer over (`_re_form_without_silent_peer`), a
  join is taken at a step boundary (`_step_boundary`); `_re_form_in_process` then leaves the old
  group, joins the round the agent runs, and opens the next incarnation, in which the survivors
  keep their own state when they all hold the same step;
- under `--sharding fsdp`, the model sharded again over the new group (`_rebuild_sharded`);
- *counting*: each committed step reported and offered to the snapshot session
  (`_after_commit`), and a sharded step counted once its parts are on two nodes.

What the run in front provides (set in its `__init__` before `_start_lifecycle`): `config`,
`context`, `module`, `ddp_model`, `model`, `state`, `fingerprint`, `startup`, `log_prefix`,
`drain`, `pacing`, `step_pace` (this rank's own time per sample, stragglers.py), `current_step`,
`_skeleton` (the copy a sharded rebuild starts from), the accessors `global_step` and `epoch`, and
`_build_state()`. This module never imports elastic_run.py (an import-linter contract checks it).

Not guaranteed: a second peer lost while the group re-forms, or before a step is committed in
the re-formed group, is not absorbed: the error propagates and torchrun's restart takes over.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_ddp.runlog.metrics_causes import WATCHDOG_REASON
from elastic_ddp.runtime.distributed import agree_on_incarnation, keep_until_exit, remove_autograd_hooks
from elastic_ddp.snapshot.manager import SnapshotSession, open_snapshot_session
from elastic_ddp.snapshot.staging import StagingBuffers
from elastic_ddp.snapshot.training_state import TrainingState
from elastic_ddp.training.in_process import (
    InterruptibleDDP,
    InterruptibleFSDPCollectives,
    Regroup,
    lost_peer,
    what_broke,
)
from elastic_ddp.training.reporting import RunLog
from elastic_ddp.training.sharding import parameterless_copy, rebuilt
from elastic_ddp.training.stop_guard import GroupReformed, StopGuard
from elastic_ddp.training.stragglers import StragglerJudge
from elastic_ddp.workload.sampler import StepPlan

logger = logging.getLogger(__name__)

# How long a rank leaving a working group for a new round (a join) waits for the loss report in flight.
SWITCH_REPORT_WAIT = timedelta(seconds=1)


class CommittedStep(Protocol):
    """What counting a committed step reads of it (elastic_run.Step)."""

    plan: StepPlan
    loss_sum: torch.Tensor | None
    amp_skipped: bool
    epoch_ended: bool


class GroupLifecycle:
    """The group's lifecycle behind `ElasticRun` (module docstring): incarnations, re-forms, counting."""

    def _start_lifecycle(self, not_in_process: str | None) -> None:
        """Set up the lifecycle's own state; `not_in_process` says why this worker cannot re-form
        in process (None: it can, when the agent's rendezvous is ours)."""
        self.stop_guard: StopGuard | None = None  # keeps the last committed step,
        self.run_log: RunLog | None = None  # what this run reports, and
        self.snapshots: SnapshotSession | None = None  # its snapshots (all three set while entered)
        self.regroup = Regroup(self.context, timedelta(seconds=self.config.collective_timeout_s), not_in_process)
        self.fsdp_collectives = InterruptibleFSDPCollectives(self.regroup.alarm, self._absorbs_fsdps_lost_peer,
                                                             lambda: self._lost_peer is not None)
        self._started = 0.0  # time.monotonic() of entering the run
        self._incarnation_exits: contextlib.ExitStack | None = None  # the log, snapshots and watchdog of this group
        self._lost_peer: str | None = None  # why the group broke under the step in progress (in-process re-form)
        self._regrouped_at: int | None = None  # the committed step at the last in-process re-form
        self._silent_peer: str | None = None  # what the watchdog found, when it handed the re-form over
        self._warm_staging: StagingBuffers | None = None  # the last incarnation's, for the next (in process)
        self._peer_switched_after: int | None = None  # a peer left this group for the next round after it
        self.regroup.alarm.also_when(self._past_a_peers_switch)
        self._runtime_steps_optimizer = False  # inside the commit, or the run's own bookkeeping
        self._model_calls = 0  # of ddp_model, when plain DDP: what `Step.backward` checks

    def _build_state(self) -> TrainingState:
        """The training state of `module`, built as the run was asked to (the run in front builds it)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------- incarnations

    def _enter_incarnation(self, re_formed: ReFormed | None = None) -> None:
        """Agree on the incarnation, open its log and snapshots, start the watchdog, restore the
        newest state the group can read, wrap the model: once per process group. `re_formed`: a
        group re-formed in this process (in_process.py), whose ranks keep their own state when they
        all hold the same step."""
        incarnation = agree_on_incarnation(self.context)
        self.step_pace.reset()
        with contextlib.ExitStack() as exits:
            log, snapshots = exits.enter_context(self._incarnation(incarnation))
            exits.push(on_success(self._finish))
            guard = self.stop_guard = StopGuard(self.state, log, snapshots, self.context, self.drain,
                                                self.config.epochs, self.config.watchdog_timeout_s,
                                                self._re_form_without_silent_peer, self._peer_switched)
            judge = self._straggler_judge(log)
            exits.enter_context(guard.watching_peers(incarnation, pace=self.step_pace.pace,
                                                     on_paces=judge.read if judge is not None else None))
            log.started(in_process=re_formed is not None)
            snapshots.start()
            # With newcomers, every rank restores as after a restart (the collectives of a fresh worker's
            # entry): the survivors' kept step is the newest, served to the newcomers.
            # Sharded, the model was rebuilt for the new world: every rank restores its parts as after a restart.
            sharded = self.config.sharding == "fsdp"
            if re_formed is not None and not self.regroup.joined and not sharded \
                    and snapshots.resume_live(self.state, re_formed.committed_in):
                sampler = self.state.sampler
                log.resumed_live(self.global_step, sampler.epoch, sampler.samples_consumed, re_formed.world_size)
            else:
                # Newcomers, or a broken all-reduce let some ranks commit a step the others did not: each
                # rank keeps its own, as the group that committed it; the newest is served to the others.
                if re_formed is not None and not sharded:
                    snapshots.keep_in_memory(self.state, f"in-process re-form: {re_formed.reason}",
                                             committed_by=(re_formed.committed_in, re_formed.world_size))
                log.restored(snapshots.restore(self.state))
            self._wrap_model(restored=self.global_step > 0)
            exits.enter_context(guard.keeping_the_last_step())
            self._incarnation_exits = exits.pop_all()

    def _straggler_judge(self, log: RunLog) -> StragglerJudge | None:
        """Rank 0's judge of the ranks' paces for this group (stragglers.py); None elsewhere, or when off."""
        if self.context.rank != 0 or not self.config.straggler_threshold:
            return None
        return StragglerJudge(self.config.straggler_threshold, self.config.straggler_patience_s,
                              on_named=lambda report: log.straggler(report, named=True),
                              on_recovered=lambda report: log.straggler(report, named=False),
                              on_scores=log.rank_speeds)

    def _leave_incarnation(self, *exc_info: Any) -> bool:
        exits, self._incarnation_exits = self._incarnation_exits, None
        return exits.__exit__(*exc_info) if exits is not None else False

    @contextlib.contextmanager
    def _incarnation(self, incarnation: int) -> Iterator[tuple[RunLog, SnapshotSession]]:
        """The run log and snapshot session of one entry, closed whatever happens."""
        self.run_log = RunLog(self.config, self.context, incarnation, self.state.sampler.steps_per_epoch,
                              self.startup, self.log_prefix)
        try:
            self.snapshots = open_snapshot_session(self.config, self.context, self.run_log.events, self.fingerprint,
                                                   incarnation, self._warm_staging)
            re_forming = False
            try:
                yield self.run_log, self.snapshots
            except GroupReformed:
                re_forming = True  # the next incarnation snapshots at once: an older write in flight stops
                raise
            finally:
                self.snapshots.close(superseded=re_forming)
                self._warm_staging = self.snapshots.staging_to_reuse()
        finally:
            self.run_log.close()

    def _finish(self) -> None:
        if self.epoch < self.config.epochs:  # the loop left early: keep its place durably, as a drain does
            logger.info("the loop left the run at step %d, before its end; saving that step", self.global_step)
            with self._runtime_owns_optimizer():
                self.snapshots.save(self.state, final=True)
        self.wait_until_counted()
        self.snapshots.finish()
        self.run_log.finished(self.global_step, time.monotonic() - self._started)
        self.snapshots.forget_memory_copies()

    def _wrap_model(self, restored: bool) -> None:
        if self.regroup.enabled and self.config.sharding == "fsdp":  # FSDP2 sharded it; its collectives give way
            try:
                self.fsdp_collectives.install(self.module)
                logger.info("FSDP2's all-gathers and reduce-scatters give way to an in-process re-form")
            except ValueError as exc:
                logger.info("a lost node restarts this worker (no in-process re-form): FSDP2 refused a custom "
                            "collective (%s)", exc)
                self.regroup.stop()
        if self.context.in_process_group and self.config.sharding == "none":  # FSDP2 sharded it in place_model
            device_ids = [self.context.device.index] if self.context.device.type == "cuda" else None
            # Restored, every rank holds the agreed state: DDP's broadcast is redundant (1.4 s per GB).
            settings = {"device_ids": device_ids, "init_sync": not restored}
            if self.regroup.enabled:  # its collectives must give way when a peer is lost or the agent re-forms
                self.ddp_model = InterruptibleDDP(self.module, self.regroup.alarm, self._absorbs_ddps_lost_peer,
                                                **settings)
                self.regroup.comm_hook.install(self.ddp_model)
            else:
                self.ddp_model = DistributedDataParallel(self.module, **settings)
            keep_until_exit(self.ddp_model)  # freeing it while Python runs can deadlock in gloo
            if not self.config.compile:
                self.ddp_model.register_forward_pre_hook(self._count_model_call)
        # Compiled around DDP (torch's DDPOptimizer splits the graph at its buckets) or FSDP2's
        # module; the model itself stays uncompiled, so its state dict keeps its own names.
        self.model = torch.compile(self.ddp_model) if self.config.compile else self.ddp_model

    # ------------------------------------------------------------------------------- re-forms and counting

    def _step_boundary(self) -> None:
        """Between two committed steps, on every rank (the drain's collective must line up): the
        drain vote, the pacing, and whether the group leaves for the agent's next round (a join,
        or a loss elsewhere), which marks it for `_re_form_in_process`."""
        with self._owned_collective("the drain vote"):
            self.stop_guard.drain_if_agreed()
        if self.pacing is not None and self._lost_peer is None:
            self.pacing.wait()
        if self._lost_peer is None and (self.regroup.replaced() or self._peer_switched_after is not None):
            # Every rank leaves after this step, also one whose agent has not taken the round yet,
            # told by the first that left (`_peer_switched`).
            self.run_log.training_interrupted(wait_at_most=SWITCH_REPORT_WAIT)
            self._lost_peer = f"the agent took a new round in process after step {self.global_step}"
            logger.info("%s; re-forming the group", self._lost_peer)

    @contextlib.contextmanager
    def _owned_collective(self, what: str) -> Iterator[None]:
        """Around a call of the run's own that holds a collective: a peer lost there (gloo says so
        at once) marks the group broken, for the iterator to re-form it in process (in_process.py),
        when this worker can. Anything else propagates, as does a loss right after a re-form with
        no step committed since (a second loss during the re-form: torchrun's restart takes over)."""
        try:
            with self.step_pace.waiting():  # not this rank's own work: a straggler's peers wait here
                yield
        except RuntimeError as exc:
            if not self._absorbs_lost_peer(what, exc):
                raise

    def _absorbs_lost_peer(self, what: str, exc: RuntimeError) -> bool:
        """Whether `exc`, raised by `what`, marks the group broken under the step in progress (the
        first such error names it): a lost peer, this worker re-forms in process, a step is in
        progress, and a step was committed since the last re-form."""
        if (not (self.regroup.enabled and lost_peer(exc)) or self._regrouped_at == self.global_step
                or self.current_step is None):
            return False
        if self._lost_peer is None:
            self._lost_peer = f"{what}: {what_broke(exc)}"
            logger.warning("a peer is lost (%s); re-forming the group in process", self._lost_peer)
        return True

    def _re_form_without_silent_peer(self, reason: str) -> bool:
        """From the watchdog's thread, which found a peer silent: whether this worker re-forms without
        it in process (the agent is asked for the round), under `_absorbs_lost_peer`'s rules and
        only while one of the run's collectives waits through the alarm, which then ends it: a
        training thread blocked in any other collective could not come out to re-form."""
        if (not self.regroup.enabled or self.current_step is None or self._regrouped_at == self.global_step
                or not self.regroup.alarm.waiting()):
            return False
        try:
            self.regroup.ask_for_round(f"peer watchdog: {reason}")
        except OSError as exc:
            logger.warning("could not ask this node's agent for a round without the silent peer (%s)", exc)
            return False
        logger.warning("peer watchdog: %s; re-forming the group in process", reason)
        self._silent_peer = reason
        return True

    def _peer_switched(self, step: int) -> None:
        """From the watchdog's thread: a peer left this group for the agent's next round after the
        committed step `step` (its agent took the round first). This rank leaves at that step's
        boundary too, and a collective of a later step that waits (begun before this was known)
        is failed by the alarm (`_past_a_peers_switch`): that peer takes part in none."""
        if self.regroup.enabled and (self._peer_switched_after is None or step < self._peer_switched_after):
            self._peer_switched_after = step

    def _past_a_peers_switch(self) -> bool:
        """(The alarm's thread.) Whether the step in progress comes after the one a peer left after."""
        left_after, step = self._peer_switched_after, self.current_step
        return left_after is not None and step is not None and step.number > left_after

    def _absorbs_fsdps_lost_peer(self, what: str, exc: RuntimeError) -> bool:
        if self.current_step is None:  # (outside a step: an evaluation) never absorbed
            return False
        return self._absorbs_lost_peer(f"step {self.current_step.number}'s {what}", exc)

    def _absorbs_ddps_lost_peer(self, exc: RuntimeError) -> bool:
        if self.current_step is None:  # (a forward outside a step: an evaluation) never absorbed
            return False
        return self._absorbs_lost_peer(f"step {self.current_step.number}'s forward (DDP's own collectives)", exc)

    def _re_form_in_process(self) -> None:
        """The group broke under the step in progress, or the agent took a new round at this step
        boundary (a join): stop the watchdog, leave the group, join the round the agent runs for
        its workers, close this group's incarnation, open the next on the new group (each rank
        keeps its own state when all hold the same step and nobody is new; else they restore as
        after a restart) and go on from the last committed step. RejoinRefused when the agent falls
        back to torchrun's restart."""
        reason, self._lost_peer = self._lost_peer, None
        self.current_step = None
        self.run_log.training_interrupted()
        self.stop_guard.stop_watching(switched_after=self.global_step)  # the re-form has its own deadline
        sharded = self.config.sharding == "fsdp"
        silent_peer, self._silent_peer = self._silent_peer, None
        # A keep also reports the step whose exchange ended meanwhile (sharded) and writes every rank's
        # audit share of the last counted step: a lost rank that committed it never wrote its line.
        if silent_peer is not None:  # kept as the watchdog's way out keeps it, and said so (the restart's cause)
            self.stop_guard.keep(f"{WATCHDOG_REASON}: {silent_peer}", after_silence=True)
        elif sharded:  # each rank's parts (its own, its partner's copy) to its node's memory, for the restore
            self.stop_guard.keep(f"in-process re-form: {reason}")
        else:
            # Nothing is kept here: the survivors usually hold the same step and keep their own state
            # (at large states a keep costs seconds); a re-form that needs copies keeps them in the
            # new incarnation, and a fallback keeps the step on its way out (`__exit__`).
            self.run_log.record_every_ranks_share()
        self.drain.forget_vote()
        self.state.optimizer.zero_grad(set_to_none=True)
        self._unhook_the_broken_wrapper()
        committed_in = None if sharded else self.snapshots.committed_in(self.global_step)  # (a part says its own)
        re_formed = ReFormed(reason, committed_in, self.context.world_size)
        # RejoinRefused propagates with this incarnation still open: on its way out it keeps the last
        # committed step in node memory (already there), which torchrun's restart then restores.
        context = self.regroup.rejoin(reason, lambda: self.drain.requested)
        self._peer_switched_after = None  # (the old group's watchdog reports no more: `stop_watching`)
        self._leave_incarnation(GroupReformed, GroupReformed(reason), None)  # closes its log and snapshots
        self.context = context
        if self.log_prefix is not None:
            self.log_prefix.rank, self.log_prefix.world_size = context.rank, context.world_size
        if sharded:
            self._rebuild_sharded()
        self._enter_incarnation(re_formed)
        self._regrouped_at = self.global_step

    def _rebuild_sharded(self) -> None:
        """The model sharded again over the new group, from the copy taken before it was first
        sharded, and its optimizer, schedule and scaler built anew as at the start (factories
        called again; the extra state's objects carried over): the restore that follows loads all
        of it. The old model and optimizer are let go (their group is kept: `Regroup.rejoin`)."""
        self.module = rebuilt(self._skeleton, self.config.shard_blocks, self.context.device)
        self.ddp_model = self.model = self.module
        self.state = self._build_state()

    def _unhook_the_broken_wrapper(self) -> None:
        """Take the DDP of the broken group off the module: its gradient hooks go (its reducer may
        still expect the abandoned backward). The wrapper itself stays referenced until exit
        (`keep_until_exit`): freeing it frees the broken group, whose destructor waits for the
        collectives still in its threads (seen: until their timeout)."""
        if isinstance(self.ddp_model, DistributedDataParallel):
            remove_autograd_hooks(self.ddp_model)
        self.ddp_model = self.model = self.module

    def _after_commit(self, step: CommittedStep) -> None:
        """Each component decides for itself what a committed step means to it, in this order on
        every rank (their collectives must line up)."""
        with self._owned_collective(f"the run's work after step {self.global_step}"):
            self._count_the_commit(step)

    def _count_the_commit(self, step: CommittedStep) -> None:
        number, plan = self.global_step, step.plan
        self.run_log.step_committed(plan, number, step.loss_sum, self.state.scheduler.get_last_lr()[0])
        if step.amp_skipped:
            self.run_log.amp_step_skipped(number, self.state.grad_scaler.scaler.get_scale())
        if step.epoch_ended:
            self.run_log.epoch_ended(plan.epoch, number)
        self._report_counted()  # under sharding, the step before (its parts are on two nodes now)
        with self._runtime_owns_optimizer():  # a sharded save may step a stateless optimizer to build its state
            self.snapshots.save(self.state, epoch_ended=step.epoch_ended)
        self._report_counted()  # a step saved durably counted first

    def wait_until_counted(self) -> None:
        """Wait until the last committed step counts, and report it (its `step` event, its audit
        line). Under `--sharding fsdp` with memory copies a step counts once its parts are on two
        nodes, which the next step's commit waits for; call this before the loop pauses for long
        between steps (the chaos harness's hold does), so that the step is reported meanwhile. A
        drain and the end of training do it themselves. Raises PartExchangeError when the exchange
        failed."""
        self.snapshots.wait_until_counted()
        self._report_counted()

    def _report_counted(self) -> None:
        self.run_log.steps_counted(self.snapshots.counted_step(self.state))

    # ------------------------------------------------------------------------------- the runtime's own optimizer steps and model calls

    @contextlib.contextmanager
    def _runtime_owns_optimizer(self) -> Iterator[None]:
        self._runtime_steps_optimizer = True
        try:
            yield
        finally:
            self._runtime_steps_optimizer = False

    def _count_model_call(self, *_: Any) -> None:
        self._model_calls += 1


def sharded_skeleton(model: nn.Module, scheduler: object) -> tuple[nn.Module | None, str | None]:
    """What `_rebuild_sharded` builds from (`sharding.parameterless_copy` of `model`, before it is
    sharded), or why the run cannot re-form in process under fsdp."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return None, "--sharding fsdp with a scheduler built outside the run (pass a factory of the optimizer)"
    try:
        return parameterless_copy(model), None
    except Exception as exc:  # noqa: BLE001 - whatever deepcopy raises for this model: the restart path then
        return None, f"--sharding fsdp with a model that cannot be copied ({type(exc).__name__}: {exc})"


@dataclass(frozen=True)
class ReFormed:
    """What the incarnation after an in-process re-form needs of the one before."""

    reason: str  # why the group broke
    committed_in: int | None  # the incarnation that committed the state the survivors hold (None under fsdp)
    world_size: int  # of the group that broke


def on_success(action: Callable[[], None]) -> Callable[..., bool]:
    """An ExitStack exit callback that runs `action` only when the block ended without an exception."""
    def exit_callback(exc_type: type[BaseException] | None, *_: Any) -> bool:
        if exc_type is None:
            action()
        return False
    return exit_callback
