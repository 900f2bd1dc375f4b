"""`python -m elastic_ddp.agent.launcher`'s arguments: `-m MODULE` runs through `elastic_ddp.handoff.warm_start`
(warm), `--rdzv_backend=c10d` runs as `elastic-c10d` (probes), everything else is torchrun's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch.distributed.run import parse_args

from elastic_ddp.agent.launcher import may_run_warm, probed_c10d_arguments, warm_arguments
from elastic_ddp.testbed.local_cluster import LAUNCHER, STOCK_LAUNCHER

REPO = Path(__file__).resolve().parents[2]
SHIM = "elastic_ddp.handoff.warm_start"


@pytest.mark.parametrize("options", [
    ["--nnodes=1:4", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "-m"],
    ["--module", "--nnodes", "1:4"],  # -m among the options, a value after it
    ["-m", "--"],
])
@pytest.mark.parametrize("module", ["elastic_ddp.train", "my_project.train", "tool"])
def test_any_module_runs_through_warm_start_and_keeps_its_own_arguments(options, module):
    script_args = ["--epochs", "3", "-m", "x", "--nnodes=7", "--rdzv_backend", "c10d"]
    argv = [*options, module, *script_args]
    warm = warm_arguments(argv)
    assert warm == [*options, SHIM, module, *script_args]
    parsed = parse_args(warm)  # what torchrun then runs: python -m SHIM MODULE ARGS...
    assert (parsed.module, parsed.training_script, parsed.training_script_args) == (True, SHIM, [module, *script_args])
    assert vars(parsed) | {"training_script": None, "training_script_args": None} == \
        vars(parse_args(argv)) | {"training_script": None, "training_script_args": None}  # torchrun's own: the same


@pytest.mark.parametrize("argv", [
    ["--nnodes=1", "train.py", "--epochs", "3", "-m", "x"],  # a script path: torchrun runs it as it always does
    ["--nnodes=1", "--no-python", "echo", "-m", "hi"],
    ["--nnodes=1", "--run-path", "train.py"],
    ["--nnodes=1", "--run-path", "-m", "my_project.train"],  # torchrun's run_path takes it as a path
    ["-m", "my_project.train", "--", "x"],  # torchrun drops the "--": left to it, cold
])
def test_other_entry_points_are_left_to_torchrun(argv):
    assert warm_arguments(argv) == argv


def test_the_m_module_spelling_is_refused_as_torchrun_refuses_it(capsys):
    """argparse reads `-mMODULE` as the flag -m with an argument, which it does not take."""
    for rewrite in (warm_arguments, parse_args):
        with pytest.raises(SystemExit) as refused:
            rewrite(["--nnodes=1", "-melastic_ddp.train", "--epochs", "1"])
        assert refused.value.code == 2
        assert "argument -m/--module: ignored explicit argument 'elastic_ddp.train'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "warm"), [
    (["--nnodes=2", "-m", "my_project.train"], True),
    (["--nnodes=2", "--module", "my_project.train", "--rdzv_conf", "warm_workers=0"], True),  # the script's own
    (["--nnodes=2", "--rdzv_conf=probe_dead_nodes=1,warm_workers=0", "-m", "my_project.train"], False),
    (["--nnodes=2", "--rdzv-conf", "warm_workers=0,probe_dead_nodes=1", "-m", "my_project.train"], False),
    (["--nnodes=2", "--rdzv_conf=warm_workers=01", "-m", "my_project.train"], True),  # the plugin refuses it
    (["--nnodes=2", "train.py"], False),
    (["--nnodes=2", "--no-python", "-m", "x"], False),
    (["--nnodes=2", "--run_path", "-m", "x"], False),
])
def test_the_server_is_started_before_torch_only_where_it_will_be_used(argv, warm):
    assert may_run_warm(argv) is warm


def test_node_sh_starts_plain_torchrun_unless_asked_for_the_launcher():
    """Plain torchrun with elastic-c10d gets the same warm workers from the plugin (issue 41)."""
    text = (REPO / "launch" / "node.sh").read_text()
    assert re.search(r"^DEFAULT_LAUNCHER=(\S+)", text, re.MULTILINE).group(1) == STOCK_LAUNCHER
    assert re.search(r'^backend="\$\{RDZV_BACKEND:-(\S+)\}"', text, re.MULTILINE).group(1) == "elastic-c10d"
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
