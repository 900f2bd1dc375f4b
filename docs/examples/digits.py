"""Handwritten digits (the 8x8 images that scikit-learn ships) trained from the command line.

    pip install scikit-learn
    PYTHONPATH=docs/examples torchrun --nnodes=1:2 --nproc_per_node=2 --rdzv_backend=elastic-c10d \\
        --rdzv_endpoint=127.0.0.1:29400 --rdzv_id=digits --max_restarts=10 \\
        -m elastic_ddp.train --config docs/examples/digits.toml --checkpoint_dir runs/digits

Nothing here knows about elastic_ddp: three callables with no arguments, named by import path in
digits.toml (`--model digits:model`, `--dataset digits:train_set`, `--eval_dataset digits:test_set`).
The split is fixed (a permutation from a constant seed), so every rank and every restart sees the
same 1437 training and 360 held-out images.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

HELD_OUT = 360  # of 1797 images, about a fifth
SPLIT_SEED = 0


def model() -> nn.Module:
    """A small MLP over the 64 pixels; elastic_ddp seeds torch from --seed before calling this."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _split(held_out: bool) -> TensorDataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the digits example needs scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0  # pixel values are 0..16
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    chosen = order[:HELD_OUT] if held_out else order[HELD_OUT:]
    return TensorDataset(images[chosen], labels[chosen])


def train_set() -> TensorDataset:
    return _split(held_out=False)


def test_set() -> TensorDataset:
    return _split(held_out=True)
