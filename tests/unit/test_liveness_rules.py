"""The rules of the dead-node probes in one process: the `probe_dead_nodes` switch, and what a verdict
"exited" is about (the probes on real agents: tests/cluster/test_liveness.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
)

from elastic_ddp.agent.rendezvous.liveness import (
    Beacon,
    DeadNodeDetector,
    beacon_key,
    probes_enabled,
)
from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc

pytestmark = pytest.mark.timeout(60)

# What torch calls torchrun as PID 1 of a container at 127.0.0.1, after every restart alike.
CONTAINER_NODE = NodeDesc("127.0.0.1", 1, 0)


def test_probes_are_on_unless_turned_off_and_a_bad_value_is_named():
    def params(**config):
        return RendezvousParameters("c10d", "127.0.0.1:1", "r", 1, 1, **config)

    assert probes_enabled(params()) and probes_enabled(params(probe_dead_nodes="1"))
    assert not probes_enabled(params(probe_dead_nodes="0"))
    with pytest.raises(ValueError, match=r"--rdzv_conf probe_dead_nodes: got 'maybe'; expected 1 or 0"):
        probes_enabled(params(probe_dead_nodes="maybe"))


@pytest.fixture
def exited_container_node():
    """A detector that found CONTAINER_NODE exited (its beacon reached, then refusing), and the store."""
    store = dist.HashStore()
    predecessor = Beacon()
    store.set(beacon_key(CONTAINER_NODE), str(predecessor.port))
    detector = DeadNodeDetector(store)
    detector.observe([CONTAINER_NODE])
    predecessor.close()
    assert detector.dead([CONTAINER_NODE]) == [CONTAINER_NODE]
    assert detector.dead([CONTAINER_NODE], suspects=[]) == [CONTAINER_NODE]  # its beacon still refuses
    return detector, store


def test_a_node_found_exited_is_live_again_once_a_beacon_under_its_name_answers(exited_container_node):
    """Issue 27: a container restarted in place has its predecessor's name (address, PID 1, counter 0);
    survivors that kept removing it as exited let it in only when its own write won a round."""
    detector, store = exited_container_node
    restarted = Beacon()
    try:
        store.set(beacon_key(CONTAINER_NODE), str(restarted.port))  # as its agent does before it joins
        assert detector.dead([CONTAINER_NODE], suspects=[]) == []  # not a suspect: it has just joined
        assert not detector.has_exited(CONTAINER_NODE)
    finally:
        restarted.close()
    # Reached again: when the restarted agent exits too, it is found like any other.
    assert detector.dead([CONTAINER_NODE]) == [CONTAINER_NODE]


def test_a_node_found_exited_that_no_longer_publishes_a_beacon_is_left_to_its_heartbeat(exited_container_node):
    """An agent of that name without probes (its beacon key gone): nothing says it is dead."""
    detector, store = exited_container_node
    store.delete_key(beacon_key(CONTAINER_NODE))
    assert detector.dead([CONTAINER_NODE]) == []
