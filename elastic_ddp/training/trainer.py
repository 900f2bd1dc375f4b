"""The training loop: restore, train with DDP over whatever world torchrun gave us, snapshot.

Usable as a library with your own objects:

    trainer = Trainer(model=my_model, dataset=my_dataset, optimizer=my_optimizer, config=config)
    trainer.fit()

Contracts:
- `dataset` is map-style and returns (input, target) samples that the default collate can batch;
  so is `eval_dataset` (optional): held-out data evaluated every `--eval_every_steps` steps and at
  each epoch end on every rank, reported by rank 0 (elastic_ddp/training/evaluation.py). Evaluation draws no
  random number and moves no data cursor: the training trajectory is the same without it.
- `loss_fn(outputs, targets)` returns one loss per sample (reduction="none", checked); the trainer scales
  the sum so that the averaged gradient is the mean over the *global* batch, whatever the split.
- `optimizer` was built on `model.parameters()`; `scheduler` (optional) is stepped once per optimizer
  step (without one: warm-up plus cosine over all epochs).
- Per-sample randomness goes through `sample_transform(sample, generator)`, whose generator is
  seeded from (seed, epoch, index), never through the global RNG.
- `after_step(trainer)` (optional) runs on every rank after each committed optimizer step and any
  snapshot it triggered; an exception from it ends `fit()` as a crash would.
- SIGTERM (torchrun forwards it when its node is drained) makes every rank stop at a step boundary
  after a final durable snapshot; `fit()` then raises `DrainRequested` (see elastic_ddp/runtime/drain.py).
- When training stops early by any exception (a peer died and a collective failed, a drain), each
  rank keeps the state of its last committed step in node memory before `fit()` re-raises, and
  the next worker group resumes from it (elastic_ddp/snapshot/memory_copies.py). A step is committed once
  its optimizer step and bookkeeping are applied whole (`TrainingState.updating`).
- With `--watchdog_timeout_s` (on by default) a peer that sends no heartbeat for that long (frozen,
  or dead under NCCL) makes `fit()` keep the last committed step the same way and end the process
  with `SILENT_PEER_EXIT_CODE`, from the watchdog's thread (elastic_ddp/runtime/watchdog.py).

Call `fit()` inside an initialised process group (see `elastic_ddp.train`); it restores the newest
snapshot the group can read, trains the remaining epochs, and waits for the last snapshot write.
The loop asks and its components decide: the snapshot session when to snapshot (snapshot/manager.py),
the evaluator when to evaluate, the run log when to report progress (reporting.py), the stop guard
when to drain. What is saved is `TrainingState` (snapshot/training_state.py), built by state_builder.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runlog.worker_logging import RankPrefix
from elastic_ddp.runtime.distributed import DistributedContext, agree_on_incarnation, keep_until_exit
from elastic_ddp.runtime.drain import DrainSignal
from elastic_ddp.snapshot.manager import SnapshotSession, open_snapshot_session
from elastic_ddp.snapshot.training_state import run_fingerprint
from elastic_ddp.training.evaluation import Evaluator
from elastic_ddp.training.reporting import RunLog
from elastic_ddp.training.sharding import place_model
from elastic_ddp.training.state_builder import autocast_dtype, build_training_state
from elastic_ddp.training.step_hooks import MinimumStepTime
from elastic_ddp.training.stop_guard import StopGuard
from elastic_ddp.workload.data import EpochSampleView, SampleTransform, empty_batch_like, plan_loader
from elastic_ddp.workload.losses import LossFn, check_per_sample, per_sample_cross_entropy
from elastic_ddp.workload.sampler import StepPlan

logger = logging.getLogger(__name__)

StepHook = Callable[["Trainer"], None]


class Trainer:
    """Trains `model` on `dataset` with elastic DDP; all state lives in snapshots."""

    def __init__(self, model: nn.Module, dataset: Dataset, config: TrainingConfig,
                 eval_dataset: Dataset | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 loss_fn: LossFn = per_sample_cross_entropy,
                 sample_transform: SampleTransform | None = None,
                 context: DistributedContext | None = None,
                 log_prefix: RankPrefix | None = None,
                 after_step: StepHook | None = None,
                 startup: StartupTimeline | None = None):
        self.config = config
        self.context = context or DistributedContext.from_env(config.device, config.dist_backend)
        self.model = place_model(model, config.sharding, config.shard_blocks, self.context.device)
        self.ddp_model: nn.Module = self.model
        self.step_model: nn.Module = self.model  # what a training step calls: ddp_model, compiled with --compile
        self.state = build_training_state(self.model, len(dataset), config, self.context.device, optimizer, scheduler)
        self.fingerprint = run_fingerprint(self.model, len(dataset), config.global_batch_size, config.seed,
                                           config.drop_last)
        self.samples = EpochSampleView(dataset, config.seed, sample_transform)
        self.evaluator = (Evaluator(self.model, eval_dataset, loss_fn, self.context, config.eval_every_steps,
                                    config.micro_batch_size) if eval_dataset is not None else None)
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype(config, self.context.device)
        self.after_step_hooks: list[StepHook] = [hook for hook in (
            after_step, MinimumStepTime(config.min_step_time_s) if config.min_step_time_s else None) if hook]
        self.startup = startup or StartupTimeline()
        self.log_prefix = log_prefix
        self.drain = DrainSignal(self.context.collective_device)
        self._empty_batch: list[torch.Tensor] | None = None
        self.amp_step_skipped = False  # whether GradScaler skipped the last committed step's update
        self.stop_guard: StopGuard | None = None  # keeps the last committed step (set during fit())
        self.run_log: RunLog | None = None  # what this fit() reports, and
        self.snapshots: SnapshotSession | None = None  # its snapshots (both set during fit())

    @property
    def global_step(self) -> int:
        return self.state.global_step

    # ------------------------------------------------------------------------------- lifecycle

    def fit(self) -> None:
        """Restore, train the remaining epochs, snapshot; always waits for the last write.

        SIGTERM during training drains (DrainRequested); one that arrives too late to drain, during
        the last steps, is raised again once everything is written and closed, so it still ends
        the process (or reaches the handler you had installed before `fit`).
        """
        started = time.monotonic()
        incarnation = agree_on_incarnation(self.context)
        with self._incarnation(incarnation) as (log, snapshots):
            guard = self.stop_guard = StopGuard(self.state, log, snapshots, self.context, self.drain,
                                                self.config.epochs, self.config.watchdog_timeout_s)
            with guard.watching_peers(incarnation):
                log.started()
                snapshots.start()
                log.restored(restored := snapshots.restore(self.state))
                self._wrap_model(restored=restored is not None)
                with self.drain.catching_sigterm(), guard.keeping_the_last_step():
                    self._train_remaining_epochs()
                    self.drain.finish()
            snapshots.finish()
            log.finished(self.global_step, time.monotonic() - started)
            snapshots.forget_memory_copies()
        self.drain.redeliver_unused()

    @contextlib.contextmanager
    def _incarnation(self, incarnation: int) -> Iterator[tuple[RunLog, SnapshotSession]]:
        """The run log and snapshot session of one `fit`, closed whatever happens."""
        self.run_log = RunLog(self.config, self.context, incarnation, self.state.sampler.steps_per_epoch,
                              self.startup, self.log_prefix)
        try:
            self.snapshots = open_snapshot_session(self.config, self.context, self.run_log.events, self.fingerprint,
                                                   incarnation)
            try:
                yield self.run_log, self.snapshots
            finally:
                self.snapshots.close()
        finally:
            self.run_log.close()

    def _wrap_model(self, restored: bool) -> None:
        if self.context.in_process_group and self.config.sharding == "none":  # FSDP2 sharded it in place_model
            device_ids = [self.context.device.index] if self.context.device.type == "cuda" else None
            # Restored, every rank holds the agreed state: DDP's broadcast is redundant (1.4 s per GB).
            self.ddp_model = DistributedDataParallel(self.model, device_ids=device_ids, init_sync=not restored)
            keep_until_exit(self.ddp_model)  # freeing it while Python runs can deadlock in gloo
        # Compiled around DDP (torch's DDPOptimizer splits the graph at its buckets) or FSDP2's
        # module; the model itself stays uncompiled, so its state dict keeps its own names.
        self.step_model = torch.compile(self.ddp_model) if self.config.compile else self.ddp_model

    # ------------------------------------------------------------------------------- training

    def _train_remaining_epochs(self) -> None:
        sampler = self.state.sampler
        if sampler.epoch >= self.config.epochs:
            logger.info("training already complete (%d epochs, step %d)", self.config.epochs, self.global_step)
        while sampler.epoch < self.config.epochs:
            self._train_epoch_remainder()

    def _train_epoch_remainder(self) -> None:
        ctx, sampler = self.context, self.state.sampler
        plans = sampler.plan_epoch_remainder(ctx.rank, ctx.world_size, self.config.micro_batch_size)
        # A committed state never holds a finished epoch (the rollover is part of the commit), so
        # there is always a step to plan; without one this loop would never end.
        assert plans, f"epoch {sampler.epoch} has no step left at sample {sampler.samples_consumed}"
        batches = iter(plan_loader(self.samples, sampler.epoch, plans, self.config.num_workers,
                                   pin_memory=ctx.device.type == "cuda"))
        self.ddp_model.train()
        self.run_log.epoch_started(sampler.epoch, steps_done=sampler.steps_per_epoch - len(plans))
        try:
            for plan in plans:
                loss_sum = self._forward_backward(plan, batches)
                epoch_ended = self._commit(plan)
                self._after_step(plan, loss_sum, epoch_ended)
        except BaseException:
            self.run_log.training_interrupted()
            raise

    def _forward_backward(self, plan: StepPlan, batches: Iterator[Any]) -> torch.Tensor:
        """Forward/backward every micro-batch of `plan`, gradients synchronised on the last; the
        summed loss. Changes no state: a failure here leaves the last committed step intact."""
        loss_sum: torch.Tensor | None = None
        # DDP averages gradients over ranks: seeding each sample's gradient with this makes the
        # result the global batch's mean (the numbers of `scaler.scale(sum * scale)`, 2 nodes fewer).
        loss_scale = self.context.world_size / plan.global_samples
        last, scaler = len(plan.micro_batches) - 1, self.state.grad_scaler.scaler
        for index, micro_batch in enumerate(plan.micro_batches):
            inputs, targets = self._to_device(next(batches) if micro_batch else self._empty_batch_like_dataset())
            sync = contextlib.nullcontext() if index == last or self.ddp_model is self.model else self.ddp_model.no_sync()
            with sync:
                with torch.autocast(self.context.device.type, dtype=self.autocast_dtype,
                                    enabled=self.autocast_dtype is not None):
                    losses = self.loss_fn(self.step_model(inputs), targets)
                check_per_sample(losses, len(inputs))
                losses = losses.float()
                torch.autograd.backward(losses, scaler.scale(torch.full_like(losses, loss_scale)))
            loss_sum = losses.detach().sum() if loss_sum is None else loss_sum + losses.detach().sum()
        return loss_sum

    def _commit(self, plan: StepPlan) -> bool:
        """Apply the step whole: optimizer, scaler, schedule, data position (rolled over into the
        next epoch when this step ends one) and step count. Returns whether it ended the epoch."""
        state = self.state
        self._clip_gradients()
        with state.updating():
            self.amp_step_skipped = state.grad_scaler.step(state.optimizer)
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            state.sampler.advance(plan.global_samples)
            epoch_ended = state.sampler.epoch_finished
            if epoch_ended:
                state.sampler.start_next_epoch()
            state.progress.global_step += 1
            self.stop_guard.committed(plan)
        return epoch_ended

    def _clip_gradients(self) -> None:
        """`--max_grad_norm`: the gradients unscaled first (the scaler then steps without unscaling
        them again, and still skips a step whose gradients are not finite), then clipped over every
        parameter: the same norm on every rank, as every rank holds the all-reduced gradient (DDP)
        or its shard of it (FSDP2: the norm is reduced over the shards)."""
        if self.config.max_grad_norm > 0:
            self.state.grad_scaler.scaler.unscale_(self.state.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)

    def _to_device(self, batch: Any) -> Any:
        non_blocking = self.context.device.type == "cuda"
        return [item.to(self.context.device, non_blocking=non_blocking) for item in batch]

    def _empty_batch_like_dataset(self) -> list[torch.Tensor]:
        if self._empty_batch is None:
            self._empty_batch = empty_batch_like(self.samples)
        return self._empty_batch

    def _after_step(self, plan: StepPlan, loss_sum: torch.Tensor, epoch_ended: bool) -> None:
        """Each component decides for itself what a committed step means to it, in this order on
        every rank (their collectives must line up)."""
        step = self.global_step
        self.run_log.step_committed(plan, step, loss_sum, self.state.scheduler.get_last_lr()[0])
        if self.amp_step_skipped:
            self.run_log.amp_step_skipped(step, self.state.grad_scaler.scaler.get_scale())
        if epoch_ended:
            self.run_log.epoch_ended(plan.epoch, step)
        self.snapshots.save(self.state, epoch_ended=epoch_ended)
        if self.evaluator is not None and self.evaluator.should_evaluate(step, epoch_ended):
            self.run_log.evaluated(step, plan.epoch, self.evaluator.evaluate())
        self.stop_guard.drain_if_agreed()
        for hook in self.after_step_hooks:
            hook(self)
