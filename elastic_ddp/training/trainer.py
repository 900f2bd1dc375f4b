"""The training loop: restore, train with DDP over whatever world torchrun gave us, snapshot.

Usable as a library with your own objects:

    trainer = Trainer(model=my_model, dataset=my_dataset, optimizer=my_optimizer, config=config)
    trainer.fit()

Contracts:
- `dataset` is map-style; `collate_fn` (default: torch's default_collate) makes each micro-batch
  of its samples. A batch that is a dict has its targets under `labels` and the model's inputs as
  its other keys: the model is called `model(**inputs)` (a Hugging Face model's way); any other
  batch is (inputs, targets), the model called `model(inputs)` (workload/collate.py, `split_batch`).
- `eval_dataset` (optional): held-out (input, target) samples that the default collate can batch,
  evaluated every `--eval_every_steps` steps and at each epoch end on every rank, reported by rank 0
  (elastic_ddp/training/evaluation.py). Evaluation draws no random number and moves no data
  cursor: the training trajectory is the same without it.
- `loss_fn(outputs, targets)` returns one loss per sample (reduction="none", checked); the trainer scales
  the sum so that the averaged gradient is the mean over the *global* batch, whatever the split.
  It may return a pair (losses, weights) instead: the mean is then weighted by them
  (`token_cross_entropy`: by each sample's target tokens; elastic_ddp/workload/losses.py).
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
`fit()` is a loop written on the public API for loops of your own (elastic_run.py): what the
run promises (restore, snapshots, the stop guard, drain, report) it does for this loop too; the
trainer adds the per-sample loss, clipping from `--max_grad_norm`, evaluation and the hooks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runlog.worker_logging import RankPrefix
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.training_state import TrainingState
from elastic_ddp.training.elastic_run import ElasticRun, Step
from elastic_ddp.training.evaluation import Evaluator
from elastic_ddp.workload.collate import Collate, call_model, split_batch
from elastic_ddp.workload.data import SampleTransform
from elastic_ddp.workload.losses import LossFn, losses_and_weights, per_sample_cross_entropy

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
                 startup: StartupTimeline | None = None,
                 collate_fn: Collate | None = None):
        self.config = config
        self.run = ElasticRun(model, dataset, config, optimizer=optimizer, scheduler=scheduler,
                              sample_transform=sample_transform, collate_fn=collate_fn, context=context,
                              log_prefix=log_prefix, startup=startup)
        self.evaluator = (Evaluator(eval_dataset, loss_fn, config.eval_every_steps, config.micro_batch_size)
                          if eval_dataset is not None else None)
        self.loss_fn = loss_fn
        self.after_step = after_step

    @property
    def model(self) -> nn.Module:
        """The model being trained (on its device, sharded under --sharding fsdp)."""
        return self.run.module

    @property
    def state(self) -> TrainingState:
        return self.run.state

    @property
    def context(self) -> DistributedContext:
        return self.run.context

    @property
    def global_step(self) -> int:
        return self.run.global_step

    def fit(self) -> None:
        """Restore, train the remaining epochs, snapshot; always waits for the last write.

        SIGTERM during training drains (DrainRequested); one that arrives too late to drain, during
        the last steps, is raised again once everything is written and closed, so it still ends
        the process (or reaches the handler you had installed before `fit`).
        """
        with self.run as run:
            for step in run.steps():
                for batch in step.micro_batches():
                    inputs, targets = split_batch(batch)
                    with run.autocast():
                        result = self.loss_fn(call_model(run.model, inputs), targets)
                    losses, weights = losses_and_weights(result, len(targets))  # names --loss, the flag that chose it
                    step.backward(losses, weights)
                if self.config.max_grad_norm > 0:
                    step.clip_grad_norm_(self.config.max_grad_norm)
                step.commit()
                if step.committed and not run.group_broken:  # a lost peer: the group is re-formed first
                    self._after_step(step)

    def _after_step(self, step: Step) -> None:
        """Evaluation when its schedule says, then the hook, on every rank (collectives line up)."""
        if self.evaluator is not None and self.evaluator.should_evaluate(step.number, step.epoch_ended):
            result = self.evaluator.evaluate(self.run.module, self.run.context)
            self.run.run_log.evaluated(step.number, step.epoch, result)
        if self.after_step is not None:
            self.after_step(self)
