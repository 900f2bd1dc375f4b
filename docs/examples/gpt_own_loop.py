"""A byte-level GPT trained by a loop of your own, made elastic by `elastic_ddp.ElasticRun`.

The text is the Python standard library's own source (every machine with Python has it, offline),
read as bytes: a vocabulary of 256, no tokenizer. Each sample is a window of `--block_size` bytes.

    # one process, no torchrun
    python docs/examples/gpt_own_loop.py --epochs 1 --checkpoint_dir runs/gpt
    # elastic, 1 to 4 nodes of 2 processes (the same line on every node)
    torchrun --nnodes=1:4 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \\
        --rdzv_id=gpt --max_restarts=10 docs/examples/gpt_own_loop.py --epochs 2 --checkpoint_dir runs/gpt

Every TrainingConfig flag works (docs/configuration.md): `--block_size`, `--gpt_layers`,
`--gpt_heads` and `--gpt_embed` size the model, `--lr`, `--global_batch_size`, `--use_amp`,
`--compile`, `--sharding fsdp`... `--corpus_bytes` is this script's own; `--model`, `--dataset*`
and `--optimizer` are not used (the script brings its own). What the loop must keep to
and why: docs/your-own-loop.md.
"""

from __future__ import annotations

import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from elastic_ddp import ElasticRun, TrainingConfig, run_worker
from elastic_ddp.runtime.distributed import DistributedContext, exit_worker
from elastic_ddp.workload.gpt import GPT
from elastic_ddp.workload.tokens import TokenWindows

VOCAB = 256  # bytes


@dataclass
class GPTConfig(TrainingConfig):
    corpus_bytes: int = 2_000_000  # how much of the standard library to train on (the same on every node)
    model: str = "gpt"  # fills --block_size and the --gpt_* sizes with their defaults
    lr: float = 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.corpus_bytes > self.block_size:
            raise ValueError(f"--corpus_bytes: got {self.corpus_bytes}; expected more than --block_size "
                             f"({self.block_size}) bytes")


class TokensSeen:
    """The loop's own state, saved and restored with each step: tokens trained on, over all ranks."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


def standard_library_bytes(limit: int) -> bytes:
    """The first `limit` bytes of the standard library's .py files, in sorted path order: the same
    on every machine with this Python version (the run's fingerprint refuses another length)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "__pycache__" in path.parts:
            continue
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if total >= limit:
            break
    return b"".join(chunks)[:limit]


def write_corpus(directory: Path, limit: int) -> Path:
    """The corpus as a token file (uint16 ids, as nanoGPT's train.bin), written once per machine:
    every rank may write it, each to a temporary name moved into place whole."""
    path = directory / f"stdlib-{limit}.u16"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        np.frombuffer(standard_library_bytes(limit), dtype=np.uint8).astype("<u2").tofile(temporary)
        os.replace(temporary, path)
    return path


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy, one value per window (its positions averaged): what step.backward takes."""
    losses = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return losses.view(targets.shape).mean(dim=1)


def adamw_without_decay_on_norms_and_biases(config: GPTConfig):
    def build(model: nn.Module) -> torch.optim.Optimizer:
        decayed = [p for p in model.parameters() if p.ndim >= 2]
        others = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                                 lr=config.lr, betas=(0.9, 0.95))
    return build


def train(config: GPTConfig, context: DistributedContext) -> None:
    corpus = TokenWindows(write_corpus(Path(config.checkpoint_dir) / "data", config.corpus_bytes),
                          config.block_size, VOCAB)
    torch.manual_seed(config.seed)  # every rank builds the same initial weights
    model = GPT(VOCAB, config.block_size, config.gpt_layers, config.gpt_heads, config.gpt_embed)
    tokens = TokensSeen()
    run = ElasticRun(model, corpus, config, context=context, extra_state={"tokens": tokens},
                     optimizer=adamw_without_decay_on_norms_and_biases(config))
    with run:  # restored on entry: count from here
        started, tokens_at_start = time.monotonic(), tokens.count
        for step in run.steps():
            for inputs, targets in step.micro_batches():
                with run.autocast():
                    logits = run.model(inputs)
                step.backward(per_sample_loss(logits, targets))
            step.clip_grad_norm_(1.0)
            with step.committing():
                tokens.count += step.global_samples * config.block_size
    if run.rank == 0 and tokens.count > tokens_at_start:
        seconds = time.monotonic() - started
        print(f"trained on {tokens.count} tokens in all; {(tokens.count - tokens_at_start) / seconds:.0f} tokens/s "
              f"in this run of {run.world_size} rank(s)", flush=True)


def main() -> int:
    config = GPTConfig.from_args()
    return run_worker(config, lambda context: train(config, context))


if __name__ == "__main__":
    exit_worker(main())
