"""The private torch names elastic_ddp relies on (elastic_ddp/agent/rendezvous/torch_internals.py) exist
with the shapes used there. A torch upgrade that moves one fails here first, with its name."""

from __future__ import annotations

import inspect

from elastic_ddp.agent.rendezvous import torch_internals


def test_a_node_is_named_by_address_pid_and_counter_hashable_and_printable():
    node = torch_internals.NodeDesc("host", 42, 0)
    assert (node.addr, node.pid, node.local_id) == ("host", 42, 0)
    assert node == torch_internals.NodeDesc("host", 42, 0) and len({node, torch_internals.NodeDesc("host", 42, 0)}) == 1
    assert str(node) == "host_42_0"  # the name torch prints in its logs, as ours do


def test_torchs_store_host_rule_takes_a_host_and_answers_for_this_machine():
    assert list(inspect.signature(torch_internals._matches_machine_hostname).parameters) == ["host"]
    assert torch_internals.matches_machine_hostname("localhost")
    assert not torch_internals.matches_machine_hostname("192.0.2.1")  # TEST-NET-1: never an address of ours
