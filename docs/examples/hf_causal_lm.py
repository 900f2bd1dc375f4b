"""A Hugging Face causal LM trained by a loop of your own, made elastic by `elastic_ddp.ElasticRun`.

The model is a `transformers` Llama built from a small config (weights initialised, nothing
downloaded). The data is the Python standard library's own source (every machine with Python has
it, offline), one document per top-level function or class: a `datasets` Dataset of variable-length
texts, tokenized with `Dataset.map` by a BPE tokenizer trained here with `tokenizers`, padded per
micro-batch by transformers' `DataCollatorForLanguageModeling`, unchanged. The loss is the mean over
every target token of the global batch: one loss per document (its tokens' mean) weighted by its
number of target tokens, `step.backward(losses, weights=tokens)`, whatever the world size.

    pip install -e '.[hf]'    # transformers, datasets, tokenizers
    # one process, no torchrun
    python docs/examples/hf_causal_lm.py --epochs 1 --checkpoint_dir runs/hf
    # elastic, 1 to 4 nodes of 2 processes (the same line on every node)
    torchrun --nnodes=1:4 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 --rdzv_id=hf \\
        --rdzv_conf=join_timeout=300,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5 \\
        --max_restarts=10 docs/examples/hf_causal_lm.py --epochs 1 --checkpoint_dir runs/hf

Every process builds the tokenizer and the dataset itself, from the same files in the same order
with nothing random, so that a node joining later needs nothing from the others and the checkpoint
directory may be each node's own disk. BPE training has no seed to share: a tokenizer trained twice
on the same text is the same here, but `tokenizers` does not promise it, and another Python's
standard library is other text. So the ranks compare a digest of the tokenizer and the token ids at
start, and the digest is kept in the run's state: a resume on other tokens is refused.

Every TrainingConfig flag works (docs/configuration.md): `--lr`, `--global_batch_size`,
`--micro_batch_size`, `--num_workers` (the collator runs in the DataLoader's workers), `--use_amp`,
`--sharding fsdp`...
The flags of the class below are this script's own. What the loop must keep to and why:
docs/your-own-loop.md.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from elastic_ddp import ElasticRun, TrainingConfig, run_worker
from elastic_ddp.runtime.distributed import DistributedContext, exit_worker
from elastic_ddp.workload.losses import token_cross_entropy

PAD, END = "<|pad|>", "<|endoftext|>"
TOP_LEVEL = re.compile(r"^(?=(?:async def|def|class) )", re.MULTILINE)


@dataclass
class CausalLMConfig(TrainingConfig):
    documents: int = 512  # top-level functions and classes of the standard library, in path order
    max_tokens: int = 128  # a longer document is cut here
    tokenizer_vocab: int = 1024  # BPE vocabulary, trained on the documents
    hidden_size: int = 64  # the Llama's width (its MLP: 4 times that), a multiple of --heads
    layers: int = 2  # decoder blocks
    heads: int = 4  # attention heads (as many key-value heads)
    optimizer: str = "adamw"
    lr: float = 1e-3
    global_batch_size: int = 16
    micro_batch_size: int = 4
    # The epoch's short last batch is dropped: smaller than the world, it leaves a rank with no document,
    # and a transformers model cannot run a batch of none (its attention reshapes 0 elements to (0, T, -1, d)).
    drop_last: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("documents", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}: got {getattr(self, name)}; expected a positive integer")
        if self.max_tokens < 2:
            raise ValueError(f"--max_tokens: got {self.max_tokens}; expected 2 or more (a token and its next)")
        if self.tokenizer_vocab <= 258:
            raise ValueError(f"--tokenizer_vocab: got {self.tokenizer_vocab}; expected more than 258 (the 256 bytes "
                             "and the two special tokens)")
        if self.hidden_size % self.heads:
            raise ValueError(f"--hidden_size: got {self.hidden_size}; expected a multiple of --heads ({self.heads})")


def standard_library_documents(count: int) -> list[str]:
    """The source of the first `count` top-level functions and classes of the standard library's
    modules, in sorted path order: the same list on every machine with this Python version."""
    root, found = Path(sysconfig.get_paths()["stdlib"]), []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        # Each chunk from one top-level `def` or `class` line to the next (the module's head dropped).
        found += TOP_LEVEL.split(path.read_text(encoding="utf-8", errors="replace"))[1:]
        if len(found) >= count:
            return found[:count]
    raise ValueError(f"--documents: got {count}; the standard library has only {len(found)} top-level functions "
                     "and classes")


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts` (GPT-2's kind: every byte has a token, nothing is unknown)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token=PAD, eos_token=END)


def tokenized_documents(config: CausalLMConfig) -> tuple[datasets.Dataset, PreTrainedTokenizerFast]:
    datasets.disable_progress_bars()  # one bar per rank otherwise
    texts = standard_library_documents(config.documents)
    tokenizer = train_tokenizer(texts, config.tokenizer_vocab)
    documents = datasets.Dataset.from_dict({"text": texts}).map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=config.max_tokens),
        batched=True, remove_columns=["text"])
    return documents, tokenizer


class DataDigest:
    """A digest of the tokenizer and the token ids, which every rank and every resume must share
    (module docstring): kept in the run's state, so checked on every restore."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, documents: datasets.Dataset):
        self.sha256 = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()
                                     + str(documents["input_ids"]).encode()).hexdigest()

    def check_every_rank_has_it(self) -> None:
        if dist.is_initialized():
            digests: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(digests, self.sha256)
            if len(set(digests)) > 1:
                raise RuntimeError(f"the ranks built {len(set(digests))} different tokenizers or datasets: run every "
                                   "node on the same Python and tokenizers versions")

    def state_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["sha256"] != self.sha256:
            raise ValueError("the run was trained on another tokenizer or other documents (another Python or "
                             "tokenizers version?): resume it where it started, or start a new --checkpoint_dir")


def build_model(config: CausalLMConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(config.seed)  # every rank builds the same initial weights
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=4 * config.hidden_size,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.heads,
        max_position_embeddings=config.max_tokens, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, use_cache=False))


def train(config: CausalLMConfig, context: DistributedContext) -> None:
    documents, tokenizer = tokenized_documents(config)
    digest = DataDigest(tokenizer, documents)
    digest.check_every_rank_has_it()
    model = build_model(config, tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels: the ids, -100 on padding
    run = ElasticRun(model, documents, config, context=context, collate_fn=collator,
                     extra_state={"data": digest})
    with run:
        for step in run.steps():
            for batch in step.micro_batches():
                with run.autocast():
                    logits = run.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                # Position t predicts token t + 1: each document's mean over its target tokens, and their count.
                losses, tokens = token_cross_entropy(logits[:, :-1].float(), batch["labels"][:, 1:])
                step.backward(losses, weights=tokens)
            step.clip_grad_norm_(1.0)
            step.commit()
    if run.rank == 0:
        print(f"trained {run.global_step} steps on {len(documents)} documents; vocabulary {len(tokenizer)}",
              flush=True)


def main() -> int:
    config = CausalLMConfig.from_args()
    return run_worker(config, lambda context: train(config, context))


if __name__ == "__main__":
    exit_worker(main())
