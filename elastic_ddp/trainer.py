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

Call `fit()` inside an initialised process group (see `elastic_ddp.train`); it restores the newest
snapshot the group can read, trains the remaining epochs, and waits for the last snapshot write.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
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
from elastic_ddp.distributed import DistributedContext
from elastic_ddp.events import EventLog, work_lost
from elastic_ddp.logging_setup import RankPrefix
from elastic_ddp.recovery import RestoredSnapshot, agree_on_latest_snapshot
from elastic_ddp.sampler import ElasticSampler, StepPlan, derive_seed
from elastic_ddp.snapshot import (Snapshot, capture_rng_state, check_compatible, copy_to_cpu,
                                  restore_rng_state)
from elastic_ddp.snapshot_writer import SnapshotWriter

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
                 after_step: Callable[[Trainer], None] | None = None):
        self.config = config
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
        self._empty_batch: Any = None

    # ------------------------------------------------------------------------------- lifecycle

    def fit(self) -> None:
        """Restore, train the remaining epochs, snapshot; always waits for the last write."""
        started = time.monotonic()
        self.incarnation = self._agree_on_incarnation()
        ctx, config = self.context, self.config
        self.events = EventLog(config.event_log or Path(config.checkpoint_dir) / "events.jsonl",
                               self.incarnation, enabled=ctx.is_main)
        if config.audit_log:
            self.audit = AuditLog(config.audit_log, self.incarnation, ctx.rank, ctx.world_size)
        if ctx.is_main:
            self.writer = SnapshotWriter(self.store, on_written=self._on_snapshot_written)
        try:
            self.events.emit("start", world_size=ctx.world_size, local_world_size=ctx.local_world_size,
                             restart_count=ctx.restart_count, run_id=ctx.run_id)
            self._restore()
            self._wrap_model()
            self._train_remaining_epochs()
            if self.writer is not None:
                self.writer.wait()
            self.events.emit("finished", global_step=self.global_step, seconds=round(time.monotonic() - started, 3))
            logger.info("finished: %d epochs, step %d; snapshots in %s", self.config.epochs, self.global_step,
                        self.config.checkpoint_dir)
        finally:
            if self.writer is not None:
                self.writer.close()
            if self.audit is not None:
                self.audit.close()
            self.events.close()

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

    # ------------------------------------------------------------------------------ restoring

    def _restore(self) -> None:
        restored = agree_on_latest_snapshot(self.store, self.context)
        if restored is None:
            logger.info("no snapshot in %s: starting from scratch", self.config.checkpoint_dir)
            self._seed_rng_for_step(0)
            return
        snapshot = restored.snapshot
        check_compatible(snapshot, self.fingerprint, f"snapshot of step {snapshot.global_step}")
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
        lost_text = f", lost {lost_steps} steps ({lost_seconds:.1f} s)" if lost_steps is not None else ""
        logger.info("world %d -> %d, resumed from step %d (epoch %d, %d samples in)%s",
                    snapshot.world_size, self.context.world_size, snapshot.global_step, snapshot.epoch,
                    snapshot.samples_consumed, lost_text)

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
        for plan in plans:
            loss_sum = self._train_step(plan, batches)
            window.add(loss_sum, len(plan.rank_samples), plan.global_samples)
            self.sampler.advance(plan.global_samples)
            self.global_step += 1
            self._after_step(plan, window)

    def _loader(self, epoch: int, plans: list[StepPlan]) -> DataLoader:
        """Batches of this rank's non-empty micro-batches, in plan order."""
        keyed = [[(epoch, index) for index in batch] for plan in plans for batch in plan.micro_batches if batch]
        return DataLoader(self.samples, batch_sampler=keyed, num_workers=self.config.num_workers,
                          pin_memory=self.context.device.type == "cuda")

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
        if self.global_step % self.config.log_interval == 0:
            self._log_progress(plan.epoch, window)
        every = self.config.snapshot_every_steps
        if self.sampler.epoch_finished:
            self.sampler.start_next_epoch()
            self.events.emit("epoch_end", epoch=plan.epoch, global_step=self.global_step)
            self._snapshot()
        elif every and self.global_step % every == 0:
            self._snapshot()
        if self.after_step is not None:
            self.after_step(self)

    def _log_progress(self, epoch: int, window: _MetricsWindow) -> None:
        loss, samples_per_second = window.reduce(self._distributed)
        lr = self.scheduler.get_last_lr()[0]
        logger.info("epoch %d loss %.4f lr %.4g %.0f samples/s world %d", epoch, loss, lr,
                    samples_per_second, self.context.world_size)
        self.events.emit("progress", global_step=self.global_step, epoch=epoch, loss=loss, lr=lr,
                         samples_per_second=round(samples_per_second, 1), world_size=self.context.world_size)

    # ------------------------------------------------------------------------------ snapshots

    def _snapshot(self) -> None:
        """Capture the state (a collective: every rank's RNG); rank 0 hands it to the writer."""
        rng_per_rank = [capture_rng_state()]
        if self._distributed:
            rng_per_rank = [None] * self.context.world_size
            dist.all_gather_object(rng_per_rank, capture_rng_state())
        if self.writer is None:
            return
        captured = time.monotonic()
        snapshot = Snapshot(
            global_step=self.global_step, epoch=self.sampler.epoch, samples_consumed=self.sampler.samples_consumed,
            model=copy_to_cpu(self.model.state_dict()), optimizer=copy_to_cpu(self.optimizer.state_dict()),
            scheduler=copy_to_cpu(self.scheduler.state_dict()),
            grad_scaler=self.scaler.state_dict() if self.scaler.is_enabled() else None,
            rng_per_rank=copy_to_cpu(rng_per_rank), fingerprint=self.fingerprint,
            world_size=self.context.world_size, incarnation=self.incarnation, wall_time=time.time(),
        )
        copy_seconds = time.monotonic() - captured
        waited_seconds = self.writer.submit(snapshot)
        self.events.emit("snapshot_captured", global_step=self.global_step,
                         blocked_seconds=round(copy_seconds + waited_seconds, 4))

    def _on_snapshot_written(self, entry: ManifestEntry, write_seconds: float) -> None:
        self.events.emit("snapshot", global_step=entry.global_step, epoch=entry.epoch, file=entry.file,
                         sha256=entry.sha256, size_bytes=entry.size_bytes, write_seconds=round(write_seconds, 4))


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
