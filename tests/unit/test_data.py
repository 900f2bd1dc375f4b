"""The built-in dataset: a sample depends on (seed, index) alone, cached or not."""

from __future__ import annotations

import pytest
import torch

from elastic_ddp.workload.data import EpochSampleView, SyntheticImageDataset, random_horizontal_flip


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
