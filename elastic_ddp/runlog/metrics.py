"""The loss and throughput that rank 0 reports every --log_interval steps, averaged over all ranks."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class LossWindow:
    """Loss and throughput since the last report; `reduce` is a collective when distributed.

    The per-step cost is two tensor additions on the device (no synchronisation): the sums are
    read once per report.
    """

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
        """(mean loss per sample, global samples per second), and start a new window."""
        if distributed:
            dist.all_reduce(self.totals)
        loss = (self.totals[0] / self.totals[1].clamp(min=1)).item()
        samples_per_second = self.global_samples / max(time.monotonic() - self.started, 1e-9)
        self._reset()
        return loss, samples_per_second
