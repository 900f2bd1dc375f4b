"""Your data as it comes: dict samples with non-tensor leaves, variable-length sequences through a
padding collate, a stream refused when the run is built, and token weights whose gradient is the
token mean of the global batch whatever the world size and the micro-batching (real gloo groups
of 1, 2 and 4 ranks in forked processes, under DDP and FSDP2), each bad weight refused in one line.

    .venv/bin/python -m pytest -q tests/unit/test_your_data.py
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from elastic_ddp import ElasticRun, LoopContractError
from elastic_ddp.config import TrainingConfig
from elastic_ddp.training.trainer import Trainer
from elastic_ddp.training.workload_builder import build_workload
from elastic_ddp.workload.collate import CollateError, empty_batch, pad_token_sequences, to_device
from elastic_ddp.workload.losses import token_cross_entropy
from tests.support.training import assert_same_parameters

pytestmark = pytest.mark.timeout(180)

VOCAB = 11


class Documents(Dataset):
    """Token sequences of 3 to 12 tokens (each length once in 10) as a tokenizer returns them,
    {"input_ids", "labels"}: the labels are the next tokens, the first two masked (-100, a prompt's)."""

    def __init__(self, size: int = 10):
        generator = torch.Generator().manual_seed(7)
        self.sequences = [torch.randint(0, VOCAB, (3 + (7 * index) % 10,), generator=generator)
                          for index in range(size)]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, Any]:
        tokens = self.sequences[index]
        labels = tokens[1:].clone()
        labels[:2] = -100
        return {"input_ids": tokens[:-1], "labels": labels}


class TokenModel(nn.Module):
    """Each position's logits from its own token alone: padding changes nothing of a real token's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(input_ids)))


def _config(directory: Path, **overrides: Any) -> TrainingConfig:
    settings = {"epochs": 1, "dataset_size": 10, "global_batch_size": 8, "micro_batch_size": 2, "model": "mlp",
                "device": "cpu", "checkpoint_dir": str(directory / "ck"), "memory_dir": str(directory / "memory"),
                "snapshot_every_steps": 0, "log_interval": 100, "watchdog_timeout_s": 0, "memory_copies": False}
    settings.update(overrides)
    return TrainingConfig(**settings)


def _token_run(directory: Path, **overrides: Any) -> ElasticRun:
    return ElasticRun(TokenModel(), Documents(), _config(directory, **overrides), collate_fn=pad_token_sequences)


def _weighted_loop(run: ElasticRun, weights_of=lambda tokens: tokens, clip: bool = False) -> None:
    with run:
        for step in run.steps():
            for batch in step.micro_batches():
                logits = run.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                losses, tokens = token_cross_entropy(logits, batch["labels"])
                step.backward(losses, weights_of(tokens))
            if clip:
                step.clip_grad_norm_(1e9)  # never clips: where the weights are settled
            step.commit()


# ------------------------------------------------------------------------------- structures and collates

def test_dict_samples_with_non_tensor_leaves_train_and_keep_them(tmp_path):
    class Named(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, index):
            return {"x": torch.full((4,), float(index)), "y": index % 3, "name": f"sample-{index}"}

    model = nn.Linear(4, 3)
    run = ElasticRun(model, Named(), _config(tmp_path, dataset_size=32, global_batch_size=16, micro_batch_size=8))
    seen: list[str] = []
    with run:
        for step in run.steps():
            for batch in step.micro_batches():
                assert set(batch) == {"x", "y", "name"} and batch["x"].shape == (8, 4)
                assert [int(name.split("-")[1]) for name in batch["name"]] == batch["x"][:, 0].long().tolist()
                seen += batch["name"]
                step.backward(nn.functional.cross_entropy(run.model(batch["x"]), batch["y"], reduction="none"))
            step.commit()
    assert sorted(seen) == sorted(f"sample-{index}" for index in range(32))  # every sample once


def test_variable_length_sequences_train_through_the_padding_collate_in_the_loader_workers(tmp_path):
    run = _token_run(tmp_path, num_workers=2)
    _weighted_loop(run)
    assert run.global_step == 2
    first, second = Documents()[0], Documents()[1]  # of 2 and 9 tokens
    batch = pad_token_sequences([first, second])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 9)
    assert batch["attention_mask"][0].tolist() == [1, 1] + [0] * 7 and batch["input_ids"][0, 2:].eq(0).all()
    assert batch["labels"][0].tolist() == [-100] * 9 and torch.equal(batch["labels"][1], second["labels"])


def test_without_a_padding_collate_unequal_lengths_are_named_with_their_samples_and_the_fix(tmp_path):
    run = ElasticRun(TokenModel(), Documents(), _config(tmp_path))
    with pytest.raises(CollateError, match=r"^collate_fn: default_collate raised RuntimeError: stack expects each "
                                           r".* on samples \[.*\] of epoch 0; samples of unequal length need a collate "
                                           r"that pads .*pad_token_sequences$"), run:
        for step in run.steps():
            for batch in step.micro_batches():
                pass


def test_a_sample_of_another_structure_is_named_from_the_loader_workers(tmp_path):
    class OneWithoutLabels(Documents):
        def __getitem__(self, index):
            sample = super().__getitem__(index)
            return {"input_ids": sample["input_ids"]} if index == 5 else sample

    run = ElasticRun(TokenModel(), OneWithoutLabels(), _config(tmp_path, num_workers=2),
                     collate_fn=pad_token_sequences)
    with pytest.raises(CollateError, match=r"collate_fn: TokenPadding raised ValueError: pad_token_sequences: "
                                           r"sample \d of the micro-batch has keys \['input_ids'\]"), run:
        _weighted_loop_body(run)
    assert not [child for child in multiprocessing.active_children() if child.daemon], "the loader's workers live on"


def _weighted_loop_body(run: ElasticRun) -> None:
    for step in run.steps():
        for batch in step.micro_batches():
            losses, tokens = token_cross_entropy(run.model(input_ids=batch["input_ids"]), batch["labels"])
            step.backward(losses, tokens)
        step.commit()


class Stream(IterableDataset):
    def __iter__(self):
        return iter(Documents())


def test_a_stream_is_refused_when_the_run_is_built_saying_why_and_what_instead(tmp_path):
    with pytest.raises(TypeError) as refused:
        ElasticRun(TokenModel(), Stream(), _config(tmp_path), collate_fn=pad_token_sequences)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("ElasticRun(dataset=...): got a Stream; expected a map-style")
    assert "exactly once across world sizes needs samples by index" in message
    assert "Hugging Face datasets" in message and "memory-mapped token file" in message and "shards" in message


USER_MODULE = '''
from tests.unit.test_your_data import Documents, TokenModel

def model():
    return TokenModel()

def documents():
    return Documents()
'''


def test_the_cli_trains_dict_samples_with_a_collate_and_token_weights(tmp_path, monkeypatch):
    name = f"user_documents_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = TrainingConfig.from_args(
        ["--model", f"{name}:model", "--dataset", f"{name}:documents", "--collate",
         "elastic_ddp.workload.collate:pad_token_sequences", "--loss", "token_cross_entropy", "--epochs", "2",
         "--global_batch_size", "8", "--micro_batch_size", "4", "--device", "cpu", "--watchdog_timeout_s", "0",
         "--checkpoint_dir", str(tmp_path / "ck"), "--memory_dir", str(tmp_path / "memory")])
    workload = build_workload(config)
    trainer = Trainer(workload.model, workload.dataset, config, loss_fn=workload.loss_fn,
                      collate_fn=workload.collate_fn)
    trainer.fit()
    assert trainer.global_step == 4
    with pytest.raises(SystemExit):
        TrainingConfig.from_args(["--collate", "not an import path"])


Pair = collections.namedtuple("Pair", "inputs targets")


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor
    names: list[str]
    length: torch.Tensor = dataclasses.field(default_factory=lambda: torch.tensor(0))


def _batch_dataclass(samples):
    return Batch(torch.stack([s["x"] for s in samples]), [s["name"] for s in samples],
                 torch.tensor(len(samples[0]["x"])))


def _unpadded_list(samples):
    return {"sequences": [s["x"] for s in samples], "table": torch.arange(3)}


SAMPLE = {"x": torch.arange(4.0), "y": 2, "name": "doc"}
EMPTY_BATCHES = {  # collate: what the empty batch's leaves look like
    "default, dict with a string": (default_collate, {"x": (0, 4), "y": (0,), "name": []}),
    "default, named tuple": (lambda samples: default_collate([Pair(s["x"], s["y"]) for s in samples]),
                             Pair((0, 4), (0,))),
    "dataclass, 0-d leaf kept": (_batch_dataclass, Batch((0, 4), [], ())),
    "list of per-sample tensors": (_unpadded_list, {"sequences": [], "table": (3,)}),
    "padding": (lambda samples: pad_token_sequences([{"input_ids": s["x"].long()} for s in samples]),
                {"input_ids": (0, 4), "attention_mask": (0, 4)}),
}


def _shapes(batch):
    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape)
    if dataclasses.is_dataclass(batch):
        return type(batch)(**{f.name: _shapes(getattr(batch, f.name)) for f in dataclasses.fields(batch)})
    if isinstance(batch, dict):
        return {key: _shapes(value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*map(_shapes, batch))
    return type(batch)(map(_shapes, batch)) if isinstance(batch, list) else batch


@pytest.mark.parametrize("case", EMPTY_BATCHES)
def test_the_empty_batch_cuts_what_follows_the_number_of_samples_and_keeps_the_rest(case):
    collate, expected = EMPTY_BATCHES[case]
    assert _shapes(empty_batch(collate, SAMPLE)) == expected


def test_a_collate_whose_batch_does_not_follow_the_samples_cannot_make_an_empty_batch():
    with pytest.raises(CollateError, match=r"^collate_fn: no tensor of its batch has a first dimension that follows"):
        empty_batch(lambda samples: {"total": torch.stack([s["x"] for s in samples]).sum(0)}, SAMPLE)
    with pytest.raises(CollateError, match=r"^collate_fn: its batch of 1 sample and of 2 differ in structure at "
                                           r"\['b'\] \(keys"):
        empty_batch(lambda samples: {"a": torch.zeros(len(samples)), "b": {f"k{len(samples)}": 1}}, SAMPLE)


class Encoding(collections.UserDict):
    """A mapping pytree does not know, as transformers' BatchEncoding."""


def test_every_tensor_leaf_moves_and_the_rest_stays(tmp_path):
    batch = {"pair": Pair(torch.ones(2), [torch.zeros(1), "id"]), "encoded": Encoding(ids=torch.ones(3), n=3),
             "record": Batch(torch.ones(2, 4), ["a", "b"])}
    moved = to_device(batch, torch.device("meta"))
    assert moved["pair"].inputs.is_meta and moved["pair"].targets[0].is_meta and moved["pair"].targets[1] == "id"
    assert isinstance(moved["encoded"], Encoding) and moved["encoded"]["ids"].is_meta and moved["encoded"]["n"] == 3
    assert isinstance(moved["record"], Batch) and moved["record"].tokens.is_meta and moved["record"].names == ["a", "b"]
    assert not batch["record"].tokens.is_meta and not batch["encoded"]["ids"].is_meta  # the batch itself unchanged
    with pytest.raises(CollateError, match=r"^collate_fn: made a batch of type dict with no tensor the run can move"):
        to_device({"names": ["a"]}, torch.device("meta"))


def test_the_collate_runs_in_the_loader_workers(tmp_path):
    def with_pid(samples):
        return {"x": torch.stack([s["x"] for s in samples]), "pid": os.getpid()}

    class Plain(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, index):
            return {"x": torch.full((4,), float(index))}

    run = ElasticRun(nn.Linear(4, 1), Plain(), _config(tmp_path, dataset_size=16, num_workers=2), collate_fn=with_pid)
    pids = set()
    with run:
        for step in run.steps():
            for batch in step.micro_batches():
                pids.add(batch["pid"])
                step.backward(run.model(batch["x"]).squeeze(1))
            step.commit()
    assert pids and os.getpid() not in pids


# ------------------------------------------------------------------------------- token weights: the maths

def _rank(rank: int, world_size: int, run_dir: str, sharding: str, micro_batch_size: int) -> None:
    """One rank of a weighted run of 2 steps (8 samples, then 2: with 4 ranks, two shares are
    empty); rank 0 writes, at each optimizer step, the parameters and the gradient it steps with."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=rank, world_size=world_size)
    try:
        run = _token_run(Path(run_dir), micro_batch_size=micro_batch_size, sharding=sharding)
        recorded: list[dict] = []

        def record(optimizer, *_):
            full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for name, p in run.module.named_parameters()}
            grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for name, p in run.module.named_parameters()}
            recorded.append({"parameters": full, "gradients": grads, "batch": run.current_step.plan.global_batch,
                             "sharded": all(hasattr(p, "full_tensor") for p in run.module.parameters())})

        run.optimizer.register_step_pre_hook(record)
        _weighted_loop(run, clip=sharding == "fsdp")
        if rank == 0:
            torch.save(recorded, Path(run_dir) / "recorded.pt")
    finally:
        dist.destroy_process_group()


def _recorded(tmp_path: Path, world_size: int, sharding: str, micro_batch_size: int) -> list[dict]:
    run_dir = tmp_path / f"{sharding}-{world_size}x{micro_batch_size}"
    run_dir.mkdir()
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(_rank, args=(world_size, str(run_dir), sharding, micro_batch_size), nprocs=world_size,
                       start_method="forkserver", join=True)
    return torch.load(run_dir / "recorded.pt", weights_only=True)


def _token_mean_gradient(parameters: dict[str, torch.Tensor], indices: list[int]) -> dict[str, torch.Tensor]:
    """The gradient of the mean over every target token of the samples `indices`, all at once."""
    model = TokenModel()
    model.load_state_dict(parameters)
    batch = pad_token_sequences([Documents()[index] for index in indices])
    logits = model(batch["input_ids"])
    nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_token_weights_give_the_token_mean_of_the_global_batch_in_any_world_and_split(tmp_path, sharding):
    splits = [(1, 1), (2, 2), (4, 2)]  # 1 rank in 8 micro-batches, 2 ranks in 2 each, 4 ranks in 1 each
    if sharding == "fsdp":
        splits = splits[1:]  # (FSDP2 over one rank shards nothing)
    for world_size, micro_batch_size in splits:
        recorded = _recorded(tmp_path, world_size, sharding, micro_batch_size)
        assert [len(step["batch"]) for step in recorded] == [8, 2]
        assert all(step["sharded"] == (sharding == "fsdp") for step in recorded)
        for number, step in enumerate(recorded, start=1):
            expected = _token_mean_gradient(step["parameters"], step["batch"])
            for name, gradient in step["gradients"].items():
                torch.testing.assert_close(gradient, expected[name], rtol=0, atol=1e-6,
                                           msg=f"{sharding}, {world_size} ranks, step {number}, {name}")


def test_weights_of_one_train_exactly_as_no_weights(tmp_path):
    weighted, plain = _token_run(tmp_path / "weighted"), _token_run(tmp_path / "plain")
    _weighted_loop(weighted, weights_of=torch.ones_like)
    with plain:
        for step in plain.steps():
            for batch in step.micro_batches():
                losses, _ = token_cross_entropy(plain.model(input_ids=batch["input_ids"]), batch["labels"])
                step.backward(losses)
            step.commit()
    assert_same_parameters(weighted.module.state_dict(), plain.module.state_dict())


# ------------------------------------------------------------------------------- token weights: bad input

def _shorter(tokens):
    return tokens[:-1]


def _negative(tokens):
    return tokens - 100


def _not_finite(tokens):
    return tokens * float("nan")


def _zero(tokens):
    return tokens * 0


BAD_WEIGHTS = {
    "wrong length": (_shorter, ValueError, (r"^step.backward: got weights of shape \(1,\) for losses of shape "
                                            r"\(2,\); expected one weight per sample")),
    "negative": (_negative, ValueError, r"^step.backward: step 1's weights hold 8 negative, NaN or infinite value"),
    "not finite": (_not_finite, ValueError, r"^step.backward: step 1's weights hold \d negative, NaN or infinite"),
    "zero sum": (_zero, ValueError, (r"^step.backward: step 1's weights sum to 0 over its global batch of 8 samples; "
                                     r"expected a positive sum")),
    "a list": (lambda tokens: tokens.tolist(), TypeError,
               r"^step.backward: got weights of type list; expected a tensor"),
}


@pytest.mark.parametrize("bad", BAD_WEIGHTS)
@pytest.mark.parametrize("clip", [False, True])
def test_bad_weights_are_refused_in_one_line_before_the_state_changes(tmp_path, bad, clip):
    weights_of, error, message = BAD_WEIGHTS[bad]
    run = _token_run(tmp_path)
    before = {name: t.clone() for name, t in run.module.state_dict().items()}
    with pytest.raises(error, match=message):
        _weighted_loop(run, weights_of=weights_of, clip=clip)
    assert run.global_step == 0
    assert_same_parameters(run.module.state_dict(), before)


def test_weights_in_some_backwards_and_not_in_others_are_refused(tmp_path):
    run = _token_run(tmp_path)
    with pytest.raises(LoopContractError, match=r"^step.backward\(\): called without weights in step 1, with them "
                                                r"before; give weights in every backward of the run"), run:
        for step in run.steps():
            for read, batch in enumerate(step.micro_batches()):
                losses, tokens = token_cross_entropy(run.model(input_ids=batch["input_ids"]), batch["labels"])
                step.backward(losses, tokens if read == 0 else None)
