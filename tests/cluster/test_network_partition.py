"""The network may fail like a node (docs/failure-semantics.md): a partitioned node is left behind like a frozen one, never trains
as a group of its own, and rejoins by itself when its link returns.

Three nodes, each a host of its own (a network namespace with its own address on a bridge:
elastic_ddp/testbed/netns.py), plain torchrun with `--rdzv_backend=elastic-c10d`; n0 hosts the
store, rank 0's snapshot replica target is partitioned (its switch port down: its packets vanish,
nothing is refused) in the middle of a transfer to it, for longer than the peer watchdog's bound.
The nodes get the README's flags alone (tests/support/network.py).
Then three nodes, n0 (the store's node) partitioned: the others stop in a stated bound with one
line naming the endpoint, and a relaunch without n0 resumes (elastic_ddp/agent/rendezvous/c10d/watch.py).

    .venv/bin/python -m pytest tests/cluster/test_network_partition.py -q -s
"""

from __future__ import annotations

import json
import time

import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.testbed.local_cluster import wait_for
from elastic_ddp.testbed.netns import NetworkFault, why_unavailable
from tests.support.cluster import assert_exactly_once, node_logs, pause_at, release, world_reached
from tests.support.held_replication import HOLD_REPLICATION_VARIABLE, held_file
from tests.support.network import start_job

HELD_REPLICATION = "tests.support.held_replication"

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces: {UNAVAILABLE}")

# The peer watchdog's default bound (--watchdog_timeout_s), and the generous test bound on
# the survivors training again after a partition (issue 26: the bound + 10 s).
WATCHDOG_S = 3.0
TRAINING_AGAIN_BOUND_S = WATCHDOG_S + 10


def _agents(event: dict) -> set[int]:
    """The agent pids of a `start` event's ranks: one per node here (every node's host name is the same)."""
    return {rank["agent_pid"] for rank in event["ranks"]}


def _node_of(job, start: dict, group_rank: int):
    """The node whose agent ran `group_rank` in the worker group that `start` announced."""
    [pid] = {rank["agent_pid"] for rank in start["ranks"] if rank["group_rank"] == group_rank}
    [node] = [node for node in job.nodes if node.pid == pid]
    return node


@pytest.mark.timeout(240)
def test_a_partitioned_replica_target_is_left_behind_never_trains_alone_and_rejoins_after_the_heal(
        local_jobs, network_bed, tmp_path):
    """Three nodes, each with a checkpoint directory of its own (snapshots replicated to one other
    node, the default). The node partitioned is rank 0's replica target, cut off in the middle of a
    transfer to it: rank 0's sender stopped after the frame's sizes were agreed, released once
    the link is down, so its bytes go into the cut link (tests/support/held_replication.py). The
    survivors train again within the bound all the same, and their next snapshot is replicated to
    the node they can reach; healed, the node rejoins by itself."""
    bed = network_bed(["n0", "n1", "n2"])
    hold, replication_hold = tmp_path / "hold", tmp_path / "replication"
    replication_hold.touch()
    # 320 steps held at 0.05 s or more each, paused once the survivors' replica landed until the
    # partitioned node is back: the job cannot end before the rejoin.
    dataset_size, epochs, batch = 1024, 20, 64
    args = ["--model", "mlp", "--epochs", str(epochs), "--dataset_size", str(dataset_size),
            "--global_batch_size", str(batch), "--snapshot_every_steps", "10", "--log_interval", "10"]
    job = start_job(local_jobs, bed, hold, args, ["n0", "n1", "n2"], nnodes="2:3", module=HELD_REPLICATION,
                    env={HOLD_REPLICATION_VARIABLE: str(replication_hold)}, per_node_checkpoint_dirs=True)
    try:
        full = world_reached(job, 3)
        [rank_0] = [rank for rank in full["ranks"] if rank["rank"] == 0]
        chosen = job.wait_for_event(lambda e: e["event"] == "replication" and e["incarnation"] == full["incarnation"],
                                    30, "the replica targets of the group of three")
        [target] = [_node_of(job, full, group_rank) for group_rank in chosen["target_nodes"]]
        assert target is not job.nodes[0], f"rank 0's replica target hosts the store: {full['ranks']}"

        def sender_held() -> dict | None:
            try:
                held = json.loads(held_file(replication_hold).read_text())
            except (FileNotFoundError, ValueError):
                return None
            return held if held["pid"] == rank_0["pid"] else None

        wait_for(lambda: sender_held() is not None, 60, "rank 0's sender stopped mid-transfer")
        held_step = sender_held()["global_step"]
        partitioned_at = time.time()
        bed.apply(NetworkFault.parse(f"partition {target.name}"))
        release(replication_hold)  # the rest of the frame now goes into the cut link
        survivors = {node.pid for node in job.nodes if node is not target}
        alone = job.wait_for_event(lambda e: e["event"] == "start" and e["time"] > partitioned_at, 60,
                                   "the survivors' group after the partition")
        assert _agents(alone) == survivors, f"{alone}\n{node_logs(job)}"
        first_step = job.wait_for_event(lambda e: e["event"] == "step" and e["time"] > alone["time"], 30,
                                        "a step of the survivors' group")
        training_again_s = first_step["time"] - partitioned_at
        restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["time"] >= alone["time"], 10,
                                     "the survivors' restore")
        replicated = job.wait_for_event(lambda e: e["event"] == "snapshot_replicated"
                                        and e["incarnation"] == alone["incarnation"], 60,
                                        "the survivors' next snapshot replicated")
        [reached] = [_node_of(job, alone, group_rank) for group_rank in replicated["nodes"]]
        # It landed on that node's own disk (its checkpoint directory is no other node's).
        replica_step = load_snapshot(job.node_checkpoint_dir(reached.name))["global_step"]
        pause_at(hold, job.last_step() + 3)
        healed_at = time.time()
        bed.apply(NetworkFault.parse(f"heal {target.name}"))

        def back() -> bool:
            return any(e["event"] == "start" and e["time"] > healed_at and target.pid in _agents(e)
                       for e in job.events())

        wait_for(back, 90, f"a group with {target.name} after the heal",
                 still_possible=lambda: None if target.is_running() else
                 f"its agent exited {target.process.returncode}:\n{node_logs(job)}\n")
        rejoined_s = time.time() - healed_at
    finally:
        release(replication_hold)
        release(hold)
    print(f"partition of {target.name}, rank 0's replica target, mid-transfer of step {held_step}: the survivors "
          f"trained again {training_again_s:.1f} s later (restored step {restore['global_step']} from "
          f"{restore['source']}, {restore['lost_steps']} step(s) lost); their snapshot of step "
          f"{replicated['global_step']} was replicated to {reached.name} in {replicated['seconds']:.2f} s; "
          f"healed, {target.name} was in a group again within {rejoined_s:.1f} s")
    codes = job.wait(120)
    assert codes == {"n0": 0, "n1": 0, "n2": 0}, f"{codes}\n{node_logs(job)}"
    # No split brain: the cut-off node never formed a group without n0 (its rank 0 would have logged its start).
    starts = job.events("start")
    assert all(job.nodes[0].pid in _agents(start) for start in starts), f"{starts}\n{node_logs(job)}"
    # `live`: the survivors left the cut-off node behind in their own processes (the watchdog asked
    # their agents for the round); `memory`: torchrun restarted them (or their steps differed).
    assert restore["source"] in ("live", "memory") and restore["lost_steps"] <= 1, restore
    assert training_again_s <= TRAINING_AGAIN_BOUND_S, f"{training_again_s:.1f} s\n{node_logs(job)}"
    assert reached is not target and reached.pid in survivors, replicated
    assert replica_step >= replicated["global_step"], (replica_step, replicated)
    assert_exactly_once(job, dataset_size, epochs, batch)


# The bound on the other nodes stopping once the store's node is cut off (docs/failure-semantics.md):
# 5 s of silence (the heartbeat expiry) and a 2 s probe (elastic_ddp/agent/rendezvous/c10d/watch.py),
# then torchrun's 30 s shutdown timeout for a worker blocked in a collective; 5 s to spare.
STORE_LOST_BOUND_S = 5 + 2 + 30 + 5


@pytest.mark.timeout(300)
def test_a_partitioned_store_host_stops_the_others_with_one_line_and_a_relaunch_resumes(
        local_jobs, network_bed, tmp_path):
    """n0 hosts the c10d store and is cut off: n1 and n2 stop within `STORE_LOST_BOUND_S`, each
    with one line naming the endpoint it cannot reach; relaunched with n1 as the rendezvous
    host, they resume from the newest state they hold, and the run ends exactly once.

    That state is the newest snapshot: their workers, blocked in a collective with n0 and in the
    peer watchdog's store read, are SIGKILLed by torchrun and keep no memory copy."""
    bed = network_bed(["n0", "n1", "n2"])
    hold = tmp_path / "hold"
    # 160 steps held at 0.05 s or more each, paused after step 40 should the group of three be late.
    dataset_size, epochs, batch = 1024, 10, 64
    args = ["--model", "mlp", "--epochs", str(epochs), "--dataset_size", str(dataset_size),
            "--global_batch_size", str(batch), "--snapshot_every_steps", "5", "--log_interval", "10"]
    # At least two nodes: n0, alone on its side, never trains as a group of its own.
    job = start_job(local_jobs, bed, hold, args, ["n0", "n1", "n2"], nnodes="2:3")
    pause_at(hold, 40)
    n0, n1, n2 = job.nodes
    world_reached(job, 3)
    job.wait_for_event(lambda e: e["event"] == "snapshot" and e["global_step"] >= 10, 60, "a snapshot at step 10")
    partitioned_at = time.monotonic()
    bed.apply(NetworkFault.parse("partition n0"))
    last_step = job.last_step()
    endpoint = job.rdzv_endpoint
    stopped = {}
    for node in (n1, n2):
        node.wait(STORE_LOST_BOUND_S + 30)
        stopped[node.name] = time.monotonic() - partitioned_at
    last_lines = {node.name: node.log_text().strip().splitlines()[-1] for node in (n1, n2)}
    print(f"store's node partitioned: stopped after {', '.join(f'{k} {v:.1f} s' for k, v in stopped.items())}: "
          f"{last_lines['n1']}")
    assert max(stopped.values()) <= STORE_LOST_BOUND_S, node_logs(job)
    for node in (n1, n2):
        assert f"--rdzv_endpoint={endpoint}" in last_lines[node.name], node.log_text()[-3000:]
    n0.stop()
    relaunched_at = time.time()
    relaunched = start_job(local_jobs, bed, hold, args, ["n1", "n2"], nnodes="2:2")
    release(hold)
    restore = relaunched.wait_for_event(lambda e: e["event"] == "restore" and e["time"] > relaunched_at, 90,
                                        "the relaunched group's restore")
    codes = relaunched.wait(120)
    newest = max(e["global_step"] for e in job.events("snapshot") if e["time"] < relaunched_at)
    print(f"relaunched with n1 as the rendezvous host: restored step {restore['global_step']} from "
          f"{restore['source']} (the newest snapshot: step {newest}; last step before the partition: {last_step})")
    assert codes == {"n1": 0, "n2": 0}, f"{codes}\n{node_logs(relaunched)}"
    assert restore["global_step"] >= newest, restore
    assert_exactly_once(relaunched, dataset_size, epochs, batch)
