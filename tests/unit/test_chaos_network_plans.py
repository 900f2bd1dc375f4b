"""Network faults in chaos plans (elastic_ddp/chaos/plan.py, elastic_ddp/chaos/network.py): read as
data, refused in one line where namespaces cannot be made. The faults themselves, on a real bed:
tests/cluster/test_network_faults.py."""

from __future__ import annotations

import json

import pytest

from elastic_ddp.chaos import cli, network
from elastic_ddp.chaos.harness import ChaosHarness
from elastic_ddp.chaos.plan import REMOVING_ACTIONS, Fault, FaultPlan, PlanError

TRAINING = ["--model", "mlp", "--epochs", "1", "--dataset_size", "256", "--global_batch_size", "64"]
PLAN = {"initial_nodes": 2, "min_nodes": 1, "max_nodes": 3,
        "faults": [{"action": "partition_node", "target": "node1", "at_step": 10},
                   {"action": "heal_node", "target": "node1", "at_seconds": 5},
                   {"action": "add_node"},
                   {"action": "blip_node", "target": "random", "seconds": 1.5}]}


def test_network_faults_read_as_a_plan_and_need_a_bed():
    plan = FaultPlan.from_dict(PLAN)
    assert plan.needs_network_bed
    assert [fault.describe() for fault in plan.faults] == [
        "partition_node node1 (at step 10)", "heal_node node1 (at 5 s)", "add_node", "blip_node random for 1.5 s"]
    assert FaultPlan.from_dict(plan.to_dict()) == plan
    assert "partition_node" in REMOVING_ACTIONS  # a partitioned node no longer trains: its recovery is measured
    assert not FaultPlan((Fault("kill_node"), Fault("freeze_node"))).needs_network_bed


@pytest.mark.parametrize(("fault", "message"), [
    ({"action": "blip_node"}, "fault seconds: blip_node needs it"),
    ({"action": "kill_node", "seconds": 2}, "fault seconds: only blip_node takes it"),
    ({"action": "blip_node", "seconds": 0}, "fault seconds: got 0; expected more than 0"),
    ({"action": "cut_node"}, "expected one of .*partition_node, heal_node, blip_node"),
])
def test_a_wrong_network_fault_is_refused_naming_the_key(fault, message):
    with pytest.raises(PlanError, match=message):
        FaultPlan.from_dict({"faults": [fault]})


def test_without_namespaces_a_network_plan_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(network, "why_unavailable", lambda: "network namespaces need root")
    plan = FaultPlan.from_dict(PLAN)
    assert network.refusal(plan) == ("network faults (blip_node, heal_node, partition_node) run each node in a "
                                     "network namespace of its own: network namespaces need root")
    assert network.refusal(FaultPlan((Fault("kill_node"),))) is None
    with pytest.raises(PlanError, match="need root"):
        ChaosHarness(tmp_path / "run", TRAINING, plan)
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    assert cli.main(["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), "--", *TRAINING]) == 2
    error = capsys.readouterr().err.strip()
    assert error.splitlines() == [f"elastic_ddp.chaos: the plan cannot be followed: {network.refusal(plan)}"], error


def test_a_network_plan_gives_every_node_and_the_store_an_address_of_its_own(monkeypatch):
    monkeypatch.setattr(network, "why_unavailable", lambda: None)
    chaos_network = network.ChaosNetwork(FaultPlan.from_dict(PLAN))  # not opened: nothing is made
    bed = chaos_network.bed
    assert bed.nodes == ["node0", "node1", "node2", "store"]  # two initial nodes, one added, the store
    assert chaos_network.endpoint(standalone_store=True) == f"{bed.address('store')}:29400"
    assert chaos_network.endpoint(standalone_store=False) == f"{bed.address('node0')}:29400"
    assert chaos_network.node_options("node1") == {"local_addr": bed.address("node1"),
                                                   "command_prefix": bed.prefix("node1")}
    assert chaos_network.env == {"GLOO_SOCKET_IFNAME": "eth0"}
