"""Weights in the global mean: what `step.backward(losses, weights)` (elastic_run.py) does with them.

The step's gradient is sum(w_i * grad loss_i) / sum(w_i), both sums over the whole global batch of
G samples, whatever the world size and the split into micro-batches:

1. each micro-batch's backward is seeded with w_i * world_size / G (equal weights seed every
   sample with world_size / G: with weights of 1 the numbers are an unweighted step's), and this
   rank adds its weights up (in float64, on the device: no synchronisation per micro-batch);
2. DDP (or FSDP2's reduce-scatter) averages the gradients over the ranks: sum(w_i grad loss_i) / G;
3. before the gradient is first read (clipping, or else the optimizer step in the commit), one
   all-reduce of two numbers gives the global weight sum W and the count of weights that are
   negative, NaN or infinite; every gradient is then divided by W / G.

A step without weights costs nothing of this. Bad weights are refused on every rank at step 3,
before any state changes, so that no rank waits for another that stopped alone; the length of a
micro-batch's weights is checked at once. Under the fp16 grad scaler the gradients are divided
while still scaled (a scalar: the order does not matter) and the scaler then unscales and checks
them as usual; under FSDP2 each rank divides its shards.

Not guaranteed: a rank that gives no weights while the others do is not in their all-reduce (its
next collective meets theirs: an error or a wait until the collective timeout). The magnitude of
the weights multiplies the backward's numbers: under fp16 keep them about 1 on average (any
constant factor cancels out: tokens / block_size weighs as tokens do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from elastic_ddp.runtime.distributed import DistributedContext


class StepWeights:
    """One step's weights on this rank: the backward seeds, their sum, and the division (module docstring)."""

    def __init__(self, step_number: int, global_samples: int):
        self.step_number = step_number
        self.global_samples = global_samples
        self.total: torch.Tensor | None = None  # this rank's weight sum (float64)
        self.invalid: torch.Tensor | None = None  # how many of them are negative, NaN or infinite
        self.divisor: float | None = None  # W / G once the ranks agreed on W

    def add(self, weights: object, losses: torch.Tensor) -> torch.Tensor:
        """`weights` of a micro-batch's `losses` (one per sample), checked for shape, added to this
        rank's sums, as float32 on the losses' device (their values are checked in `agree`)."""
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"step.backward: got weights of type {type(weights).__name__}; expected a tensor of one "
                            "non-negative finite weight per sample (or weights=None: equal weights)")
        if weights.shape != losses.shape:
            raise ValueError(f"step.backward: got weights of shape {tuple(weights.shape)} for losses of shape "
                             f"{tuple(losses.shape)}; expected one weight per sample, of the losses' shape")
        exact = weights.detach().to(device=losses.device, dtype=torch.float64)
        invalid = (~torch.isfinite(exact) | (exact < 0)).sum()
        total = exact.sum()
        self.total = total if self.total is None else self.total + total
        self.invalid = invalid if self.invalid is None else self.invalid + invalid
        return exact.float()

    def agree(self, context: DistributedContext) -> float:
        """W / G, from one all-reduce of this rank's sums (a collective: every rank calls it once
        per weighted step); ValueError on every rank when a weight is bad or W is 0."""
        sums = torch.stack([self.total, self.invalid.double()]).to(context.collective_device)
        if context.in_process_group:
            dist.all_reduce(sums)
        total, invalid = sums.tolist()
        if invalid:
            raise ValueError(f"step.backward: step {self.step_number}'s weights hold {int(invalid)} negative, NaN or "
                             "infinite value(s) over the global batch; expected non-negative finite weights")
        if total <= 0:
            raise ValueError(f"step.backward: step {self.step_number}'s weights sum to {total:g} over its global "
                             f"batch of {self.global_samples} samples; expected a positive sum (a step whose "
                             "samples all weigh nothing has no mean: give them weight, or leave them out)")
        self.divisor = total / self.global_samples
        return self.divisor


def divide_gradients(module: nn.Module, divisor: float) -> None:
    """Divide every gradient of `module` by `divisor` (DTensor shards under FSDP2 too)."""
    gradients = [parameter.grad for parameter in module.parameters() if parameter.grad is not None]
    if gradients:
        torch._foreach_div_(gradients, divisor)
