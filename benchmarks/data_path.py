"""The input pipeline alone against the model step: is the loader ever the bottleneck?

    python -m benchmarks.data_path            # full size
    python -m benchmarks.data_path --quick

(run from the repository root). Everything runs in this one process with one thread, standing in
for rank 0 of a world of 2 (`OMP_NUM_THREADS=1` per worker, as the launch scripts set it):

- elastic_ddp's pipeline, the trainer's loader (`workload.data.plan_loader`): the `ElasticSampler`
  plan of the epoch, `EpochSampleView` over `SyntheticImageDataset` with the seeded flip (drawn for
  the whole epoch at once, applied per batch), `num_workers=0` (the default). Each epoch includes
  planning it and building its loader, as in training.
- the bare loop's pipeline (`bare_ddp.build_loader`): `DistributedSampler`, the same dataset read
  a per-rank batch at a time, with a flip from the global RNG.
- the model step: forward, backward and an SGD step on one per-rank batch, no DDP (the
  communication only makes the real step slower, so this is the loader's hardest comparison).

The loader is not the bottleneck when its samples per second exceed the model step's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

if __package__ in (None, ""):  # `python benchmarks/data_path.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bare_ddp
from benchmarks.table import Row, render_markdown
from elastic_ddp.workload.data import (
    EpochSampleView,
    SyntheticImageDataset,
    plan_loader,
    random_horizontal_flip,
)
from elastic_ddp.workload.models import build_model
from elastic_ddp.workload.sampler import ElasticSampler

MODELS = ("mini_resnet", "mlp")


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


def measure(setup: DataPathSetup, repetitions: int, models: Sequence[str] = MODELS, progress=None) -> list[Row]:
    """Interleaved repetitions of both pipelines and of each model's step, in one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
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
    finally:
        torch.set_num_threads(threads)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_path", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized, one repetition")
    parser.add_argument("--repetitions", type=int, default=None, help="default: 1 with --quick, else 5")
    args = parser.parse_args(argv)
    repetitions = args.repetitions or (1 if args.quick else 5)
    rows = measure(QUICK if args.quick else FULL, repetitions, progress=lambda line: print(line, file=sys.stderr))
    print(render_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
