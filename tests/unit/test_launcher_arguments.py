"""`python -m elastic_ddp.agent.launcher`'s arguments: `-m MODULE` runs warm, `--rdzv_backend=c10d` runs
as `elastic-c10d` (probes), everything else is torchrun's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic_ddp.testbed.local_cluster import LAUNCHER, STOCK_LAUNCHER
from elastic_ddp.agent.launcher import probed_c10d_arguments, warm_arguments

REPO = Path(__file__).resolve().parents[2]


def test_module_entry_points_become_warm_run_path_entry_points():
    argv = ["--nnodes=1:4", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "-m",
            "elastic_ddp.train", "--epochs", "3", "-m", "x"]
    assert warm_arguments(argv) == ["--nnodes=1:4", "--nproc_per_node=2", "--rdzv_backend=c10d",
                                    "--rdzv_endpoint=h:1", "--start-method=forkserver", "--run-path",
                                    "elastic_ddp.train", "--epochs", "3", "-m", "x"]


@pytest.mark.parametrize("argv", [
    ["--nnodes=1", "train.py", "--epochs", "3"],  # a script path: torchrun runs it as it always does
    ["--nnodes=1", "--no-python", "echo", "hi"],
    ["--nnodes=1", "--run-path", "train.py"],
])
def test_other_entry_points_are_left_to_torchrun(argv):
    assert warm_arguments(argv) is None


def test_an_explicit_start_method_is_kept():
    warm = warm_arguments(["--start-method=spawn", "-m", "elastic_ddp.train"])
    assert warm == ["--start-method=spawn", "--run-path", "elastic_ddp.train"]


def test_node_sh_starts_the_launcher_unless_asked_for_plain_torchrun():
    text = (REPO / "launch" / "node.sh").read_text()
    assert re.search(r"^DEFAULT_LAUNCHER=(\S+)", text, re.M).group(1) == LAUNCHER
    assert f"LAUNCHER: got '$launcher'; expected {LAUNCHER} or {STOCK_LAUNCHER}" in text


@pytest.mark.parametrize("spelling", [["--rdzv_backend=c10d"], ["--rdzv-backend", "c10d"], ["--rdzv_backend", "c10d"]])
def test_the_launcher_runs_c10d_as_elastic_c10d_and_leaves_the_scripts_arguments_alone(spelling):
    argv = ["--nnodes=1:2", *spelling, "--rdzv_endpoint=h:1", "-m", "elastic_ddp.train", "--rdzv_backend", "c10d"]
    rewritten = probed_c10d_arguments(argv)
    assert rewritten[:len(spelling) + 1] == ["--nnodes=1:2", *[a.replace("c10d", "elastic-c10d") for a in spelling]]
    assert rewritten[-2:] == ["--rdzv_backend", "c10d"]  # the training script's own argument


def test_other_backends_are_left_as_they_are():
    argv = ["--rdzv_backend=etcd-v3", "--rdzv_endpoint=h:1", "-m", "elastic_ddp.train"]
    assert probed_c10d_arguments(argv) == argv
