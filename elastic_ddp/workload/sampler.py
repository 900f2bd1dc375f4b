"""The elastic sampler: which samples each rank trains on, whatever the world size.

Every epoch has one global permutation of the dataset, drawn from (seed, epoch). The run's position
is a global cursor: `samples_consumed` in the current epoch. An optimizer step takes the next
`global_batch_size` samples of the permutation (fewer for the last step of an epoch, unless
`drop_last`) and splits them over the ranks of the *current* world as evenly as possible: shares
differ by at most one sample and a rank may get none. The state, (epoch, samples_consumed), does
not mention the world size, so a snapshot taken with 4 ranks resumes with 3 on exactly the samples
not yet consumed: nothing is padded, repeated or skipped.

Not guaranteed: with `drop_last`, the samples of the dropped tail are not seen in that epoch
(they are different samples each epoch, since the permutation changes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of plain values; stable across processes and Python runs."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


_MASK64 = (1 << 64) - 1


def mix_seed(value: int) -> int:
    """A 63-bit seed from an integer, well mixed (SplitMix64's finaliser): about 1 us, against about
    7 us for `derive_seed`. For the per-sample seeds of a hot loop: derive a base once with
    `derive_seed`, then `mix_seed(base + index)`."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def mix_seeds(values: np.ndarray) -> np.ndarray:
    """`mix_seed` of every value of a 1-d array at once (uint64; arithmetic modulo 2**64 as there)."""
    z = np.asarray(values).astype(np.uint64)
    assert z.ndim == 1, z.shape  # 0-d numpy arithmetic warns on the overflow relied on here
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) >> np.uint64(1)


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """The [start, stop) of share `index` when `total` items are split into `parts` shares.

    The first `total % parts` shares get one item more; shares are contiguous and cover everything.
    """
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def micro_batches(share: list[int], micro_batch_size: int) -> list[list[int]]:
    """Cut one rank's share of a global batch into forward passes of at most `micro_batch_size`.

    Always returns at least one micro-batch (empty when the share is empty): the last micro-batch
    is the one whose backward pass synchronises gradients, and every rank must take part in it.
    """
    if not share:
        return [[]]
    return [share[start:start + micro_batch_size] for start in range(0, len(share), micro_batch_size)]


def epoch_length(dataset_size: int, global_batch_size: int, drop_last: bool) -> int:
    """Samples trained on per epoch: the whole dataset, less the short last batch under `drop_last`."""
    return dataset_size - (dataset_size % global_batch_size if drop_last else 0)


def steps_per_epoch(dataset_size: int, global_batch_size: int, drop_last: bool) -> int:
    """Optimizer steps per epoch; a function of the data and the global batch, never of the world size."""
    return -(-epoch_length(dataset_size, global_batch_size, drop_last) // global_batch_size)


@dataclass(frozen=True)
class StepPlan:
    """What one rank does in one optimizer step."""

    epoch: int
    global_batch: list[int]  # the whole step's dataset indices, over every rank
    micro_batches: list[list[int]]  # this rank's dataset indices, one list per forward pass

    @property
    def global_samples(self) -> int:
        """Samples in the whole global batch (the loss is averaged over these)."""
        return len(self.global_batch)

    @property
    def rank_samples(self) -> list[int]:
        return [index for batch in self.micro_batches for index in batch]

    def samples_of(self, rank: int, world_size: int) -> list[int]:
        """Rank `rank`'s share of this step in a world of `world_size` (every rank can compute it)."""
        start, stop = even_split(len(self.global_batch), world_size, rank)
        return self.global_batch[start:stop]


class ElasticSampler:
    """Global permutation per epoch plus a global cursor; splits each global batch over the ranks.

    Call `plan_epoch_remainder(rank, world_size, micro_batch_size)` at the start of an epoch (or
    after a restore), train the steps in order, and `advance(step.global_samples)` after each
    committed optimizer step, then `start_next_epoch()` in the same commit once `epoch_finished`:
    a committed state never holds a finished epoch. `state_dict()` is independent of the world size.
    """

    def __init__(self, dataset_size: int, global_batch_size: int, seed: int, drop_last: bool = False):
        if dataset_size <= 0 or global_batch_size <= 0:
            raise ValueError(f"dataset_size ({dataset_size}) and global_batch_size ({global_batch_size}) "
                             "must be positive")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.samples_consumed = 0
        self._permutation_epoch: int | None = None
        self._permutation: list[int] = []

    @property
    def epoch_length(self) -> int:
        """Samples actually trained on per epoch (the whole dataset unless `drop_last` cuts a tail)."""
        return epoch_length(self.dataset_size, self.global_batch_size, self.drop_last)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.dataset_size, self.global_batch_size, self.drop_last)

    @property
    def epoch_finished(self) -> bool:
        return self.samples_consumed >= self.epoch_length

    def permutation(self, epoch: int) -> list[int]:
        """The epoch's order of dataset indices; the same on every rank and in every incarnation."""
        if self._permutation_epoch != epoch:
            generator = torch.Generator().manual_seed(derive_seed("permutation", self.seed, epoch))
            self._permutation = torch.randperm(self.dataset_size, generator=generator).tolist()
            self._permutation_epoch = epoch
        return self._permutation

    def next_global_batch(self) -> list[int]:
        """Dataset indices of the next optimizer step of the current epoch ([] when it is finished)."""
        stop = min(self.samples_consumed + self.global_batch_size, self.epoch_length)
        return self.permutation(self.epoch)[self.samples_consumed:stop]

    def plan_epoch_remainder(self, rank: int, world_size: int, micro_batch_size: int) -> list[StepPlan]:
        """This rank's plan for every step left in the current epoch, from the current cursor on."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        order = self.permutation(self.epoch)
        plans = []
        for start in range(self.samples_consumed, self.epoch_length, self.global_batch_size):
            global_batch = order[start:min(start + self.global_batch_size, self.epoch_length)]
            share_start, share_stop = even_split(len(global_batch), world_size, rank)
            plans.append(StepPlan(
                epoch=self.epoch,
                global_batch=global_batch,
                micro_batches=micro_batches(global_batch[share_start:share_stop], micro_batch_size),
            ))
        return plans

    def advance(self, samples: int) -> None:
        """Record that one optimizer step over `samples` samples has been committed."""
        self.samples_consumed += samples
        assert self.samples_consumed <= self.epoch_length, "advanced past the end of the epoch"

    def start_next_epoch(self) -> None:
        assert self.epoch_finished, "the current epoch still has samples to train on"
        self.epoch += 1
        self.samples_consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Load a cursor. One at the very end of an epoch (a state committed before the epoch
        rollover joined the commit) is the start of the next: it has no step left to plan."""
        epoch, consumed = int(state["epoch"]), int(state["samples_consumed"])
        if epoch < 0 or not 0 <= consumed <= self.epoch_length:
            raise ValueError(f"sampler state {state} does not fit a dataset of {self.dataset_size} samples "
                             f"with a global batch of {self.global_batch_size}")
        self.epoch, self.samples_consumed = epoch, consumed
        if self.epoch_finished:
            self.start_next_epoch()
