"""The rendezvous's dead-node probes (`probes.ExitWitness`) on real beacons in this process,
and their `--rdzv_conf` switch (the probes on real agents: tests/cluster/test_liveness.py)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.liveness import Answer, Beacon, probe, probes_enabled
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.state import NodeDesc
from elastic_ddp.testbed.local_cluster import wait_for

pytestmark = pytest.mark.timeout(30)

EVICTION_LOG = "has exited (its beacon refuses connections)"
# What torch calls torchrun as PID 1 of a container at 127.0.0.1, after every restart alike.
CONTAINER_NODE = NodeDesc("127.0.0.1", 1, 0)


def test_probes_are_on_unless_turned_off_and_a_bad_value_is_named():
    def params(**config):
        return RendezvousParameters("elastic-c10d", "127.0.0.1:1", "r", 1, 1, **config)

    assert probes_enabled(params()) and probes_enabled(params(probe_dead_nodes="1"))
    assert not probes_enabled(params(probe_dead_nodes="0"))
    with pytest.raises(ValueError, match=r"--rdzv_conf probe_dead_nodes: got 'maybe'; expected 1 or 0"):
        probes_enabled(params(probe_dead_nodes="maybe"))


def reached(here: ExitWitness, node: NodeDesc, port: int) -> None:
    here.observe_soon(lambda: {node: port}, [node])
    wait_for(lambda: here.reached(node, port) is not None, 10, "reaching the other's beacon")


def test_an_exited_member_is_found_at_every_ask_and_logged_once_as_a_warning(caplog) -> None:
    here, other = ExitWitness(), ExitWitness()
    node = NodeDesc("127.0.0.1", 2, 0)
    ports = {node: other.port}
    reached(here, node, other.port)
    assert here.exited(ports) == set()  # alive: accepts
    other.close()  # its process "exits": the beacon refuses
    with caplog.at_level(logging.INFO, logger="elastic_ddp.agent.rendezvous.probes"):
        assert here.exited(ports) == {node}
        assert here.exited(ports) == {node}  # the closer asks again at its next poll
    said = [record for record in caplog.records if EVICTION_LOG in record.getMessage()]
    assert [record.levelno for record in said] == [logging.WARNING]  # agents log warnings, not info
    here.close()


def test_a_node_restarted_with_the_same_name_is_not_judged_by_its_predecessors_refusal() -> None:
    """Issue 27: a container restarted in place has its predecessor's name (address, PID 1, counter 0).
    Its new beacon listens on another port, which this agent has not reached: only the lease, or
    a refusal of that port once reached, can leave it out."""
    here, predecessor = ExitWitness(), ExitWitness()
    restarted = ExitWitness()  # opened now, so that its port is not the predecessor's (the kernel may reuse it)
    reached(here, CONTAINER_NODE, predecessor.port)
    predecessor.close()
    assert here.exited({CONTAINER_NODE: predecessor.port}) == {CONTAINER_NODE}
    assert here.exited({CONTAINER_NODE: restarted.port}) == set()  # its liveness key names the new port
    reached(here, CONTAINER_NODE, restarted.port)
    restarted.close()  # once reached, it is found like any other when it exits too
    assert here.exited({CONTAINER_NODE: restarted.port}) == {CONTAINER_NODE}
    here.close()


def _beacon_until_killed(ports) -> None:
    ports.put(Beacon().port)
    signal.pause()  # until the test kills it


def test_a_frozen_beacon_completes_the_handshakes_of_a_few_hundred_probes() -> None:
    """Every fellow member of a round probes a node's beacon once; Python's default listen backlog
    (128) made the kernel drop the handshakes beyond it while the beacon's thread had not accepted
    yet, and a dropped handshake reads as "unknown": that node's exit then waits for its lease."""
    if int(Path("/proc/sys/net/core/somaxconn").read_text()) < 300:
        pytest.skip("the kernel caps every listen backlog below 300 (net.core.somaxconn)")
    context = multiprocessing.get_context("fork")
    ports = context.Queue()
    process = context.Process(target=_beacon_until_killed, args=(ports,), daemon=True)
    process.start()
    try:
        port = ports.get(timeout=20)
        os.kill(process.pid, signal.SIGSTOP)  # nothing accepts now: only the backlog takes handshakes
        answers = [probe(("127.0.0.1", port), timeout=0.1) for _ in range(300)]
        assert answers.count(Answer.ACCEPTED) == 300
    finally:
        process.kill()
        process.join(timeout=10)
