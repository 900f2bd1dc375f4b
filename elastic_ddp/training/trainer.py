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
- `optimizer` was built on `model.parameters()`; `scheduler` (optional) is stepped once per
  optimizer step. Without one, a warm-up plus cosine schedule over all epochs is used.
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
What is saved is `TrainingState` (elastic_ddp/snapshot/training_state.py); where it goes, the snapshot
session (elastic_ddp/snapshot/manager.py); what is reported, the run log (elastic_ddp/runlog).
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
from elastic_ddp.workload.data import EpochSampleView, SampleTransform, empty_batch_like, plan_loader
from elastic_ddp.runtime.distributed import DistributedContext, agree_on_incarnation, keep_until_exit
from elastic_ddp.runtime.drain import DrainRequested, DrainSignal
from elastic_ddp.training.evaluation import evaluate
from elastic_ddp.workload.losses import LossFn, per_sample_cross_entropy
from elastic_ddp.training.state_builder import build_optimizer, warmup_cosine_schedule
from elastic_ddp.training.loss_window import LossWindow, WindowReport
from elastic_ddp.training.reporting import RunLog
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runlog.worker_logging import RankPrefix
from elastic_ddp.workload.sampler import ElasticSampler, StepPlan
from elastic_ddp.snapshot.manager import SnapshotSession
from elastic_ddp.snapshot.training_state import ScalerState, StepCounter, TrainingState, run_fingerprint
from elastic_ddp.training.stop_guard import StopGuard

logger = logging.getLogger(__name__)


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
                 after_step: Callable[[Trainer], None] | None = None,
                 startup: StartupTimeline | None = None):
        self.config = config
        self.context = context or DistributedContext.from_env(config.device)
        self.model = model.to(self.context.device)
        self.ddp_model: nn.Module = self.model
        optimizer = optimizer or build_optimizer(config, self.model.parameters())
        sampler = ElasticSampler(len(dataset), config.global_batch_size, config.seed, config.drop_last)
        use_cuda = self.context.device.type == "cuda"
        self.state = TrainingState(
            model=self.model, optimizer=optimizer,
            scheduler=scheduler or warmup_cosine_schedule(optimizer, config.warmup_steps,
                                                          config.epochs * sampler.steps_per_epoch),
            grad_scaler=ScalerState(torch.amp.GradScaler("cuda", enabled=config.use_amp and use_cuda)),
            sampler=sampler, progress=StepCounter())
        self.fingerprint = run_fingerprint(self.model, len(dataset), config.global_batch_size, config.seed,
                                           config.drop_last)
        self.samples = EpochSampleView(dataset, config.seed, sample_transform)
        self.eval_dataset = eval_dataset
        self.loss_fn = loss_fn
        self.autocast_dtype = (torch.float16 if use_cuda else torch.bfloat16) if config.use_amp else None
        self.after_step = after_step
        self.startup = startup or StartupTimeline()
        self.log_prefix = log_prefix
        self.drain = DrainSignal(self.context.device)
        self._empty_batch: list[torch.Tensor] | None = None
        self.stop_guard: StopGuard | None = None  # keeps the last committed step (set during fit())
        self.run_log: RunLog | None = None  # what this fit() reports, and
        self.snapshots: SnapshotSession | None = None  # its snapshots (both set during fit())

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def _distributed(self) -> bool:
        return self.context.in_process_group

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
            guard = self.stop_guard = StopGuard(self.state, log, snapshots, self.context,
                                                self.config.watchdog_timeout_s, self._distributed)
            with guard.watching_peers(incarnation):
                log.started()
                snapshots.start()
                log.restored(snapshots.restore(self.state))
                self._wrap_model()
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
            self.snapshots = SnapshotSession(self.config, self.context, self.run_log.events, self.fingerprint,
                                              incarnation)
            try:
                yield self.run_log, self.snapshots
            finally:
                self.snapshots.close()
        finally:
            self.run_log.close()

    def _wrap_model(self) -> None:
        if self._distributed:
            device_ids = [self.context.device.index] if self.context.device.type == "cuda" else None
            self.ddp_model = DistributedDataParallel(self.model, device_ids=device_ids)
            keep_until_exit(self.ddp_model)  # freeing it while Python runs can deadlock in gloo

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
        batches = iter(plan_loader(self.samples, sampler.epoch, plans, self.config.num_workers,
                                   pin_memory=ctx.device.type == "cuda"))
        self.ddp_model.train()
        window = LossWindow(ctx.device)
        self.run_log.epoch_started(sampler.epoch, steps_done=sampler.steps_per_epoch - len(plans))
        try:
            for plan in plans:
                step_started = time.monotonic()
                loss_sum = self._forward_backward(plan, batches)
                self._commit(plan)
                window.add(loss_sum, len(plan.rank_samples), plan.global_samples)
                self._after_step(plan, window)
                if self.config.min_step_time_s:
                    time.sleep(max(0.0, self.config.min_step_time_s - (time.monotonic() - step_started)))
        except BaseException:
            # A window reduced before the failure is still reported (never waited for: the group
            # may be broken). Its reduce came before the failed step's collectives, so it is done.
            with contextlib.suppress(Exception):
                self._report_progress(window.take_report())
            raise

    def _forward_backward(self, plan: StepPlan, batches: Iterator[Any]) -> torch.Tensor:
        """Forward/backward every micro-batch of `plan`, gradients synchronised on the last; the
        summed loss. Changes no state: a failure here leaves the last committed step intact."""
        loss_sum = torch.zeros((), device=self.context.device)
        # DDP averages gradients over ranks; scale so the result is the mean over the global batch.
        loss_scale = self.context.world_size / plan.global_samples
        last = len(plan.micro_batches) - 1
        scaler = self.state.grad_scaler.scaler
        for index, micro_batch in enumerate(plan.micro_batches):
            inputs, targets = self._to_device(next(batches) if micro_batch else self._empty_batch_like_dataset())
            sync = contextlib.nullcontext() if index == last or self.ddp_model is self.model else self.ddp_model.no_sync()
            with sync:
                with torch.autocast(self.context.device.type, dtype=self.autocast_dtype,
                                    enabled=self.autocast_dtype is not None):
                    losses = self.loss_fn(self.ddp_model(inputs), targets)
                _check_per_sample(losses, len(inputs))
                loss = losses.float().sum()
                scaler.scale(loss * loss_scale).backward()
            loss_sum += loss.detach()
        return loss_sum

    def _commit(self, plan: StepPlan) -> None:
        """Apply the step whole: optimizer, scaler, schedule, data position and step count."""
        scaler, state = self.state.grad_scaler.scaler, self.state
        with state.updating():
            scaler.step(state.optimizer)
            scaler.update()
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            state.sampler.advance(plan.global_samples)
            state.progress.global_step += 1
            self.stop_guard.committed(plan)

    def _to_device(self, batch: Any) -> Any:
        non_blocking = self.context.device.type == "cuda"
        return [item.to(self.context.device, non_blocking=non_blocking) for item in batch]

    def _empty_batch_like_dataset(self) -> list[torch.Tensor]:
        if self._empty_batch is None:
            self._empty_batch = empty_batch_like(self.samples)
        return self._empty_batch

    def _after_step(self, plan: StepPlan, window: LossWindow) -> None:
        sampler = self.state.sampler
        self.run_log.step_committed(plan, self.global_step)
        self._report_progress(window.take_report())  # the window closed a step or more ago, once reduced
        if self.global_step % self.config.log_interval == 0:
            window.close(self.global_step, plan.epoch, self.state.scheduler.get_last_lr()[0], self._distributed)
        every = self.config.snapshot_every_steps
        epoch_ended = sampler.epoch_finished
        if epoch_ended:
            self._report_progress(window.finish())  # the epoch's last window, before its summary line
            sampler.start_next_epoch()
            self.run_log.epoch_ended(plan.epoch, self.global_step)
            self.snapshots.save(self.state)
        elif every and self.global_step % every == 0:
            self.snapshots.save(self.state)
        eval_every = self.config.eval_every_steps
        if self.eval_dataset is not None and (epoch_ended or (eval_every and self.global_step % eval_every == 0)):
            self._evaluate(plan.epoch)
        self._drain_if_agreed()
        if self.after_step is not None:
            self.after_step(self)

    def _report_progress(self, report: WindowReport | None) -> None:
        if report is not None:
            self.run_log.report_progress(report.global_step, report.epoch, report.loss, report.lr,
                                         report.samples_per_second)

    def _evaluate(self, epoch: int) -> None:
        """Held-out loss and accuracy over all ranks, reported by rank 0 (a collective)."""
        ctx = self.context
        result = evaluate(self.model, self.eval_dataset, self.loss_fn, ctx.rank, ctx.world_size,
                          self.config.micro_batch_size, ctx.device, self._distributed)
        self.run_log.evaluated(self.global_step, epoch, result)

    def _drain_if_agreed(self) -> None:
        """If any rank got SIGTERM, stop every rank here: final snapshot, then DrainRequested."""
        if not self.drain.agreed() or self.state.sampler.epoch >= self.config.epochs:
            return  # (a run whose last step is done simply finishes)
        self.stop_guard.keep("drain")  # first: fast, and kept if SIGKILL comes during the snapshot write
        if self.snapshots.last_saved_step != self.global_step:
            self.snapshots.save(self.state)
        self.drain.finish()
        durable = self.snapshots.finish()  # a drained rank 0 takes its disk along: replicate first
        self.run_log.drained(self.global_step, durable, self.drain.seconds_since_request())
        raise DrainRequested(f"stopped on SIGTERM at step {self.global_step}")


def _check_per_sample(losses: torch.Tensor, samples: int) -> None:
    if losses.dim() != 1 or losses.shape[0] != samples:
        raise ValueError(f"--loss: the loss returned a tensor of shape {tuple(losses.shape)} for {samples} samples; "
                         "expected one loss per sample, shape (samples,) (reduction='none')")
