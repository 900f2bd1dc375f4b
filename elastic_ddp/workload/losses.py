"""Per-sample losses (`--loss`): the trainer sums them and scales the sum to the mean over the global batch.

A loss returns one loss per sample, or a pair (losses, weights): the trainer then passes the
weights to `step.backward`, and the mean over the global batch is weighted by them
(`token_cross_entropy`: each sample weighs its number of target tokens, so the step's loss is the
mean over every target token of the global batch). Outputs with `logits` (a Hugging Face model's)
are read for them; targets equal to IGNORE_INDEX (-100, a padding collate's) count for nothing.

Not done here: shifting. A sequence's target at position t is what the model must predict at t;
a Hugging Face causal LM's `labels` are its inputs, which the model shifts in its own loss: give
these losses `labels[:, 1:]` against `logits[:, :-1]`, or shift the labels in the dataset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastic_ddp.workload.collate import IGNORE_INDEX

LossFn = Callable[[Any, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def per_sample_cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample; for sequences (logits (N, T, classes), targets (N, T): a language
    model's), the mean over each sample's target positions (those not IGNORE_INDEX; 0 for none)."""
    logits = _logits(outputs)
    if logits.dim() != 3:
        return nn.functional.cross_entropy(logits, targets, reduction="none")
    losses, tokens = _summed_over_tokens(logits, targets)
    return losses / tokens.clamp(min=1)  # with no position ignored, the mean over T bit for bit


def token_cross_entropy(outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_sample_cross_entropy` and, as weights, each sample's number of target tokens (for class
    targets: 1, or 0 when ignored): their weighted mean is the mean over every target token."""
    logits = _logits(outputs)
    if logits.dim() != 3:
        losses = nn.functional.cross_entropy(logits, targets, reduction="none")
        return losses, (targets != IGNORE_INDEX).to(losses.dtype)
    losses, tokens = _summed_over_tokens(logits, targets)
    return losses / tokens.clamp(min=1), tokens


def _summed_over_tokens(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's cross-entropy summed over its target positions, and their number."""
    losses = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none",
                                         ignore_index=IGNORE_INDEX).view(targets.shape)
    return losses.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1).to(losses.dtype)


def _logits(outputs: Any) -> torch.Tensor:
    return getattr(outputs, "logits", outputs)


def per_sample_mse(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each sample over its own elements. Targets of the outputs' size in
    another shape (a regression target of shape (N,) for outputs of (N, 1)) are reshaped to it."""
    outputs = _logits(outputs)
    targets = targets.to(outputs.dtype)
    if targets.shape != outputs.shape and targets.numel() == outputs.numel():
        targets = targets.reshape(outputs.shape)
    squared = nn.functional.mse_loss(outputs, targets, reduction="none")
    return squared.reshape(len(squared), -1).mean(dim=1)


def losses_and_weights(result: Any, samples: int, what: str = "--loss") -> tuple[torch.Tensor, torch.Tensor | None]:
    """A loss's result as (losses, weights or None), checked: one loss (and weight) per sample."""
    losses, weights = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(losses, torch.Tensor):
        raise TypeError(f"{what}: the loss returned a {type(result).__name__}; expected one loss per sample (a "
                        "tensor), or a pair (losses, weights)")
    check_per_sample(losses, samples, what)
    if weights is not None and (not isinstance(weights, torch.Tensor) or weights.shape != losses.shape):
        raise ValueError(f"{what}: the loss returned weights of {getattr(weights, 'shape', type(weights).__name__)} "
                         f"for {samples} samples; expected one weight per sample, shape ({samples},)")
    return losses, weights


def check_per_sample(losses: torch.Tensor, samples: int, what: str = "--loss") -> None:
    """Raise ValueError naming `what` unless `losses` holds one loss per sample (reduction='none')."""
    if losses.dim() != 1 or losses.shape[0] != samples:
        raise ValueError(f"{what}: the loss returned a tensor of shape {tuple(losses.shape)} for {samples} samples; "
                         "expected one loss per sample, shape (samples,) (reduction='none')")
