"""Per-sample losses (`--loss`): the trainer sums them and scales the sum to the mean over the global batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample; for sequences (logits (N, T, classes), targets (N, T): a language
    model's), the mean over each sample's positions."""
    if outputs.dim() == 3:
        losses = nn.functional.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction="none")
        return losses.view(targets.shape).mean(dim=1)
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def per_sample_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each sample over its own elements. Targets of the outputs' size in
    another shape (a regression target of shape (N,) for outputs of (N, 1)) are reshaped to it."""
    targets = targets.to(outputs.dtype)
    if targets.shape != outputs.shape and targets.numel() == outputs.numel():
        targets = targets.reshape(outputs.shape)
    squared = nn.functional.mse_loss(outputs, targets, reduction="none")
    return squared.reshape(len(squared), -1).mean(dim=1)


def check_per_sample(losses: torch.Tensor, samples: int, what: str = "--loss") -> None:
    """Raise ValueError naming `what` unless `losses` holds one loss per sample (reduction='none')."""
    if losses.dim() != 1 or losses.shape[0] != samples:
        raise ValueError(f"{what}: the loss returned a tensor of shape {tuple(losses.shape)} for {samples} samples; "
                         "expected one loss per sample, shape (samples,) (reduction='none')")
