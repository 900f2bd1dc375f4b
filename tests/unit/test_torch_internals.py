"""The private torch name elastic_ddp relies on (elastic_ddp/agent/rendezvous/torch_internals.py) exists
with the shape used there. A torch upgrade that moves it fails here first, with its name."""

from __future__ import annotations

import inspect

from elastic_ddp.agent.rendezvous import torch_internals


def test_torchs_store_host_rule_takes_a_host_and_answers_for_this_machine():
    assert list(inspect.signature(torch_internals._matches_machine_hostname).parameters) == ["host"]
    assert torch_internals.matches_machine_hostname("localhost")
    assert not torch_internals.matches_machine_hostname("192.0.2.1")  # TEST-NET-1: never an address of ours
