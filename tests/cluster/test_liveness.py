"""Dead-node probes (elastic_ddp.agent.rendezvous.liveness): a killed node leaves the rendezvous before its
heartbeat expires.

Real sockets, real signals, the elastic-c10d handler that torchrun's registry builds, and at the
end real torchrun agents, whose heartbeats get 60 s to expire: a round that re-forms within the
test's deadline was re-formed by a probe. The probes in the rendezvous's own rounds, one
process: tests/unit/test_rendezvous_probes.py and tests/unit/test_rendezvous_c10d.py.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.agent.rendezvous.defaults import RDZV_CONF
from elastic_ddp.agent.rendezvous.handler import RoundRendezvousHandler
from elastic_ddp.agent.rendezvous.liveness import Answer, probe
from elastic_ddp.testbed.local_cluster import free_port
from tests.support.cluster import hold_settings, node_logs

pytestmark = pytest.mark.timeout(60)

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


@pytest.mark.parametrize("probe_dead_nodes, probes", [("1", True), ("0", False)])
def test_the_elastic_c10d_backend_comes_from_the_entry_point_and_probes_unless_told_not_to(probe_dead_nodes, probes):
    port = free_port()
    handler = get_rendezvous_handler(RendezvousParameters(
        BACKEND_NAME, f"127.0.0.1:{port}", "launcher", 1, 1, is_host="1", probe_dead_nodes=probe_dead_nodes))
    assert isinstance(handler, RoundRendezvousHandler)
    assert (handler._witness.port is not None) is probes  # a beacon only with the probes on
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()


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
