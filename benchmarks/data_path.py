"""The input pipeline alone: against the model step, and against a plain DataLoader.

    python -m benchmarks.data_path                        # both workloads, full size
    python -m benchmarks.data_path --quick                # CI-sized, one repetition
    python -m benchmarks.data_path --workloads tokens --num_workers 0 2 --repetitions 10

(run from the repository root). Everything is measured in this one process (and its DataLoader
workers), with one torch thread, standing in for rank 0 of a world of 2 (`OMP_NUM_THREADS=1` per
worker, as the launch scripts set it). Two workloads:

`images`: is the loader ever the bottleneck?

- elastic_ddp's pipeline, the trainer's loader (`workload.data.plan_loader`): the `ElasticSampler`
  plan of the epoch, `EpochSampleView` over `SyntheticImageDataset` with the seeded flip (drawn for
  the whole epoch at once, applied per batch), `num_workers=0` (the default). Each epoch includes
  planning it and building its loader, as in training.
- the bare loop's pipeline (`bare_ddp.build_loader`): `DistributedSampler`, the same dataset read
  a per-rank batch at a time, with a flip from the global RNG.
- the model step: forward, backward and an SGD step on one per-rank batch, no DDP (the
  communication only makes the real step slower, so this is the loader's hardest comparison).

The loader is not the bottleneck when its samples per second exceed the model step's.

`tokens`: what a collate and variable-length samples cost against the loader a user would write.
`VariableLengthTokens` makes dict samples `{"input_ids", "labels"}` of 16 to 512 tokens from
(seed, index), padded per micro-batch by `pad_token_sequences`, read with 0 and 2 DataLoader workers:

- elastic_ddp's path, as `ElasticRun` reads it: `plan_loader` over `EpochSampleView(dataset, seed,
  None, pad_token_sequences)` with the sampler's plan for rank 0, then `to_device` of each batch.
- the plain one: `DataLoader(dataset, batch_size=micro, sampler=DistributedSampler(num_replicas=2,
  rank=0, shuffle=True), collate_fn=pad_token_sequences, num_workers=N)`, then `.to(device)` of
  each tensor.

Both read the same number of samples in micro-batches of the same size, build their loader (and
start its workers) every epoch, and run on the CPU without pinned memory. The two sides run in
turns (elastic_ddp, plain, elastic_ddp, ...), after one pass of each that is not timed; the ratio
is paired per turn.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

if __package__ in (None, ""):  # `python benchmarks/data_path.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bare_ddp
from benchmarks.table import Row, render_markdown
from elastic_ddp.workload.collate import pad_token_sequences, to_device
from elastic_ddp.workload.data import (
    EpochSampleView,
    SyntheticImageDataset,
    plan_loader,
    random_horizontal_flip,
)
from elastic_ddp.workload.models import build_model
from elastic_ddp.workload.sampler import ElasticSampler, derive_seed, mix_seed

MODELS = ("mini_resnet", "mlp")
WORKLOADS = ("images", "tokens")
DEVICE = torch.device("cpu")  # this machine's; pinned memory is off on both sides


@dataclass(frozen=True)
class DataPathSetup:
    dataset_size: int = 4096
    global_batch_size: int = 64
    world_size: int = 2
    epochs: int = 3  # epochs of loading per measurement
    model_steps: int = 60  # model steps per measurement (after 5 not timed)
    seed: int = 0

    @property
    def rank_batch(self) -> int:
        return self.global_batch_size // self.world_size


FULL = DataPathSetup()
QUICK = DataPathSetup(dataset_size=1024, epochs=1, model_steps=10)


def elastic_loader_samples_per_second(setup: DataPathSetup) -> float:
    """Rank 0's samples per second through elastic_ddp's input pipeline, epoch set-up included."""
    dataset = SyntheticImageDataset(setup.dataset_size, setup.seed)
    sampler = ElasticSampler(setup.dataset_size, setup.global_batch_size, setup.seed)
    view = EpochSampleView(dataset, setup.seed, random_horizontal_flip)
    samples = 0
    started = time.perf_counter()
    for epoch in range(setup.epochs):
        sampler.load_state_dict({"epoch": epoch, "samples_consumed": 0})
        plans = sampler.plan_epoch_remainder(0, setup.world_size, setup.rank_batch)
        for inputs, _ in plan_loader(view, epoch, plans, num_workers=0, pin_memory=False):
            samples += len(inputs)
    return samples / (time.perf_counter() - started)


def bare_loader_samples_per_second(setup: DataPathSetup) -> float:
    """Rank 0's samples per second through the bare loop's input pipeline (`bare_ddp.build_loader`)."""
    args = bare_ddp.parse_args(["--dataset_size", str(setup.dataset_size), "--global_batch_size",
                                str(setup.global_batch_size), "--seed", str(setup.seed)])
    loader, sampler = bare_ddp.build_loader(args, rank=0, world_size=setup.world_size, pin_memory=False)
    samples = 0
    started = time.perf_counter()
    for epoch in range(setup.epochs):
        sampler.set_epoch(epoch)
        for inputs, _ in loader:
            samples += len(inputs)
    return samples / (time.perf_counter() - started)


def model_step_samples_per_second(setup: DataPathSetup, model_name: str) -> float:
    """Samples per second of forward, backward and SGD step on one per-rank batch (no loading)."""
    model = build_model(model_name, setup.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset = SyntheticImageDataset(setup.rank_batch, setup.seed)
    inputs, targets = next(iter(DataLoader(dataset, batch_size=setup.rank_batch)))
    model.train()

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    started = time.perf_counter()
    for _ in range(setup.model_steps):
        step()
    return setup.model_steps * setup.rank_batch / (time.perf_counter() - started)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread inside, as in a worker under the launch scripts (`OMP_NUM_THREADS=1`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure(setup: DataPathSetup, repetitions: int, models: Sequence[str] = MODELS, progress=None) -> list[Row]:
    """Interleaved repetitions of both pipelines and of each model's step, in one thread."""
    with one_torch_thread():
        elastic, bare = [], []
        steps: dict[str, list[float]] = {model: [] for model in models}
        for repetition in range(repetitions):
            elastic.append(elastic_loader_samples_per_second(setup))
            bare.append(bare_loader_samples_per_second(setup))
            for model in models:
                steps[model].append(model_step_samples_per_second(setup, model))
            if progress is not None:
                progress(f"data path #{repetition + 1}: loader {elastic[-1]:.0f} (bare {bare[-1]:.0f}) samples/s, "
                         + ", ".join(f"{m} step {steps[m][-1]:.0f}" for m in models))
    note = f"rank 0 of {setup.world_size}, {setup.rank_batch} samples per batch, 1 thread"
    rows = [Row("data path", "input pipeline alone: samples/s per worker", elastic, bare, "bare DDP loader",
                note=note)]
    for model in models:
        rows.append(Row("data path", f"{model}: loader samples/s ÷ model step samples/s", 
                        [e / s for e, s in zip(elastic, steps[model])], [b / s for b, s in zip(bare, steps[model])],
                        "bare DDP loader", target="> 1", target_on="elastic",
                        note=f"model step alone {statistics.median(steps[model]):.0f} samples/s; "
                             "above 1: the loader is not the bottleneck"))
    return rows


# ------------------------------------------------------------------------------- variable-length tokens


@dataclass(frozen=True)
class TokensSetup:
    """The variable-length workload; both sides read `dataset_size / world_size` samples per epoch."""

    dataset_size: int = 8192
    global_batch_size: int = 64
    micro_batch_size: int = 16
    world_size: int = 2
    epochs: int = 2  # epochs of loading per measurement, each with its own loader (and workers)
    shortest: int = 16  # tokens per sample, drawn uniformly from shortest..longest per index
    longest: int = 512
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        # Equal work: every global batch full and split into whole micro-batches, so that both
        # sides read the same number of micro-batches, each of `micro_batch_size` samples.
        if self.dataset_size % self.global_batch_size or self.global_batch_size % (
                self.world_size * self.micro_batch_size):
            raise ValueError(f"dataset_size {self.dataset_size}, global_batch_size {self.global_batch_size}: "
                             f"expected a multiple of global_batch_size, itself of world_size x micro_batch_size "
                             f"({self.world_size} x {self.micro_batch_size})")
        if not 1 <= self.shortest <= self.longest:
            raise ValueError(f"shortest {self.shortest}, longest {self.longest}: expected 1 <= shortest <= longest")


FULL_TOKENS = TokensSetup()
QUICK_TOKENS = TokensSetup(dataset_size=512, epochs=1)
NUM_WORKERS = (0, 2)


class VariableLengthTokens(Dataset):
    """Sample `index`: `{"input_ids": random token ids, "labels": the same}`, its length and its ids
    drawn from (seed, index) alone, so every side and every DataLoader worker makes the same one."""

    def __init__(self, setup: TokensSetup):
        self.setup = setup
        self._sample_base = derive_seed("token-sample", setup.seed)

    def __len__(self) -> int:
        return self.setup.dataset_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside a dataset of {len(self)}")
        generator = torch.Generator().manual_seed(mix_seed(self._sample_base + index))
        length = int(torch.randint(self.setup.shortest, self.setup.longest + 1, (), generator=generator))
        input_ids = torch.randint(self.setup.vocab_size, (length,), generator=generator)
        return {"input_ids": input_ids, "labels": input_ids.clone()}


def elastic_token_batches(dataset: VariableLengthTokens, num_workers: int) -> Iterator[dict[str, torch.Tensor]]:
    """Rank 0's batches on the device through elastic_ddp's path, epoch by epoch as `ElasticRun` reads them."""
    setup = dataset.setup
    sampler = ElasticSampler(len(dataset), setup.global_batch_size, setup.seed)
    view = EpochSampleView(dataset, setup.seed, None, pad_token_sequences)
    for epoch in range(setup.epochs):
        sampler.load_state_dict({"epoch": epoch, "samples_consumed": 0})
        plans = sampler.plan_epoch_remainder(0, setup.world_size, setup.micro_batch_size)
        for batch in plan_loader(view, epoch, plans, num_workers=num_workers, pin_memory=False):
            yield to_device(batch, DEVICE)


def plain_token_batches(dataset: VariableLengthTokens, num_workers: int) -> Iterator[dict[str, torch.Tensor]]:
    """Rank 0's batches on the device through a plain DataLoader with the same collate."""
    setup = dataset.setup
    sampler = DistributedSampler(dataset, num_replicas=setup.world_size, rank=0, shuffle=True, seed=setup.seed)
    loader = DataLoader(dataset, batch_size=setup.micro_batch_size, sampler=sampler,
                        collate_fn=pad_token_sequences, num_workers=num_workers)
    for epoch in range(setup.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            yield {key: tensor.to(DEVICE) for key, tensor in batch.items()}


TokenPath = Callable[[VariableLengthTokens, int], Iterator[dict[str, torch.Tensor]]]
TOKEN_PATHS: dict[str, TokenPath] = {"elastic_ddp": elastic_token_batches, "plain": plain_token_batches}


def samples_per_second(path: TokenPath, dataset: VariableLengthTokens, num_workers: int) -> float:
    """Samples per second of one pass of `path` (its set-up and every epoch's loader included)."""
    started = time.perf_counter()
    samples = sum(len(batch["input_ids"]) for batch in path(dataset, num_workers))
    elapsed = time.perf_counter() - started
    expected = dataset.setup.epochs * len(dataset) // dataset.setup.world_size
    assert samples == expected, f"read {samples} samples, not {expected}: the two sides must do the same work"
    return samples / elapsed


def measure_tokens(setup: TokensSetup, repetitions: int, worker_counts: Sequence[int] = NUM_WORKERS,
                   progress: Callable[[str], None] | None = None) -> list[Row]:
    """One row per worker count: samples/s of both paths, in turns, after one pass of each not timed."""
    dataset = VariableLengthTokens(setup)
    rates = {(side, workers): [] for side in TOKEN_PATHS for workers in worker_counts}
    with one_torch_thread():
        for workers in worker_counts:
            for path in TOKEN_PATHS.values():
                samples_per_second(path, dataset, workers)
        for repetition in range(repetitions):
            for workers in worker_counts:
                for side, path in TOKEN_PATHS.items():
                    rates[side, workers].append(samples_per_second(path, dataset, workers))
                if progress is not None:
                    progress(f"data path, tokens #{repetition + 1}, {workers} workers: elastic_ddp "
                             f"{rates['elastic_ddp', workers][-1]:.0f}, plain {rates['plain', workers][-1]:.0f} "
                             "samples/s")
    note = (f"rank 0 of {setup.world_size}, micro-batches of {setup.micro_batch_size}, {setup.shortest}-"
            f"{setup.longest} tokens per sample, pad_token_sequences, 1 thread")
    return [Row("data path", f"variable-length tokens, {workers} workers: samples/s", rates["elastic_ddp", workers],
                rates["plain", workers], "plain DataLoader", target=">= 0.98", note=note)
            for workers in worker_counts]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_path", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized, one repetition")
    parser.add_argument("--repetitions", type=int, default=None, help="default: 1 with --quick, else 5")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="images: the loader against the model step; tokens: a collate and variable-length "
                             "samples against a plain DataLoader (default: both)")
    parser.add_argument("--num_workers", nargs="+", type=int, default=list(NUM_WORKERS),
                        help="DataLoader workers of the tokens workload, one row each (default: 0 2)")
    args = parser.parse_args(argv)
    if args.repetitions is not None and args.repetitions < 1:
        parser.error(f"--repetitions: got {args.repetitions}; expected at least 1")
    if any(workers < 0 for workers in args.num_workers):
        parser.error(f"--num_workers: got {args.num_workers}; expected counts of 0 or more")
    repetitions = args.repetitions or (1 if args.quick else 5)
    progress = functools.partial(print, file=sys.stderr)
    rows = []
    if "images" in args.workloads:
        rows += measure(QUICK if args.quick else FULL, repetitions, progress=progress)
    if "tokens" in args.workloads:
        rows += measure_tokens(QUICK_TOKENS if args.quick else FULL_TOKENS, repetitions, args.num_workers, progress)
    print(render_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
