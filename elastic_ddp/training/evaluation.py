"""Evaluation on held-out data, over whatever ranks there are now.

`evaluate` splits the held-out set over the current ranks (contiguous shares, each sample once, no
padding), runs the model in eval mode under `torch.no_grad()` in batches of `batch_size`, and
all-reduces three sums: the per-sample loss, the correct predictions and the samples. The result
is the mean loss over the whole held-out set and, when the targets are class indices (integer
targets of one dimension, outputs of two), the accuracy; otherwise `accuracy` is None.

It does not change the training trajectory: no RNG is drawn (the samples are read in order and
collated directly, without a DataLoader, whose iterator draws a seed from the global RNG), the
sampler is not touched, and the model goes back to train mode afterwards. Buffers (BatchNorm's
running statistics) are first taken from rank 0, as DDP's next training forward would do anyway,
so every rank evaluates the same model. It is a collective: every rank calls it at the same step
with the unwrapped model (DDP's forward is a collective too, and the shares differ in length).
Not covered: models whose eval-mode forward depends on how the set is split into batches.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, default_collate

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.workload.losses import LossFn, losses_and_weights
from elastic_ddp.workload.sampler import even_split


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean per-sample loss over the held-out set (weighted, for a loss that returns weights)
    accuracy: float | None  # fraction of correct predictions, None when targets are not class indices
    samples: int


class Evaluator:
    """Evaluation on a schedule: every `every_steps` optimizer steps (0: never) and at each epoch end."""

    def __init__(self, dataset: Dataset, loss_fn: LossFn, every_steps: int, batch_size: int):
        self.dataset, self.loss_fn = dataset, loss_fn
        self.every_steps = every_steps
        self.batch_size = batch_size

    def should_evaluate(self, global_step: int, epoch_ended: bool) -> bool:
        """Whether the step just committed is one to evaluate at (the same answer on every rank)."""
        return epoch_ended or bool(self.every_steps and global_step % self.every_steps == 0)

    def evaluate(self, model: nn.Module, ctx: DistributedContext) -> EvalResult:
        """Held-out loss and accuracy of `model` (the run's of the moment: an in-process re-form under
        fsdp builds another) over all ranks of `ctx`, the group of the moment (a collective: every
        rank calls it)."""
        return evaluate(model, self.dataset, self.loss_fn, ctx.rank, ctx.world_size, self.batch_size,
                        ctx.device, ctx.in_process_group)


def evaluate(model: nn.Module, dataset: Dataset, loss_fn: LossFn, rank: int, world_size: int,
             batch_size: int, device: torch.device, distributed: bool) -> EvalResult:
    """The held-out loss (and accuracy) of `model` over all ranks (see the module docstring)."""
    if distributed:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    start, stop = even_split(len(dataset), world_size, rank)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    weight_sum = torch.zeros((), dtype=torch.float64, device=device)  # for a loss that returns weights (else 0)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    classified = torch.zeros((), dtype=torch.float64, device=device)  # samples whose targets are class indices
    was_training = model.training
    # A sharded model's forward is a collective (each block gathers its parameters), so every rank
    # makes the same number of forward calls: ranks with a smaller share forward sample 0 and
    # drop it. Unsharded, each rank only forwards its own share.
    sharded = _is_sharded(model)
    calls = math.ceil(math.ceil(len(dataset) / world_size) / batch_size) if sharded else 0
    model.eval()
    try:
        with torch.no_grad():
            for first in range(start, stop, batch_size):
                inputs, targets = (item.to(device) for item in
                                   default_collate([dataset[i] for i in range(first, min(stop, first + batch_size))]))
                outputs = model(inputs)
                calls -= 1
                losses, weights = losses_and_weights(loss_fn(outputs, targets), len(targets))
                if weights is None:
                    loss_sum += losses.double().sum()
                else:
                    loss_sum += (losses.double() * weights.double()).sum()
                    weight_sum += weights.double().sum()
                if _are_class_indices(outputs, targets):
                    correct += (outputs.argmax(dim=1) == targets).sum()
                    classified += len(targets)
            for _ in range(calls):
                model(default_collate([dataset[0]])[0].to(device))
    finally:
        model.train(was_training)
    sums = torch.stack([loss_sum, weight_sum, correct, classified])
    if distributed:
        dist.all_reduce(sums)
    loss_total, weight_total, correct_total, classified_total = sums.tolist()
    samples = len(dataset)
    accuracy = correct_total / classified_total if classified_total == samples else None
    # Unweighted, each rank divides by the whole set's length: the ranks' shares add up to the mean.
    mean = loss_total / weight_total if weight_total else loss_total / samples
    return EvalResult(loss=mean, accuracy=accuracy, samples=samples)


def _are_class_indices(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    return (not targets.is_floating_point() and targets.dim() == 1 and outputs.dim() == 2
            and len(outputs) == len(targets))


def _is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 sharded `model` (its parameters are DTensors). DTensor is looked up, not imported:
    importing it costs every unsharded worker about 0.7 s of CPU, and without it none can exist."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    return dtensor_module is not None and any(isinstance(p, dtensor_module.DTensor) for p in model.parameters())
