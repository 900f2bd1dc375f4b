"""The baseline of `benchmarks.own_loop`: docs/examples/gpt_own_loop.py's loop, in bare PyTorch DDP.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.bare_gpt_loop \\
        --token_file runs/gpt/data/stdlib-400000.u16 --block_size 64 --global_batch_size 32 --micro_batch_size 8

(run from the repository root; `benchmarks.own_loop` writes the token file with the example's own
`write_corpus` and runs this for you). The same work as the example under `ElasticRun`: the same
model (`elastic_ddp.workload.gpt.GPT`, built after `torch.manual_seed(seed)`), sizes and windows of
the same token file, AdamW with the same two parameter groups (decay 0.1 on matrices, none on norms
and biases), the same warm-up plus cosine schedule, each global batch split over the ranks as
elastic_ddp splits it (contiguous shares, the first ranks one sample more) and cut into micro-batches
of `--micro_batch_size` with DDP's `no_sync` on all but the last, the per-sample loss scaled so that
the averaged gradient is the global batch's mean (each sample's gradient seeded with that scale,
as `Step.backward` does), `clip_grad_norm_(1.0)`, the same number of steps
(the epoch's short last batch included). What it leaves out is everything about fault tolerance:
snapshots, memory copies, the event log, the watchdog, the drain, the loop contract's checks. And it
is as fast as a plain loop gets: a micro-batch is one gather from the memory-mapped token file (no
per-window `__getitem__`, no DataLoader, no token-id check), gradients are set to None.

Each rank prints one `BENCH_RESULT {json}` line at exit (`benchmarks.measure`): its peak resident
memory, and on rank 0 the wall time (`time.time()`) at the end of every optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.baseline_schedule import warmup_cosine_schedule
from benchmarks.measure import emit_result, peak_rss_mb
from elastic_ddp.workload.gpt import GPT
from elastic_ddp.workload.sampler import even_split, micro_batches
from elastic_ddp.workload.tokens import TokenWindows

VOCAB = 256  # bytes, as in the example


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The example's flags that matter to the loop, same names and defaults (the example's GPTConfig)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bare_gpt_loop", description=__doc__.split("\n")[0])
    parser.add_argument("--token_file", required=True, help="uint16 token ids, as the example's write_corpus writes")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--gpt_layers", type=int, default=2)
    parser.add_argument("--gpt_heads", type=int, default=2)
    parser.add_argument("--gpt_embed", type=int, default=64)
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument("--micro_batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop_last", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--log_interval", type=int, default=10**9, help="print rank 0's loss every N steps")
    return parser.parse_args(argv)


def adamw_groups(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """The example's optimizer: decay on matrices, none on norms and biases."""
    decayed = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The example's loss: next-token cross-entropy, one value per window."""
    losses = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return losses.view(targets.shape).mean(dim=1)


def backward_scaled(losses: torch.Tensor, scale: float) -> None:
    """The backward of `losses.sum() * scale`, each sample's gradient seeded with `scale` directly:
    the same gradients, bit for bit, with two autograd nodes fewer (as elastic_ddp's `Step.backward`)."""
    torch.autograd.backward(losses, torch.full_like(losses, scale))


def rank_micro_batches(global_batch: np.ndarray, rank: int, world_size: int,
                       micro_batch_size: int) -> list[np.ndarray]:
    """This rank's micro-batches of one global batch, cut as elastic_ddp's sampler cuts them (its
    `even_split` and `micro_batches`: plain arithmetic, nothing of the runtime)."""
    start, stop = even_split(len(global_batch), world_size, rank)
    return [np.asarray(piece, dtype=global_batch.dtype)
            for piece in micro_batches(list(global_batch[start:stop]), micro_batch_size)]


def window_batch(tokens: np.ndarray, windows: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `windows` in one gather: window i is tokens [i * block, (i + 1) * block]."""
    rows = tokens[windows[:, None] * block_size + np.arange(block_size + 1)]
    batch = torch.from_numpy(rows.astype(np.int64))
    return batch[:, :-1], batch[:, 1:]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    step_times = train(args, rank, world_size)
    record: dict = {"side": "bare_gpt_loop", "rank": rank, "world_size": world_size,
                    "peak_rss_mb": round(peak_rss_mb(), 1)}
    if rank == 0:
        record["step_times"] = step_times
    emit_result(record)
    return 0


def train(args: argparse.Namespace, rank: int, world_size: int) -> list[float]:
    """The loop. Returns, on rank 0 (an empty list elsewhere), `time.time()` at the end of every step."""
    windows = len(TokenWindows(args.token_file, args.block_size, VOCAB))  # the example's windows of the file
    tokens = np.memmap(args.token_file, dtype="<u2", mode="r")
    torch.manual_seed(args.seed)  # every rank builds the same initial weights, as in the example
    model = GPT(VOCAB, args.block_size, args.gpt_layers, args.gpt_heads, args.gpt_embed)
    ddp_model = DistributedDataParallel(model)
    optimizer = adamw_groups(model, args.lr)
    epoch_length = windows - (windows % args.global_batch_size if args.drop_last else 0)
    steps_per_epoch = -(-epoch_length // args.global_batch_size)
    scheduler = warmup_cosine_schedule(optimizer, args.warmup_steps, args.epochs * steps_per_epoch)
    step_times: list[float] = []
    step = 0
    ddp_model.train()
    for epoch in range(args.epochs):
        order = torch.randperm(windows, generator=torch.Generator().manual_seed(args.seed + epoch)).numpy()
        for start in range(0, epoch_length, args.global_batch_size):
            global_batch = order[start:min(start + args.global_batch_size, epoch_length)]
            scale = world_size / len(global_batch)  # DDP averages over ranks: the global batch's mean
            pieces = rank_micro_batches(global_batch, rank, world_size, args.micro_batch_size)
            for index, piece in enumerate(pieces):
                inputs, targets = window_batch(tokens, piece, args.block_size)
                with contextlib.nullcontext() if index == len(pieces) - 1 else ddp_model.no_sync():
                    losses = per_sample_loss(ddp_model(inputs), targets)
                    backward_scaled(losses, scale)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if rank == 0:
                step_times.append(time.time())
                if step % args.log_interval == 0:
                    print(f"epoch {epoch} step {step} loss {losses.mean().item():.4f}", file=sys.stderr, flush=True)
    return step_times


if __name__ == "__main__":
    # As the example ends (elastic_ddp.runtime.distributed.exit_worker, written out here): no interpreter
    # teardown, which can abort while freeing DDP's gloo group. Teardown is outside the measured window.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
