"""Dead-node probes (elastic_ddp.agent.rendezvous.liveness): a killed node leaves the rendezvous before its
heartbeat expires.

Real sockets, real signals, torch's real dynamic rendezvous on a real TCPStore, and at the end real
torchrun agents. The rendezvous tests give heartbeats 60 s to expire, so a round that re-forms
within the test's deadline was re-formed by a probe, not by torch's heartbeat check.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_ddp.agent.rendezvous.c10d import BACKEND_NAME
from elastic_ddp.agent.rendezvous.defaults import RDZV_CONF
from elastic_ddp.agent.rendezvous.handler import elastic_handler
from elastic_ddp.agent.rendezvous.keyed_handler import KeyedRendezvousHandler
from elastic_ddp.agent.rendezvous.liveness import Answer, Beacon, DeadNodeDetector, beacon_key, probe
from elastic_ddp.testbed.local_cluster import free_port
from tests.support.cluster import hold_settings, node_logs

pytestmark = pytest.mark.timeout(60)

SLOW_HEARTBEAT_EXPIRY = {"keep_alive_interval": 1, "keep_alive_max_attempt": 60}
EVICTION_LOG = "has exited (its beacon refuses connections)"

BEACON_PROCESS = """
import sys, threading
from elastic_ddp.agent.rendezvous.liveness import Beacon
print(Beacon().port, flush=True)
threading.Event().wait()
"""


@pytest.fixture
def beacon_process():
    process = subprocess.Popen([sys.executable, "-c", BEACON_PROCESS], stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())  # the pytest timeout bounds this read
        yield process, ("127.0.0.1", port)
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_beacon_answers_while_its_process_lives_frozen_or_not_and_refuses_once_it_is_killed(beacon_process):
    process, address = beacon_process
    assert probe(address) is Answer.ACCEPTED
    process.send_signal(signal.SIGSTOP)  # a frozen agent is not a dead one: its kernel still accepts
    assert probe(address) is Answer.ACCEPTED
    process.kill()
    process.wait(timeout=30)
    assert probe(address) is Answer.REFUSED


def test_a_probe_that_gets_no_answer_says_nothing():
    # A full accept queue drops new handshakes, as a lost machine or a partition does.
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        address = server.getsockname()
        with socket.create_connection(address, timeout=5):
            assert probe(address, timeout=0.2) is Answer.UNKNOWN


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_only_a_node_reached_before_and_refusing_now_is_dead(store):
    alive, exited, never_reached = Beacon(), Beacon(), Beacon()
    nodes = {name: _NodeDesc("localhost", 1000 + i, 0) for i, name in enumerate(
        ["alive", "exited", "never reached", "without beacon"])}
    store.set(beacon_key(nodes["alive"]), str(alive.port))
    store.set(beacon_key(nodes["exited"]), str(exited.port))
    detector = DeadNodeDetector(store)
    detector.observe([nodes["alive"], nodes["exited"], nodes["without beacon"]])
    never_reached.close()
    store.set(beacon_key(nodes["never reached"]), str(never_reached.port))
    detector.observe(nodes.values())
    assert detector.dead(nodes.values()) == []
    exited.close()
    assert detector.dead(nodes.values()) == [nodes["exited"]]
    assert detector.dead(nodes.values()) == [nodes["exited"]]  # and it stays dead
    alive.close()


def test_only_the_suspects_given_are_probed_again(store):
    alive, exited = Beacon(), Beacon()
    nodes = {name: _NodeDesc("localhost", 2000 + i, 0) for i, name in enumerate(["alive", "exited"])}
    for name, beacon in (("alive", alive), ("exited", exited)):
        store.set(beacon_key(nodes[name]), str(beacon.port))
    detector = DeadNodeDetector(store)
    detector.observe(nodes.values())
    exited.close()
    assert detector.dead(nodes.values(), suspects=[nodes["alive"]]) == []  # the exited one was not probed
    assert detector.dead(nodes.values(), suspects=[nodes["exited"]]) == [nodes["exited"]]
    assert detector.dead(nodes.values(), suspects=[]) == [nodes["exited"]]  # known (its beacon looked up: refusing)
    alive.close()


class CountingStore(dist.Store):
    """`store` (a real TCPStore), counting the reads a detector makes: our extension of torch's Store."""

    def __init__(self, store):
        super().__init__()
        self._store = store
        self.reads = 0

    def has_extended_api(self) -> bool:
        return True

    def check(self, keys):
        self.reads += 1
        return self._store.check(keys)

    def get(self, key):
        self.reads += 1
        return self._store.get(key)

    def multi_get(self, keys):
        self.reads += 1
        return self._store.multi_get(keys)


def test_beacons_are_looked_up_a_bounded_batch_at_a_time_with_one_read_for_the_batch(store):
    """After a round of 64 completed, every agent looked up 63 beacons at one sync, two store
    reads each, which held etcd and every agent for 8 s (docs/benchmarks-history.md). Now at most
    OBSERVE_PER_SYNC per sync, found with one check and one multi_get; a port that is not one is
    never probed, and the other nodes are still learnt."""
    from elastic_ddp.agent.rendezvous.liveness import OBSERVE_PER_SYNC

    beacons = [Beacon() for _ in range(OBSERVE_PER_SYNC + 4)]
    nodes = [_NodeDesc("localhost", 3000 + i, 0) for i in range(len(beacons))]
    for node, beacon in zip(nodes, beacons):
        store.set(beacon_key(node), str(beacon.port))
    store.set(beacon_key(nodes[1]), "not a port")
    counting = CountingStore(store)
    detector = DeadNodeDetector(counting)
    detector.observe(nodes)
    assert counting.reads == 2
    detector.observe(nodes)
    assert counting.reads == 4
    detector.observe(nodes)
    assert counting.reads == 4  # every node seen
    for beacon in beacons:
        beacon.close()
    assert detector.dead(nodes) == [node for index, node in enumerate(nodes) if index != 1]


def test_agents_waiting_in_a_forming_round_do_not_probe_live_peers(store, monkeypatch):
    """Live peers that joined the forming round beat their heartbeats: none is a suspect. Probing
    all of them at every sync made the rendezvous of 16+ agents churn (docs/benchmarks-history.md)."""
    from elastic_ddp.agent.rendezvous import liveness

    probes = []
    real_probe = liveness.probe
    monkeypatch.setattr(liveness, "probe", lambda address, *args: probes.append(address) or real_probe(address, *args))
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    handlers = []
    for _ in range(3):  # min_nodes 4: the round never completes, all three wait in it until join_timeout
        params = RendezvousParameters("c10d", f"127.0.0.1:{store.port}", "forming", 4, 5, join_timeout=4,
                                      **SLOW_HEARTBEAT_EXPIRY)
        handlers.append(elastic_handler(params, client, C10dRendezvousBackend(client, "forming")))
    outcomes = []

    def wait_in_round(handler) -> None:
        try:
            handler.next_rendezvous()
            outcomes.append("completed")
        except RendezvousTimeoutError:
            outcomes.append("timed out")

    threads = [threading.Thread(target=wait_in_round, args=(handler,), daemon=True) for handler in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert outcomes == ["timed out"] * 3  # they waited the whole join timeout (about 40 syncs each)
    # Each agent probes each peer once, when it first sees it (to learn it is reachable); no more.
    assert len(probes) <= 3 * 2, probes


def _handler(port: int, run_id: str, **config):
    """A handler with the probes and nothing else of ours (no prompt completion)."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, 1, 2, last_call_timeout=1,
                                  prompt_completion=0, **config)
    return elastic_handler(params, client, C10dRendezvousBackend(client, run_id))


def _first_round(survivor, peer) -> None:
    """Both handlers join one round (max_nodes 2 completes it at once)."""
    peer_round = threading.Thread(target=peer.next_rendezvous, daemon=True)
    peer_round.start()
    assert survivor.next_rendezvous().world_size == 2
    peer_round.join(timeout=30)
    assert not peer_round.is_alive()


def test_the_survivor_of_an_exited_peer_forms_the_next_round_without_waiting_for_its_heartbeat(store, caplog):
    survivor = _handler(store.port, "exited-peer", **SLOW_HEARTBEAT_EXPIRY)
    peer = _handler(store.port, "exited-peer", **SLOW_HEARTBEAT_EXPIRY)
    _first_round(survivor, peer)
    # The peer's agent "exits": no more heartbeats, its beacon closed by the kernel.
    peer._stop_heartbeats()
    peer._state_holder._beacon.close()
    info = survivor.next_rendezvous()  # within the test's 60 s, though the peer's heartbeat is fresh
    assert (info.rank, info.world_size) == (0, 1)
    assert EVICTION_LOG in caplog.text
    survivor._stop_heartbeats()


def test_a_live_peer_that_has_not_come_back_keeps_its_place(store, caplog):
    survivor = _handler(store.port, "live-peer", join_timeout=2, **SLOW_HEARTBEAT_EXPIRY)
    peer = _handler(store.port, "live-peer", **SLOW_HEARTBEAT_EXPIRY)
    _first_round(survivor, peer)
    with pytest.raises(RendezvousTimeoutError):
        survivor.next_rendezvous()  # the peer still trains in the old round as far as anyone knows
    assert EVICTION_LOG not in caplog.text
    peer._stop_heartbeats()


@pytest.mark.parametrize("algorithm", ["keyed", "dynamic"])
@pytest.mark.parametrize("probe_dead_nodes, holder_probes", [("1", True), ("0", False)])
def test_the_elastic_c10d_backend_comes_from_the_entry_point_and_probes_unless_told_not_to(
        probe_dead_nodes, holder_probes, algorithm):
    port = free_port()
    handler = get_rendezvous_handler(RendezvousParameters(
        BACKEND_NAME, f"127.0.0.1:{port}", "launcher", 1, 1, is_host="1", probe_dead_nodes=probe_dead_nodes,
        algorithm=algorithm))
    keyed = isinstance(handler, KeyedRendezvousHandler)
    assert keyed is (algorithm == "keyed")
    # The keyed handler's witness publishes a beacon port only with the probes on; torch's has a detector.
    probes = handler._witness.port is not None if keyed else handler._state_holder._detector is not None
    assert probes is holder_probes
    assert handler.next_rendezvous().world_size == 1
    if keyed:
        handler.shutdown()
    else:
        handler._stop_heartbeats()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_agents_resume_without_a_killed_node_long_before_its_heartbeat_expires(local_jobs, tmp_path):
    conf = RDZV_CONF.replace("keep_alive_max_attempt=5", "keep_alive_max_attempt=60")
    assert conf != RDZV_CONF
    args = ["--model", "mlp", "--epochs", "100", "--dataset_size", "1024", "--global_batch_size", "64",
            "--snapshot_every_steps", "5", "--log_interval", "1"]
    # Held (elastic_ddp/chaos/held_train.py): 1600 steps cannot end before the probe has done its work.
    job = local_jobs(args, nnodes="1:3", nproc_per_node=1, rdzv_conf=conf, **hold_settings(tmp_path / "hold"))
    host = job.add_node("host")
    lost = job.add_node("lost")
    job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == 2, 120, "a group of world size 2")
    job.wait_for_step(job.last_step() + 3, timeout=60)
    killed_at = time.time()
    lost.kill()
    # 60 s of heartbeat expiry after the kill would miss this deadline: only a probe meets it.
    job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == 1 and e["time"] > killed_at, 40,
                       "a group without the lost node")
    assert EVICTION_LOG in host.log_text(), node_logs(job)
