"""The built-in synthetic dataset, and the view that gives the trainer rank-independent augmentation.

`SyntheticImageDataset` makes sample `i` from (seed, i) alone, so every rank and every incarnation
sees the same data without any file. `EpochSampleView` wraps any map-style dataset: it is indexed by
(epoch, index) and draws per-sample randomness from (seed, epoch, index), so an augmented sample is
the same whichever rank, world size or DataLoader worker produces it. A transform that can also work
on a whole batch (`BatchedSampleTransform`, such as the built-in flip) gets the draws of every
sample of an epoch's loader computed at once, and returns exactly what the per-sample calls would.
With a collate of the user's (collate.py), each micro-batch is that collate of its samples, made
in the DataLoader's workers; the built-in fast paths are then not taken (they make what
`default_collate` makes). `check_map_style` refuses a stream where the run is built.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from elastic_ddp.workload.collate import Collate, CollateError, empty_batch
from elastic_ddp.workload.generator_draws import first_uniform_floats
from elastic_ddp.workload.sampler import StepPlan, derive_seed, mix_seed, mix_seeds

SampleTransform = Callable[[Any, torch.Generator], Any]


@runtime_checkable
class BatchedSampleTransform(Protocol):
    """A `SampleTransform` that can also transform a collated batch, with the same result.

    Contract: for samples s_i with seeds k_i, `apply_to_batch(default_collate([s_i]), draw([k_i]))`
    equals `default_collate([self(s_i, torch.Generator().manual_seed(k_i))])` exactly.
    """

    def __call__(self, sample: Any, generator: torch.Generator) -> Any: ...

    def draw(self, seeds: np.ndarray) -> np.ndarray:
        """What the per-sample call would draw from a generator seeded with each seed (one row each)."""

    def apply_to_batch(self, batch: Any, draws: np.ndarray) -> Any:
        """The collated batch transformed by `draw`'s rows, sample by sample."""

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
        cached = size * image_bytes <= self.CACHE_LIMIT_BYTES  # else too big to keep: made on each call
        # The cache: every sample made so far, kept as a row of `_images` (a batch is then one
        # index_select) and in `_made` as (that row, label) for the per-sample path.
        self._made: dict[int, tuple[torch.Tensor, int]] | None = {} if cached else None
        self._images = torch.empty((size, *image_shape), dtype=self.class_patterns.dtype) if cached else None
        self._labels = np.zeros(size, dtype=np.int64) if cached else None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self._sample(index)
        return image.clone(), label  # a copy: the caller may change it in place

    def collated(self, indices: list[int]) -> list[torch.Tensor]:
        """`default_collate([self[index] for index in indices])`, without a copy of each sample first."""
        if self._made is None:
            return default_collate([self._sample(index) for index in indices])
        for index in indices:
            if index not in self._made:
                self._sample(index)  # makes and keeps it, or refuses an index outside the dataset
        rows = np.asarray(indices, dtype=np.int64)
        return [self._images.index_select(0, torch.from_numpy(rows)), torch.from_numpy(self._labels[rows])]

    def _sample(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample `index`; a cached one is the cache's own row: not to be changed."""
        made = self._made.get(index) if self._made is not None else None
        if made is not None:
            return made
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} is outside a dataset of {self.size}")
        sample_seed = mix_seed(self._sample_base + index)
        label = sample_seed % self.num_classes
        noise = torch.randn(self.image_shape, generator=self._generator.manual_seed(sample_seed))
        image = self.class_patterns[label] + noise
        if self._made is not None:
            self._images[index] = image
            self._labels[index] = label
            image = self._images[index]
            self._made[index] = (image, label)
        return image, label


class RandomHorizontalFlip:
    """Flip the image left-right with probability 1/2: when `torch.rand` of the sample's generator
    is under 1/2. `draw` computes that draw for many seeds at once (workload/generator_draws.py), so
    a batch flips exactly the samples that one call per sample would."""

    def __call__(self, sample: tuple[torch.Tensor, int], generator: torch.Generator) -> tuple[torch.Tensor, int]:
        image, label = sample
        # .item(): a Python comparison costs a third of a tensor one (on the per-sample path).
        if torch.rand((), generator=generator).item() < 0.5:
            image = image.flip(-1)
        return image, label

    def draw(self, seeds: np.ndarray) -> np.ndarray:
        """Whether each seed's sample is flipped."""
        return first_uniform_floats(seeds) < 0.5

    def apply_to_batch(self, batch: list[torch.Tensor], draws: np.ndarray) -> list[torch.Tensor]:
        images, labels = batch
        rows = torch.from_numpy(np.flatnonzero(draws))
        # `images` is the collated copy, ours to change; index_copy_ is the cheapest of the ways tried.
        images.index_copy_(0, rows, images.index_select(0, rows).flip(-1))
        return [images, labels]


random_horizontal_flip = RandomHorizontalFlip()


class EpochSampleView(Dataset):
    """`dataset` indexed by (epoch, index), with `transform` seeded from (seed, epoch, index).

    `batch` makes a collated batch at once: with `collate_fn`, that collate of the transformed
    samples; without, `default_collate`'s, through the dataset's `collated(indices)` when it has
    one, and the transform's `apply_to_batch` when it is a `BatchedSampleTransform` given its draws.

    The transform gets one generator per view, reseeded for every sample (creating a generator per
    sample cost a few microseconds each, on the training thread): use it within the call only.
    """

    def __init__(self, dataset: Dataset, seed: int, transform: SampleTransform | None = None,
                 collate_fn: Collate | None = None):
        self.dataset = dataset
        self.seed = seed
        self.transform = transform
        self.collate_fn = collate_fn
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

    def sample_seeds(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        """`sample_seed(epoch, index)` for every index of a 1-d array at once (uint64)."""
        self.sample_seed(epoch, 0)  # the epoch's base, derived once
        return mix_seeds(np.uint64(self._epoch_bases[epoch]) + np.asarray(indices).astype(np.uint64))

    def batch(self, epoch: int, indices: list[int], draws: np.ndarray | None = None) -> Any:
        """The samples `indices` of `epoch`, transformed and collated. `draws`: the transform's
        draws for them (a `BatchedSampleTransform` without `collate_fn` only); without, one
        transform call per sample."""
        if self.collate_fn is not None or (self.transform is not None and draws is None):
            return self.collate([self[(epoch, index)] for index in indices], indices, epoch)
        collated = getattr(self.dataset, "collated", None)  # a dataset's own batched fetch, if it has one
        if collated is not None:
            batch = collated(indices)
        else:
            batch = self.collate([self.dataset[index] for index in indices], indices, epoch)
        return batch if self.transform is None else self.transform.apply_to_batch(batch, draws)

    def collate(self, samples: list[Any], indices: list[int], epoch: int) -> Any:
        """`collate_fn(samples)` (default_collate's without one); CollateError naming the samples
        when it raises (a sample of another structure than the others', unequal lengths)."""
        try:
            return (self.collate_fn or default_collate)(samples)
        except Exception as exc:
            shown = indices if len(indices) <= 8 else [*indices[:8], "..."]
            if self.collate_fn is None:
                name, hint = "default_collate", ("; samples of unequal length need a collate that pads (collate_fn=, "
                                                 "--collate), such as elastic_ddp.workload.collate:pad_token_sequences")
            else:
                name, hint = getattr(self.collate_fn, "__name__", type(self.collate_fn).__name__), ""
            said = " ".join(str(exc).split())  # one line
            raise CollateError(f"collate_fn: {name} raised {type(exc).__name__}: {said} on samples {shown} of "
                               f"epoch {epoch}{hint}") from exc

    def empty_batch(self) -> Any:
        """The batch of a rank whose share of a step is empty (collate.empty_batch's rule), made
        from sample 0 as epoch 0 sees it."""
        return empty_batch(lambda samples: self.collate(samples, [0] * len(samples), 0), self[(0, 0)])

    def draw_all(self, epoch: int, indices: np.ndarray) -> np.ndarray | None:
        """The batched transform's draws for `indices` of `epoch`; None when the transform is per
        sample, or a collate of the user's makes the batch (the transform then runs per sample)."""
        if self.collate_fn is not None or not isinstance(self.transform, BatchedSampleTransform):
            return None
        return self.transform.draw(self.sample_seeds(epoch, indices))


class _EpochBatches(Dataset):
    """One epoch's micro-batches of one rank, item k the collated k-th; the draws of a batched
    transform are made for all of them when the loader is built (a few hundred numpy operations
    per epoch instead of a seeded generator per sample)."""

    def __init__(self, samples: EpochSampleView, epoch: int, batches: list[list[int]]):
        self.samples = samples
        self.epoch = epoch
        self.batches = batches
        indices = np.fromiter(itertools.chain.from_iterable(batches), dtype=np.int64)
        draws = samples.draw_all(epoch, indices)
        ends = np.cumsum([len(batch) for batch in batches])[:-1]
        self.draws = np.split(draws, ends) if draws is not None else None

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, number: int) -> Any:
        return self.samples.batch(self.epoch, self.batches[number],
                                  self.draws[number] if self.draws is not None else None)


def plan_loader(samples: EpochSampleView, epoch: int, plans: list[StepPlan], num_workers: int,
                pin_memory: bool) -> DataLoader:
    """The batches of this rank's non-empty micro-batches of `plans`, in plan order."""
    batches = [batch for plan in plans for batch in plan.micro_batches if batch]
    # batch_size=None: each item of _EpochBatches is already a collated batch.
    return DataLoader(_EpochBatches(samples, epoch, batches), batch_size=None, num_workers=num_workers,
                      pin_memory=pin_memory, worker_init_fn=_ignore_sigterm)


def check_map_style(dataset: Any, what: str) -> None:
    """Raise TypeError, `what` (e.g. "dataset: got") first, unless `dataset` is map-style: a stream
    cannot be split by sample index, which exactly once across world sizes rests on."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(f"{what} a {type(dataset).__name__}; expected a map-style dataset (__len__ and __getitem__, "
                        "not an IterableDataset): exactly once across world sizes needs samples by index (each "
                        "step's global batch is split over the ranks by index, a resume starts at a sample count); "
                        "use a map-style one instead: Hugging Face datasets' Dataset (Arrow, memory-mapped), a "
                        "memory-mapped token file (--dataset tokens), or a map-style view over shards of known "
                        "length")


def _ignore_sigterm(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to the training process, which drains and then ends them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
