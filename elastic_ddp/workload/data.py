"""The built-in synthetic dataset, and the view that gives the trainer rank-independent augmentation.

`SyntheticImageDataset` makes sample `i` from (seed, i) alone, so every rank and every incarnation
sees the same data without any file. `EpochSampleView` wraps any map-style dataset: it is indexed by
(epoch, index) and draws per-sample randomness from (seed, epoch, index), so an augmented sample is
the same whichever rank, world size or DataLoader worker produces it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from elastic_ddp.workload.sampler import StepPlan, derive_seed, mix_seed

SampleTransform = Callable[[Any, torch.Generator], Any]

IMAGE_SHAPE = (3, 16, 16)
NUM_CLASSES = 10


class SyntheticImageDataset(Dataset):
    """Noisy images around one fixed pattern per class: learnable, deterministic per index.

    `held_out=True` draws other samples around the same class patterns: data for evaluation.

    Making a sample costs about 15 us of CPU (seeding a generator and drawing the noise), a third
    of the MLP's whole training step per sample on one core. So a dataset of at most
    `CACHE_LIMIT_BYTES` of images keeps every sample it made (the default 4096 samples: 12 MiB)
    and serves later epochs from memory; `__getitem__` returns a copy, the same values either way.
    """

    CACHE_LIMIT_BYTES = 256 * 2**20

    def __init__(self, size: int, seed: int = 0, image_shape: tuple[int, ...] = IMAGE_SHAPE,
                 num_classes: int = NUM_CLASSES, held_out: bool = False):
        self.size = size
        self.seed = seed
        self.image_shape = image_shape
        self.num_classes = num_classes
        generator = torch.Generator().manual_seed(derive_seed("class-patterns", seed))
        self.class_patterns = torch.randn((num_classes, *image_shape), generator=generator)
        # A held-out set: the same class patterns, other noise (and so other samples).
        self._sample_base = derive_seed("held-out-sample" if held_out else "sample", seed)
        self._generator = torch.Generator()  # reseeded per sample
        image_bytes = self.class_patterns[0].numel() * self.class_patterns.element_size()
        self._made: dict[int, tuple[torch.Tensor, int]] | None = (
            {} if size * image_bytes <= self.CACHE_LIMIT_BYTES else None)  # None: too big to keep

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} is outside a dataset of {self.size}")
        made = self._made.get(index) if self._made is not None else None
        if made is None:
            sample_seed = mix_seed(self._sample_base + index)
            label = sample_seed % self.num_classes
            noise = torch.randn(self.image_shape, generator=self._generator.manual_seed(sample_seed))
            made = (self.class_patterns[label] + noise, label)
            if self._made is not None:
                self._made[index] = made
        image, label = made
        return image.clone(), label  # a copy: the caller may change it in place


def random_horizontal_flip(sample: tuple[torch.Tensor, int], generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Flip the image left-right with probability 1/2, drawn from `generator`."""
    image, label = sample
    # .item(): a Python comparison costs a third of a tensor one, and this runs for every sample.
    if torch.rand((), generator=generator).item() < 0.5:
        image = image.flip(-1)
    return image, label


class EpochSampleView(Dataset):
    """`dataset` indexed by (epoch, index), with `transform` seeded from (seed, epoch, index).

    The transform gets one generator per view, reseeded for every sample (creating a generator per
    sample cost a few microseconds each, on the training thread): use it within the call only.
    """

    def __init__(self, dataset: Dataset, seed: int, transform: SampleTransform | None = None):
        self.dataset = dataset
        self.seed = seed
        self.transform = transform
        self._generator = torch.Generator()
        self._epoch_bases: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        sample = self.dataset[index]
        if self.transform is None:
            return sample
        return self.transform(sample, self._generator.manual_seed(self.sample_seed(epoch, index)))

    def sample_seed(self, epoch: int, index: int) -> int:
        """The transform's seed for sample `index` in `epoch`: a function of (seed, epoch, index) only."""
        base = self._epoch_bases.get(epoch)
        if base is None:
            base = self._epoch_bases[epoch] = derive_seed("augment", self.seed, epoch)
        return mix_seed(base + index)


def plan_loader(samples: EpochSampleView, epoch: int, plans: list[StepPlan], num_workers: int,
                pin_memory: bool) -> DataLoader:
    """The batches of this rank's non-empty micro-batches of `plans`, in plan order."""
    keyed = [[(epoch, index) for index in batch] for plan in plans for batch in plan.micro_batches if batch]
    return DataLoader(samples, batch_sampler=keyed, num_workers=num_workers, pin_memory=pin_memory,
                      worker_init_fn=_ignore_sigterm)


def empty_batch_like(samples: EpochSampleView) -> list[torch.Tensor]:
    """A batch of zero samples shaped like the dataset's: for a rank whose share of a step is empty
    (it still runs the forward and backward passes that synchronise the gradients)."""
    collated = default_collate([samples[(0, 0)]])
    return [item[:0] for item in collated]


def _ignore_sigterm(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to the training process, which drains and then ends them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
