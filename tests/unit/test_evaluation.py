"""Evaluation on held-out data: the numbers, the cadence, and that training does not notice it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from elastic_ddp import load_snapshot
from elastic_ddp.workload.data import SyntheticImageDataset
from elastic_ddp.training.evaluation import evaluate
from elastic_ddp.workload.losses import per_sample_cross_entropy, per_sample_mse
from elastic_ddp.runlog.reader import read_events
from tests.support.training import assert_same_parameters, make_trainer, small_config

CPU = torch.device("cpu")


def classification_set() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(23, 5, generator=generator)
    return TensorDataset(inputs, torch.randint(0, 3, (23,), generator=generator))


def test_loss_and_accuracy_over_the_whole_set():
    dataset, model = classification_set(), torch.nn.Linear(5, 3)
    result = evaluate(model, dataset, per_sample_cross_entropy, rank=0, world_size=1, batch_size=4, device=CPU,
                      distributed=False)
    inputs, targets = dataset.tensors
    with torch.no_grad():
        outputs = model(inputs)
    assert result.samples == 23
    assert result.loss == pytest.approx(per_sample_cross_entropy(outputs, targets).mean().item(), rel=1e-6)
    assert result.accuracy == pytest.approx((outputs.argmax(1) == targets).float().mean().item())


def test_the_shares_of_any_world_size_cover_each_sample_once():
    """What each rank adds before the all-reduce: the shares' sums are the whole set's, for any world."""
    dataset, model = classification_set(), torch.nn.Linear(5, 3)
    whole = evaluate(model, dataset, per_sample_cross_entropy, 0, 1, 4, CPU, distributed=False)
    for world_size in (2, 3, 7, 30):  # 30 > 23 samples: some ranks have nothing
        shares = [evaluate(model, dataset, per_sample_cross_entropy, rank, world_size, 4, CPU, distributed=False)
                  for rank in range(world_size)]
        # Each rank divides its sums by the whole length, so the shares add up to the whole.
        assert sum(share.loss for share in shares) == pytest.approx(whole.loss, rel=1e-6)


def test_regression_targets_have_no_accuracy():
    inputs = torch.randn(10, 3)
    result = evaluate(torch.nn.Linear(3, 1), TensorDataset(inputs, inputs.sum(1)), per_sample_mse, 0, 1, 4, CPU,
                      distributed=False)
    assert result.accuracy is None and result.loss > 0


def test_eval_mode_no_grad_and_train_mode_again():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Dropout(0.9))
    model.train()
    first = evaluate(model, classification_set(), per_sample_cross_entropy, 0, 1, 8, CPU, distributed=False)
    second = evaluate(model, classification_set(), per_sample_cross_entropy, 0, 1, 8, CPU, distributed=False)
    assert first == second  # dropout off: eval mode
    assert model.training and all(p.grad is None for p in model.parameters())


def test_the_trainer_evaluates_at_the_cadence_without_changing_the_trajectory(tmp_path):
    held_out = SyntheticImageDataset(32, seed=0, held_out=True)
    plain = small_config(tmp_path / "plain")
    make_trainer(plain).fit()
    evaluated = small_config(tmp_path / "evaluated", eval_dataset="synthetic", eval_every_steps=4)
    make_trainer(evaluated, eval_dataset=held_out).fit()

    # Evaluation draws no random number and moves no cursor: the same model, bit for bit.
    assert_same_parameters(load_snapshot(plain.checkpoint_dir)["model"], load_snapshot(evaluated.checkpoint_dir)["model"])
    evals = [e for e in read_events(f"{evaluated.checkpoint_dir}/events.jsonl") if e["event"] == "eval"]
    # 2 epochs of 6 steps: every 4 steps (4, 8) and each epoch end (6, 12).
    assert [(e["global_step"], e["epoch"]) for e in evals] == [(4, 0), (6, 0), (8, 1), (12, 1)]
    assert all(e["samples"] == 32 and 0 <= e["accuracy"] <= 1 and e["loss"] > 0 for e in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]  # it learns
    assert not any(e["event"] == "eval" for e in read_events(f"{plain.checkpoint_dir}/events.jsonl"))


def test_a_loss_that_is_not_per_sample_is_refused(tmp_path):
    def mean_loss(outputs, targets):
        return per_sample_cross_entropy(outputs, targets).mean()

    with pytest.raises(ValueError, match=r"--loss: the loss returned a tensor of shape \(\) for 8 samples; expected "
                                         r"one loss per sample"):
        make_trainer(small_config(tmp_path), loss_fn=mean_loss).fit()
