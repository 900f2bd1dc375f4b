"""A frozen node is left behind by the peer watchdog, long before the collective timeout (by
torchrun's restart with torch's c10d, in process with ours); a slow or briefly stopped one is not.
Real torchrun agents on 127.0.0.1, real SIGSTOP, gloo.

The collective timeout is 120 s in these jobs: a group that trains again without the frozen node
sooner than that owes it to the watchdog (elastic_ddp/runtime/watchdog.py, bound `--watchdog_timeout_s`,
3 s by default), not to gloo. With torch's own `c10d` the agents get the documented `--rdzv_conf`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, LocalJob, wait_for
from tests.support.cluster import (
    assert_exactly_once,
    assert_workers_started_warm,
    hold_settings,
    node_logs,
    pace,
    pause_at,
    release,
    run_to,
    world_reached,
)

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATASET, BATCH, EPOCHS = 2048, 64, 2
COLLECTIVE_TIMEOUT_S = 120
TRAINING_ARGS = ["--model", "mlp", "--no-augment", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET),
                 "--global_batch_size", str(BATCH), "--micro_batch_size", "16", "--snapshot_every_steps", "0",
                 "--log_interval", "5", "--collective_timeout_s", str(COLLECTIVE_TIMEOUT_S)]
# Well below the collective timeout, well above watchdog + heartbeat expiry + rendezvous + start.
LEFT_BEHIND_WITHIN_S = 60
# The group stops after this step until both nodes are in it: however fast it trains, and however
# slowly the second agent starts, the job cannot end before the scenario (a 16-core GPU machine ran
# all 64 steps alone before the second node of the etcd-v3 test had joined).
WAIT_FOR_BOTH_AT_STEP = 5


def held_until_both_joined(hold) -> dict:
    """hold_settings that stop the job after WAIT_FOR_BOTH_AT_STEP until `paced_with_both`."""
    settings = hold_settings(hold)
    pause_at(hold, WAIT_FOR_BOTH_AT_STEP)
    return settings


def paced_with_both(job: LocalJob, hold) -> None:
    world_reached(job, 2)
    pace(hold)


def assert_frozen_node_left_behind(job: LocalJob, survivor, frozen, hold, source: str = "memory") -> dict:
    """Freeze `frozen` while the job trains; the `start` event of the survivor's group without it.
    `source`: the restore's (`memory` after torchrun's restart, `live` in process)."""
    paced_with_both(job, hold)
    job.wait_for_step(job.last_step() + 5, timeout=90)
    frozen_at = time.time()
    frozen.freeze()
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1 and e["time"] > frozen_at,
                                 COLLECTIVE_TIMEOUT_S, "a restore without the frozen node")
    first_step = job.wait_for_event(lambda e: e["event"] == "step" and e["incarnation"] == restore["incarnation"],
                                    60, "a step without the frozen node")
    seconds = first_step["time"] - frozen_at
    print(f"training again {seconds:.1f} s after the freeze")
    assert seconds < LEFT_BEHIND_WITHIN_S, node_logs(job)
    assert restore["source"] == source and restore["lost_steps"] == 0, restore
    alone = job.wait_for_event(lambda e: e["event"] == "start" and e["incarnation"] == restore["incarnation"], 10,
                               "the start of the group without the frozen node")
    frozen.kill()  # it stays gone: a thawed node would rejoin, which is another test's subject
    release(hold)
    assert survivor.wait(timeout=180) == 0, node_logs(job)
    assert load_snapshot(job.checkpoint_dir)["global_step"] == EPOCHS * DATASET // BATCH
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
    assert "peer watchdog: rank(s) [1] sent no heartbeat" in survivor.log_text(), survivor.log_text()[-4000:]
    return alone


def test_plain_torchrun_with_torchs_c10d_leaves_a_frozen_node_behind(local_jobs, tmp_path):
    hold = tmp_path / "hold"
    job = local_jobs(TRAINING_ARGS, launcher=STOCK_LAUNCHER, nnodes="1:2", **held_until_both_joined(hold))
    survivor = job.add_node("host")  # hosts the c10d store: the one that must not freeze
    frozen = job.add_node("frozen")
    assert_frozen_node_left_behind(job, survivor, frozen, hold)


@pytest.mark.etcd
def test_etcd_v3_leaves_a_frozen_node_behind_in_process(local_jobs, etcd_server: EtcdServer, tmp_path):
    """With our rendezvous (in_process=1, the default) the survivor's worker keeps its process: its
    watchdog, whose store answered the read that found the frozen node silent, asks its agent for a
    round without that node, and the collective that waits on it gives way once the round is
    announced (elastic_ddp/training/in_process.py)."""
    hold = tmp_path / "hold"
    job = local_jobs(TRAINING_ARGS, launcher=STOCK_LAUNCHER, nnodes="1:2", rdzv_backend="etcd-v3",
                     rdzv_endpoint=etcd_server.endpoint, rdzv_conf=None, run_id="frozen", **held_until_both_joined(hold))
    survivor = job.add_node("first")
    wait_for(lambda: job.events("start") or not survivor.is_running(), 60, "the first node's worker group")
    frozen = job.add_node("frozen")
    alone = assert_frozen_node_left_behind(job, survivor, frozen, hold, source="live")
    assert alone["in_process"] is True, alone
    both = next(e for e in job.events("start") if e["world_size"] == 2)
    [pid_with_both] = [rank["pid"] for rank in both["ranks"] if rank["agent_pid"] == survivor.pid]
    assert [rank["pid"] for rank in alone["ranks"]] == [pid_with_both], ("the survivor's worker kept its process",
                                                                         both, alone)
    assert "will restart worker group" not in survivor.log_text().split("peer watchdog: rank(s) [1]")[-1]
    assert_workers_started_warm(job, survivor, starts=1)


# Enough steps for a brief stop, a slowdown named as a straggler (at full speed) and a starved CPU.
SLOW_EPOCHS = 60
STRAGGLER_PATIENCE_S = 3


def slowed_down(node, stop_fraction: float, period_s: float, until: threading.Event) -> None:
    """A node slowed by a stop/continue duty cycle (`stop_fraction` of every `period_s` stopped)."""
    while not until.is_set():
        node.freeze()
        until.wait(period_s * stop_fraction)
        node.thaw()
        until.wait(period_s * (1 - stop_fraction))


def test_a_briefly_stopped_slowed_or_starved_peer_is_not_evicted_and_a_slow_one_is_named(local_jobs, tmp_path):
    """SIGSTOP for half the watchdog's bound; then the node slowed by a stop/continue duty cycle,
    which rank 0 names as a straggler (training/stragglers.py); then the CPU taken by busy loops
    (two per core): the group never restarts."""
    hold = tmp_path / "hold"
    args = [*TRAINING_ARGS, "--epochs", str(SLOW_EPOCHS), "--straggler_patience_s", str(STRAGGLER_PATIENCE_S)]
    job = local_jobs(args, launcher=STOCK_LAUNCHER, nnodes="1:2", **held_until_both_joined(hold))
    job.add_node("host")
    slow = job.add_node("slow")
    paced_with_both(job, hold)
    job.wait_for_step(job.last_step() + 5, timeout=90)
    slow.freeze()
    stopped_at = time.monotonic()
    wait_for(lambda: time.monotonic() - stopped_at > 1.5, 10, "half the watchdog's bound")
    slow.thaw()
    job.wait_for_step(job.last_step() + 5, timeout=60)
    # Full speed while slowed (the held pace's sleep would be most of either rank's own time), up
    # to a step the job cannot reach before the verdict: the job then stops until paced again.
    run_to(hold, job.last_step() + (SLOW_EPOCHS - EPOCHS) * DATASET // BATCH)
    slowed_at, stop_slowing = time.time(), threading.Event()
    duty_cycle = threading.Thread(target=slowed_down, args=(slow, 0.75, 0.04, stop_slowing), daemon=True)
    duty_cycle.start()
    try:
        named = job.wait_for_event(lambda e: e["event"] == "straggler" and e["state"] == "named", 90,
                                   "the slowed node named as a straggler")
    finally:
        stop_slowing.set()
        duty_cycle.join(timeout=10)
        slow.thaw()
        pace(hold)
    print(f"named {named['time'] - slowed_at:.1f} s after the slowdown: {named}")
    assert named["rank"] == 1 and named["score"] < 0.6, named
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        steps_before = job.last_step()
        job.wait_for_step(steps_before + 40, timeout=120)  # trained on, slowly, for a while
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=30)
    release(hold)
    assert job.wait(timeout=180) == {"host": 0, "slow": 0}, node_logs(job)
    assert len(job.events("start")) == 1, "the group restarted: a live peer was evicted"
    logs = "\n".join(node.log_text() for node in job.nodes)
    assert "straggler: rank 1 on node 1 is slow" in logs
    assert "peer watchdog:" not in logs.replace("peer watchdog: the longest", "")
    gaps = [float(gap) for gap in re.findall(r"heartbeat stayed unchanged was ([0-9.]+) s", logs)]
    print(f"longest heartbeat gaps seen: {gaps}")
    assert gaps, "every rank reports its longest gap when it leaves"
    assert_exactly_once(job, DATASET, SLOW_EPOCHS, BATCH)
