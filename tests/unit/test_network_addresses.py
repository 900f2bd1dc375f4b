"""This node's addresses (elastic_ddp/agent/rendezvous/addresses.py) and the c10d store's host and
reachability (c10d/store.py), without a network of several hosts: the interface table read from
the C library against the stdlib's and iproute2's view of it, the decisions on tables given here.
tests/cluster/test_network_addresses.py runs them across network namespaces.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import shutil
import socket
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_ddp.agent.rendezvous import addresses
from elastic_ddp.agent.rendezvous.addresses import (
    holds,
    interface_addresses,
    interface_holding,
    is_loopback,
    loopback_problem,
    worker_interface_environment,
)
from elastic_ddp.agent.rendezvous.c10d import store as c10d_store

ip = ipaddress.ip_address
# A table of a machine with a loopback, one link with an IPv4 and an IPv6 address, and a second link.
TABLE = {"lo": [ip("127.0.0.1"), ip("::1")], "eth0": [ip("10.0.0.5"), ip("fd00::5")], "ib0": [ip("192.168.7.5")]}
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the interface table is read on Linux and macOS")


@linux_only
def test_the_table_lists_every_interface_and_the_loopback_addresses():
    table = interface_addresses()
    assert table is not None
    assert {name for _, name in socket.if_nameindex()} <= set(table)
    assert ip("127.0.0.1") in table["lo"]


@pytest.mark.skipif(shutil.which("ip") is None or sys.platform != "linux", reason="needs iproute2 (ip -j addr)")
def test_the_table_holds_the_addresses_iproute2_lists():
    """The ctypes reading of getifaddrs against `ip -j addr` (a check of the struct layout)."""
    listed = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout)
    expected = {link["ifname"]: {ip(entry["local"]) for entry in link.get("addr_info", []) if "local" in entry}
                for link in listed}
    table = interface_addresses()
    assert {name: set(found) for name, found in table.items() if name in expected} == expected


def test_an_address_is_held_by_the_interface_that_has_it():
    assert interface_holding("10.0.0.5", TABLE) == "eth0"
    assert interface_holding("[fd00::5]", TABLE) == "eth0"
    assert interface_holding("192.168.7.5", TABLE) == "ib0"
    assert interface_holding("127.0.0.1", TABLE) == "lo"
    assert interface_holding("10.0.0.6", TABLE) is None
    assert holds("10.0.0.5", TABLE) is True and holds("10.0.0.6", TABLE) is False
    assert holds("name.that-does-not-resolve.invalid", TABLE) is False


def test_a_host_name_is_held_where_an_address_it_resolves_to_is(monkeypatch):
    monkeypatch.setattr(addresses, "resolve", lambda host: [ip("127.0.1.1"), ip("192.168.7.5")])
    assert interface_holding("trainer-3", TABLE) == "ib0"  # not the loopback line of /etc/hosts: no interface has it


def test_holding_is_unknown_where_the_interfaces_cannot_be_listed(monkeypatch):
    monkeypatch.setattr(addresses, "interface_addresses", lambda: None)
    assert holds("10.0.0.5") is None and interface_holding("10.0.0.5") is None


@pytest.mark.parametrize(("host", "expected"), [
    ("localhost", True), ("LOCALHOST", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True),
    ("10.0.0.1", False), ("fd00::5", False), ("name.that-does-not-resolve.invalid", False),
])
def test_loopback(host, expected):
    assert is_loopback(host) is expected


def test_a_loopback_address_published_to_a_remote_endpoint_is_one_line_naming_local_addr(monkeypatch):
    monkeypatch.setattr(addresses, "source_address", lambda host, port: "10.0.0.5")
    line = loopback_problem(None, "10.0.0.1", 29400)
    assert line is not None and "\n" not in line
    assert "--local_addr=10.0.0.5" in line and "10.0.0.1:29400" in line and "loopback" in line
    assert "--local_addr=127.0.1.1" in loopback_problem("127.0.1.1", "10.0.0.1", 29400)
    assert loopback_problem("10.0.0.5", "10.0.0.1", 29400) is None  # a real address
    assert loopback_problem(None, "127.0.0.1", 29400) is None  # one machine: loopback is right
    assert loopback_problem(None, "localhost", 29400) is None


def test_without_a_route_the_line_says_what_to_pass(monkeypatch):
    monkeypatch.setattr(addresses, "source_address", lambda host, port: None)
    assert "--local_addr=<this node's address" in loopback_problem(None, "10.0.0.1", 29400)


def test_the_source_address_toward_a_local_address_is_that_address():
    assert addresses.source_address("127.0.0.1", 9) == "127.0.0.1"


def test_workers_get_the_interface_of_the_published_address_unless_set():
    assert worker_interface_environment("10.0.0.5", {}, TABLE) == {"GLOO_SOCKET_IFNAME": "eth0",
                                                                   "NCCL_SOCKET_IFNAME": "eth0"}
    assert worker_interface_environment("10.0.0.5", {"GLOO_SOCKET_IFNAME": "ib0"}, TABLE) == {
        "NCCL_SOCKET_IFNAME": "eth0"}
    both = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert worker_interface_environment("10.0.0.5", both, TABLE) == {}
    assert worker_interface_environment("127.0.0.1", {}, TABLE) == {}  # one machine: the libraries' choice works
    assert worker_interface_environment("10.9.9.9", {}, TABLE) == {}  # held by no interface (NAT): left alone


def _params(endpoint: str, **conf) -> RendezvousParameters:
    return RendezvousParameters("elastic-c10d", endpoint, "run", 1, 2, **conf)


def test_the_node_that_holds_the_endpoint_address_hosts_the_store(monkeypatch):
    monkeypatch.setattr(addresses, "interface_addresses", lambda: TABLE)
    assert c10d_store.hosts_store(_params("10.0.0.5:29400")) == (True, False)
    assert c10d_store.hosts_store(_params("10.0.0.1:29400")) == (False, False)
    assert c10d_store.hosts_store(_params("127.0.0.1:29400")) == (True, False)
    assert c10d_store.hosts_store(_params("10.0.0.1:29400", is_host="1")) == (True, True)  # is_host decides
    assert c10d_store.hosts_store(_params("10.0.0.5:29400", is_host="0")) == (False, True)


def test_bad_store_settings_name_the_key_and_value():
    with pytest.raises(ValueError, match=r"--rdzv_conf is_host: got 'maybe'"):
        c10d_store.hosts_store(_params("10.0.0.5", is_host="maybe"))
    for bad in ("0", "-3", "soon"):
        with pytest.raises(ValueError, match=rf"--rdzv_conf read_timeout: got '{bad}'"):
            c10d_store.read_timeout_s(_params("10.0.0.5", read_timeout=bad))
    assert c10d_store.read_timeout_s(_params("10.0.0.5")) == 60


def test_an_endpoint_whose_machine_refuses_is_reachable():
    """A refusal is the machine's answer (the store is not up yet): torch's client waits for it."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    c10d_store.wait_until_reachable("127.0.0.1", port, timeout_s=5)
    assert time.monotonic() - started < 1


def test_an_endpoint_without_an_answer_is_named_in_one_warning_then_one_error(monkeypatch, caplog):
    monkeypatch.setattr(c10d_store, "unanswered", lambda host, port: "no answer within 2 s")
    monkeypatch.setattr(c10d_store, "PROBE_INTERVAL_S", 0.05)
    caplog.set_level(logging.WARNING, logger=c10d_store.__name__)
    with pytest.raises(RendezvousConnectionError) as raised:
        c10d_store.wait_until_reachable("10.0.0.1", 29400, timeout_s=0.3)
    message = str(raised.value)
    assert "\n" not in message and "--rdzv_endpoint=10.0.0.1:29400" in message and "no answer" in message
    # (this module's records only: a background thread of an earlier test, an etcd lease refresher
    # retrying against a stopped server, may log a warning meanwhile; seen in CI)
    warnings = [record.getMessage() for record in caplog.records if record.name == c10d_store.__name__]
    assert len(warnings) == 1 and "--rdzv_endpoint=10.0.0.1:29400" in warnings[0], warnings


def test_an_endpoint_that_answers_later_ends_the_wait(monkeypatch, caplog):
    answers = iter(["no answer within 2 s", None])
    monkeypatch.setattr(c10d_store, "unanswered", lambda host, port: next(answers))
    monkeypatch.setattr(c10d_store, "PROBE_INTERVAL_S", 0.01)
    caplog.set_level(logging.WARNING, logger=c10d_store.__name__)
    c10d_store.wait_until_reachable("10.0.0.1", 29400, timeout_s=5)
    assert "answers now" in caplog.records[-1].getMessage()


def test_a_name_that_does_not_resolve_is_no_answer():
    assert "does not resolve" in c10d_store.unanswered("name.that-does-not-resolve.invalid", 29400)


def _connects(monkeypatch, outcomes: list) -> list:
    """socket.create_connection replaced by one that raises `outcomes` in turn (None: connected);
    returns the list of (host, port) it was called with."""
    calls, pending = [], iter(outcomes)

    class Connected:
        def close(self) -> None:
            pass

    def create_connection(address, timeout=None):
        calls.append(address)
        outcome = next(pending, outcomes[-1])
        if outcome is not None:
            raise outcome
        return Connected()

    monkeypatch.setattr(c10d_store.socket, "create_connection", create_connection)
    return calls


def test_no_route_just_after_a_heal_is_tried_again_and_the_answer_counts(monkeypatch):
    """The kernel fails a connect queued on an address resolution begun before the link came back
    (EHOSTUNREACH up to a second after the heal; reproduced with a partitioned namespace here): the
    probe connects again within its deadline instead of reading the endpoint as cut off."""
    no_route = OSError(errno.EHOSTUNREACH, "No route to host")
    monkeypatch.setattr(c10d_store, "NO_ROUTE_RETRY_S", 0.01)
    calls = _connects(monkeypatch, [no_route, no_route, ConnectionRefusedError()])
    assert c10d_store.unanswered("10.0.0.1", 29400) is None
    assert calls == [("10.0.0.1", 29400)] * 3


def test_no_route_for_the_whole_probe_is_no_answer_named_by_its_reason(monkeypatch):
    monkeypatch.setattr(c10d_store, "NO_ROUTE_RETRY_S", 0.01)
    monkeypatch.setattr(c10d_store, "PROBE_TIMEOUT_S", 0.2)
    calls = _connects(monkeypatch, [OSError(errno.ENETUNREACH, "Network is unreachable")])
    started = time.monotonic()
    assert c10d_store.unanswered("10.0.0.1", 29400) == "Network is unreachable"
    assert len(calls) > 2 and time.monotonic() - started < 2


def test_torchs_own_rule_is_there_for_machines_without_a_table():
    """The one private torch name this uses (elastic_ddp/agent/rendezvous/torch_internals.py)."""
    from elastic_ddp.agent.rendezvous.torch_internals import matches_machine_hostname

    assert matches_machine_hostname("localhost") is True and matches_machine_hostname("127.0.0.1") is True


_SECOND_AGENT = """
import logging, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from elastic_ddp.agent.rendezvous.c10d.store import create_tcp_store
logging.basicConfig(level=logging.INFO)
conf = dict(item.split("=") for item in sys.argv[2:])
store = create_tcp_store(RendezvousParameters("elastic-c10d", sys.argv[1], "run", 1, 2, read_timeout="5", **conf))
store.set("from-the-second", b"1")
"""


def test_a_second_agent_of_the_machine_joins_the_store_the_first_hosts():
    """As in torch: the endpoint's address is this machine's for both agents (processes), the port
    is taken for the second, which joins as a client; with is_host=1 it stops with one line."""
    host = c10d_store.create_tcp_store(_params("127.0.0.1:0", read_timeout="5"))
    endpoint = f"127.0.0.1:{host.port}"
    second = subprocess.run([sys.executable, "-c", _SECOND_AGENT, endpoint], check=False, capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 0 and "joining it as a client" in second.stderr, second.stderr
    assert host.get("from-the-second") == b"1"
    forced = subprocess.run([sys.executable, "-c", _SECOND_AGENT, endpoint, "is_host=1"], check=False,
                            capture_output=True, text=True, timeout=60)
    last_line = forced.stderr.strip().splitlines()[-1]
    assert forced.returncode != 0 and f"could not host the c10d rendezvous store at --rdzv_endpoint {endpoint}: " \
        in last_line, forced.stderr
