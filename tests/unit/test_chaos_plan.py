"""Fault plans, the event-log follower, the SIGTERM flag and the chaos verdict, without any agent."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from elastic_ddp.chaos.plan import Fault, FaultPlan, PlanError, random_plan
from elastic_ddp.runtime.drain import DrainSignal
from elastic_ddp.runlog.reader import EventFollower


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


def test_the_follower_reads_only_complete_new_lines(tmp_path):
    log = tmp_path / "events.jsonl"
    follower = EventFollower(log)
    assert follower.poll() == []
    start = {"time": 10.0, "event": "start", "incarnation": 1, "world_size": 2,
             "ranks": [{"rank": 0, "agent_pid": 100}, {"rank": 1, "agent_pid": 200}]}
    step = {"time": 11.0, "event": "step", "incarnation": 1, "global_step": 1}
    with open(log, "w") as handle:
        handle.write(json.dumps(start) + "\n" + json.dumps(step)[:20])  # the step line is half written
    assert [e["event"] for e in follower.poll()] == ["start"]
    with open(log, "a") as handle:
        handle.write(json.dumps(step)[20:] + "\n" + "{torn\n")
    assert [e["event"] for e in follower.poll()] == ["step"]
    group = follower.groups[1]
    assert group.agent_pids == {100, 200} and group.first_step["global_step"] == 1
    assert follower.newest_step() == 1 and follower.groups_since(10.5) == []


def test_sigterm_becomes_a_flag_and_the_handler_is_put_back():
    drain = DrainSignal(torch.device("cpu"))
    before = signal.getsignal(signal.SIGTERM)
    with drain.catching_sigterm():
        assert not drain.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert drain.agreed()  # without a process group, this process alone decides
    assert signal.getsignal(signal.SIGTERM) is before
    assert drain.seconds_since_request() >= 0


def test_the_report_flags_a_restore_of_a_snapshot_whose_write_never_completed(tmp_path):
    """The check behind "no torn snapshot was ever loaded", on a hand-written event log."""
    from elastic_ddp.chaos.harness import ChaosHarness

    args = ["--model", "mlp", "--epochs", "1", "--dataset_size", "128", "--global_batch_size", "64"]
    harness = ChaosHarness(tmp_path / "run", args, FaultPlan((), initial_nodes=1))
    harness.job.checkpoint_dir.mkdir(parents=True)
    start = {"event": "start", "world_size": 1, "ranks": [{"rank": 0, "pid": 1, "agent_pid": 2}]}
    lines = [
        {"time": 1.0, "incarnation": 1, **start},
        {"time": 1.1, "incarnation": 1, "event": "snapshot_captured", "global_step": 1},
        {"time": 1.2, "incarnation": 1, "event": "snapshot", "global_step": 1, "checksum": "blake3:aaa"},
        {"time": 1.3, "incarnation": 1, "event": "snapshot_captured", "global_step": 2},  # killed mid-write
        {"time": 5.0, "incarnation": 2, **start},
        {"time": 5.1, "incarnation": 2, "event": "restore", "global_step": 1, "checksum": "blake3:aaa", "verified": True},
        {"time": 5.2, "incarnation": 2, "event": "restore", "global_step": 2, "checksum": "blake3:bbb", "verified": True},
        {"time": 6.0, "incarnation": 2, "event": "finished", "global_step": 2},
    ]
    harness.job.event_log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = harness._report([], [])
    assert [r["trusted"] for r in report.restores] == [True, False]
    assert report.interrupted_snapshot_writes == [2]
    assert any("restore of step 2 (checksum blake3:bbb" in problem for problem in report.problems)
    assert any(problem.startswith("exactly once") for problem in report.problems)  # no audit log here
    assert not report.ok


def test_the_report_trusts_memory_restores_of_committed_steps_and_counts_lost_steps(tmp_path):
    """A memory restore may be one step past rank 0's log (the step rank 0 died in), not more; a
    fault may cost one committed step, not more."""
    from elastic_ddp.chaos.harness import ChaosHarness
    from elastic_ddp.chaos.verdict import FaultRecord

    args = ["--model", "mlp", "--epochs", "1", "--dataset_size", "128", "--global_batch_size", "64"]
    harness = ChaosHarness(tmp_path / "run", args, FaultPlan((), initial_nodes=1))
    harness.job.checkpoint_dir.mkdir(parents=True)
    start = {"event": "start", "world_size": 1, "ranks": [{"rank": 0, "pid": 1, "agent_pid": 2}]}
    memory = {"event": "restore", "checksum": "blake3:ccc", "verified": True, "source": "memory"}
    lines = [
        {"time": 1.0, "incarnation": 1, **start},
        *({"time": 1.0 + step / 10, "incarnation": 1, "event": "step", "global_step": step} for step in (1, 2, 3)),
        {"time": 5.0, "incarnation": 2, **start},
        {"time": 5.1, "incarnation": 2, **memory, "global_step": 4, "lost_steps": 0},
        {"time": 7.0, "incarnation": 3, **start},
        {"time": 7.1, "incarnation": 3, **memory, "global_step": 9, "lost_steps": 0},
        {"time": 9.0, "incarnation": 4, **start},
        {"time": 9.1, "incarnation": 4, **memory, "global_step": 1, "lost_steps": 2},
    ]
    harness.job.event_log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    faults = [FaultRecord(index, "kill_node random", {"action": "kill_node"}, fired=True, fired_at=at, node=node)
              for index, (at, node) in enumerate([(4.0, "node1"), (6.0, "node1"), (8.0, "node1")])]
    report = harness._report(faults, [])
    assert [(r["source"], r["trusted"]) for r in report.restores] == [("memory", True), ("memory", False),
                                                                       ("memory", True)]
    assert "restore of step 9 from memory is not a verified copy of a committed step" in report.problems
    assert [p for p in report.problems if "committed steps" in p] == [
        "fault 2 (kill_node random) cost 2 committed steps (the restore of step 1 from memory); at most 1 expected"]
