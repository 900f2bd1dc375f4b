"""The elastic sampler: exactly-once splits, world-size-free state, resume on another world size."""

from __future__ import annotations

import pytest

from elastic_ddp.workload.sampler import ElasticSampler, even_split, micro_batches


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("global_batch", [1, 4, 7, 64])
def test_every_split_of_a_global_batch_covers_it_exactly_once(world_size, global_batch):
    shares = [even_split(global_batch, world_size, rank) for rank in range(world_size)]
    covered = [i for start, stop in shares for i in range(start, stop)]
    assert covered == list(range(global_batch))
    sizes = [stop - start for start, stop in shares]
    assert max(sizes) - min(sizes) <= 1


def test_micro_batches_respect_the_limit_and_an_empty_share_still_syncs():
    assert micro_batches(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert micro_batches([], 4) == [[]]


def epoch_samples(sampler: ElasticSampler, world_size: int, micro: int = 3) -> list[int]:
    """Train (on paper) the rest of the epoch with `world_size` ranks; return the samples seen."""
    plans = [sampler.plan_epoch_remainder(rank, world_size, micro) for rank in range(world_size)]
    seen = []
    for step_plans in zip(*plans):
        assert len({p.global_samples for p in step_plans}) == 1
        for plan in step_plans:
            assert all(len(batch) <= micro for batch in plan.micro_batches)
            seen += plan.rank_samples
        sampler.advance(step_plans[0].global_samples)
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_an_epoch_consumes_every_sample_exactly_once(world_size):
    sampler = ElasticSampler(dataset_size=103, global_batch_size=16, seed=1)
    assert sorted(epoch_samples(sampler, world_size)) == list(range(103))
    assert sampler.epoch_finished


def test_permutation_changes_with_epoch_and_seed_but_not_with_world_size():
    a = ElasticSampler(50, 8, seed=1)
    assert a.permutation(0) != a.permutation(1)
    assert ElasticSampler(50, 8, seed=1).permutation(0) == ElasticSampler(50, 8, seed=1).permutation(0)
    assert ElasticSampler(50, 8, seed=2).permutation(0) != a.permutation(0)


def test_state_round_trip_mid_epoch():
    sampler = ElasticSampler(100, 10, seed=3)
    sampler.advance(10)
    sampler.advance(10)
    restored = ElasticSampler(100, 10, seed=3)
    restored.load_state_dict(sampler.state_dict())
    assert restored.state_dict() == {"epoch": 0, "samples_consumed": 20}
    assert restored.next_global_batch() == sampler.next_global_batch()


@pytest.mark.parametrize("before, after", [(4, 3), (1, 4), (3, 5), (2, 1)])
def test_resume_on_another_world_size_continues_with_exactly_the_unconsumed_samples(before, after):
    sampler = ElasticSampler(dataset_size=97, global_batch_size=12, seed=7)
    plans = [sampler.plan_epoch_remainder(rank, before, 5) for rank in range(before)]
    first_part = []
    for step_plans in list(zip(*plans))[:3]:
        for plan in step_plans:
            first_part += plan.rank_samples
        sampler.advance(step_plans[0].global_samples)
    resumed = ElasticSampler(dataset_size=97, global_batch_size=12, seed=7)
    resumed.load_state_dict(sampler.state_dict())
    second_part = epoch_samples(resumed, after)
    assert not set(first_part) & set(second_part)
    assert sorted(first_part + second_part) == list(range(97))


def test_drop_last_trains_only_full_global_batches():
    sampler = ElasticSampler(dataset_size=50, global_batch_size=16, seed=0, drop_last=True)
    assert sampler.steps_per_epoch == 3
    assert len(epoch_samples(sampler, 3)) == 48


def test_a_state_that_does_not_fit_the_dataset_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        ElasticSampler(10, 4, seed=0).load_state_dict({"epoch": 0, "samples_consumed": 11})
