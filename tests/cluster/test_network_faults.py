"""Promise 10 (docs/design.md): the network may fail like a node.

Every node here is a host of its own: a network namespace with its own address on a bridge
(elastic_ddp/testbed/netns.py), its torchrun agent started inside it with
`--rdzv_backend=elastic-c10d --rdzv_endpoint=<n0's address>:PORT --local_addr=<own address>`.
Faults are links set down on the switch: packets vanish, nothing is refused or reset.

Nothing else is given by hand (no `is_host`, no `GLOO_SOCKET_IFNAME`): tests/support/network.py.

    .venv/bin/python -m pytest tests/cluster/test_network_faults.py -q
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

import pytest

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.testbed.netns import NetworkBed, NetworkFault, bed_namespaces, why_unavailable
from tests.support.cluster import assert_exactly_once, node_logs, release, world_reached
from tests.support.network import start_job

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces: {UNAVAILABLE}")

# Below the peer watchdog's default bound (--watchdog_timeout_s 3).
BLIP_S = 1.0


def _host_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


# A server in one namespace that answers every connection with a word; the client prints what it got.
_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    connection, _ = server.accept()
    connection.sendall(sys.argv[3].encode())
    connection.close()
"""
_CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as connection:
        connection.settimeout(float(sys.argv[3]))
        print(connection.recv(64).decode())
except OSError as exc:
    print(type(exc).__name__)
"""


def _ask(bed: NetworkBed | None, node: str | None, address: str, timeout: float = 2.0) -> tuple[str, float]:
    """What a client in `node`'s namespace (None: the host's) reads from the word server, and how long it took."""
    prefix = bed.prefix(node) if node is not None else []
    started = time.monotonic()
    done = subprocess.run([*prefix, sys.executable, "-c", _CLIENT, address, "5555", str(timeout)],
                          check=False, capture_output=True, text=True, timeout=timeout + 10)
    return done.stdout.strip(), time.monotonic() - started


@pytest.mark.timeout(60)
def test_nodes_reach_each_other_over_the_bridge_until_partitioned_and_leave_nothing_behind(network_bed):
    """Two namespaces talk over the bridge (not through any loopback: the word comes from n0's
    server, which listens on n0's address alone); a partitioned n1 gets nothing (its connect times
    out: packets vanish); healed, it does again, also after a blip; closing the bed leaves no
    namespace and changes no link of the host."""
    links_before = _host_links()
    word = f"word-{time.monotonic_ns()}"
    bed = network_bed(["n0", "n1"])
    n0 = bed.address("n0")
    assert bed.name in " ".join(bed_namespaces())
    server = subprocess.Popen([*bed.prefix("n0"), sys.executable, "-c", _SERVER, n0, "5555", word],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        assert _ask(bed, "n1", n0)[0] == word
        assert _ask(bed, "n1", "127.0.0.1")[0] == "ConnectionRefusedError"  # n1's loopback is its own
        assert _ask(None, None, n0, timeout=1)[0] != word  # the host's namespace is not on the bridge
        bed.apply(NetworkFault.parse("partition n1"))
        answer, took = _ask(bed, "n1", n0, timeout=1)
        assert answer == "TimeoutError" and took >= 1, (answer, took)
        bed.apply(NetworkFault.parse("heal n1"))
        assert _ask(bed, "n1", n0)[0] == word
        bed.apply(NetworkFault.parse("blip n1 0.2"))
        assert _ask(bed, "n1", n0)[0] == word
    finally:
        bed.close()
        server.wait(timeout=10)  # closing the bed killed every process in its namespaces
    assert not [name for name in bed_namespaces() if name.startswith(bed.name)]
    assert _host_links() == links_before


@pytest.mark.timeout(180)
def test_a_blip_shorter_than_the_watchdog_bound_loses_nothing(local_jobs, network_bed, tmp_path):
    """n1 (not the store's node) loses its link for 1 s mid-epoch: gloo's TCP retransmits carry the
    collectives over the gap, so the group trains on: no restart (one `start` event), the job
    finishes, every sample exactly once."""
    bed = network_bed(["n0", "n1"])
    hold = tmp_path / "hold"
    # 320 steps held at 0.05 s or more each (elastic_ddp/chaos/held_train.py): the job cannot end
    # before the blip; released, it ends in seconds.
    dataset_size, epochs, batch = 1024, 20, 64
    args = ["--model", "mlp", "--epochs", str(epochs), "--dataset_size", str(dataset_size),
            "--global_batch_size", str(batch), "--snapshot_every_steps", "20", "--log_interval", "10"]
    job = start_job(local_jobs, bed, hold, args, ["n0", "n1"], nnodes="2:2")
    try:
        world_reached(job, 2)
        job.wait_for_step(job.last_step() + 3, 30)
        blip_started = time.time()
        bed.apply(NetworkFault("blip", "n1", BLIP_S))
        healed = time.time()
        job.wait_for_event(lambda e: e["event"] == "step" and e["time"] > healed + 0.5, 30,
                           "steps after the heal")
    finally:
        release(hold)
    step_times = [e["time"] for e in job.events("step") if blip_started - 1 < e["time"] < healed + 1]
    stall = max(later - earlier for earlier, later in itertools.pairwise(step_times))
    print(f"a {BLIP_S:g} s blip of n1: the longest time between two steps around it {stall:.2f} s")
    assert stall > BLIP_S / 2, f"the blip did not stop training ({stall:.2f} s between steps): did it bite?"
    codes = job.wait(120)
    assert codes == {"n0": 0, "n1": 0}, f"{codes}\n{node_logs(job)}"
    starts = [event for event in read_events(job.event_log) if event["event"] == "start"]
    assert len(starts) == 1, f"the group re-formed: {starts}\n{node_logs(job)}"
    assert_exactly_once(job, dataset_size, epochs, batch)
