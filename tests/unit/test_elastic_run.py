"""`ElasticRun`: a loop of the user's own gets the Trainer's numbers, its extra state travels with
the step through a crash, and each rule of the contract is refused at the line that broke it.

    .venv/bin/python -m pytest -q tests/unit/test_elastic_run.py
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
import torch

from elastic_ddp import ElasticRun, LoopContractError, load_snapshot
from elastic_ddp.config import TrainingConfig
from elastic_ddp.snapshot.files.errors import IncompatibleSnapshotError
from elastic_ddp.snapshot.manager import SnapshotSession
from elastic_ddp.workload.data import SyntheticImageDataset
from elastic_ddp.workload.losses import per_sample_cross_entropy
from elastic_ddp.workload.models import build_model
from tests.support.training import Crash, assert_same_parameters, make_trainer, small_config


class WeightAverage:
    """An exponential moving average of the weights: the kind of extra state a loop keeps."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9):
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.updates = 0

    def update(self, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": {name: t.clone() for name, t in self.shadow.items()}, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, t in state["shadow"].items():
            self.shadow[name].copy_(t)
        self.updates = int(state["updates"])


def new_run(config: TrainingConfig, **kwargs: Any) -> ElasticRun:
    return ElasticRun(build_model(config.model, config.seed), SyntheticImageDataset(config.dataset_size, config.seed),
                      config, **kwargs)


def own_loop(config: TrainingConfig, crash_after: int | None = None) -> tuple[ElasticRun, WeightAverage]:
    """A loop as a user writes it: clipping, an EMA updated in the commit, a crash of its own."""
    model = build_model(config.model, config.seed)
    ema = WeightAverage(model)
    run = ElasticRun(model, SyntheticImageDataset(config.dataset_size, config.seed), config, extra_state={"ema": ema})
    with run:
        for step in run.steps():
            for inputs, targets in step.micro_batches():
                step.backward(per_sample_cross_entropy(run.model(inputs), targets))
            step.clip_grad_norm_(0.5)
            with step.committing():
                ema.update(run.module)
            if run.global_step == crash_after:
                raise Crash(f"the loop's own crash at step {crash_after}")
    return run, ema


def plain_loop(run: ElasticRun) -> None:
    with run:
        for step in run.steps():
            for inputs, targets in step.micro_batches():
                with run.autocast():
                    losses = per_sample_cross_entropy(run.model(inputs), targets)
                step.backward(losses)
            step.commit()


def test_a_plain_own_loop_gets_the_trainers_parameters_bit_for_bit(tmp_path):
    trainer = make_trainer(small_config(tmp_path / "trainer"))
    trainer.fit()
    run = new_run(small_config(tmp_path / "own"))
    plain_loop(run)
    assert run.global_step == trainer.global_step == 12
    assert_same_parameters(run.module.state_dict(), trainer.model.state_dict())


def test_under_ddp_with_two_micro_batches_the_own_loop_equals_the_trainer(one_rank_gloo_group, monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # what torchrun gives a worker: DDP wraps the model
    monkeypatch.setenv("MASTER_PORT", "1")
    trainer = make_trainer(small_config(tmp_path / "trainer", watchdog_timeout_s=0))
    trainer.fit()
    run = new_run(small_config(tmp_path / "own", watchdog_timeout_s=0))
    plain_loop(run)
    assert isinstance(run.model, torch.nn.parallel.DistributedDataParallel)
    assert_same_parameters(run.module.state_dict(), trainer.model.state_dict())


def test_under_fsdp_an_optimizer_factory_gets_the_trainers_parameters(one_rank_gloo_group, tmp_path):
    trainer = make_trainer(small_config(tmp_path / "trainer", sharding="fsdp"))
    trainer.fit()
    config = small_config(tmp_path / "own", sharding="fsdp")
    run = new_run(config, optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=config.lr,
                                                                   momentum=config.momentum))
    plain_loop(run)
    expected, got = load_snapshot(trainer.config.checkpoint_dir), load_snapshot(config.checkpoint_dir)
    assert got["global_step"] == expected["global_step"] == 12
    assert_same_parameters(got["model"], expected["model"])


def test_under_fsdp_an_optimizer_built_before_sharding_is_refused(tmp_path):
    model = build_model("mlp", 0)
    config = small_config(tmp_path, sharding="fsdp")
    with pytest.raises(ValueError, match="--sharding fsdp: got an optimizer built before the model was sharded"):
        ElasticRun(model, SyntheticImageDataset(96), config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_extra_state_travels_with_the_step_through_a_crash(tmp_path):
    uninterrupted, expected_ema = own_loop(small_config(tmp_path / "whole"))
    config = small_config(tmp_path / "crashed")
    with pytest.raises(Crash):
        own_loop(config, crash_after=5)  # between snapshots (every 4): step 5 lives in the memory copy
    resumed, ema = own_loop(config)
    assert resumed.global_step == 12 and ema.updates == expected_ema.updates == 12
    assert_same_parameters(resumed.module.state_dict(), uninterrupted.module.state_dict())
    assert_same_parameters(ema.shadow, expected_ema.shadow)
    saved = load_snapshot(config.checkpoint_dir)
    assert saved["extra_state"]["ema"]["updates"] == 12


def test_a_sigterm_while_a_failed_run_keeps_its_step_waits_for_the_keep(tmp_path, monkeypatch):
    """torchrun SIGTERMs a node's workers as soon as one fails: the signal must not end the process
    while it keeps its last step on the way out (seen in CI: a worker vanished without a line and
    its step was lost). Here the signal comes in the middle of the keep; the test's own handler
    stands for the default one, which would have ended the process."""
    seen_by_the_process: list[int] = []

    def the_process_handler(signum, frame):
        seen_by_the_process.append(signum)

    previous = signal.signal(signal.SIGTERM, the_process_handler)
    kept: list[int] = []
    keep = SnapshotSession.keep_in_memory

    def signalled_while_keeping(session, state, reason, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        copy = keep(session, state, reason, *args, **kwargs)
        kept.append(state.global_step)
        return copy

    monkeypatch.setattr(SnapshotSession, "keep_in_memory", signalled_while_keeping)
    try:
        config = small_config(tmp_path)
        run = new_run(config)
        with pytest.raises(Crash), run:
            for step in run.steps():
                for inputs, targets in step.micro_batches():
                    step.backward(per_sample_cross_entropy(run.model(inputs), targets))
                step.commit()
                if run.global_step == 5:
                    raise Crash("the loop's own crash at step 5")
        assert kept == [5] and run.drain.requested, "the signal reached the run's handler during the keep"
        assert not seen_by_the_process, "the process's own handler (the default: the end) was back too early"
        assert signal.getsignal(signal.SIGTERM) is the_process_handler, "the process's handler is back after"
    finally:
        signal.signal(signal.SIGTERM, previous)


def _optimizer_step(run, step):
    for inputs, targets in step.micro_batches():
        step.backward(per_sample_cross_entropy(run.model(inputs), targets))
        run.optimizer.step()


def _unread(run, step):
    step.commit()


def _no_backward(run, step):
    for inputs, _ in step.micro_batches():
        run.model(inputs)


def _mean_loss(run, step):
    for inputs, targets in step.micro_batches():
        step.backward(per_sample_cross_entropy(run.model(inputs), targets).mean())


def _backward_twice(run, step):
    for inputs, targets in step.micro_batches():
        losses = per_sample_cross_entropy(run.model(inputs), targets)
        step.backward(losses)
        step.backward(losses)


def _left_uncommitted(run, step):
    for inputs, targets in step.micro_batches():
        step.backward(per_sample_cross_entropy(run.model(inputs), targets))


def _committed_twice(run, step):
    _left_uncommitted(run, step)
    step.commit()
    step.commit()


def _clip_before_reading(run, step):
    step.clip_grad_norm_(1.0)


MISUSES: dict[str, tuple[Callable, type[Exception], str]] = {
    "optimizer stepped by the loop": (_optimizer_step, LoopContractError,
                                      r"optimizer.step\(\) called by the loop during step 1; the run steps"),
    "commit before reading": (_unread, LoopContractError,
                              r"step.commit\(\): step 1 has 2 micro-batch\(es\); 0 were read"),
    "micro-batch without backward": (_no_backward, LoopContractError,
                                     r"step 1: micro-batch 1 of 2 was read but step.backward\(\) was not called"),
    "mean-reduced loss": (_mean_loss, ValueError, r"step.backward: the loss returned a tensor of shape \(\) for 8"),
    "backward twice": (_backward_twice, LoopContractError, r"called twice for one micro-batch of step 1"),
    "step left uncommitted": (_left_uncommitted, LoopContractError,
                              r"step 1 was not committed before the next one was asked for"),
    "committed twice": (_committed_twice, LoopContractError, r"step 1 is already committed"),
    "clip before reading": (_clip_before_reading, LoopContractError, r"step.clip_grad_norm_\(\): step 1 has 2"),
}


@pytest.mark.parametrize("misuse", MISUSES)
def test_each_misuse_is_refused_where_it_happens_and_the_run_keeps_its_state(tmp_path, misuse):
    body, error, message = MISUSES[misuse]
    run = new_run(small_config(tmp_path))
    before = {name: t.clone() for name, t in run.module.state_dict().items()}
    with pytest.raises(error, match=message), run:
        for step in run.steps():
            body(run, step)
    assert run.global_step == (1 if misuse == "committed twice" else 0)
    if run.global_step == 0:
        assert_same_parameters(run.module.state_dict(), before)


def test_calling_the_users_module_under_ddp_is_refused(one_rank_gloo_group, monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    run = new_run(small_config(tmp_path, watchdog_timeout_s=0))
    with pytest.raises(LoopContractError, match="the loss was not computed through run.model"), run:
        for step in run.steps():
            for inputs, targets in step.micro_batches():
                step.backward(per_sample_cross_entropy(run.module(inputs), targets))


def test_steps_outside_the_run_and_a_second_entry_are_refused(tmp_path):
    run = new_run(small_config(tmp_path))
    with pytest.raises(LoopContractError, match=r"steps\(\): called outside `with run:`"):
        next(run.steps())
    with run, pytest.raises(LoopContractError, match="entered a second time"):
        run.__enter__()
    with pytest.raises(LoopContractError, match="entered a second time"):
        run.__enter__()


@pytest.mark.parametrize("extra_state, error, message", [
    ([1], TypeError, r"extra_state: got a list; expected a dict"),
    ({"": WeightAverage(torch.nn.Linear(1, 1))}, ValueError, r"extra_state: got the key ''"),
    ({"count": 3}, TypeError, r"extra_state\['count'\]: got a int, which has no state_dict\(\)"),
])
def test_bad_extra_state_is_refused_before_anything_starts(tmp_path, extra_state, error, message):
    with pytest.raises(error, match=message):
        new_run(small_config(tmp_path), extra_state=extra_state)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan"), float("inf")])
def test_clipping_to_a_norm_that_is_not_positive_and_finite_is_refused(tmp_path, max_norm):
    run = new_run(small_config(tmp_path))
    with pytest.raises(ValueError, match=r"step.clip_grad_norm_: got max_norm=.*; expected a positive finite"), run:
        for step in run.steps():
            _left_uncommitted(run, step)
            step.clip_grad_norm_(max_norm)


def test_leaving_the_loop_early_makes_its_last_step_durable(tmp_path):
    config = small_config(tmp_path, snapshot_every_steps=100)
    run = new_run(config)
    with run:
        for step in run.steps():
            _left_uncommitted(run, step)
            step.commit()
            if run.global_step == 3:
                break
    assert load_snapshot(config.checkpoint_dir)["global_step"] == 3
    resumed = new_run(config)
    plain_loop(resumed)
    assert resumed.global_step == 12


def test_a_snapshot_without_extra_state_restores_into_a_run_without_any_and_is_refused_by_one_with_some(tmp_path):
    plain = new_run(small_config(tmp_path / "plain"))
    written_before_extra_state = {name: state for name, state in plain.state.state_dicts().items()
                                  if name != "extra_state"}
    plain.state.load_state_dicts(written_before_extra_state)
    model = build_model("mlp", 0)
    with_ema = ElasticRun(model, SyntheticImageDataset(96), small_config(tmp_path / "ema"),
                          extra_state={"ema": WeightAverage(model)})
    with pytest.raises(IncompatibleSnapshotError, match="the snapshot holds no extra state named ema"):
        with_ema.state.load_state_dicts(written_before_extra_state)
    with pytest.raises(IncompatibleSnapshotError, match="the snapshot holds no state for sampler"):
        plain.state.load_state_dicts({n: s for n, s in written_before_extra_state.items() if n != "sampler"})
