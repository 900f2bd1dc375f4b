"""Small in-process training runs: a config, a trainer, an injected crash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from elastic_ddp.config import TrainingConfig
from elastic_ddp.training.trainer import Trainer
from elastic_ddp.workload.data import SyntheticImageDataset
from elastic_ddp.workload.models import build_model


def small_config(tmp_path: Path, **overrides: Any) -> TrainingConfig:
    """Two epochs of 6 steps of the MLP on 96 samples, a snapshot every 4 steps, on the CPU; memory
    copies in the test's own directory."""
    settings = dict(epochs=2, dataset_size=96, global_batch_size=16, micro_batch_size=8, model="mlp",
                    checkpoint_dir=str(tmp_path / "ck"), memory_dir=str(tmp_path / "memory"), snapshot_every_steps=4,
                    log_interval=100, device="cpu")
    settings.update(overrides)
    return TrainingConfig(**settings)


def make_trainer(config: TrainingConfig, **kwargs: Any) -> Trainer:
    """The built-in model and data for `config`, in a Trainer (kwargs go to the Trainer)."""
    return Trainer(model=build_model(config.model, config.seed),
                   dataset=SyntheticImageDataset(config.dataset_size, config.seed), config=config, **kwargs)


class Crash(Exception):
    """A crash injected by a test."""


def crash_at(step: int):
    """An `after_step` hook that raises Crash once the trainer has committed `step`."""
    def after_step(trainer: Trainer) -> None:
        if trainer.global_step == step:
            raise Crash(f"injected crash at step {step}")
    return after_step


def silent_peer_at(step: int):
    """An `after_step` hook that, once the trainer has committed `step`, takes the peer watchdog's way
    out (keep the step, end the worker: patch `stop_guard.end_worker_now` first), then raises Crash
    as the ended process would no longer train."""
    def after_step(trainer: Trainer) -> None:
        if trainer.global_step == step:
            trainer.run.stop_guard._stop_for_silent_peer("rank(s) [1] sent no heartbeat for over 3 s")
            raise Crash("the watchdog ended the worker")
    return after_step


def assert_same_parameters(left: dict, right: dict) -> None:
    """Two state dicts hold bit-identical tensors."""
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name
