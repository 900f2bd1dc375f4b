"""The built-in synthetic dataset, and the view that gives the trainer rank-independent augmentation.

`SyntheticImageDataset` makes sample `i` from (seed, i) alone, so every rank and every incarnation
sees the same data without any file. `EpochSampleView` wraps any map-style dataset: it is indexed by
(epoch, index) and draws per-sample randomness from (seed, epoch, index), so an augmented sample is
the same whichever rank, world size or DataLoader worker produces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from elastic_ddp.sampler import derive_seed

SampleTransform = Callable[[Any, torch.Generator], Any]

IMAGE_SHAPE = (3, 16, 16)
NUM_CLASSES = 10


class SyntheticImageDataset(Dataset):
    """Noisy images around one fixed pattern per class: learnable, deterministic per index."""

    def __init__(self, size: int, seed: int = 0, image_shape: tuple[int, ...] = IMAGE_SHAPE,
                 num_classes: int = NUM_CLASSES):
        self.size = size
        self.seed = seed
        self.image_shape = image_shape
        self.num_classes = num_classes
        generator = torch.Generator().manual_seed(derive_seed("class-patterns", seed))
        self.class_patterns = torch.randn((num_classes, *image_shape), generator=generator)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} is outside a dataset of {self.size}")
        generator = torch.Generator().manual_seed(derive_seed("sample", self.seed, index))
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        noise = torch.randn(self.image_shape, generator=generator)
        return self.class_patterns[label] + noise, label


def random_horizontal_flip(sample: tuple[torch.Tensor, int], generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Flip the image left-right with probability 1/2, drawn from `generator`."""
    image, label = sample
    # .item(): a Python comparison costs a third of a tensor one, and this runs for every sample.
    if torch.rand((), generator=generator).item() < 0.5:
        image = image.flip(-1)
    return image, label


class EpochSampleView(Dataset):
    """`dataset` indexed by (epoch, index), with `transform` seeded from (seed, epoch, index)."""

    def __init__(self, dataset: Dataset, seed: int, transform: SampleTransform | None = None):
        self.dataset = dataset
        self.seed = seed
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        sample = self.dataset[index]
        if self.transform is None:
            return sample
        generator = torch.Generator().manual_seed(derive_seed("augment", self.seed, epoch, index))
        return self.transform(sample, generator)
