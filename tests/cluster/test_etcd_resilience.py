"""etcd going away and coming back, a cluster losing its leader, auth and TLS: all against real etcd,
through the rendezvous's etcd board and handler (`boards.etcd`) and the agents' store.

torch's agent dies on any exception from the rendezvous backend (it polls num_nodes_waiting()
every monitor interval), so an outage of a few seconds must be invisible to the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous import (
    EtcdAuthenticationError,
    EtcdConnection,
    EtcdTlsError,
    EtcdUnavailableError,
    EtcdV3Options,
    EtcdV3Store,
    create_etcd_v3_handler,
)
from elastic_ddp.agent.rendezvous.boards.etcd import EtcdRoundBoard
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord
from elastic_ddp.testbed.local_cluster import MONITOR_INTERVAL_S, wait_for

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdCluster, EtcdServer

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def params(endpoint: str, run_id: str = "run", **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **conf)


def connect(endpoint: str, **conf: Any) -> EtcdConnection:
    return EtcdConnection(EtcdV3Options.from_params(params(endpoint, **conf)))


NODE = NodeDesc("127.0.0.1", 1, 0)


def round_board(connection: EtcdConnection) -> EtcdRoundBoard:
    settings = RendezvousSettings("run", 1, 1, join_timeout=30, last_call_timeout=1, keep_alive_interval=1,
                             keep_alive_max_attempt=5)
    return EtcdRoundBoard(connection, EtcdV3Store(connection, "run"), "run", settings)


class Traffic:
    """Rendezvous-like load in a thread: a round closed (the record's compare-and-set), a store add,
    and a look at the board, with the slowest call timed."""

    def __init__(self, connection: EtcdConnection) -> None:
        self.board = round_board(connection)
        self.store = self.board.store
        self.rounds = 0
        self.slowest_call_s = 0.0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:  # noqa: PYI034 (Self needs Python 3.11)
        self._thread.start()
        wait_for(lambda: self.rounds >= 3 or bool(self.errors), 20, "traffic to flow")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        token = 0
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                record = RoundRecord(self.rounds, (NODE,))
                # A close whose answer was lost and that was retried reports a lost comparison:
                # the look after it says whether the round is closed, as for a closer.
                self.board.close_round(record, token)
                assert self.store.add("rounds", 1) == self.rounds + 1
                view = self.board.view(self.rounds + 1)
                assert view.record == record, view
                token = view.token
                self.slowest_call_s = max(self.slowest_call_s, time.monotonic() - started)
                self.rounds += 1
                self._stop.wait(0.05)  # paced like an agent's store traffic; ends at once on exit
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not lost in the thread
            self.errors.append(exc)

    def assert_flows_again(self, after: int) -> None:
        wait_for(lambda: self.rounds >= after + 5 or bool(self.errors), 30, "traffic to resume")
        assert not self.errors, self.errors


def test_operations_ride_out_an_etcd_restart(etcd_server: EtcdServer) -> None:
    with Traffic(connect(etcd_server.endpoint)) as traffic:
        etcd_server.restart(down_for=3.0)
        traffic.assert_flows_again(after=traffic.rounds)
    assert traffic.slowest_call_s >= 2.5, "the outage was never felt: did etcd really go down?"


def test_a_handler_polled_like_the_agent_does_survives_an_etcd_restart(etcd_server: EtcdServer) -> None:
    handler = create_etcd_v3_handler(params(etcd_server.endpoint, local_addr="127.0.0.1", last_call_timeout="1",
                                                  keep_alive_interval="1", keep_alive_max_attempt="5"))
    assert handler.next_rendezvous().world_size == 1
    outage = threading.Thread(target=etcd_server.restart, kwargs={"down_for": 3.0})
    outage.start()
    polls_after_the_outage = 0
    deadline = time.monotonic() + 60
    # The agent's monitor loop, through the whole outage and a few polls after: any exception here
    # kills a real agent.
    while polls_after_the_outage < 3:
        assert time.monotonic() < deadline, "etcd did not come back within 60 s"
        assert handler.num_nodes_waiting() == 0
        polls_after_the_outage += 0 if outage.is_alive() else 1
        outage.join(timeout=MONITOR_INTERVAL_S)  # paced like the agent's --monitor_interval
    assert not handler.is_closed()
    assert handler.shutdown()


def test_a_cluster_keeps_working_when_the_leader_dies(etcd_cluster: EtcdCluster) -> None:
    leader = etcd_cluster.leader()
    # The leader first in the list: the connection starts on it and must fail over.
    ordered = [leader] + [m for m in etcd_cluster.members if m is not leader]
    with Traffic(connect(",".join(m.endpoint for m in ordered))) as traffic:
        leader.stop()
        new_leader = etcd_cluster.leader()
        traffic.assert_flows_again(after=traffic.rounds)
    assert new_leader is not leader
    # A write sent to the dying leader hangs until read_timeout (2 s), then goes to the new one.
    assert traffic.slowest_call_s < 6, f"losing the leader stalled a call for {traffic.slowest_call_s:.1f} s"


def test_a_dead_first_endpoint_costs_one_quick_failover(etcd_cluster: EtcdCluster) -> None:
    leader = etcd_cluster.leader()
    down = next(m for m in etcd_cluster.members if m is not leader)  # no election: only the failover
    down.stop()
    ordered = [down] + [m for m in etcd_cluster.members if m is not down]
    board = round_board(connect(",".join(m.endpoint for m in ordered), retry_timeout="10"))
    started = time.monotonic()
    assert board.close_round(RoundRecord(0, (NODE,)), 0)
    assert time.monotonic() - started < 3
    started = time.monotonic()
    assert board.view(1).record is not None
    assert time.monotonic() - started < 1, "the connection went back to the dead endpoint"


def test_wrong_password_says_authentication_failed(auth_etcd_server: EtcdServer, tmp_path: Path) -> None:
    (tmp_path / "password").write_text("battery staple\n")
    started = time.monotonic()
    with pytest.raises(EtcdAuthenticationError) as raised:
        create_etcd_v3_handler(params(auth_etcd_server.endpoint, user="root",
                                            password_file=str(tmp_path / "password")))
    assert time.monotonic() - started < 5, "a wrong password is not worth retrying"
    message = str(raised.value)
    assert "authentication failed for user 'root'" in message and auth_etcd_server.endpoint in message
    assert "battery" not in message


def test_no_credentials_on_an_auth_etcd_server_says_so(auth_etcd_server: EtcdServer) -> None:
    with pytest.raises(EtcdAuthenticationError, match="requires authentication: set rdzv_conf user="):
        create_etcd_v3_handler(params(auth_etcd_server.endpoint))


def test_a_user_without_permission_on_the_prefix_is_told_what_to_grant(auth_etcd_server: EtcdServer,
                                                                       tmp_path: Path) -> None:
    auth_etcd_server.etcdctl("user", "add", "bob:builder")
    (tmp_path / "password").write_text("builder")
    with pytest.raises(EtcdAuthenticationError, match=r"user 'bob' may not .* grant its role readwrite on the key "
                                                      r"prefix /elastic_ddp/rendezvous/"):
        create_etcd_v3_handler(params(auth_etcd_server.endpoint, user="bob",
                                            password_file=str(tmp_path / "password")))


def test_right_password_works_and_logs_in_again_when_etcd_forgets_the_token(
        auth_etcd_server: EtcdServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "password").write_text(f"{auth_etcd_server.auth_password}\n")
    connection = connect(auth_etcd_server.endpoint, user="root", password_file=str(tmp_path / "password"))
    # 20 s, not the default: a key that never shows up fails the test naming it (seen once: a
    # multi_get after the restart that waited out the test's timeout, not diagnosed).
    store = EtcdV3Store(connection, "run", timeout=timedelta(seconds=20))
    store.set("before", "1")
    expired_at = time.monotonic() + 2.5  # the token's 1 s TTL is long gone by then
    wait_for(lambda: time.monotonic() >= expired_at, 5, "the auth token to expire")
    with caplog.at_level(logging.WARNING):
        store.set("after", "2")
    assert "invalid auth token" in caplog.text, "the token did not expire: the test proves nothing"
    auth_etcd_server.restart(down_for=1.0)
    store.set("after restart", "3")
    assert store.multi_get(["before", "after", "after restart"]) == [b"1", b"2", b"3"]


def _rendezvous_round_trip(handler_params: RendezvousParameters) -> None:
    handler = create_etcd_v3_handler(handler_params)
    assert handler.next_rendezvous().rank == 0
    assert handler.shutdown()


def test_tls_with_the_right_ca_works(tls_etcd_server: EtcdServer) -> None:
    assert tls_etcd_server.tls is not None
    _rendezvous_round_trip(params(tls_etcd_server.endpoint, protocol="https", ca_cert=str(tls_etcd_server.tls.ca_cert),
                                  local_addr="127.0.0.1", last_call_timeout="1"))


def test_tls_with_another_ca_is_refused_clearly(tls_etcd_server: EtcdServer) -> None:
    assert tls_etcd_server.tls is not None
    started = time.monotonic()
    with pytest.raises(EtcdTlsError) as raised:
        create_etcd_v3_handler(params(tls_etcd_server.endpoint, protocol="https",
                                            ca_cert=str(tls_etcd_server.tls.other_ca_cert)))
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert f"TLS handshake with etcd at {tls_etcd_server.endpoint} failed" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message and str(tls_etcd_server.tls.other_ca_cert) in message


def test_plain_client_against_tls_etcd_server_hints_at_https(tls_etcd_server: EtcdServer) -> None:
    with pytest.raises(EtcdUnavailableError, match="if etcd serves TLS, set rdzv_conf protocol=https and ca_cert"):
        create_etcd_v3_handler(params(tls_etcd_server.endpoint, retry_timeout="1"))
