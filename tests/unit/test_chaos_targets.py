"""When a chaos fault fires and which node it hits (elastic_ddp/chaos/targets.py), on hand-written
event logs, without any agent: the nodes are stand-ins that only have a name and a pid (this
process's, so that their "workers" are alive). The real harness runs in tests/cluster/test_chaos.py.

    .venv/bin/python -m pytest -q tests/unit/test_chaos_targets.py
"""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest

from elastic_ddp.chaos.plan import Fault, PlanError
from elastic_ddp.chaos.targets import FaultTargeting
from elastic_ddp.runlog.reader import EventFollower


def node(name: str, pid: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, pid=pid, is_running=lambda: True)


def start(incarnation: int, time: float, agents: dict[int, int]) -> dict:
    """A `start` event; `agents` maps each global rank to its agent's pid (its worker: this process)."""
    ranks = [{"rank": rank, "local_rank": 0, "pid": os.getpid(), "agent_pid": agent} for rank, agent in agents.items()]
    return {"time": time, "event": "start", "incarnation": incarnation, "world_size": len(ranks), "ranks": ranks}


def step(incarnation: int, time: float, global_step: int) -> dict:
    return {"time": time, "event": "step", "incarnation": incarnation, "global_step": global_step, "epoch": 0}


def targeting(tmp_path, events: list[dict], nodes=(), state=None, store_host=None, max_nodes=4) -> FaultTargeting:
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(event) + "\n" for event in events))
    follower = EventFollower(log)
    follower.poll()
    state = state if state is not None else {n.name: "live" for n in nodes}
    return FaultTargeting(SimpleNamespace(nodes=list(nodes)), follower, state, store_host=store_host,
                          rng=random.Random(0), max_nodes=max_nodes)


def test_a_settled_step_trigger_counts_only_groups_that_started_after_the_previous_fault(tmp_path):
    fault = Fault("kill_node", at_step=5)
    before = targeting(tmp_path, [start(1, 1.0, {0: 10}), step(1, 1.5, 9)])
    assert before.triggered(fault, since=2.0, joiner=None, seen_event=0, seconds_into_run=9) == (False, None)
    after = targeting(tmp_path, [start(1, 1.0, {0: 10}), step(1, 1.5, 9), start(2, 3.0, {0: 10}), step(2, 3.5, 4)])
    assert after.triggered(fault, since=2.0, joiner=None, seen_event=0, seconds_into_run=9) == (False, None)
    reached = targeting(tmp_path, [start(2, 3.0, {0: 10}), step(2, 3.5, 5)])
    assert reached.triggered(fault, since=2.0, joiner=None, seen_event=0, seconds_into_run=9) == (True, None)
    assert not reached.triggered(fault, since=2.0, joiner=11, seen_event=0, seconds_into_run=9)[0]  # 11 not in it
    assert not reached.triggered(Fault("kill_node", at_seconds=10), since=0.0, joiner=None, seen_event=0,
                                 seconds_into_run=9)[0]


def test_an_event_trigger_fires_on_a_new_event_at_or_past_its_step(tmp_path):
    captured = {"time": 3.6, "event": "snapshot_captured", "incarnation": 2, "global_step": 8}
    events = [start(2, 3.0, {0: 10}), step(2, 3.5, 8), captured]
    fault = Fault("kill_node", target="rank0", at_step=8, on_event="snapshot_captured")
    found = targeting(tmp_path, events)
    assert found.triggered(fault, since=2.0, joiner=None, seen_event=0, seconds_into_run=9) == (True, captured)
    assert not found.triggered(fault, since=2.0, joiner=None, seen_event=2, seconds_into_run=9)[0]  # seen already
    later = Fault("kill_node", at_step=9, on_event="snapshot_captured")
    assert not found.triggered(later, since=2.0, joiner=None, seen_event=0, seconds_into_run=9)[0]


def test_symbolic_targets_never_pick_the_store_host_and_rank0_on_it_is_refused(tmp_path):
    nodes = [node("node0", 10), node("node1", 11), node("node2", 12)]
    group = [start(1, 1.0, {0: 10, 1: 11, 2: 12})]
    chosen = targeting(tmp_path, group, nodes, store_host="node0")
    assert {chosen.resolve(Fault("kill_node"), None).node.name for _ in range(20)} == {"node1", "node2"}
    assert chosen.resolve(Fault("kill_node", target="oldest"), None).node.name == "node1"
    assert chosen.resolve(Fault("kill_node", target="newest"), None).node.name == "node2"
    assert chosen.resolve(Fault("kill_node", target="node0"), None).node.name == "node0"  # named: on purpose
    with pytest.raises(PlanError, match="hosts the c10d store"):
        chosen.resolve(Fault("kill_node", target="rank0"), None)
    elsewhere = targeting(tmp_path, [start(1, 1.0, {0: 11, 1: 10})], nodes, store_host="node0")
    assert elsewhere.resolve(Fault("kill_node", target="rank0"), None).node.name == "node1"


def test_impossible_faults_are_plan_errors_and_a_target_between_groups_waits(tmp_path):
    nodes = [node("node0", 10), node("node1", 11)]
    state = {"node0": "live", "node1": "killed"}
    plan = targeting(tmp_path, [start(1, 1.0, {0: 10})], nodes, state=state, max_nodes=1)
    with pytest.raises(PlanError, match="no node is named 'node7'"):
        plan.resolve(Fault("kill_node", target="node7"), None)
    with pytest.raises(PlanError, match="node1 is killed"):
        plan.resolve(Fault("freeze_node", target="node1"), None)
    with pytest.raises(PlanError, match="node0 is not frozen"):
        plan.resolve(Fault("thaw_node", target="node0"), None)
    with pytest.raises(PlanError, match="max_nodes=1"):
        plan.resolve(Fault("add_node"), None)
    between_groups = targeting(tmp_path, [], nodes)
    assert between_groups.resolve(Fault("kill_node", target="rank0"), None) is None
    assert between_groups.resolve(Fault("kill_worker", target="node0"), None) is None
