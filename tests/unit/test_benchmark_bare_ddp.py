"""The bare loops' fast paths do the work of the plain ones they replace: the same batches, the same gradients."""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from benchmarks import bare_ddp, bare_gpt_loop
from elastic_ddp.workload.data import SyntheticImageDataset


class PerSampleFlip(Dataset):
    """The tutorial's loader: one copied sample at a time, flipped when `torch.rand(())` of the global RNG is under 1/2."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, label = self.dataset[index]
        if torch.rand(()).item() < 0.5:
            image = image.flip(-1)
        return image, label


def loader_args(augment: bool = True) -> argparse.Namespace:
    return bare_ddp.parse_args(["--dataset_size", "256", "--global_batch_size", "32", "--seed", "3",
                                "--augment" if augment else "--no-augment"])


def batches_of_epochs(loader: DataLoader, sampler: DistributedSampler, epochs: int, seed: int) -> list[list]:
    torch.manual_seed(seed)
    batches = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches += [list(batch) for batch in loader]
    return batches


def test_the_bare_loop_reads_the_batches_a_per_sample_loader_reads():
    for augment in (True, False):
        args = loader_args(augment)
        for rank in range(2):
            loader, sampler = bare_ddp.build_loader(args, rank, world_size=2, pin_memory=False)
            dataset = SyntheticImageDataset(args.dataset_size, args.seed)
            plain = PerSampleFlip(dataset) if augment else dataset
            plain_sampler = DistributedSampler(plain, num_replicas=2, rank=rank, shuffle=True, seed=args.seed)
            plain_loader = DataLoader(plain, batch_size=16, sampler=plain_sampler)
            got = batches_of_epochs(loader, sampler, epochs=2, seed=7 + rank)
            expected = batches_of_epochs(plain_loader, plain_sampler, epochs=2, seed=7 + rank)
            assert len(got) == len(expected) == len(loader) * 2 == 16
            for (images, labels), (plain_images, plain_labels) in zip(got, expected):
                assert torch.equal(images, plain_images) and torch.equal(labels, plain_labels)
            sampler.set_epoch(0)  # and the flips were applied (some of the first batch's images), or not
            unflipped = torch.stack([dataset[index][0] for index in list(sampler)[:16]])
            assert torch.equal(got[0][0], unflipped) is not augment


def test_the_gpt_loops_seeded_backward_gives_the_gradients_of_the_scaled_sum():
    torch.manual_seed(0)
    model = bare_gpt_loop.GPT(256, 8, 1, 2, 16)
    inputs, targets = torch.randint(0, 256, (5, 8)), torch.randint(0, 256, (5, 8))
    scale = 2 / 33  # a global batch of 33 over 2 ranks: no power of two

    def gradients(backward) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        backward(bare_gpt_loop.per_sample_loss(model(inputs), targets))
        return [p.grad.clone() for p in model.parameters()]

    seeded = gradients(lambda losses: bare_gpt_loop.backward_scaled(losses, scale))
    summed = gradients(lambda losses: (losses.sum() * scale).backward())
    assert all(torch.equal(a, b) for a, b in zip(seeded, summed))
