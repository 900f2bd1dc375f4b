"""What a torchrun command line will cost on a failure (elastic_ddp/runtime/launch_costs.py)."""

from __future__ import annotations

import pytest

from elastic_ddp.runtime.launch_costs import launch_warnings, parse_launch, torchrun_arguments

TRAIN = ["-m", "elastic_ddp.train", "--epochs", "1"]


def warnings_for(*arguments: str) -> list[str]:
    settings = parse_launch([*arguments, *TRAIN])
    assert settings is not None
    return launch_warnings(settings)


def test_torchs_c10d_with_its_defaults_is_told_both_costs():
    lines = warnings_for("--nnodes=1:4", "--rdzv_backend=c10d", "--rdzv_endpoint=h:29400")
    assert len(lines) == 2
    assert lines[0].startswith("--rdzv_backend=c10d waits a last call of 30 s (last_call_timeout) before a round "
                               "with fewer than 4 nodes completes: every peer failure or join costs at least 30 s.")
    assert "--rdzv_backend=elastic-c10d" in lines[0] and "--rdzv_conf=last_call_timeout=1," in lines[0]
    assert lines[1].startswith("--max_restarts=0 (torchrun's default) with --nnodes=1:4: the first worker failure")


def test_the_last_call_given_in_rdzv_conf_is_the_one_told():
    lines = warnings_for("--nnodes=2:3", "--rdzv_backend=c10d", "--rdzv_conf=join_timeout=60,last_call_timeout=12",
                         "--max_restarts=5")
    assert lines == [line for line in lines if "a last call of 12 s" in line] and len(lines) == 1


@pytest.mark.parametrize("arguments", [
    ["--nnodes=1:4", "--rdzv_backend=elastic-c10d", "--max_restarts=10"],  # ours: its shipped last call
    ["--nnodes=1:4", "--rdzv_backend=c10d", "--rdzv_conf=last_call_timeout=1", "--max_restarts=3"],
    ["--nnodes=2", "--rdzv_backend=c10d"],  # not elastic: no last call, and a restart cannot help anyway
    ["--standalone", "--nproc_per_node=2"],
])
def test_settings_that_cost_little_are_not_warned_about(arguments):
    assert warnings_for(*arguments) == []


def test_an_elastic_range_on_our_backend_without_restarts_is_still_warned():
    assert [line[:15] for line in warnings_for("--nnodes=1:2", "--rdzv_backend=etcd-v3")] == ["--max_restarts="]


@pytest.mark.parametrize("argv, expected", [
    (["/usr/bin/python3", "/venv/bin/torchrun", "--nnodes=1:2", "x.py"], ["--nnodes=1:2", "x.py"]),
    (["python", "-m", "torch.distributed.run", "--nnodes=2", "x.py"], ["--nnodes=2", "x.py"]),
    (["python", "-m", "elastic_ddp.agent.launcher", "-m", "elastic_ddp.train"], ["-m", "elastic_ddp.train"]),
    (["python", "train.py", "--epochs", "1"], None),
])
def test_the_torchrun_arguments_are_found_after_any_launcher(argv, expected):
    assert torchrun_arguments(argv) == expected


def test_a_command_line_torchrun_would_refuse_is_left_alone():
    assert parse_launch(["--nnodes=4:1:7", *TRAIN]) is None
