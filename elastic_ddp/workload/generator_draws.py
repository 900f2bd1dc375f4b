"""What torch's CPU generator draws first after `manual_seed(seed)`, for many seeds at once.

Seeded per-sample augmentation reseeds one generator for every sample and draws from it: about
3 us of CPU per sample on the training thread, most of it the call overhead of `manual_seed` and a
scalar `torch.rand`. These functions give the same numbers for a whole array of seeds with a few
hundred numpy operations, so an epoch's draws cost a fraction of a microsecond per sample.

torch's CPU generator is MT19937 seeded with the low 32 bits of the seed (`at::mt19937`,
`init_with_uint32`); a float32 `torch.rand` is the low 24 bits of the next 32-bit output divided by
2**24 (`at::uniform_real_distribution`). The first output of MT19937 needs words 0, 1 and 397 of
the seeded state, and the state is a recurrence, hence a loop of 397 steps over the whole array.

Not guaranteed: only the first draw after seeding, and only float32 `torch.rand`; a torch release
that changed its generator would break the equality, which tests/unit/test_generator_draws.py
checks against torch itself.
"""

from __future__ import annotations

import numpy as np

_STATE_WORDS_NEEDED = 397  # MT19937's middle word (m): output 0 mixes words 0, 1 and 397
_INIT_MULTIPLIER = np.uint32(1812433253)
_MATRIX_A = np.uint32(0x9908B0DF)
_UPPER_BIT = np.uint32(0x80000000)
_LOWER_BITS = np.uint32(0x7FFFFFFF)
_FLOAT32_MANTISSA_MASK = np.uint32((1 << 24) - 1)


def first_mt19937_outputs(seeds: np.ndarray) -> np.ndarray:
    """The first 32-bit output of torch's CPU generator after `manual_seed(seed)`, per seed."""
    seeds = np.asarray(seeds)
    assert seeds.ndim == 1, seeds.shape  # 0-d numpy arithmetic warns on the overflow relied on here
    state = (seeds.astype(np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    word0 = state.copy()
    word1 = None
    shifted = np.empty_like(state)
    with np.errstate(over="ignore"):
        for position in range(1, _STATE_WORDS_NEEDED + 1):
            np.right_shift(state, 30, out=shifted)
            np.bitwise_xor(state, shifted, out=state)
            np.multiply(state, _INIT_MULTIPLIER, out=state)
            np.add(state, np.uint32(position), out=state)
            if position == 1:
                word1 = state.copy()
    mixed = (word0 & _UPPER_BIT) | (word1 & _LOWER_BITS)
    output = state ^ (mixed >> np.uint32(1)) ^ np.where(mixed & np.uint32(1), _MATRIX_A, np.uint32(0))
    output ^= output >> np.uint32(11)  # MT19937's tempering
    output ^= (output << np.uint32(7)) & np.uint32(0x9D2C5680)
    output ^= (output << np.uint32(15)) & np.uint32(0xEFC60000)
    output ^= output >> np.uint32(18)
    return output


def first_uniform_floats(seeds: np.ndarray) -> np.ndarray:
    """`torch.rand((), generator=torch.Generator().manual_seed(seed)).item()` per seed, exactly
    (float64 holds every float32 value of [0, 1) that this can give)."""
    return (first_mt19937_outputs(seeds) & _FLOAT32_MANTISSA_MASK).astype(np.float64) / float(1 << 24)
