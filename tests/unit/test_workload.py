"""Your model, data and loss by import path: what builds, and the one line for each bad value
(before any process group: `build_workload` runs first in `elastic_ddp.train.main`)."""

from __future__ import annotations

import textwrap
import uuid

import pytest
import torch

from elastic_ddp.config import TrainingConfig
from elastic_ddp.workload.data import SyntheticImageDataset
from elastic_ddp.workload.losses import per_sample_mse
from elastic_ddp.train import BAD_INPUT_EXIT_CODE, main
from elastic_ddp.workload.user_code import UserCodeError
from elastic_ddp.training.workload_builder import build_workload

USER_MODULE = '''
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

def model():
    return nn.Linear(4, 3)

def train_set():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(40, 4, generator=generator)
    return TensorDataset(inputs, inputs.argmax(dim=1) % 3)

def not_a_model():
    return "a string"

def raises():
    raise RuntimeError("no data here")

def empty():
    return TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))

class Stream(IterableDataset):
    def __iter__(self):
        return iter([])

def stream():
    return Stream()

def absolute_error(outputs, targets):
    return (outputs - targets).abs().flatten(1).mean(dim=1)

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the test's own, importable by the name this returns."""
    name = f"user_workload_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def config(tmp_path, **overrides) -> TrainingConfig:
    settings = dict(checkpoint_dir=str(tmp_path / "ck"), device="cpu", global_batch_size=8, micro_batch_size=8)
    settings.update(overrides)
    return TrainingConfig(**settings)


def test_import_paths_build_the_users_model_data_and_loss(tmp_path, user_module):
    workload = build_workload(config(tmp_path, model=f"{user_module}:model", dataset=f"{user_module}:train_set",
                                     eval_dataset=f"{user_module}:train_set", loss=f"{user_module}:absolute_error"))
    assert isinstance(workload.model, torch.nn.Linear) and len(workload.dataset) == len(workload.eval_dataset) == 40
    assert workload.sample_transform is None  # augmentation is the built-in data's
    assert workload.loss_fn(torch.ones(2, 3), torch.zeros(2, 3)).tolist() == [1.0, 1.0]


def test_the_model_is_built_from_the_seed_so_every_rank_starts_the_same(tmp_path, user_module):
    first, second, other = (build_workload(config(tmp_path, model=f"{user_module}:model", seed=seed)).model
                            for seed in (3, 3, 4))
    assert torch.equal(first.weight, second.weight) and not torch.equal(first.weight, other.weight)


def test_builtins_by_name(tmp_path):
    workload = build_workload(config(tmp_path, model="mlp", eval_dataset="synthetic", loss="mse", dataset_size=64))
    assert isinstance(workload.dataset, SyntheticImageDataset) and len(workload.dataset) == 64
    assert len(workload.eval_dataset) == 16 and workload.loss_fn is per_sample_mse
    assert workload.sample_transform is not None  # --augment defaults on for the built-in data
    held_out, train = workload.eval_dataset[0], workload.dataset[0]
    assert not torch.equal(held_out[0], train[0]), "the held-out set must hold other samples"


@pytest.mark.parametrize("flag, value, message", [
    ("model", "no_such_module_xyz:build", "--model: got 'no_such_module_xyz:build', but module 'no_such_module_xyz' "
                                          "was not found"),
    ("model", "{m}:missing", "--model: got '{m}:missing', but '{m}' has no attribute 'missing'"),
    ("model", "{m}:NOT_CALLABLE", "--model: got '{m}:NOT_CALLABLE', but 'NOT_CALLABLE' is a int, not callable"),
    ("model", "{m}:not_a_model", "--model: '{m}:not_a_model' returned a str; expected a torch.nn.Module"),
    ("dataset", "{m}:raises", "--dataset: '{m}:raises' raised RuntimeError: no data here"),
    ("dataset", "{m}:empty", "--dataset: '{m}:empty' returned an empty dataset"),
    ("dataset", "{m}:stream", "--dataset: '{m}:stream' returned a Stream; expected a map-style dataset"),
    ("eval_dataset", "{m}:model", "--eval_dataset: '{m}:model' returned a Linear; expected a map-style dataset"),
    ("loss", "{m}:missing", "--loss: got '{m}:missing', but '{m}' has no attribute 'missing'"),
])
def test_a_bad_import_path_is_one_line_naming_flag_value_and_problem(tmp_path, user_module, flag, value, message):
    with pytest.raises(UserCodeError) as excinfo:
        build_workload(config(tmp_path, **{flag: value.format(m=user_module)}))
    text = str(excinfo.value)
    assert message.format(m=user_module) in text and "\n" not in text


def test_a_module_that_fails_to_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_user_module.py").write_text("raise ImportError('needs a GPU library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserCodeError, match="importing 'broken_user_module' raised ImportError: needs a GPU library"):
        build_workload(config(tmp_path, model="broken_user_module:build"))


def test_drop_last_with_a_dataset_smaller_than_the_global_batch(tmp_path, user_module):
    with pytest.raises(UserCodeError, match=r"--global_batch_size: got 64 with --drop_last; expected at most the "
                                            r"length of --dataset .* \(40\)"):
        build_workload(config(tmp_path, dataset=f"{user_module}:train_set", global_batch_size=64,
                              micro_batch_size=8, drop_last=True))


def test_the_worker_exits_with_the_line_before_any_process_group(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["--model", "no_such_module_xyz:build", "--checkpoint_dir", str(tmp_path / "ck"), "--device", "cpu"])
    assert code == BAD_INPUT_EXIT_CODE
    assert "--model: got 'no_such_module_xyz:build'" in capfd.readouterr().err
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "ck").exists()
