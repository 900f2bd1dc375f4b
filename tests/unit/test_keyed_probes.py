"""The keyed rendezvous's dead-node probes (`keyed_probes.ExitWitness`) on real beacons in this process."""

from __future__ import annotations

import logging

import pytest

from elastic_ddp.agent.rendezvous.keyed_probes import ExitWitness
from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc
from elastic_ddp.testbed.local_cluster import wait_for

pytestmark = pytest.mark.timeout(30)

EVICTION_LOG = "has exited (its beacon refuses connections)"  # the words torch's algorithm logs too


def test_an_exited_member_is_found_at_every_ask_and_logged_once_as_a_warning(caplog) -> None:
    here, other = ExitWitness(), ExitWitness()
    node = NodeDesc("127.0.0.1", 2, 0)
    ports = {node: other.port}
    here.observe_soon(lambda: ports, [node])
    wait_for(lambda: here._reached, 10, "reaching the other's beacon")
    assert here.exited(ports) == set()  # alive: accepts
    other.close()  # its process "exits": the beacon refuses
    with caplog.at_level(logging.INFO, logger="elastic_ddp.agent.rendezvous.keyed_probes"):
        assert here.exited(ports) == {node}
        assert here.exited(ports) == {node}  # the closer asks again at its next poll
    said = [record for record in caplog.records if EVICTION_LOG in record.getMessage()]
    assert [record.levelno for record in said] == [logging.WARNING]  # agents log warnings, not info
    here.close()
