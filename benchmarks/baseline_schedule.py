"""The learning-rate schedule of the bare baselines (bare_ddp.py, bare_gpt_loop.py).

Linear warm-up, then cosine decay to zero: what elastic_ddp builds when given no scheduler. Written
out here so that a baseline imports nothing of elastic_ddp's training machinery (its memory and
start-up stay the bare loop's); tests/unit/test_benchmark_tables.py checks the learning rates are
the same as `elastic_ddp.training.state_builder.warmup_cosine_schedule`'s.
"""

from __future__ import annotations

import math

import torch


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                           total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
