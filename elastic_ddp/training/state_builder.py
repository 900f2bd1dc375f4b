"""The optimizer and learning-rate schedule the trainer builds when you bring none."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from elastic_ddp.config import TrainingConfig


def build_optimizer(config: TrainingConfig, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """`--optimizer`: SGD (`--momentum`) or AdamW (`--betas`), with `--lr` and `--weight_decay`."""
    if config.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    return torch.optim.SGD(parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                           total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to zero at `total_steps`: a pure function of the step."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
