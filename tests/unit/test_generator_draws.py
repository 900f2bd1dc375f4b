"""The batched draws equal torch's own per-seed draws, seeds of every size."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from elastic_ddp.workload.generator_draws import first_mt19937_outputs, first_uniform_floats
from elastic_ddp.workload.sampler import mix_seed, mix_seeds


@pytest.mark.timeout(60)
def test_first_uniform_floats_equal_torch_rand_after_manual_seed():
    rng = random.Random(28)
    seeds = [0, 1, 5489, 2**32 - 1, 2**32, 2**63 - 1] + [rng.getrandbits(63) for _ in range(3000)]
    batched = first_uniform_floats(np.array(seeds, dtype=np.uint64))
    generator = torch.Generator()
    expected = [torch.rand((), generator=generator.manual_seed(seed)).item() for seed in seeds]
    assert batched.tolist() == expected


@pytest.mark.timeout(60)
def test_first_outputs_are_mt19937s_reference_values():
    # The reference implementation's first output for its default seed 5489 (std::mt19937).
    assert first_mt19937_outputs(np.array([5489], dtype=np.uint64)).tolist() == [3499211612]


@pytest.mark.timeout(60)
def test_mix_seeds_equals_mix_seed_everywhere_modulo_two_to_the_64():
    rng = random.Random(7)
    values = [0, 1, 2**63 - 1, 2**64 - 1] + [rng.getrandbits(64) for _ in range(2000)]
    assert mix_seeds(np.array(values, dtype=np.uint64)).tolist() == [mix_seed(value) for value in values]
