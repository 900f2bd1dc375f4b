"""The examples of docs/custom-model.md run as it says: under torchrun, two processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.runlog.reader import read_events

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
DIGITS_MIN_ACCURACY = 0.95


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_custom_model_example_trains_under_torchrun_and_its_snapshot_loads(tmp_path):
    checkpoint_dir = tmp_path / "ck"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(DOCS / "examples" / "custom_model.py"), "--epochs", "1", "--dataset_size", "256",
               "--global_batch_size", "64", "--micro_batch_size", "16", "--lr", "0.01", "--log_interval", "2",
               "--checkpoint_dir", str(checkpoint_dir)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=200,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 1/1, step 4/4 of the epoch: loss" in result.stderr and "world 2" in result.stderr
    snapshot = load_snapshot(checkpoint_dir)
    assert snapshot["global_step"] == 4 and snapshot["world_size"] == 2
    sys.path.insert(0, str(DOCS / "examples"))
    try:
        from custom_model import SignalClassifier
    finally:
        sys.path.remove(str(DOCS / "examples"))
    model = SignalClassifier()
    model.load_state_dict(snapshot["model"])
    assert model(torch.zeros(3, 64)).shape == (3, 4)




@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_digits_example_trains_from_the_command_line_to_the_documented_accuracy(tmp_path):
    """docs/examples/digits.toml as docs/custom-model.md runs it: no script, import paths only."""
    checkpoint_dir = tmp_path / "ck"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "elastic_ddp.train", "--config", str(DOCS / "examples" / "digits.toml"),
               "--checkpoint_dir", str(checkpoint_dir), "--progress", "log"]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=280, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": os.pathsep.join(filter(None, [str(DOCS / "examples"), str(REPO),
                                                                  os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [event for event in read_events(checkpoint_dir / "events.jsonl") if event["event"] == "eval"]
    assert evals and evals[-1]["samples"] == 360, evals
    # docs/custom-model.md records the accuracy this run reaches; a regression shows here.
    assert evals[-1]["accuracy"] >= DIGITS_MIN_ACCURACY, evals[-1]
