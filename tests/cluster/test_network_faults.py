"""Promise 10 (docs/design.md): the network may fail like a node. The test bed itself.

Every node of a bed is a host of its own: a network namespace with its own address on a bridge
(elastic_ddp/testbed/netns.py). Faults are links set down on the switch: packets vanish, nothing
is refused or reset. Training jobs on a bed: a blip shorter than the peer watchdog's bound, a
partition and its heal played by `elastic-ddp chaos` (tests/cluster/test_chaos_cli.py); a replica
target and the store's node partitioned (tests/cluster/test_network_partition.py).

    .venv/bin/python -m pytest tests/cluster/test_network_faults.py -q
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from elastic_ddp.testbed.netns import NetworkBed, NetworkFault, bed_namespaces, why_unavailable

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces: {UNAVAILABLE}")


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
