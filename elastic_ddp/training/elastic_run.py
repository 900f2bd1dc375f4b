"""Your own training loop, with every promise of elastic_ddp: `ElasticRun` and its steps.

    run = ElasticRun(model, train_set, config, optimizer=optimizer, extra_state={"ema": ema})
    with run:                                   # restores the newest state the group can read
        for step in run.steps():                # this rank's share of every step left, in any world
            for inputs, targets in step.micro_batches():
                with run.autocast():            # --use_amp / --amp_dtype (does nothing without)
                    losses = my_loss(run.model(inputs), targets)   # one loss per sample
                step.backward(losses)           # scaled: the gradient is the global batch's mean
                                                # (weights=: its weighted mean, e.g. by target tokens)
            step.clip_grad_norm_(1.0)           # optional: unscaled first, as AMP needs
            with step.committing():             # the optimizer has stepped; the step counts on exit
                ema.update(run.module)          # your state that changes with the step

`step.commit()` is `committing()` with nothing inside. The Trainer (trainer.py) is a loop written
this way. docs/your-own-loop.md gives each rule of the contract with its reason; in short:

- Call `run.model` (DDP, or FSDP2's module, compiled with `--compile`), not your own module: the
  gradients are synchronised in its backward. `run.module` is your model (placed, perhaps sharded).
- Read every micro-batch (an empty one too: a rank whose share of a step is empty must still take
  part in the gradients' all-reduce) and call `step.backward` once for each, inside the loop body:
  all but the last micro-batch run under DDP's `no_sync`, entered by the iterator.
- `step.backward` takes one loss per sample (reduction="none"): the run scales it so that the
  averaged gradient is the mean over the *global* batch whatever the world size; a mean-reduced
  loss would make the maths depend on how the batch was split. `weights=` (one per sample, e.g.
  its target tokens) makes it the weighted mean: sample_weights.py; give them in every backward
  of the run on every rank, or in none.
- The dataset is map-style (a stream is refused: exactly once needs samples by index); a batch
  is `collate_fn`'s of the micro-batch's samples (default_collate's without), of any structure,
  moved to the device tensor by tensor (workload/collate.py, which also has the empty batch's rule).
- The run steps the optimizer (through the grad scaler), the scheduler it was given (or its own
  warm-up plus cosine), the data position and the step count, all in the commit, which is all or
  nothing: a failure before the commit ends leaves the previous step as the last committed one.
  An `optimizer.step()` of the loop's own is refused where it is called (`LoopContractError`).
- `extra_state` objects (`state_dict`/`load_state_dict`) are saved and restored with the step;
  change them inside `committing()` so that a kept step never holds them half a step ahead. Under
  `--sharding fsdp` they are saved by rank 0 alone, so they must be the same on every rank.
- Per-sample randomness goes through `sample_transform(sample, generator)` (seeded from the
  sample), never the global RNG: that is what makes the data the same in any world.

What the run does for the loop: exactly once over the data at any world size, snapshots on the
overhead budget, the memory copy of the last committed step kept whenever training stops early
(stop_guard.py), the peer watchdog, drain on SIGTERM (`DrainRequested` out of `steps()` at a step
boundary, after a final durable snapshot), events, the report and live metrics. Leaving the `with`
block early without an exception (a `break`) makes the last committed step durable, as a drain does.
With our rendezvous, a lost node's survivors keep their processes (in_process.py): the step in
progress is abandoned (a forward whose DDP collectives broke runs on the module alone; backward,
clipping and commit do nothing; no further micro-batch is read; `run.group_broken` is True) and
redone in the re-formed group, whose rank and world size the run's accessors then give. A joining
node is let in at a step boundary the same way, without abandoning a step. Under `--sharding fsdp`
the re-form shards the model again over the new group: `module`, `model`, `optimizer` and
`scheduler` are new objects afterwards (factories called again), so read them from the run.

Not guaranteed: one optimizer (a second one of the loop's own is neither stepped nor checked, but
its state may travel in `extra_state`); a loop that changes the model or the optimizer's
parameter groups between steps, or computes its loss outside `run.model`, breaks the maths in
ways the run cannot see (the module call is checked only for plain DDP without `--compile`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runlog.worker_logging import RankPrefix, installed_rank_prefix
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.runtime.drain import DrainSignal
from elastic_ddp.snapshot.training_state import Stateful, TrainingState, run_fingerprint
from elastic_ddp.training.group_lifecycle import GroupLifecycle, on_success, sharded_skeleton
from elastic_ddp.training.sample_weights import StepWeights, divide_gradients
from elastic_ddp.training.sharding import ShardingError, place_model
from elastic_ddp.training.state_builder import autocast_dtype, build_optimizer, build_training_state
from elastic_ddp.training.step_hooks import MinimumStepTime
from elastic_ddp.training.stragglers import StepPace
from elastic_ddp.workload.collate import Collate, to_device
from elastic_ddp.workload.data import EpochSampleView, SampleTransform, check_map_style, plan_loader
from elastic_ddp.workload.losses import check_per_sample
from elastic_ddp.workload.sampler import StepPlan

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class LoopContractError(RuntimeError):
    """The loop broke a rule of `ElasticRun`'s contract; raised where it did (module docstring)."""


class ElasticRun(GroupLifecycle):
    """One worker group's part of an elastic run of a loop of the user's own (module docstring).

    Build it inside an initialised process group (or none, for one process), enter it once with
    `with`, iterate `steps()` inside. `optimizer` and `scheduler` may be factories, called with the
    model once placed (sharded under `--sharding fsdp`, where only a factory can be given) and with
    the optimizer; without them the run builds `--optimizer` and its warm-up plus cosine schedule.
    `dataset` is map-style (a stream is refused here, TypeError); `collate_fn` makes each
    micro-batch of its samples, in the DataLoader's workers (default: torch's default_collate).
    Accessors: `model` (call it), `module` (your model),
    `optimizer`, `scheduler`, `global_step` (committed steps), `epoch`, `rank`, `world_size` (the current
    group's: a lost node's survivors re-form it in process, in_process.py), `group_broken`.
    """

    def __init__(self, model: nn.Module, dataset: Dataset, config: TrainingConfig, *,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | SchedulerFactory | None = None,
                 extra_state: dict[str, Stateful] | None = None,
                 sample_transform: SampleTransform | None = None,
                 collate_fn: Collate | None = None,
                 context: DistributedContext | None = None,
                 log_prefix: RankPrefix | None = None,
                 startup: StartupTimeline | None = None):
        check_extra_state(extra_state)
        check_map_style(dataset, "ElasticRun(dataset=...): got")
        if isinstance(optimizer, torch.optim.Optimizer) and config.sharding == "fsdp":
            raise ShardingError("--sharding fsdp: got an optimizer built before the model was sharded; expected none "
                                "(the run builds --optimizer over the sharded parameters) or a factory, "
                                "optimizer=lambda model: AdamW(model.parameters(), ...)")
        self.config = config
        self.context = context or DistributedContext.from_env(config.device, config.dist_backend)
        # Under fsdp a re-form in process shards the model again, over the new group (`_rebuild_sharded`).
        self._skeleton, not_in_process = None, None
        if config.sharding == "fsdp":
            self._skeleton, not_in_process = sharded_skeleton(model, scheduler)
        self.module = place_model(model, config.sharding, config.shard_blocks, self.context.device)
        self.ddp_model: nn.Module = self.module  # DDP once entered (FSDP2 sharded the module in place)
        self.model: nn.Module = self.module  # what a step calls: ddp_model, compiled with --compile
        self._dataset_size = len(dataset)
        self._given = (optimizer, scheduler, extra_state)
        self.state = self._build_state()
        self.fingerprint = run_fingerprint(self.module, len(dataset), config.global_batch_size, config.seed,
                                           config.drop_last)
        self.samples = EpochSampleView(dataset, config.seed, sample_transform, collate_fn)
        # Made now, so that a collate that cannot make one fails before training, not at the first
        # step whose share on this rank is empty (a join, the short last step of an epoch).
        self._empty_batch = self.samples.empty_batch()
        self.autocast_dtype = autocast_dtype(config, self.context.device)
        self.startup = startup or StartupTimeline()
        self.log_prefix = log_prefix or installed_rank_prefix()  # its step number follows the commits
        self.drain = DrainSignal(self.context.collective_device)
        self.pacing = MinimumStepTime(config.min_step_time_s) if config.min_step_time_s else None
        self.current_step: Step | None = None
        self._exits: contextlib.ExitStack | None = None
        self._entered = False
        self._weighs_samples: bool | None = None  # whether step.backward is given weights (the first call says)
        self._batches: Iterator[Any] | None = None  # the loader of the epoch in progress
        self.step_pace = StepPace()  # this rank's own time per sample, for the straggler judge
        self._start_lifecycle(not_in_process)

    def _build_state(self) -> TrainingState:
        """The training state of `module` (placed, under fsdp sharded) with the optimizer, scheduler
        and extra state the run was given (factories called now), the defaults for the rest."""
        optimizer, scheduler, extra_state = self._given
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(self.module)  # over the placed (under fsdp: sharded) parameters
        if callable(scheduler) and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            scheduler = scheduler(optimizer or build_optimizer(self.config, self.module.parameters()))
        state = build_training_state(self.module, self._dataset_size, self.config, self.context.device, optimizer,
                                     scheduler, extra_state)
        state.optimizer.register_step_pre_hook(self._refuse_the_loops_optimizer_step)
        return state

    # ------------------------------------------------------------------------------- accessors

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.state.scheduler

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def epoch(self) -> int:
        return self.state.sampler.epoch

    @property
    def group_broken(self) -> bool:
        """A peer was lost during the step in progress: the run re-forms the group when the next
        step is asked for. Until then no collective of the loop's own can succeed: skip them."""
        return self._lost_peer is not None

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def autocast(self) -> torch.autocast:
        """Autocast for the forward pass as `--use_amp`/`--amp_dtype` say (disabled without AMP)."""
        return torch.autocast(self.context.device.type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype is not None)

    # ------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> Self:
        """Join the run: agree on the incarnation, open its log and snapshots, start the watchdog,
        restore the newest state the group can read, wrap the model."""
        if self._entered:
            raise LoopContractError("ElasticRun: entered a second time; a run is entered once (build a new one to "
                                    "train again: it restores where this one stopped)")
        self._entered = True
        self._started = time.monotonic()
        with contextlib.ExitStack() as exits:
            # A SIGTERM that came too late to drain is raised again once everything is closed.
            exits.push(on_success(self.drain.redeliver_unused))
            exits.callback(self.regroup.stop)
            # SIGTERM is caught from the first step until the incarnation is closed, its last step
            # kept included: torchrun sends it to a node's workers as soon as one fails or its
            # agent gives an in-process round up, and caught only until the exits began, it ended
            # the process in the middle of that keep (seen in CI: a worker vanished without a line
            # and its step was lost). Before the first step it ends the process as usual: there is
            # nothing to keep, and a worker stuck in its restore must end at once.
            exits.enter_context(self.drain.sigterm_handler_restored())
            exits.push(self._leave_incarnation)  # whichever group the run is in by then
            self.regroup.start()
            self.drain.guard_vote = self.regroup.alarm.guard if self.regroup.enabled else None
            self._enter_incarnation()
            self.drain.catch_sigterm()
            exits.push(on_success(self.drain.finish))
            self._exits = exits.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> bool:
        """Whatever exception leaves the block, the last committed step is kept in node memory
        first (then it propagates); without one, the last step's snapshot is waited for."""
        exits, self._exits = self._exits, None
        self.current_step = None
        self._stop_loader()
        if exc_info[0] is not None:  # first: the agent must not run a round in process for a worker on its way out
            self.regroup.stop()
        return exits.__exit__(*exc_info)

    # ------------------------------------------------------------------------------- steps

    def steps(self) -> Iterator[Step]:
        """This rank's share of every step left in the run, in order; between two steps (at the
        boundary) a drain agreed by the group raises `DrainRequested`. Each step must be committed
        before the next is asked for."""
        if self._exits is None:
            raise LoopContractError("ElasticRun.steps(): called outside `with run:`; enter the run first "
                                    "(entering restores the newest state)")
        if self.epoch >= self.config.epochs:
            logger.info("training already complete (%d epochs, step %d)", self.config.epochs, self.global_step)
        while self.epoch < self.config.epochs:
            yield from self._epoch_remainder()

    def _epoch_remainder(self) -> Iterator[Step]:
        ctx, sampler = self.context, self.state.sampler
        plans = sampler.plan_epoch_remainder(ctx.rank, ctx.world_size, self.config.micro_batch_size)
        # A committed state never holds a finished epoch (the rollover is part of the commit), so
        # there is always a step to plan; without one this loop would never end.
        assert plans, f"epoch {sampler.epoch} has no step left at sample {sampler.samples_consumed}"
        batches = self._batches = iter(plan_loader(self.samples, sampler.epoch, plans, self.config.num_workers,
                                                   pin_memory=ctx.device.type == "cuda"))
        self.ddp_model.train()
        self.run_log.epoch_started(sampler.epoch, steps_done=sampler.steps_per_epoch - len(plans))
        try:
            for plan in plans:
                step = self.current_step = Step(self, plan, batches)
                yield step
                if self._lost_peer is None and not step.committed:
                    raise LoopContractError(f"step {step.number} was not committed before the next one was asked "
                                            "for; end every step with step.commit() (or `with step.committing():`)")
                if self._lost_peer is None:
                    self._step_boundary()  # may mark the group for a re-form: a join, or a loss elsewhere
                if self._lost_peer is not None:
                    self._re_form_in_process()
                    return  # `steps()` plans the rest of the epoch for the new world
        except BaseException:
            self.run_log.training_interrupted()
            raise

    # ------------------------------------------------------------------------------- the contract's checks

    def _refuse_the_loops_optimizer_step(self, *_: Any) -> None:
        if self.current_step is not None and not self._runtime_steps_optimizer:
            raise LoopContractError(f"optimizer.step() called by the loop during step {self.current_step.number}; "
                                    "the run steps the optimizer (through the grad scaler) in step.commit(), once "
                                    "per step: remove this call")

    def _device_batch(self, indices: list[int], batches: Iterator[Any]) -> Any:
        """The loader's next batch on this rank's device; for no `indices`, the empty batch
        (collate.empty_batch: the loader holds only the non-empty micro-batches)."""
        batch = next(batches) if indices else self._empty_batch
        return to_device(batch, self.context.device, non_blocking=self.context.device.type == "cuda")

    def _stop_loader(self) -> None:
        """End the loader's worker processes now: they ignore SIGTERM (the run drains), so left to
        the garbage collector after an exception (its traceback keeps them), they would hold up
        the interpreter's exit, whose multiprocessing clean-up terminates them with SIGTERM."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)  # (torch's iterator with worker processes)
        if shutdown is not None:
            shutdown()

    def _check_weighing(self, weighted: bool, step_number: int) -> None:
        """The run's first step.backward says whether its samples are weighted; the others must agree."""
        if self._weighs_samples is None:
            self._weighs_samples = weighted
        elif self._weighs_samples != weighted:
            raise LoopContractError(
                f"step.backward(): called {'with' if weighted else 'without'} weights in step {step_number}, "
                f"{'without' if weighted else 'with'} them before; give weights in every backward of the run on "
                "every rank (an empty micro-batch's are an empty tensor), or in none")


class Step:
    """One optimizer step of this rank: read its micro-batches, `backward` each, commit once.

    `number` is the global step it becomes when committed (1-based), `epoch` the epoch it is in,
    `samples` this rank's share, `global_samples` the whole step's over every rank.
    """

    def __init__(self, run: ElasticRun, plan: StepPlan, batches: Iterator[Any]):
        self.run = run
        self.plan = plan
        self.batches = batches
        self.number = run.global_step + 1
        self.epoch = plan.epoch
        self.samples = len(plan.rank_samples)
        self.global_samples = plan.global_samples
        self.committed = False
        self.epoch_ended = False  # whether the commit ended the epoch
        self.amp_skipped = False  # whether the grad scaler skipped the optimizer's update (fp16)
        self.loss_sum: torch.Tensor | None = None  # of this rank's samples, for the report
        self._read = 0
        self._backwards = 0
        self._calls_at_read = 0
        # DDP averages gradients over ranks: seeding each sample's gradient with this makes the
        # result the global batch's mean (the numbers of `scaler.scale(sum * scale)`, 2 nodes fewer).
        self._loss_scale = run.world_size / plan.global_samples
        run.step_pace.step_started(self.samples)
        self._weights: StepWeights | None = None  # with step.backward(weights=...)

    def micro_batches(self) -> Iterator[Any]:
        """This rank's micro-batches of the step, on its device, each collated as the dataset's
        samples are; all but the last are handed out under DDP's `no_sync`, so call
        `backward` inside the loop body."""
        if self._read:
            raise LoopContractError(f"step.micro_batches(): called again for step {self.number}; read them once")
        run = self.run
        last = len(self.plan.micro_batches) - 1
        for index, indices in enumerate(self.plan.micro_batches):
            if run._lost_peer is not None:
                return  # the step is abandoned: its other micro-batches are not read
            batch = run._device_batch(indices, self.batches)
            self._read += 1
            self._calls_at_read = run._model_calls
            synchronising = index == last or run.ddp_model is run.module
            with contextlib.nullcontext() if synchronising else run.ddp_model.no_sync():
                yield batch
                if self._backwards != self._read:
                    raise LoopContractError(
                        f"step {self.number}: micro-batch {index + 1} of {last + 1} was read but step.backward() "
                        "was not called for it inside the loop body; call it once per micro-batch (an empty "
                        "one too: every rank takes part in the gradients' all-reduce)")

    def backward(self, losses: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Backward of the last micro-batch read, from one loss per sample (reduction="none"),
        scaled so that the step's averaged gradient is the global batch's mean (and by the grad
        scaler under fp16). `weights` (one non-negative finite weight per sample, such as its
        number of target tokens): the weighted mean sum(w_i * loss_i) / sum(w_i) over the global
        batch instead, exactly, in any world (sample_weights.py). Give weights in every backward
        of the run on every rank, or in none (LoopContractError)."""
        if self._backwards >= self._read:
            raise LoopContractError(f"step.backward(): called {'twice for one' if self._read else 'before any'} "
                                    f"micro-batch of step {self.number}; call it once for each micro-batch read")
        check_per_sample(losses, len(self.plan.micro_batches[self._read - 1]), "step.backward")
        run = self.run
        run._check_weighing(weights is not None, self.number)
        if isinstance(run.model, DistributedDataParallel) and run._model_calls == self._calls_at_read:
            raise LoopContractError("step.backward(): the loss was not computed through run.model (DDP); calling "
                                    "your own module skips the gradients' all-reduce and the ranks drift apart")
        if weights is not None:
            if self._weights is None:
                self._weights = StepWeights(self.number, self.plan.global_samples)
            weights = self._weights.add(weights, losses)  # its shape checked; float32, on the losses' device
        if run._lost_peer is not None:  # abandoned (its forward ran on the module alone): nothing to reduce
            self._backwards += 1
            return
        losses = losses.float()
        seeds = torch.full_like(losses, self._loss_scale) if weights is None else weights * self._loss_scale
        scaler = run.state.grad_scaler.scaler
        with run._owned_collective(f"step {self.number}'s gradient all-reduce"):
            torch.autograd.backward(losses, scaler.scale(seeds))
        self._backwards += 1
        summed = (losses.detach() if weights is None else losses.detach() * weights).sum()
        self.loss_sum = summed if self.loss_sum is None else self.loss_sum + summed

    def _weigh_gradients(self) -> None:
        """Once per weighted step, before its gradient is first read (clipping, the commit): the
        ranks agree on the weight sum W and divide the gradients (sample_weights.py); the loss
        reported becomes the weighted mean. A lost peer here abandons the step."""
        if self._weights is None or self._weights.divisor is not None:
            return
        run = self.run
        with run._owned_collective(f"step {self.number}'s weight sum"):
            divisor = self._weights.agree(run.context)
            divide_gradients(run.module, divisor)
            if self.loss_sum is not None:  # the report divides by the samples: sum(w * loss) / W that way
                self.loss_sum = self.loss_sum / divisor

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of every parameter to `max_norm` (their total norm, returned):
        unscaled first (the grad scaler then steps without unscaling again, and still skips a step
        whose gradients are not finite). The same norm on every rank: each holds the all-reduced
        gradient (DDP) or its shard of it (FSDP2 reduces the norm over the shards)."""
        if not (max_norm > 0 and max_norm < float("inf")):
            raise ValueError(f"step.clip_grad_norm_: got max_norm={max_norm}; expected a positive finite number")
        if self.run._lost_peer is not None:
            return torch.zeros((), device=self.run.context.device)  # an abandoned step: nothing to clip
        self._check_all_read("step.clip_grad_norm_()")
        self._weigh_gradients()
        run = self.run
        if run._lost_peer is not None:  # lost in the weight sum's all-reduce: the step is abandoned
            return torch.zeros((), device=run.context.device)
        state = run.state
        state.grad_scaler.scaler.unscale_(state.optimizer)
        with run._owned_collective(f"step {self.number}'s gradient norm"):  # (sharded: an all-reduce of the norms)
            return torch.nn.utils.clip_grad_norm_(run.module.parameters(), max_norm)
        return torch.zeros((), device=run.context.device)  # a lost peer there: the step is abandoned

    def commit(self) -> None:
        """Apply the step whole (see `committing`)."""
        with self.committing():
            pass

    @contextlib.contextmanager
    def committing(self) -> Iterator[None]:
        """The commit point: on entry the optimizer has stepped (through the grad scaler), the
        gradients are zeroed and the scheduler stepped; the block may update `extra_state`; on exit
        the data position (rolled into the next epoch when this step ends one) and the step count
        move, and the step is committed: reported, and snapshotted when the schedule says so.

        An exception out of the block leaves the state half changed and marked so: it is never
        kept, and the restart takes the previous step from the other ranks or the snapshots.

        A step abandoned because a peer was lost (in_process.py) changes nothing here: the block
        runs, and `extra_state` is put back as it was; the step is redone in the re-formed group."""
        if self.run._lost_peer is None:
            self._check_all_read("step.commit()")
            if self.committed:
                raise LoopContractError(f"step.commit(): step {self.number} is already committed")
            self._weigh_gradients()
        if self.run._lost_peer is not None:  # (perhaps lost in the weight sum's all-reduce)
            yield from self._abandoned_commit()
            return
        run, state = self.run, self.run.state
        with state.updating():
            with run._runtime_owns_optimizer():
                self.amp_skipped = state.grad_scaler.step(state.optimizer)
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            yield
            state.sampler.advance(self.plan.global_samples)
            self.epoch_ended = state.sampler.epoch_finished
            if self.epoch_ended:
                state.sampler.start_next_epoch()
            state.progress.global_step += 1
        self.committed = True
        run._after_commit(self)

    def _abandoned_commit(self) -> Iterator[None]:
        extra = self.run.state.extra_state
        before = copy.deepcopy(extra.state_dict()) if extra else None
        yield
        if before is not None:
            extra.load_state_dict(before)

    def _check_all_read(self, what: str) -> None:
        total = len(self.plan.micro_batches)
        if self._read < total or self._backwards < self._read:
            raise LoopContractError(f"{what}: step {self.number} has {total} micro-batch(es); {self._read} were read "
                                    f"and {self._backwards} went through step.backward(); every one must, first")



def check_extra_state(extra_state: Any) -> None:
    """Raise TypeError (ValueError for an empty name) naming `extra_state` unless it maps names to objects that save and load
    themselves (`state_dict` and `load_state_dict`)."""
    if extra_state is None:
        return
    if not isinstance(extra_state, dict):
        raise TypeError(f"extra_state: got a {type(extra_state).__name__}; expected a dict of name -> object "
                         "with state_dict() and load_state_dict()")
    for name, obj in extra_state.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"extra_state: got the key {name!r}; expected non-empty strings")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"extra_state[{name!r}]: got a {type(obj).__name__}, which has no state_dict() and "
                             "load_state_dict(); expected a Stateful (wrap plain values in an object that has both)")


