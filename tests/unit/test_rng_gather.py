"""Every rank's RNG state in one fixed-size gather: the same states `capture_rng_state` gives."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.snapshot.exchange import rng_gather
from elastic_ddp.snapshot.training_state import capture_rng_state, restore_rng_state


def assert_same_state(a: dict, b: dict) -> None:
    assert torch.equal(a["torch"], b["torch"])
    assert a["python"][0] == b["python"][0] and tuple(a["python"][1]) == tuple(b["python"][1])
    assert a["python"][2] == b["python"][2]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("with_cached_gaussian", [False, True])
def test_a_state_survives_encoding_and_restores_the_same_streams(with_cached_gaussian):
    torch.manual_seed(7)
    random.seed(11)
    if with_cached_gaussian:
        random.gauss(0, 1)  # leaves a cached second value in the state
    state = capture_rng_state()
    assert (state["python"][2] is not None) == with_cached_gaussian
    decoded = rng_gather.decode_rng_state(rng_gather.encode_rng_state(state))
    assert_same_state(decoded, state)
    expected = (torch.rand(3), random.random(), random.gauss(0, 1))
    restore_rng_state(decoded)
    drawn = (torch.rand(3), random.random(), random.gauss(0, 1))
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]


@pytest.mark.timeout(30)
def test_every_state_encodes_to_the_same_size():
    sizes = set()
    for seed in (0, 1, 2**31, 2**62):
        torch.manual_seed(seed)
        random.seed(seed)
        sizes.add(rng_gather.encode_rng_state(capture_rng_state()).numel())
    assert len(sizes) == 1


@pytest.mark.timeout(60)
def test_the_gather_is_one_collective_of_fixed_size_tensors_on_cpu(one_rank_gloo_group, monkeypatch):
    calls = []
    all_gather = dist.all_gather
    monkeypatch.setattr(dist, "all_gather", lambda outputs, tensor, **kw: calls.append(tensor.numel())
                        or all_gather(outputs, tensor, **kw))
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("pickled gather used on CPU"))
    torch.manual_seed(3)
    expected = capture_rng_state()
    gathered = rng_gather.gather_rng_states(1, torch.device("cpu"))
    assert len(calls) == 1 and len(gathered) == 1
    assert_same_state(gathered[0], expected)
