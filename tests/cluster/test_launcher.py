"""`python -m elastic_ddp.agent.launcher` for real: warm workers train and exit like cold ones, and end
with their agent.

The recovery-speed work of docs/failure-semantics.md rests on it; the chaos tests run every job
through it (it is LocalJob's default), these check its contract directly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runtime.procfs import process_is_alive
from elastic_ddp.testbed.local_cluster import wait_for
from tests.support.cluster import assert_workers_started_warm


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_warm_worker_trains_reports_its_rank_and_exits_like_a_cold_one(local_jobs):
    args = ["--model", "mlp", "--epochs", "1", "--dataset_size", "512", "--global_batch_size", "64",
            "--snapshot_every_steps", "4", "--log_interval", "1"]
    job = local_jobs(args, nnodes="1", nproc_per_node=2)
    node = job.add_node("only")
    assert node.wait(timeout=200) == 0, node.log_text()[-3000:]
    events = read_events(job.event_log)
    start = next(e for e in events if e["event"] == "start")
    assert start["world_size"] == 2 and {r["agent_pid"] for r in start["ranks"]} == {node.pid}
    assert any(e["event"] == "startup" for e in events)
    assert any(e["event"] == "finished" and e["global_step"] == 8 for e in events)
    assert_workers_started_warm(job, node, starts=2)  # through elastic_ddp.handoff.warm_start, by the agent's server


def test_the_launcher_shows_torchruns_help():
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.agent.launcher", "--help"], check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--rdzv-endpoint" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victims", ["agent", "agent and its children"])
def test_warm_workers_end_with_their_agent(local_jobs, victims):
    # The workers are the warm-worker server's children, not the agent's: they must not train on,
    # unseen, after their node was killed the way plain torchrun's nodes are (getting-started.md).
    args = ["--model", "mlp", "--epochs", "100", "--dataset_size", "512", "--global_batch_size", "64",
            "--log_interval", "1", "--min_step_time_s", "0.05"]  # 800 steps: 40 s at least, killed after 3
    job = local_jobs(args, nnodes="1", nproc_per_node=2)
    node = job.add_node("only")
    job.wait_for_step(3, timeout=180)
    start = next(e for e in read_events(job.event_log) if e["event"] == "start")
    workers = [rank["pid"] for rank in start["ranks"]]
    assert len(workers) == 2 and all(process_is_alive(pid) for pid in workers)
    assert not set(workers) & {int(c) for c in subprocess.run(
        ["pgrep", "-P", str(node.pid)], check=False, capture_output=True, text=True).stdout.split()}, \
        "workers are not forked"
    if victims == "agent and its children":
        subprocess.run(["bash", "-c", 'kill -KILL $(pgrep -P "$1") "$1"', "kill-node", str(node.pid)], check=True,
                       timeout=30)
    else:
        os.kill(node.pid, signal.SIGKILL)
    node.process.wait(timeout=30)
    try:
        wait_for(lambda: not any(process_is_alive(pid) for pid in workers), 30, f"the warm workers {workers} to end")
    finally:  # the fixture finds a node's processes through its agent, which is gone: clean up here
        for pid in workers:
            if process_is_alive(pid):
                os.kill(pid, signal.SIGKILL)
