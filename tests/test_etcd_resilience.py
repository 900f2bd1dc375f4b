"""etcd going away and coming back, a cluster losing its leader, auth and TLS: all against real etcd.

torch's agent dies on any exception from the rendezvous backend (it polls num_nodes_waiting()
every monitor interval), so an outage of a few seconds must be invisible to the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.local_cluster import wait_for
from elastic_ddp.rendezvous import (
    EtcdAuthenticationError,
    EtcdConnection,
    EtcdTlsError,
    EtcdUnavailableError,
    EtcdV3Options,
    EtcdV3RendezvousBackend,
    EtcdV3Store,
    create_etcd_v3_handler,
)
from tests.etcd_fixtures import (  # noqa: F401 (fixtures)
    EtcdCluster,
    EtcdServer,
    enable_auth,
    etcd_cluster,
    etcd_server,
    make_tls_files,
    single_server,
)

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def params(endpoint: str, run_id: str = "run", **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **conf)


def connect(endpoint: str, **conf: Any) -> EtcdConnection:
    return EtcdConnection(EtcdV3Options.from_params(params(endpoint, **conf)))


class Traffic:
    """Rendezvous-like load in a thread: state CAS, store add and reads, with the slowest call timed."""

    def __init__(self, connection: EtcdConnection) -> None:
        self.backend = EtcdV3RendezvousBackend(connection, "run")
        self.store = EtcdV3Store(connection, "run")
        self.rounds = 0
        self.slowest_call_s = 0.0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        wait_for(lambda: self.rounds >= 3 or bool(self.errors), 20, "traffic to flow")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        token = None
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                result = self.backend.set_state(f"round {self.rounds}".encode(), token)
                assert result is not None
                token = result[1]
                assert self.store.add("rounds", 1) == self.rounds + 1
                assert self.backend.get_state() is not None
                self.slowest_call_s = max(self.slowest_call_s, time.monotonic() - started)
                self.rounds += 1
                time.sleep(0.05)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.errors.append(exc)

    def assert_flows_again(self, after: int) -> None:
        wait_for(lambda: self.rounds >= after + 5 or bool(self.errors), 30, "traffic to resume")
        assert not self.errors, self.errors


def test_operations_ride_out_an_etcd_restart(etcd_server: EtcdServer) -> None:  # noqa: F811
    with Traffic(connect(etcd_server.endpoint)) as traffic:
        etcd_server.restart(down_for=3.0)
        traffic.assert_flows_again(after=traffic.rounds)
    assert traffic.slowest_call_s >= 2.5, "the outage was never felt: did etcd really go down?"


def test_a_handler_polled_like_the_agent_does_survives_an_etcd_restart(etcd_server: EtcdServer) -> None:  # noqa: F811
    handler = create_etcd_v3_handler(params(etcd_server.endpoint, local_addr="127.0.0.1", last_call_timeout="1",
                                            keep_alive_interval="1", keep_alive_max_attempt="5"))
    assert handler.next_rendezvous().world_size == 1
    outage = threading.Thread(target=etcd_server.restart, kwargs={"down_for": 3.0})
    outage.start()
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:  # the agent's monitor loop: any exception here kills it
        assert handler.num_nodes_waiting() == 0
        time.sleep(0.5)
    outage.join(timeout=60)
    assert not handler.is_closed()
    assert handler.shutdown()


def test_a_cluster_keeps_working_when_the_leader_dies(etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    leader = etcd_cluster.leader()
    # The leader first in the list: the connection starts on it and must fail over.
    ordered = [leader] + [m for m in etcd_cluster.members if m is not leader]
    with Traffic(connect(",".join(m.endpoint for m in ordered))) as traffic:
        leader.stop()
        new_leader = etcd_cluster.leader()
        traffic.assert_flows_again(after=traffic.rounds)
    assert new_leader is not leader


def test_operations_continue_when_one_listed_endpoint_is_down_from_the_start(etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    down = etcd_cluster.members[0]
    down.stop()
    connection = connect(etcd_cluster.endpoints, retry_timeout="10")
    backend = EtcdV3RendezvousBackend(connection, "run")
    started = time.monotonic()
    assert backend.set_state(b"x") is not None
    assert time.monotonic() - started < 5


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[EtcdServer]:
    # Auth tokens that expire after 1 s idle: the client must notice and log in again.
    server = single_server(tmp_path, extra_args=("--auth-token-ttl", "1"))
    try:
        enable_auth(server, "correct horse")
        yield server
    finally:
        server.stop()


def test_wrong_password_says_authentication_failed(auth_server: EtcdServer, tmp_path: Path) -> None:
    (tmp_path / "password").write_text("battery staple\n")
    started = time.monotonic()
    with pytest.raises(EtcdAuthenticationError) as raised:
        create_etcd_v3_handler(params(auth_server.endpoint, user="root", password_file=str(tmp_path / "password")))
    assert time.monotonic() - started < 5, "a wrong password is not worth retrying"
    message = str(raised.value)
    assert "authentication failed for user 'root'" in message and auth_server.endpoint in message
    assert "battery" not in message


def test_no_credentials_on_an_auth_server_says_so(auth_server: EtcdServer) -> None:
    with pytest.raises(EtcdAuthenticationError, match="requires authentication: set rdzv_conf user="):
        create_etcd_v3_handler(params(auth_server.endpoint))


def test_right_password_works_and_logs_in_again_when_etcd_forgets_the_token(
        auth_server: EtcdServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "password").write_text("correct horse\n")
    connection = connect(auth_server.endpoint, user="root", password_file=str(tmp_path / "password"))
    store = EtcdV3Store(connection, "run")
    store.set("before", "1")
    expired_at = time.monotonic() + 2.5  # the token's 1 s TTL is long gone by then
    wait_for(lambda: time.monotonic() >= expired_at, 5, "the auth token to expire")
    with caplog.at_level(logging.WARNING):
        store.set("after", "2")
    assert "invalid auth token" in caplog.text, "the token did not expire: the test proves nothing"
    auth_server.restart(down_for=1.0)
    store.set("after restart", "3")
    assert store.multi_get(["before", "after", "after restart"]) == [b"1", b"2", b"3"]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[EtcdServer]:
    tls = make_tls_files(tmp_path / "tls")
    server = EtcdServer(name="tls", data_dir=tmp_path / "tls.data", tls=tls).start()
    try:
        yield server
    finally:
        server.stop()


def _rendezvous_round_trip(handler_params: RendezvousParameters) -> None:
    handler = create_etcd_v3_handler(handler_params)
    assert handler.next_rendezvous().rank == 0
    assert handler.shutdown()


def test_tls_with_the_right_ca_works(tls_server: EtcdServer) -> None:
    assert tls_server.tls is not None
    _rendezvous_round_trip(params(tls_server.endpoint, protocol="https", ca_cert=str(tls_server.tls.ca_cert),
                                  local_addr="127.0.0.1", last_call_timeout="1"))


def test_tls_with_another_ca_is_refused_clearly(tls_server: EtcdServer) -> None:
    assert tls_server.tls is not None
    started = time.monotonic()
    with pytest.raises(EtcdTlsError) as raised:
        create_etcd_v3_handler(params(tls_server.endpoint, protocol="https", ca_cert=str(tls_server.tls.other_ca_cert)))
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert f"TLS handshake with etcd at {tls_server.endpoint} failed" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message and str(tls_server.tls.other_ca_cert) in message


def test_plain_client_against_tls_server_hints_at_https(tls_server: EtcdServer) -> None:
    with pytest.raises(EtcdUnavailableError, match="if etcd serves TLS, set rdzv_conf protocol=https and ca_cert"):
        create_etcd_v3_handler(params(tls_server.endpoint, retry_timeout="1"))
