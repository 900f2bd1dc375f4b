"""The built-in dataset: a sample depends on (seed, index) alone, cached or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from elastic_ddp.workload.data import EpochSampleView, SyntheticImageDataset, plan_loader, random_horizontal_flip
from elastic_ddp.workload.sampler import ElasticSampler


class UncachedDataset(SyntheticImageDataset):
    CACHE_LIMIT_BYTES = 0


@pytest.mark.timeout(60)
def test_cached_samples_equal_freshly_made_ones_in_every_epoch():
    cached, uncached = SyntheticImageDataset(64, seed=3), UncachedDataset(64, seed=3)
    assert cached._made is not None and uncached._made is None
    for _ in range(2):  # the first pass makes and caches, the second serves from the cache
        for index in (0, 17, 63, 17):
            (image, label), (expected_image, expected_label) = cached[index], uncached[index]
            assert label == expected_label
            assert torch.equal(image, expected_image)


@pytest.mark.timeout(60)
def test_a_returned_sample_is_a_copy_of_the_cache():
    dataset = SyntheticImageDataset(8, seed=0)
    first, _ = dataset[5]
    first.zero_()  # an in-place transform of the caller's sample
    again, _ = dataset[5]
    assert again.abs().sum() > 0


@pytest.mark.timeout(60)
def test_augmentation_depends_on_epoch_and_index_not_on_who_asks():
    view = EpochSampleView(SyntheticImageDataset(32, seed=1), seed=1, transform=random_horizontal_flip)
    other = EpochSampleView(UncachedDataset(32, seed=1), seed=1, transform=random_horizontal_flip)
    for key in [(epoch, index) for epoch in range(4) for index in range(32)]:
        assert torch.equal(view[key][0], other[key][0]), key
    flipped = [not torch.equal(view[(epoch, 7)][0], view.dataset[7][0]) for epoch in range(16)]
    assert any(flipped) and not all(flipped), "the flip should differ between epochs"


@pytest.mark.timeout(60)
def test_an_index_outside_the_dataset_is_refused():
    with pytest.raises(IndexError, match="sample 8 is outside a dataset of 8"):
        SyntheticImageDataset(8)[8]


@pytest.mark.timeout(60)
def test_per_sample_seeds_are_distinct_and_the_same_in_every_view():
    views = [EpochSampleView(SyntheticImageDataset(8), seed=5, transform=random_horizontal_flip) for _ in range(2)]
    seeds = {(epoch, index): views[0].sample_seed(epoch, index) for epoch in range(50) for index in range(2000)}
    assert len(set(seeds.values())) == len(seeds), "two samples share a seed"
    assert all(0 <= seed < 2**63 for seed in seeds.values())
    assert all(views[1].sample_seed(epoch, index) == seed for (epoch, index), seed in seeds.items())
    other_run = EpochSampleView(SyntheticImageDataset(8), seed=6, transform=random_horizontal_flip)
    assert other_run.sample_seed(0, 0) != seeds[(0, 0)]


@pytest.mark.timeout(60)
def test_labels_cover_every_class_about_evenly():
    dataset = SyntheticImageDataset(2000, seed=0)
    counts = torch.bincount(torch.tensor([dataset[index][1] for index in range(len(dataset))]), minlength=10)
    assert counts.min() > 140 and counts.max() < 260, counts.tolist()


@pytest.mark.timeout(60)
def test_batched_flips_equal_the_per_sample_ones_for_many_seeds_epochs_and_indices():
    dataset = SyntheticImageDataset(512, seed=2)
    for seed in (0, 1, 28, 2**40 + 3):
        view = EpochSampleView(dataset, seed=seed, transform=random_horizontal_flip)
        generator = torch.Generator()
        for epoch in (0, 1, 7, 1000):
            indices = np.arange(len(dataset))
            seeds = view.sample_seeds(epoch, indices)
            assert seeds.tolist() == [view.sample_seed(epoch, index) for index in indices.tolist()]
            expected = [torch.rand((), generator=generator.manual_seed(int(key))).item() < 0.5 for key in seeds]
            assert random_horizontal_flip.draw(seeds).tolist() == expected
            batch = indices[::3].tolist()
            reference = default_collate([view[(epoch, index)] for index in batch])
            batched = view.batch(epoch, batch, view.draw_all(epoch, np.array(batch)))
            assert all(torch.equal(got, want) for got, want in zip(batched, reference, strict=True)), (seed, epoch)


@pytest.mark.timeout(60)
def test_an_epoch_loader_gives_the_per_sample_batches_bit_for_bit():
    sampler = ElasticSampler(300, 64, seed=4)
    sampler.load_state_dict({"epoch": 3, "samples_consumed": 128})
    plans = sampler.plan_epoch_remainder(1, 3, micro_batch_size=8)
    for dataset in (SyntheticImageDataset(300, seed=4), UncachedDataset(300, seed=4)):
        for transform in (random_horizontal_flip, None):
            view = EpochSampleView(dataset, seed=4, transform=transform)
            expected = [default_collate([view[(3, index)] for index in batch])
                        for plan in plans for batch in plan.micro_batches if batch]
            loaded = list(plan_loader(view, 3, plans, num_workers=0, pin_memory=False))
            assert len(loaded) == len(expected)
            for got, want in zip(loaded, expected, strict=True):
                assert got[1].dtype == want[1].dtype
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.timeout(60)
def test_a_per_sample_transform_still_gets_one_seeded_generator_per_sample():
    def add_a_draw(sample, generator):
        image, label = sample
        return image + torch.rand((), generator=generator), label

    view = EpochSampleView(SyntheticImageDataset(40, seed=0), seed=0, transform=add_a_draw)
    sampler = ElasticSampler(40, 16, seed=0)
    plans = sampler.plan_epoch_remainder(0, 2, micro_batch_size=8)
    loaded = list(plan_loader(view, 0, plans, num_workers=0, pin_memory=False))
    batches = [batch for plan in plans for batch in plan.micro_batches if batch]
    for (images, _), batch in zip(loaded, batches, strict=True):
        assert torch.equal(images, torch.stack([view[(0, index)][0] for index in batch]))


@pytest.mark.timeout(60)
def test_a_loader_with_worker_processes_gives_the_same_batches():
    view = EpochSampleView(SyntheticImageDataset(96, seed=9), seed=9, transform=random_horizontal_flip)
    plans = ElasticSampler(96, 32, seed=9).plan_epoch_remainder(0, 2, micro_batch_size=8)
    in_process = list(plan_loader(view, 0, plans, num_workers=0, pin_memory=False))
    in_workers = list(plan_loader(view, 0, plans, num_workers=2, pin_memory=False))
    assert len(in_workers) == len(in_process) == 6
    for got, want in zip(in_workers, in_process, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
