"""The mission's command told what it costs: real torchrun agents, and what rank 0 logs at start
(elastic_ddp/runtime/launch_costs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_ddp.testbed.local_cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TRAINING = ["-m", "elastic_ddp.train", "--model", "mlp", "--epochs", "1", "--dataset_size", "64",
            "--global_batch_size", "32", "--micro_batch_size", "32", "--progress", "off"]


def torchrun(tmp_path, *arguments: str) -> str:
    """Run one torchrun node to the end; its whole output (the workers' logs included)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
               f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=costs", *arguments, *TRAINING,
               "--checkpoint_dir", str(tmp_path / "ck"), "--memory_dir", str(tmp_path / "memory")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


def test_torchs_c10d_in_an_elastic_range_without_restarts_is_told_both_costs(tmp_path):
    # A last call of 6 s instead of torch's 30 s keeps the test short; the line names the value in force.
    output = torchrun(tmp_path, "--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_conf=last_call_timeout=6")
    assert output.count("waits a last call of 6 s (last_call_timeout)") == 1, output[-3000:]
    assert "Use --rdzv_backend=elastic-c10d" in output
    assert output.count("--max_restarts=0 (torchrun's default) with --nnodes=1:2") == 1, output[-3000:]


def test_the_recommended_command_is_told_nothing(tmp_path):
    output = torchrun(tmp_path, "--nnodes=1:2", "--rdzv_backend=elastic-c10d", "--max_restarts=3")
    assert "finished: 1 epochs" in output, output[-3000:]
    assert "last call of" not in output and "--max_restarts=0" not in output, output[-3000:]
