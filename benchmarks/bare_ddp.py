"""The baseline: a bare DDP training loop, as fast as a plain loop gets.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m benchmarks.bare_ddp --model mlp --epochs 5

(run from the repository root). It does the same work as `python -m elastic_ddp.train` with the
same flags and `--micro_batch_size` equal to the per-rank share (no gradient accumulation): the same
model (`elastic_ddp.workload.models.build_model`), the same synthetic data (`SyntheticImageDataset`) with a
random horizontal flip, SGD with momentum under the same warm-up plus cosine schedule, the same
global batch split evenly over the same world, DDP with the same options (torch's defaults). It
uses `DistributedSampler`, so it needs a dataset size and global batch that divide evenly
(otherwise the sampler pads and the two would not do the same work).

It has every optimisation of elastic_ddp's training path that is not about fault tolerance: a batch
is read whole (one `index_select` from the dataset's in-memory samples, the flips applied to the
batch, as elastic_ddp's loader does, instead of a copy, a draw and a stack per sample), gradients are
set to None, the loss is read on rank 0 only every `--log_interval` steps. What it leaves out is
what elastic_ddp adds for fault tolerance and elasticity: snapshots, memory copies, the event log
and progress windows, the watchdog and the drain vote, the elastic sampler with its per-sample
seeded augmentation and per-sample loss, the loop contract's checks, restore on start.
docs/benchmarks-history.md ("What ours costs per step") lists each difference and where it sits.

Each rank prints one `BENCH_RESULT {json}` line at exit: its peak resident memory, and on rank 0 the
wall and CPU time at the end of every optimizer step and the steady-state samples per second (the
first epoch left out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from benchmarks.baseline_schedule import warmup_cosine_schedule
from benchmarks.measure import emit_result, peak_rss_mb, run_maybe_profiled, steady_state_samples_per_second
from elastic_ddp.runtime.distributed import exit_worker
from elastic_ddp.workload.data import SyntheticImageDataset, random_horizontal_flip
from elastic_ddp.workload.models import build_model


class ImageBatches(Dataset):
    """`SyntheticImageDataset` read a batch at a time: `self[indices]` is the collated batch, each
    image flipped left-right with probability 1/2 when `augment`.

    The batch is one `index_select` from the dataset's in-memory samples, flipped with elastic_ddp's
    own batch flip (`RandomHorizontalFlip.apply_to_batch`). The flips are drawn from the global torch
    RNG, one `torch.rand(len(indices))` per batch: the same numbers in the same order as one
    `torch.rand(())` per sample (torchvision's per-sample flip), so the same images as a per-sample
    loader (tests/unit/test_benchmark_bare_ddp.py)."""

    def __init__(self, dataset: SyntheticImageDataset, augment: bool):
        self.dataset = dataset
        self.augment = augment

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> list[torch.Tensor]:
        batch = self.dataset.collated(indices)  # a fresh tensor: ours to flip in place
        if not self.augment:
            return batch
        flips = (torch.rand(len(indices)) < 0.5).numpy()
        return random_horizontal_flip.apply_to_batch(batch, flips)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The subset of `python -m elastic_ddp.train`'s flags that a bare loop has, same names."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bare_ddp", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini_resnet", choices=("mini_resnet", "mlp"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dataset_size", type=int, default=4096)
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--augment", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--use_amp", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--log_interval", type=int, default=10)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--sharding", default="none", choices=("none", "fsdp"),
                        help="fsdp: a bare FSDP2 loop (fully_shard on the model's sharding_blocks() and the root)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.global_batch_size % world_size or args.dataset_size % args.global_batch_size:
        raise SystemExit(f"bare_ddp: --global_batch_size {args.global_batch_size} must divide --dataset_size "
                         f"{args.dataset_size} and be divisible by the world size {world_size}")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    try:
        step_times, cpu_times = run_maybe_profiled("bare_ddp", lambda: train(args, rank, world_size, device))
    finally:
        dist.destroy_process_group()
    record = {"side": "bare_ddp", "rank": rank, "world_size": world_size, "peak_rss_mb": round(peak_rss_mb(), 1)}
    if use_cuda:
        record["peak_cuda_allocated_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    if rank == 0:
        steps_per_epoch = args.dataset_size // args.global_batch_size
        record["step_times"] = step_times
        record["cpu_times"] = cpu_times
        if len(step_times) > steps_per_epoch + 1:
            record["samples_per_second"] = round(steady_state_samples_per_second(
                step_times, args.global_batch_size, skip_steps=steps_per_epoch), 1)
    emit_result(record)
    return 0


def build_loader(args: argparse.Namespace, rank: int, world_size: int,
                 pin_memory: bool) -> tuple[DataLoader, DistributedSampler]:
    """This rank's batches (`DistributedSampler`'s order, `ImageBatches`), and the sampler to set
    the epoch of."""
    batches = ImageBatches(SyntheticImageDataset(args.dataset_size, args.seed), args.augment)
    sampler = DistributedSampler(batches, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    # batch_size=None: the sampler hands out each batch's indices and the dataset collates them.
    loader = DataLoader(batches, sampler=BatchSampler(sampler, args.global_batch_size // world_size, drop_last=False),
                        batch_size=None, num_workers=args.num_workers, pin_memory=pin_memory)
    return loader, sampler


def train(args: argparse.Namespace, rank: int, world_size: int,
          device: torch.device) -> tuple[list[float], list[float]]:
    """The loop itself. Returns, on rank 0 (empty lists elsewhere), the wall time (`time.time()`) and
    the process CPU time (`time.process_time()`) at the end of every optimizer step."""
    use_cuda = device.type == "cuda"
    model = build_model(args.model, args.seed).to(device)
    if args.sharding == "fsdp":  # written out here, as torchtitan's tutorial loop would
        for block in model.sharding_blocks():
            fully_shard(block)
        ddp_model = fully_shard(model)
    else:
        ddp_model = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    loader, sampler = build_loader(args, rank, world_size, pin_memory=use_cuda)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = warmup_cosine_schedule(optimizer, args.warmup_steps, args.epochs * len(loader))
    autocast_dtype = torch.float16 if use_cuda else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.use_amp and use_cuda)
    torch.manual_seed(args.seed + rank)  # the flips differ per rank, as they would in a tutorial script
    step_times: list[float] = []
    cpu_times: list[float] = []
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=use_cuda)
            targets = targets.to(device, non_blocking=use_cuda)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=args.use_amp):
                # Mean-reduced: cheaper than elastic_ddp's per-sample loss with a seeded backward,
                # which it needs for shares of any size (docs/benchmarks-history.md, "What ours costs per step").
                loss = torch.nn.functional.cross_entropy(ddp_model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if rank == 0:
                step_times.append(time.time())
                cpu_times.append(time.process_time())
                if step % args.log_interval == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f}", file=sys.stderr, flush=True)
    return step_times, cpu_times


if __name__ == "__main__":
    # As elastic_ddp's worker ends (benchmarks/elastic_worker.py): without the interpreter's teardown,
    # which can abort freeing DDP's gloo group ("terminate called without an active exception", seen
    # once in CI on this baseline after it had printed its result). Teardown is outside the window.
    exit_worker(main())
