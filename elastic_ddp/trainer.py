"""The training loop: restore, train with DDP over whatever world torchrun gave us, snapshot.

Usable as a library with your own objects:

    trainer = Trainer(model=my_model, dataset=my_dataset, optimizer=my_optimizer, config=config)
    trainer.fit()

Contracts:
- `dataset` is map-style and returns (input, target) samples that the default collate can batch.
- `loss_fn(outputs, targets)` returns one loss per sample (reduction="none"); the trainer scales
  the sum so that the averaged gradient is the mean over the *global* batch, whatever the split.
- `optimizer` was built on `model.parameters()`; `scheduler` (optional) is stepped once per
  optimizer step. Without one, a warm-up plus cosine schedule over all epochs is used.
- Per-sample randomness goes through `sample_transform(sample, generator)`, whose generator is
  seeded from (seed, epoch, index), never through the global RNG.
- `after_step(trainer)` (optional) runs on every rank after each committed optimizer step and any
  snapshot it triggered; an exception from it ends `fit()` as a crash would.
- SIGTERM (torchrun forwards it when its node is drained) makes every rank stop at a step boundary
  after a final durable snapshot; `fit()` then raises `DrainRequested` (see elastic_ddp/drain.py).

Call `fit()` inside an initialised process group (see `elastic_ddp.train`); it restores the newest
snapshot the group can read, trains the remaining epochs, and waits for the last snapshot write.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from elastic_ddp.audit import AuditLog
from elastic_ddp.checkpoint import CheckpointStore, ManifestEntry
from elastic_ddp.config import TrainingConfig
from elastic_ddp.data import EpochSampleView, SampleTransform
from elastic_ddp.distributed import DistributedContext, agent_pid, keep_until_exit
from elastic_ddp.drain import DrainRequested, DrainSignal
from elastic_ddp.events import EventLog, StartupTimeline, next_round, work_lost
from elastic_ddp.logging_setup import RankPrefix
from elastic_ddp.progress import ProgressReporter
from elastic_ddp.recovery import RestoredSnapshot, agree_on_latest_snapshot
from elastic_ddp.replication import Replication
from elastic_ddp.sampler import ElasticSampler, StepPlan, derive_seed
from elastic_ddp.snapshot import Snapshot, StagingBuffers, capture_rng_state, restore_rng_state
from elastic_ddp.snapshot_writer import SnapshotWriter
from elastic_ddp.tensorboard_scalars import TensorBoardScalars, open_scalars

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """Linear warm-up, then cosine decay to zero at `total_steps`: a pure function of the step."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def model_signature(model: nn.Module) -> str:
    """Parameter and buffer names with shapes: two models with the same signature share snapshots."""
    return ";".join(f"{name}:{tuple(tensor.shape)}" for name, tensor in model.state_dict().items())


class Trainer:
    """Trains `model` on `dataset` with elastic DDP; all state lives in snapshots."""

    def __init__(self, model: nn.Module, dataset: Dataset, config: TrainingConfig,
                 optimizer: torch.optim.Optimizer | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 loss_fn: LossFn = per_sample_cross_entropy,
                 sample_transform: SampleTransform | None = None,
                 context: DistributedContext | None = None,
                 log_prefix: RankPrefix | None = None,
                 after_step: Callable[[Trainer], None] | None = None,
                 startup: StartupTimeline | None = None):
        self.config = config
        self.startup = startup or StartupTimeline()
        self.context = context or DistributedContext.from_env(config.device)
        self.model = model.to(self.context.device)
        self.dataset = dataset
        self.optimizer = optimizer or torch.optim.SGD(
            self.model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
        self.sampler = ElasticSampler(len(dataset), config.global_batch_size, config.seed, config.drop_last)
        self.scheduler = scheduler or warmup_cosine_schedule(
            self.optimizer, config.warmup_steps, config.epochs * self.sampler.steps_per_epoch)
        self.loss_fn = loss_fn
        self.samples = EpochSampleView(dataset, config.seed, sample_transform)
        use_cuda = self.context.device.type == "cuda"
        self.autocast_dtype = (torch.float16 if use_cuda else torch.bfloat16) if config.use_amp else None
        self.scaler = torch.amp.GradScaler("cuda", enabled=config.use_amp and use_cuda)
        self.store = CheckpointStore(config.checkpoint_dir, config.keep_last)
        self.log_prefix = log_prefix
        self.after_step = after_step
        self.global_step = 0
        self.fingerprint = {
            "model": model_signature(self.model), "dataset_size": len(dataset),
            "global_batch_size": config.global_batch_size, "seed": config.seed, "drop_last": config.drop_last,
        }
        self.ddp_model: nn.Module = self.model
        self.incarnation = 0
        self.events: EventLog | None = None
        self.audit: AuditLog | None = None
        self.writer: SnapshotWriter | None = None
        self.replication = Replication()  # the real one is agreed on in fit()
        self._empty_batch: Any = None
        self.progress = ProgressReporter(config.progress, config.epochs, self.sampler.steps_per_epoch,
                                         enabled=self.context.is_main)
        self.scalars: TensorBoardScalars | None = None
        self.drain = DrainSignal(self.context.device)
        self._last_snapshot_step: int | None = None

    # ------------------------------------------------------------------------------- lifecycle

    def fit(self) -> None:
        """Restore, train the remaining epochs, snapshot; always waits for the last write.

        SIGTERM during training drains (DrainRequested); one that arrives too late to drain, during
        the last steps, is raised again once everything is written and closed, so it still ends
        the process (or reaches the handler you had installed before `fit`).
        """
        started = time.monotonic()
        self.incarnation = self._agree_on_incarnation()
        ctx, config = self.context, self.config
        self.events = EventLog(config.event_log or self._default_event_log(), self.incarnation, enabled=ctx.is_main)
        if config.audit_log:
            self.audit = AuditLog(config.audit_log, self.incarnation, ctx.rank, ctx.world_size)
        if ctx.is_main:
            self.writer = SnapshotWriter(self.store, on_written=self._on_snapshot_written,
                                         on_failed=self._on_snapshot_failed, asynchronous=config.snapshot_async)
        try:
            self._announce_start()
            self.replication = Replication.start(self.store, ctx, config.snapshot_replicas, self.events.emit)
            self._restore()
            self.startup.mark("restored")
            if ctx.is_main:
                self.scalars = open_scalars(config.tensorboard_dir, resumed_from_step=self.global_step)
            self._wrap_model()
            with self.drain.catching_sigterm():
                self._train_remaining_epochs()
                self.drain.finish()
            if self.writer is not None:
                self.writer.wait()
            self.replication.finish(timeout=config.collective_timeout_s / 2)
            self.events.emit("finished", global_step=self.global_step, seconds=round(time.monotonic() - started, 3))
            logger.info("finished: %d epochs, step %d; snapshots in %s", self.config.epochs, self.global_step,
                        self.config.checkpoint_dir)
        finally:
            if self.writer is not None:
                self.writer.close()
            self.replication.close()
            if self.audit is not None:
                self.audit.close()
            self.progress.close()
            if self.scalars is not None:
                self.scalars.close()
            self.events.close()
        self.drain.redeliver_unused()

    def _announce_start(self) -> None:
        """The `start` event: rendezvous round, world, and where every rank runs (a collective)."""
        ctx = self.context
        mine = {"rank": ctx.rank, "host": socket.gethostname(), "pid": os.getpid(), "agent_pid": agent_pid(),
                "group_rank": int(os.environ.get("GROUP_RANK", 0)), "local_rank": ctx.local_rank}
        ranks = [mine]
        if self._distributed:
            ranks = [None] * ctx.world_size
            dist.all_gather_object(ranks, mine)
        self.events.emit("start", round=next_round(self.events.path) if ctx.is_main else None,
                         world_size=ctx.world_size, local_world_size=ctx.local_world_size,
                         nodes=len({(r["host"], r["agent_pid"]) for r in ranks}), ranks=ranks,
                         restart_count=ctx.restart_count, run_id=ctx.run_id)

    def _default_event_log(self) -> Path:
        """CHECKPOINT_DIR/events.jsonl; ./events.jsonl when snapshots go to an object store."""
        directory = self.store.storage.local_directory
        return (directory if directory is not None else Path.cwd()) / "events.jsonl"

    def _agree_on_incarnation(self) -> int:
        """A number shared by all ranks of this worker-group start, larger than any before it."""
        if not self._distributed:
            return time.time_ns() // 1000
        value = torch.tensor([time.time_ns() // 1000], dtype=torch.int64, device=self.context.device)
        dist.broadcast(value, src=0)
        return int(value.item())

    @property
    def _distributed(self) -> bool:
        return self.context.is_distributed and dist.is_initialized()

    def _wrap_model(self) -> None:
        if self._distributed:
            device_ids = [self.context.device.index] if self.context.device.type == "cuda" else None
            self.ddp_model = DistributedDataParallel(self.model, device_ids=device_ids)
            keep_until_exit(self.ddp_model)  # freeing it while Python runs can deadlock in gloo

    # ------------------------------------------------------------------------------ restoring

    def _restore(self) -> None:
        restored = agree_on_latest_snapshot(self.store, self.context, self.fingerprint)
        if restored is None:
            logger.info("no snapshot in %s: starting from scratch", self.config.checkpoint_dir)
            self._seed_rng_for_step(0)
            return
        snapshot = restored.snapshot
        self.model.load_state_dict(snapshot.model)
        self.optimizer.load_state_dict(snapshot.optimizer)
        if snapshot.scheduler is not None:
            self.scheduler.load_state_dict(snapshot.scheduler)
        if snapshot.grad_scaler is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(snapshot.grad_scaler)
        self.sampler.load_state_dict({"epoch": snapshot.epoch, "samples_consumed": snapshot.samples_consumed})
        self.global_step = snapshot.global_step
        if len(snapshot.rng_per_rank) == self.context.world_size:
            restore_rng_state(snapshot.rng_per_rank[self.context.rank])
        else:  # another world size: no rank's stream carries over, so derive fresh ones
            self._seed_rng_for_step(snapshot.global_step)
        self._announce_restore(restored)
        self._keep_restored_copies(restored)

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

    def _announce_restore(self, restored: RestoredSnapshot) -> None:
        snapshot = restored.snapshot
        lost = work_lost(self.events.path, snapshot.global_step) if self.context.is_main else None
        lost_steps, lost_seconds = lost if lost is not None else (None, None)
        self.events.emit(
            "restore", global_step=snapshot.global_step, epoch=snapshot.epoch,
            samples_consumed=snapshot.samples_consumed, sha256=restored.sha256, verified=True,
            source_rank=restored.source_rank, file=restored.entry.file if restored.entry else None,
            previous_world_size=snapshot.world_size, world_size=self.context.world_size,
            lost_steps=lost_steps, lost_seconds=lost_seconds)
        if self.log_prefix is not None:
            self.log_prefix.step = snapshot.global_step
        self.progress.announce_restore(self.events.path, self.incarnation, snapshot.global_step, snapshot.epoch,
                                       snapshot.world_size, self.context.world_size, lost_steps, lost_seconds)

    def _seed_rng_for_step(self, global_step: int) -> None:
        seed = derive_seed("rng", self.config.seed, global_step, self.context.rank)
        torch.manual_seed(seed)
        random.seed(seed)

    # ------------------------------------------------------------------------------- training

    def _train_remaining_epochs(self) -> None:
        if self.sampler.epoch >= self.config.epochs:
            logger.info("training already complete (%d epochs, step %d)", self.config.epochs, self.global_step)
            return
        while self.sampler.epoch < self.config.epochs:
            self._train_epoch_remainder()

    def _train_epoch_remainder(self) -> None:
        ctx = self.context
        plans = self.sampler.plan_epoch_remainder(ctx.rank, ctx.world_size, self.config.micro_batch_size)
        batches = iter(self._loader(self.sampler.epoch, plans))
        self.ddp_model.train()
        window = _MetricsWindow(ctx.device)
        self.progress.start_epoch(self.sampler.epoch, steps_done=self.sampler.steps_per_epoch - len(plans))
        for plan in plans:
            loss_sum = self._train_step(plan, batches)
            window.add(loss_sum, len(plan.rank_samples), plan.global_samples)
            self.sampler.advance(plan.global_samples)
            self.global_step += 1
            self._after_step(plan, window)
        self.progress.end_epoch()

    def _loader(self, epoch: int, plans: list[StepPlan]) -> DataLoader:
        """Batches of this rank's non-empty micro-batches, in plan order."""
        keyed = [[(epoch, index) for index in batch] for plan in plans for batch in plan.micro_batches if batch]
        return DataLoader(self.samples, batch_sampler=keyed, num_workers=self.config.num_workers,
                          pin_memory=self.context.device.type == "cuda", worker_init_fn=_ignore_sigterm)

    def _train_step(self, plan: StepPlan, batches) -> torch.Tensor:
        """Forward/backward every micro-batch of `plan` (gradients synchronised on the last), step."""
        loss_sum = torch.zeros((), device=self.context.device)
        # DDP averages gradients over ranks; scale so the result is the mean over the global batch.
        loss_scale = self.context.world_size / plan.global_samples
        last = len(plan.micro_batches) - 1
        for index, micro_batch in enumerate(plan.micro_batches):
            inputs, targets = self._to_device(next(batches) if micro_batch else self._empty_like_dataset())
            sync = contextlib.nullcontext() if index == last or self.ddp_model is self.model else self.ddp_model.no_sync()
            with sync:
                with torch.autocast(self.context.device.type, dtype=self.autocast_dtype,
                                    enabled=self.autocast_dtype is not None):
                    losses = self.loss_fn(self.ddp_model(inputs), targets)
                loss = losses.float().sum()
                self.scaler.scale(loss * loss_scale).backward()
            loss_sum += loss.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum

    def _to_device(self, batch: Any) -> Any:
        non_blocking = self.context.device.type == "cuda"
        return [item.to(self.context.device, non_blocking=non_blocking) for item in batch]

    def _empty_like_dataset(self) -> Any:
        """A batch of zero samples, shaped like the dataset's: this rank's share is empty."""
        if self._empty_batch is None:
            sample = self.samples[(0, 0)]
            collated = torch.utils.data.default_collate([sample])
            self._empty_batch = [item[:0] for item in collated]
        return self._empty_batch

    def _after_step(self, plan: StepPlan, window: _MetricsWindow) -> None:
        if self.log_prefix is not None:
            self.log_prefix.step = self.global_step
        if self.audit is not None:
            self.audit.record_step(plan.epoch, self.global_step, plan.rank_samples)
        self.events.emit("step", global_step=self.global_step, epoch=plan.epoch)
        self.progress.advance()
        if "first_step" not in self.startup.marks:
            self.startup.mark("first_step")
            self.events.emit("startup", global_step=self.global_step, process_started=self.startup.process_started,
                             seconds=self.startup.marks)
        if self.global_step % self.config.log_interval == 0:
            self._log_progress(plan.epoch, window)
        every = self.config.snapshot_every_steps
        if self.sampler.epoch_finished:
            self.sampler.start_next_epoch()
            self.events.emit("epoch_end", epoch=plan.epoch, global_step=self.global_step)
            self._snapshot()
        elif every and self.global_step % every == 0:
            self._snapshot()
        self._drain_if_agreed()
        if self.after_step is not None:
            self.after_step(self)

    def _drain_if_agreed(self) -> None:
        """If any rank got SIGTERM, stop every rank here: final snapshot, then DrainRequested."""
        if not self.drain.agreed() or self.sampler.epoch >= self.config.epochs:
            return  # (a run whose last step is done simply finishes)
        if self._last_snapshot_step != self.global_step:
            self._snapshot()
        self.drain.finish()
        durable = None
        if self.writer is not None:
            self.writer.wait()
            durable = self.writer.last_written is not None and self.writer.last_written.global_step == self.global_step
        self.replication.finish(timeout=self.config.collective_timeout_s / 2)  # a drained rank 0 takes its disk along
        self.events.emit("drain", global_step=self.global_step, snapshot_durable=durable,
                         seconds_since_signal=self.drain.seconds_since_request())
        logger.warning("drain requested (SIGTERM on a rank): stopped at step %d after the final snapshot "
                       "(durable: %s)", self.global_step, "yes" if durable else "see rank 0" if durable is None else "NO")
        raise DrainRequested(f"drained at step {self.global_step}")

    def _log_progress(self, epoch: int, window: _MetricsWindow) -> None:
        loss, samples_per_second = window.reduce(self._distributed)
        lr = self.scheduler.get_last_lr()[0]
        self.progress.report(self.global_step, loss, lr, samples_per_second, self.context.world_size)
        self.events.emit("progress", global_step=self.global_step, epoch=epoch, loss=loss, lr=lr,
                         samples_per_second=round(samples_per_second, 1), world_size=self.context.world_size)
        if self.scalars is not None:
            self.scalars.add(self.global_step, time.time(), loss=loss, lr=lr,
                             samples_per_second=samples_per_second, world_size=self.context.world_size)

    # ------------------------------------------------------------------------------ snapshots

    def _snapshot(self) -> None:
        """Capture the state (a collective: every rank's RNG); rank 0 hands it to the writer."""
        self._last_snapshot_step = self.global_step
        rng_per_rank = [capture_rng_state()]
        if self._distributed:
            rng_per_rank = [None] * self.context.world_size
            dist.all_gather_object(rng_per_rank, capture_rng_state())
        if self.writer is None:
            return
        blocked_seconds = self.writer.submit(lambda staging: self._capture(staging, rng_per_rank))
        self.events.emit("snapshot_captured", global_step=self.global_step, blocked_seconds=round(blocked_seconds, 4))

    def _capture(self, staging: StagingBuffers, rng_per_rank: list) -> Snapshot:
        """The state as a Snapshot whose tensors are copies in `staging`, so training may go on."""
        return Snapshot(
            global_step=self.global_step, epoch=self.sampler.epoch, samples_consumed=self.sampler.samples_consumed,
            model=staging.copy(self.model.state_dict(), "model"),
            optimizer=staging.copy(self.optimizer.state_dict(), "optimizer"),
            scheduler=staging.copy(self.scheduler.state_dict(), "scheduler"),
            grad_scaler=self.scaler.state_dict() if self.scaler.is_enabled() else None,
            rng_per_rank=rng_per_rank, fingerprint=self.fingerprint,
            world_size=self.context.world_size, incarnation=self.incarnation, wall_time=time.time(),
        )

    def _on_snapshot_written(self, entry: ManifestEntry, write_seconds: float) -> None:
        self.events.emit("snapshot", global_step=entry.global_step, epoch=entry.epoch, file=entry.file,
                         sha256=entry.sha256, size_bytes=entry.size_bytes, write_seconds=round(write_seconds, 4))
        self.replication.offer(entry)

    def _on_snapshot_failed(self, global_step: int, reason: str) -> None:
        self.events.emit("snapshot_failed", global_step=global_step, error=reason)


def _ignore_sigterm(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to the training process, which drains and then ends them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _MetricsWindow:
    """Loss and throughput since the last log line, averaged over all ranks when reduced."""

    def __init__(self, device: torch.device):
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, samples
        self.global_samples = 0
        self.started = time.monotonic()

    def add(self, loss_sum: torch.Tensor, rank_samples: int, global_samples: int) -> None:
        self.totals[0] += loss_sum.double()
        self.totals[1] += rank_samples
        self.global_samples += global_samples

    def reduce(self, distributed: bool) -> tuple[float, float]:
        """(mean loss per sample, global samples per second); collective when distributed."""
        if distributed:
            dist.all_reduce(self.totals)
        loss = (self.totals[0] / self.totals[1].clamp(min=1)).item()
        samples_per_second = self.global_samples / max(time.monotonic() - self.started, 1e-9)
        self._reset()
        return loss, samples_per_second
