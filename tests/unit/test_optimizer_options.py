"""`--max_grad_norm` (clipping before each optimizer step) and `--no-decay_norms_and_biases` (no
weight decay on biases and norm scales), in the built-in trainer: DDP in this process, and FSDP2 on
a real one-rank gloo group, which must give the unsharded run's numbers.

    .venv/bin/python -m pytest -q tests/unit/test_optimizer_options.py
"""

from __future__ import annotations

import math

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.config import TrainingConfig
from elastic_ddp.snapshot.files.errors import IncompatibleSnapshotError
from elastic_ddp.training.state_builder import build_optimizer, weight_decay_groups
from elastic_ddp.workload.models import MLP
from tests.support.training import make_trainer, small_config


def gradient_norms_at_each_step(config: TrainingConfig) -> list[float]:
    """The global gradient norm the optimizer sees at each of its steps in a run of `config`."""
    trainer = make_trainer(config)
    norms: list[float] = []

    def record(optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    trainer.state.optimizer.register_step_pre_hook(record)
    trainer.fit()
    return norms


def test_max_grad_norm_bounds_every_step_and_changes_nothing_when_off(tmp_path):
    free = gradient_norms_at_each_step(small_config(tmp_path / "free", lr=0.5))
    bound = min(free) / 2  # below every step's norm: every step is clipped
    clipped = gradient_norms_at_each_step(small_config(tmp_path / "clipped", lr=0.5, max_grad_norm=bound))
    assert len(clipped) == len(free) == 12
    assert all(norm == pytest.approx(bound, rel=1e-5) for norm in clipped), clipped
    unclipped = gradient_norms_at_each_step(small_config(tmp_path / "loose", lr=0.5, max_grad_norm=1e6))
    assert unclipped == free  # a bound no step reaches leaves the run as it was, bit for bit


def test_a_sharded_run_clips_as_the_unsharded_one(one_rank_gloo_group, tmp_path):
    """FSDP2's parameters are DTensors: the norm is reduced over the shards, the same number."""
    plain = small_config(tmp_path / "plain", lr=0.5, max_grad_norm=0.05)
    sharded = small_config(tmp_path / "sharded", lr=0.5, max_grad_norm=0.05, sharding="fsdp")
    make_trainer(plain).fit()
    make_trainer(sharded).fit()
    unclipped = small_config(tmp_path / "unclipped", lr=0.5)
    make_trainer(unclipped).fit()
    expected, got, free = (load_snapshot(c.checkpoint_dir)["model"] for c in (plain, sharded, unclipped))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)
    assert any(not torch.allclose(free[name], value) for name, value in expected.items()), "the clip did nothing"


def test_without_decay_on_norms_and_biases_only_matrices_decay():
    model = MLP()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    assert matrices and vectors
    config = TrainingConfig(model="mlp", optimizer="adamw", weight_decay=0.1, decay_norms_and_biases=False)
    optimizer = build_optimizer(config, model.parameters())
    assert [(group["params"], group["weight_decay"]) for group in optimizer.param_groups] == [
        (matrices, 0.1), (vectors, 0.0)]
    assert len(weight_decay_groups(list(model.parameters()), 0.1, decay_all=True)) == 1
    assert len(weight_decay_groups(list(model.parameters()), 0.0, decay_all=False)) == 1  # nothing to apply


def test_a_run_without_decay_on_biases_saves_and_resumes_its_two_groups(tmp_path):
    config = small_config(tmp_path, optimizer="adamw", weight_decay=0.5, decay_norms_and_biases=False)
    make_trainer(config).fit()
    groups = load_snapshot(config.checkpoint_dir)["optimizer"]["param_groups"]
    assert [(len(group["params"]), group["weight_decay"]) for group in groups] == [(3, 0.5), (3, 0.0)]
    longer = small_config(tmp_path, optimizer="adamw", weight_decay=0.5, decay_norms_and_biases=False, epochs=3)
    make_trainer(longer).fit()  # resumes into the same two groups
    assert load_snapshot(config.checkpoint_dir)["global_step"] == 18
    one_group = small_config(tmp_path, optimizer="adamw", weight_decay=0.5, epochs=4)
    with pytest.raises(IncompatibleSnapshotError, match=r"optimizer state does not fit .*--decay_norms_and_biases"):
        make_trainer(one_group).fit()
    assert load_snapshot(config.checkpoint_dir)["global_step"] == 18  # the last good snapshot is still there


@pytest.mark.parametrize(("value", "message"), [
    (-1.0, "--max_grad_norm: got -1.0; expected 0 or more"),
    (math.nan, "--max_grad_norm: got nan; expected a finite number"),
    (math.inf, "--max_grad_norm: got inf; expected a finite number"),
])
def test_a_bad_max_grad_norm_is_one_line_naming_it(tmp_path, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        small_config(tmp_path, max_grad_norm=value)
