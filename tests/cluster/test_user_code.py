"""A user's own model and data from the command line: import paths, a TOML file, AdamW, evaluation,
and a node killed mid-run. Real torchrun agents (plain torchrun, `--rdzv_backend=elastic-c10d`) as
nodes on 127.0.0.1, real gloo, a real SIGKILL; the user's module is written by the test into a
directory of its own and found through PYTHONPATH, as a user's package would be."""

from __future__ import annotations

import importlib.util
import math
import os
import textwrap
import time

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER
from elastic_ddp.training.evaluation import evaluate
from elastic_ddp.workload.losses import per_sample_cross_entropy
from tests.support.cluster import (
    assert_exactly_once,
    assert_workers_started_warm,
    hold_settings,
    node_logs,
    release,
    world_reached,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN_SAMPLES, HELD_OUT, BATCH, EPOCHS, EVAL_EVERY = 768, 256, 32, 3, 8
STEPS_PER_EPOCH = TRAIN_SAMPLES // BATCH  # 24

# Four well-separated Gaussian blobs in 8 dimensions: a linear model can reach ~100 % accuracy.
USER_MODULE = f'''
import torch
from torch import nn
from torch.utils.data import TensorDataset

CENTRES = torch.randn(4, 8, generator=torch.Generator().manual_seed(123)) * 3

def _blobs(count, seed):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (count,), generator=generator)
    return TensorDataset(CENTRES[labels] + torch.randn(count, 8, generator=generator), labels)

def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

def train_set():
    return _blobs({TRAIN_SAMPLES}, seed=1)

def held_out_set():
    return _blobs({HELD_OUT}, seed=2)
'''

CONFIG = f'''
model = "blobs_workload:build_model"
dataset = "blobs_workload:train_set"
eval_dataset = "blobs_workload:held_out_set"
eval_every_steps = {EVAL_EVERY}
optimizer = "adamw"
lr = 0.01
betas = [0.9, 0.98]
weight_decay = 0.01
epochs = {EPOCHS}
global_batch_size = {BATCH}
micro_batch_size = 16
snapshot_every_steps = 0
log_interval = 4
'''


def import_user_module(directory):
    spec = importlib.util.spec_from_file_location("blobs_workload", directory / "blobs_workload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_users_module_trains_from_a_toml_file_through_a_node_failure(local_jobs, tmp_path):
    user_dir = tmp_path / "user_code"
    user_dir.mkdir()
    (user_dir / "blobs_workload.py").write_text(textwrap.dedent(USER_MODULE))
    config_file = tmp_path / "run.toml"
    config_file.write_text(CONFIG)

    hold = tmp_path / "hold"
    settings = hold_settings(hold)
    settings["env"]["PYTHONPATH"] = os.pathsep.join([str(user_dir), settings["env"]["PYTHONPATH"]])
    # The restart path (in_process=0): its restarted workers must find the user's module too, warm.
    job = local_jobs(launcher=STOCK_LAUNCHER, rdzv_backend=BACKEND_NAME, rdzv_conf="in_process=0", monitor_interval=None,
                     training_args=["--config", str(config_file)], nproc_per_node=2, **settings)
    host = job.add_node("host")
    lost = job.add_node("lost")
    world_reached(job, 4)
    job.wait_for_step(STEPS_PER_EPOCH + 5, timeout=120)  # mid-epoch 2: no snapshot file holds it
    killed_at = time.time()
    lost.kill()
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 2
                                 and e["time"] > killed_at, 120, "the restore without the killed node")
    assert restore["source"] == "memory" and restore["lost_steps"] == 0, restore
    release(hold)
    assert host.wait(timeout=180) == 0, node_logs(job)
    assert_workers_started_warm(job, host, starts=4)  # 2 workers, before and after the kill

    assert_exactly_once(job, TRAIN_SAMPLES, EPOCHS, BATCH)
    evals = job.events("eval")
    final_step = EPOCHS * STEPS_PER_EPOCH
    # Every EVAL_EVERY steps (the epoch ends, 24, 48, 72, are among them), in both worlds.
    assert sorted({e["global_step"] for e in evals}) == list(range(EVAL_EVERY, final_step + 1, EVAL_EVERY)), evals
    assert all(e["samples"] == HELD_OUT and math.isfinite(e["loss"]) for e in evals), evals
    last = max(evals, key=lambda e: e["time"])
    assert last["global_step"] == final_step and last["accuracy"] >= 0.95, last
    assert last["loss"] < evals[0]["loss"], evals

    # The snapshot loads into the user's own model, and that model scores what rank 0 reported.
    user_module = import_user_module(user_dir)
    model = user_module.build_model()
    snapshot = load_snapshot(job.checkpoint_dir)
    assert snapshot["global_step"] == final_step
    model.load_state_dict(snapshot["model"])
    assert type(snapshot["optimizer"]["state"][0]["exp_avg"]) is torch.Tensor  # AdamW's state
    result = evaluate(model, user_module.held_out_set(), per_sample_cross_entropy, 0, 1, 64, torch.device("cpu"),
                      distributed=False)
    assert result.accuracy == pytest.approx(last["accuracy"]) and result.loss == pytest.approx(last["loss"], rel=1e-4)
    assert "eval at step 72 (epoch 3): held-out loss" in node_logs(job)
