"""Your own model, dataset, loss, optimizer and schedule, trained elastically by elastic_ddp's Trainer.

    # one process, no torchrun
    python docs/examples/custom_model.py --epochs 2 --checkpoint_dir runs/custom
    # elastic, 1 to 4 nodes of 2 processes (run the same line on every node)
    torchrun --nnodes=1:4 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \\
        --rdzv_id=custom --max_restarts=10 docs/examples/custom_model.py --epochs 5 --checkpoint_dir runs/custom

Every TrainingConfig flag works here (`--global_batch_size`, `--snapshot_every_steps`, ...; see
docs/configuration.md); `--model`, `--dataset_size` and `--augment` describe the built-in model and
data, so this script ignores them. Walk-through: docs/custom-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_ddp import Trainer, TrainingConfig
from elastic_ddp.runtime.distributed import DistributedContext, exit_worker, process_group
from elastic_ddp.runlog.worker_logging import configure_worker_logging

SIGNAL_LENGTH = 64
FREQUENCIES = (1.0, 2.0, 3.0, 5.0)  # the class of a signal is its frequency


class NoisySines(Dataset):
    """Sine waves with random phase and noise; the label is the frequency's index.

    Map-style, and every sample is a pure function of (seed, index): every rank, in every world
    size and after every restart, sees the same sample for the same index. That is what lets the
    Trainer split the data over any number of ranks and resume mid-epoch exactly.
    """

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self.time = torch.linspace(0.0, 1.0, SIGNAL_LENGTH)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(len(FREQUENCIES), (), generator=generator))
        phase = float(torch.rand((), generator=generator)) * 2 * math.pi
        signal = torch.sin(2 * math.pi * FREQUENCIES[label] * self.time + phase)
        return signal + 0.3 * torch.randn(SIGNAL_LENGTH, generator=generator), label


class SignalClassifier(nn.Module):
    """A small 1-D convolutional network; no BatchNorm, so the maths does not depend on the world size."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, 16, kernel_size=7, padding=3), nn.GELU(),
            nn.Conv1d(16, 32, kernel_size=5, padding=2, stride=2), nn.GELU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.head = nn.Linear(32, len(FREQUENCIES))

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(signals.unsqueeze(1)))


def smoothed_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One loss per sample (reduction="none"): the Trainer averages over the global batch itself."""
    return nn.functional.cross_entropy(outputs, targets, reduction="none", label_smoothing=0.05)


def random_gain(sample: tuple[torch.Tensor, int], generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Augmentation drawn from the generator the Trainer seeds per (seed, epoch, index), never from
    the global RNG: a resumed or re-sharded run draws the same augmentation for the same sample."""
    signal, label = sample
    return signal * (0.8 + 0.4 * torch.rand((), generator=generator)), label


def main(argv: Sequence[str] | None = None) -> int:
    config = TrainingConfig.from_args(argv)
    context = DistributedContext.from_env(config.device)
    log_prefix = configure_worker_logging(context.rank, context.world_size)  # "[rank/world step N]" on each line
    with process_group(context, timedelta(seconds=config.collective_timeout_s)):
        torch.manual_seed(config.seed)  # the same initial weights on every rank
        model = SignalClassifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
        # Stepped once per optimizer step; the step count does not depend on the world size.
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.epochs * config.steps_per_epoch)
        trainer = Trainer(model=model, dataset=NoisySines(config.dataset_size, config.seed), config=config,
                          optimizer=optimizer, scheduler=scheduler, loss_fn=smoothed_cross_entropy,
                          sample_transform=random_gain, context=context, log_prefix=log_prefix)
        trainer.fit()
    return 0


if __name__ == "__main__":
    # Not sys.exit: the interpreter's teardown can abort in gloo after a finished run (see exit_worker).
    exit_worker(main())
