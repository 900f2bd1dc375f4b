"""What the trainer builds when you bring less: the optimizer, the schedule, the scaler, autocast.

`build_training_state` assembles the `TrainingState` a run snapshots from your model, your
optimizer and scheduler if you gave them, and the defaults below otherwise:

- `--optimizer`: SGD (`--momentum`) or AdamW (`--betas`), with `--lr` and `--weight_decay` (on every
  parameter, or with `--no-decay_norms_and_biases` only on those of two or more dimensions: a second
  parameter group without decay holds the biases and norm scales);
- a linear warm-up (`--warmup_steps`) then cosine decay to zero over all epochs;
- a GradScaler, enabled only for fp16 autocast (`--use_amp` on CUDA, `--amp_dtype auto` or `fp16`);
  bf16 (on the CPU, or `--amp_dtype bf16` on CUDA) needs none.

Not guaranteed: a scheduler you bring is stepped once per optimizer step and saved with the
state; one whose state_dict does not capture its position resumes from the wrong place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from elastic_ddp.config import TrainingConfig
from elastic_ddp.snapshot.training_state import ExtraState, ScalerState, Stateful, StepCounter, TrainingState
from elastic_ddp.workload.sampler import ElasticSampler


def build_optimizer(config: TrainingConfig, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """`--optimizer`: SGD (`--momentum`) or AdamW (`--betas`), with `--lr`, `--weight_decay` and
    `--decay_norms_and_biases` (module docstring)."""
    groups = weight_decay_groups(list(parameters), config.weight_decay, config.decay_norms_and_biases)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def weight_decay_groups(parameters: list[torch.nn.Parameter], weight_decay: float,
                        decay_all: bool) -> list[dict[str, object]]:
    """One parameter group with `weight_decay` on every parameter (`decay_all`), or two: the
    parameters of two or more dimensions with it, the others (biases, norm scales) without. A group
    that would be empty is left out, and with no decay to apply there is one group either way."""
    if decay_all or weight_decay == 0:
        return [{"params": parameters}]
    groups = [{"params": [p for p in parameters if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                           total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to zero at `total_steps`: a pure function of the step."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast_dtype(config: TrainingConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `--use_amp` and `--amp_dtype` (auto: fp16 on CUDA, bf16 on CPU); None
    without AMP. Only fp16 enables the GradScaler (`build_training_state`)."""
    if not config.use_amp:
        return None
    if config.amp_dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.bfloat16 if config.amp_dtype == "bf16" else torch.float16


def build_training_state(model: torch.nn.Module, dataset_size: int, config: TrainingConfig, device: torch.device,
                         optimizer: torch.optim.Optimizer | None = None,
                         scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                         extra_state: dict[str, Stateful] | None = None) -> TrainingState:
    """The state of a run of `model` (already on `device`) over `dataset_size` samples, with the
    defaults of the module docstring for what is None; `extra_state`: the user's own (`ExtraState`)."""
    optimizer = optimizer or build_optimizer(config, model.parameters())
    sampler = ElasticSampler(dataset_size, config.global_batch_size, config.seed, config.drop_last)
    if scheduler is None:
        scheduler = warmup_cosine_schedule(optimizer, config.warmup_steps, config.epochs * sampler.steps_per_epoch)
    fp16 = autocast_dtype(config, device) == torch.float16
    return TrainingState(model=model, optimizer=optimizer, scheduler=scheduler,
                         grad_scaler=ScalerState(torch.amp.GradScaler("cuda", enabled=fp16)),
                         sampler=sampler, progress=StepCounter(), extra_state=ExtraState(extra_state))
