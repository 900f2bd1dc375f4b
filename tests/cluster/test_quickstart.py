"""The README's first command, `bash launch/quickstart.sh`, run as documented: three local nodes, one
SIGKILLed mid-epoch and started again, then the run's report and verdict, in well under two
minutes; and `--plain`, the two-node run without a failure, one flag away."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ddp.runlog.reader import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
STEPS_PER_EPOCH = 64  # the quick start's job: the default dataset and global batch


def run_quickstart(*args: str, env: dict[str, str] | None = None,
                   timeout: float = 200) -> tuple[subprocess.CompletedProcess, float, Path | None]:
    """`bash launch/quickstart.sh ARGS` from the repository, as the README says; its output, its
    seconds, and the run directory it made (removed after the test)."""
    started = time.monotonic()
    process = subprocess.Popen(["bash", "launch/quickstart.sh", *args], cwd=REPO, text=True,
                               env={**os.environ, "PYTHON": sys.executable, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"quickstart.sh did not finish in {timeout:.0f} s:\n{out[-4000:]}")
    seconds = time.monotonic() - started
    made = re.findall(r"runs/quickstart-\d{8}-\d{6}", out)
    return subprocess.CompletedProcess(process.args, process.returncode, out), seconds, REPO / made[0] if made else None


@pytest.fixture
def cleanup():
    made: list[Path] = []
    yield made
    for path in made:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def test_the_quick_start_shows_a_node_killed_mid_epoch_and_back_and_the_report(cleanup):
    result, seconds, run_dir = run_quickstart()
    cleanup.append(run_dir)
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    assert seconds < 120, f"the quick start took {seconds:.0f} s"
    assert run_dir is not None and run_dir.is_dir(), out[-3000:]

    # Exactly three groups: all three nodes from the first one on (its last call waits for agents
    # still starting on a loaded machine: elastic_ddp/tools/quickstart.py), the survivors, all three again.
    assert re.search(r"World size +3 on 3 nodes \([^)]*\) -> 2 on 2 nodes \([^)]*\) -> 3 on 3 nodes \([^)]*\)$", out,
                     re.MULTILINE), out
    # The survivors re-form in process and keep their own state (issue 44), or, where that falls
    # back to torchrun's restart, restore from node memory.
    lost = re.search(r"node lost: world 3 -> 2, resumed from step (\d+) from (memory .*|the survivors' own state "
                     r"\(re-formed in process\)), lost 0 steps \(0\.0 s\), (\d+\.\d) s without training", out)
    assert lost, out
    assert int(lost.group(1)) % STEPS_PER_EPOCH != 0, "the node is killed mid-epoch"
    assert "node joined: world 2 -> 3" in out
    assert re.search(r"Work lost +0 steps redone", out), out
    assert "exactly once: yes" in out and "final step 192 (expected 192)" in out
    plot = re.search(r"Plot +(\S+\.png)", out)
    assert plot and Path(plot.group(1)).is_file(), out

    events = read_events(run_dir / "ck" / "events.jsonl")
    assert [e["world_size"] for e in events if e["event"] == "start"] == [3, 2, 3]
    assert [r["lost_steps"] for r in events if r["event"] == "restore"] == [0, 0]


def test_the_plain_run_without_a_failure_is_one_flag_away(tmp_path):
    # Paced (64 steps, at least 6.4 s), so that the second node joins before the first one finishes.
    tiny = ["--model", "mlp", "--epochs", "1", "--dataset_size", "4096", "--global_batch_size", "64",
            "--micro_batch_size", "32", "--min_step_time_s", "0.1", "--checkpoint_dir", str(tmp_path / "ck")]
    result, _, _ = run_quickstart("--plain", *tiny, env={"RUN_LOGS": str(tmp_path / "logs")})
    assert result.returncode == 0, result.stdout[-4000:]
    assert "local_cluster: 2 nodes on 127.0.0.1:" in result.stdout
    events = read_events(tmp_path / "ck" / "events.jsonl")
    assert any(e["event"] == "finished" for e in events)
