"""A language model from the flags alone: `--model gpt` on `--dataset tokens` (windows of a flat
uint16 token file, here the bytes of a Python standard-library source file), trained, interrupted,
resumed bit-equal, and sharded with the unsharded run's numbers; a bad token file refused in one
line. Exactly once over windows is the sampler's (tests/unit/test_sampler.py): a window is a sample.

    .venv/bin/python -m pytest -q tests/unit/test_language_model.py
"""

from __future__ import annotations

import json.decoder
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from elastic_ddp import load_snapshot
from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.training.trainer import Trainer
from elastic_ddp.training.workload_builder import build_workload
from elastic_ddp.workload.tokens import TokenWindows
from elastic_ddp.workload.user_code import UserCodeError
from tests.support.training import Crash, crash_at

GPT_FLAGS = {"model": "gpt", "dataset": "tokens", "block_size": 32, "gpt_layers": 2, "gpt_heads": 2, "gpt_embed": 32,
             "optimizer": "adamw", "lr": 3e-3, "global_batch_size": 16, "micro_batch_size": 8, "epochs": 2,
             "max_grad_norm": 1.0, "snapshot_every_steps": 4, "log_interval": 1, "device": "cpu"}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    """Byte-level tokens of a real text every machine has offline: 4 KiB of json/decoder.py."""
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    text = Path(json.decoder.__file__).read_bytes()[:4096]
    path.write_bytes(b"".join(byte.to_bytes(2, "little") for byte in text))  # uint16, little-endian
    return path


def gpt_config(tmp_path: Path, tokens: Path, **overrides) -> TrainingConfig:
    return TrainingConfig(**{**GPT_FLAGS, "token_file": str(tokens), "checkpoint_dir": str(tmp_path / "ck"),
                             "memory_dir": str(tmp_path / "memory"), **overrides})


def trainer_for(config: TrainingConfig, **kwargs) -> Trainer:
    workload = build_workload(config)
    return Trainer(model=workload.model, dataset=workload.dataset, loss_fn=workload.loss_fn, config=config, **kwargs)


def losses(config: TrainingConfig) -> list[float]:
    return [event["loss"] for event in read_events(Path(config.checkpoint_dir) / EVENT_LOG_NAME)
            if event["event"] == "progress"]


def test_a_byte_level_gpt_learns_and_resumes_bit_equal(tmp_path, token_file):
    reference = gpt_config(tmp_path / "reference", token_file)
    trainer_for(reference).fit()
    steps = 2 * (127 // 16 + 1)  # 4096 bytes: 127 windows of 32 + 1 tokens, 8 steps per epoch
    history = losses(reference)
    assert len(history) == steps and history[-1] < history[0] - 0.5, history  # from ln 256: it learns the bytes
    interrupted = gpt_config(tmp_path / "interrupted", token_file)
    with pytest.raises(Crash):
        trainer_for(interrupted, after_step=crash_at(5)).fit()
    trainer_for(interrupted).fit()
    expected, resumed = load_snapshot(reference.checkpoint_dir), load_snapshot(interrupted.checkpoint_dir)
    assert resumed["global_step"] == expected["global_step"] == steps
    for name, value in expected["model"].items():
        assert torch.equal(resumed["model"][name], value), name


def test_a_sharded_gpt_trains_as_the_unsharded_one(one_rank_gloo_group, tmp_path, token_file):
    plain = gpt_config(tmp_path / "plain", token_file, epochs=1)
    sharded = gpt_config(tmp_path / "sharded", token_file, epochs=1, sharding="fsdp")
    trainer_for(plain).fit()
    trainer_for(sharded).fit()
    expected, got = load_snapshot(plain.checkpoint_dir)["model"], load_snapshot(sharded.checkpoint_dir)["model"]
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5)


def test_a_token_file_that_is_not_one_is_refused_in_one_line(tmp_path, token_file):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(UserCodeError, match=r"^--token_file: .*odd\.bin holds 3 bytes; expected little-endian uint16"):
        build_workload(gpt_config(tmp_path, odd))
    large = tmp_path / "large.bin"
    large.write_bytes(b"".join(token.to_bytes(2, "little") for token in [1, 2, 300, 4] * 20))
    windows = TokenWindows(large, block_size=8, vocab_size=256)
    with pytest.raises(ValueError, match=r"holds token id 300 in window 0 .*expected ids below --vocab_size 256"):
        windows[0]
    with pytest.raises(ValueError, match=r"holds token id 300 in window 1 "):  # the first in the batch
        windows.collated([1, 0])
    with pytest.raises(IndexError, match=r"window 9 of 9"):
        windows.collated([1, 9])


def test_a_batch_of_windows_is_what_the_default_collate_makes_of_them(token_file):
    windows = TokenWindows(token_file, block_size=16, vocab_size=256)
    indices = [5, 0, len(windows) - 1, 5]
    batch, one_by_one = windows.collated(indices), default_collate([windows[i] for i in indices])
    assert [t.shape for t in batch] == [(4, 16), (4, 16)]
    assert all(torch.equal(got, expected) and got.dtype == expected.dtype for got, expected in zip(batch, one_by_one))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"token_file": None}, r"^--token_file: got None with --dataset tokens; expected both"),
    ({"gpt_embed": 33}, r"^--gpt_embed: got 33; expected a multiple of --gpt_heads \(2\)$"),
    ({"model": "mlp", "dataset": "synthetic", "token_file": None, "gpt_layers": None, "gpt_heads": None,
      "gpt_embed": None, "block_size": 8}, r"^--block_size: got 8 with --model mlp and --dataset synthetic; it sizes"),
    ({"gpt_layers": 0}, r"^--gpt_layers: got 0; expected a positive integer$"),
])
def test_bad_language_model_flags_are_one_line_naming_them(tmp_path, token_file, overrides, message):
    with pytest.raises(ValueError, match=message):
        gpt_config(tmp_path, token_file, **overrides)
