"""Fault plans as data (elastic_ddp/chaos/plan.py): saved and loaded, refused with the reason,
drawn at random within the node bounds. The event follower, the SIGTERM flag and the verdict have
their own files: test_event_follower.py, test_drain.py, test_chaos_verdict.py.

    .venv/bin/python -m pytest -q tests/unit/test_chaos_plan.py
"""

from __future__ import annotations

import pytest

from elastic_ddp.chaos.plan import Fault, FaultPlan, PlanError, random_plan


def test_a_plan_survives_a_json_round_trip(tmp_path):
    plan = FaultPlan((Fault("kill_node", "rank0", at_step=40, on_event="snapshot_captured"),
                      Fault("add_node", at_seconds=12.5, settle=False),
                      Fault("kill_worker", "node1", at_step=60, worker=1),
                      Fault("terminate_node", "newest", at_step=80)),
                     initial_nodes=3, min_nodes=1, max_nodes=4, seed=9)
    plan.save(tmp_path / "plan.json")
    assert FaultPlan.load(tmp_path / "plan.json") == plan
    assert plan.nnodes == "1:4"


@pytest.mark.parametrize("document, message", [
    ({"faults": [{"action": "explode"}]}, "fault action: got 'explode'"),
    ({"faults": [{"action": "kill_node", "when": 3}]}, "unknown keys ['when']"),
    ({"faults": [{"action": "add_node", "worker": 1}]}, "only kill_worker takes it"),
    ({"faults": [], "initial_nodes": 5}, "initial_nodes: got 5"),
    ({"faults": [], "min_nodes": 3, "max_nodes": 2}, "min_nodes/max_nodes: got 3/2"),
    ({"fault": []}, '"faults" list'),
])
def test_a_bad_plan_is_refused_with_the_reason(document, message):
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        FaultPlan.from_dict(document)


def test_an_unreadable_plan_file_names_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="plan.json: cannot be read as JSON"):
        FaultPlan.load(path)


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_hold_every_kind_of_fault_within_the_node_bounds(seed):
    plan = random_plan(seed, total_steps=400, faults=8, initial_nodes=3, min_nodes=1, max_nodes=4)
    assert plan == random_plan(seed, total_steps=400, faults=8, initial_nodes=3, min_nodes=1, max_nodes=4)
    assert len(plan.faults) >= 8
    kinds = {(f.action, f.target, f.on_event) for f in plan.faults}
    assert ("kill_node", "random", None) in kinds
    assert ("kill_node", "rank0", None) in kinds
    assert ("kill_node", "rank0", "snapshot_captured") in kinds
    assert any(f.action == "kill_worker" for f in plan.faults)
    assert any(f.action == "add_node" and f.at_step is not None for f in plan.faults)
    nodes = plan.initial_nodes
    for fault in plan.faults:
        nodes += {"add_node": 1, "kill_node": -1}.get(fault.action, 0)
        assert plan.min_nodes <= nodes <= plan.max_nodes, plan.faults
    steps = [f.at_step for f in plan.faults if f.at_step is not None]
    assert steps == sorted(steps) and 40 <= steps[0] and steps[-1] <= 320


def test_a_random_plan_needs_room_for_its_faults():
    with pytest.raises(PlanError, match="too few steps"):
        random_plan(0, total_steps=20, faults=8)
