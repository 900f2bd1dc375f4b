"""Network faults as data, and the names of a network bed (elastic_ddp/testbed/netns.py), without
making a namespace (the bed itself: tests/cluster/test_network_faults.py)."""

from __future__ import annotations

import pytest

from elastic_ddp.testbed.netns import NetworkBed, NetworkFault

MAX_INTERFACE_NAME = 15  # IFNAMSIZ - 1


def test_network_faults_read_as_text():
    assert NetworkFault.parse("blip n1 1.5") == NetworkFault("blip", "n1", 1.5)
    assert NetworkFault.parse("partition n2") == NetworkFault("partition", "n2")
    assert NetworkFault.parse("heal n2").describe() == "heal n2"
    assert NetworkFault.parse("blip n1 1").describe() == "blip n1 1"
    # Several nodes cut off together (one side), and an etcd member with a training node beside it.
    assert NetworkFault.parse("partition n1 n2") == NetworkFault("partition", "n1", side=("n2",))
    assert NetworkFault.parse("partition-etcd e1 n2").nodes == ("e1", "n2")
    assert NetworkFault.parse("heal e1 n2").describe() == "heal e1 n2"


@pytest.mark.parametrize("wrong", ["blip n1", "drop n1", "blip n1 -1", "blip n1 soon", "partition",
                                   "blip n1 1 2", "partition n1 n1", "partition-etcd"])
def test_a_wrong_network_fault_names_what_is_allowed(wrong):
    with pytest.raises(ValueError, match="partition NODE|expected|needs|takes no|number|distinct"):
        NetworkFault.parse(wrong)


def test_every_bed_has_names_of_its_own_and_short_interfaces():
    nodes = [f"node{index}" for index in range(250)]
    first, second = NetworkBed(nodes), NetworkBed(nodes)
    assert first.name != second.name
    assert first.namespace("node3") != second.namespace("node3")
    assert len({first.address(node) for node in nodes}) == len(nodes)
    assert all(len(first.port(node)) <= MAX_INTERFACE_NAME for node in nodes)
    assert first.prefix("node1") == ["ip", "netns", "exec", first.namespace("node1")]


def test_a_bed_refuses_unknown_or_repeated_nodes():
    with pytest.raises(ValueError, match="distinct"):
        NetworkBed(["n0", "n0"])
    with pytest.raises(ValueError, match="expected one of n0, n1"):
        NetworkBed(["n0", "n1"]).address("n2")


def test_partition_etcd_takes_only_an_etcd_member():
    bed = NetworkBed(["e0", "n0"], etcd_members=["e0"])
    with pytest.raises(ValueError, match="etcd member: got 'n0'; expected one of e0"):
        bed.apply(NetworkFault.parse("partition-etcd n0"))
    with pytest.raises(ValueError, match="etcd_members: got"):
        NetworkBed(["n0"], etcd_members=["e0"])
