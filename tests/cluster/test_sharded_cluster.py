"""Sharded training (`--sharding fsdp`) with real torchrun nodes on 127.0.0.1 and real gloo: a node
SIGKILLed (the shards of 2 ranks resharded over 1, from the survivor's memory: its own part and the
copy of the lost rank's, so no committed step is lost), then a node joining (1 over 2, the part
served from memory to the new rank); every sample exactly once, and the final model that of an
uninterrupted, unsharded run.

    .venv/bin/python -m pytest -q tests/cluster/test_sharded_cluster.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.chaos.equivalence import run_reference
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.safe_reader import read_tensors
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER
from tests.support.cluster import REPO, assert_exactly_once, hold_settings, node_logs, release, world_reached

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATASET, BATCH, EPOCHS = 768, 32, 2
STEPS = EPOCHS * DATASET // BATCH
TRAINING_ARGS = ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET),
                 "--global_batch_size", str(BATCH), "--micro_batch_size", "16", "--snapshot_every_steps", "4",
                 "--log_interval", "4"]
DOCS = REPO / "docs"
PARAMETER_TOLERANCE = 1e-4  # world sizes 2, 1, 2 sum the gradients in other orders (as tests/cluster/test_zero_loss.py)


def test_a_sharded_job_reshards_after_a_kill_and_a_join(local_jobs, tmp_path):
    hold = tmp_path / "hold"
    job = local_jobs(launcher=STOCK_LAUNCHER, training_args=[*TRAINING_ARGS, "--sharding", "fsdp"], nproc_per_node=1,
                     **hold_settings(hold))
    host = job.add_node("host")
    lost = job.add_node("lost")
    world_reached(job, 2)
    job.wait_for_step(6, timeout=90)
    lost.kill()
    shrunk = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1, 90, "restore in world 1")
    job.add_node("joiner")
    grown = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 2, 120, "restore in world 2")
    release(hold)
    assert host.wait(timeout=180) == 0, node_logs(job)

    assert (shrunk["previous_world_size"], grown["previous_world_size"]) == (2, 1)
    # Zero loss: the lost rank's part was in the survivor's memory (its buddy copy), not only on disk.
    assert (shrunk["source"], shrunk["lost_steps"]) == ("memory", 0), shrunk
    # A kill during a step's exchange: that step never counted, and only it may be refused.
    assert all(item["global_step"] == shrunk["global_step"] + 1 for item in shrunk["refused"]), shrunk
    assert grown["source"] == "memory" and grown["lost_steps"] == 0, grown
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
    (final_step, newest), *_ = steps.committed_steps(job.checkpoint_dir)
    assert final_step == STEPS
    sharded = {name[len("model."):]: value for name, value in read_tensors(newest).items()
               if name.startswith("model.")}
    expected = load_snapshot(run_reference(tmp_path / "reference", TRAINING_ARGS))["model"]
    assert sharded.keys() == expected.keys()
    difference = max((sharded[name] - value).abs().max().item() for name, value in expected.items())
    assert difference <= PARAMETER_TOLERANCE, f"largest parameter difference {difference:g}"


def test_a_users_model_trains_sharded_from_the_command_line(tmp_path):
    """docs/examples/digits.toml (a user's model, data, loss and AdamW by import path), sharded over
    two ranks, with evaluation (a collective in sharded mode: every rank forwards alike)."""
    checkpoint_dir = tmp_path / "ck"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "elastic_ddp.train", "--config", str(DOCS / "examples" / "digits.toml"), "--sharding", "fsdp",
               "--epochs", "3", "--checkpoint_dir", str(checkpoint_dir), "--progress", "log"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": os.pathsep.join([str(DOCS / "examples"), str(REPO)])})
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [event for event in read_events(checkpoint_dir / "events.jsonl") if event["event"] == "eval"]
    assert evals and evals[-1]["samples"] == 360, evals
    assert evals[-1]["accuracy"] > 0.8, evals[-1]  # ten classes: far above chance after 3 epochs
    (final_step, _), *_ = steps.committed_steps(checkpoint_dir)
    assert final_step == evals[-1]["global_step"]
