"""The keyed rendezvous's dead-node probes (`keyed_probes.ExitWitness`) on real beacons in this process."""

from __future__ import annotations

import logging
import time

import pytest

from elastic_ddp.agent.rendezvous.keyed_probes import ExitWitness
from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc

pytestmark = pytest.mark.timeout(30)

EVICTION_LOG = "has exited (its beacon refuses connections)"  # the words torch's algorithm logs too


def test_an_exited_member_is_found_at_every_ask_and_logged_once_as_a_warning(caplog) -> None:
    here, other = ExitWitness(), ExitWitness()
    node = NodeDesc("127.0.0.1", 2, 0)
    ports = {node: other.port}
    here.observe_soon(lambda: ports, [node])
    deadline = time.monotonic() + 10
    while not here._reached and time.monotonic() < deadline:  # it has reached the other's beacon
        time.sleep(0.02)
    assert here.exited(ports) == set()  # alive: accepts
    other.close()  # its process "exits": the beacon refuses
    with caplog.at_level(logging.INFO, logger="elastic_ddp.agent.rendezvous.keyed_probes"):
        assert here.exited(ports) == {node}
        assert here.exited(ports) == {node}  # the closer asks again at its next poll
    said = [record for record in caplog.records if EVICTION_LOG in record.getMessage()]
    assert [record.levelno for record in said] == [logging.WARNING]  # agents log warnings, not info
    here.close()
