"""The rendezvous's board in etcd (`boards.etcd.EtcdRoundBoard`) against a real etcd: where a
run's keys live, the record's lifetime on the run lease, and an etcd that cannot be reached. (The
contract every board keeps, closing writes included: tests/cluster/test_board_contract.py; the
rounds themselves: tests/cluster/test_rendezvous_handler.py.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_ddp.agent.rendezvous import (
    EtcdConnection,
    EtcdUnavailableError,
    EtcdV3Options,
    EtcdV3Store,
    create_etcd_v3_handler,
)
from elastic_ddp.agent.rendezvous.boards.etcd import EtcdRoundBoard
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord, decode_record
from elastic_ddp.testbed.local_cluster import free_port, wait_for

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdServer

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

A = NodeDesc("127.0.0.1", 1, 0)


def connect(endpoint: str, run_id: str = "run", **conf: Any) -> EtcdConnection:
    params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **conf)
    return EtcdConnection(EtcdV3Options.from_params(params))


def board(connection: EtcdConnection, run_id: str) -> EtcdRoundBoard:
    settings = RendezvousSettings(run_id, 1, 2, join_timeout=30, last_call_timeout=0.5, keep_alive_interval=0.5,
                             keep_alive_max_attempt=4)
    return EtcdRoundBoard(connection, EtcdV3Store(connection, run_id), run_id, settings)


def test_an_empty_run_id_is_refused_before_anything_is_written(shared_etcd_server: EtcdServer) -> None:
    with pytest.raises(ValueError, match="run id"):
        create_etcd_v3_handler(RendezvousParameters("etcd-v3", shared_etcd_server.endpoint, "", 1, 1))


def test_the_round_record_is_per_run_under_key_prefix(shared_etcd_server: EtcdServer, run_id: str) -> None:
    prefix = f"/{run_id}/jobs"
    connection = connect(shared_etcd_server.endpoint, key_prefix=prefix + "/")
    first, second = board(connection, "a"), board(connection, "b")
    assert first.close_round(RoundRecord(0, (A,)), 0)
    assert second.view(1).record is None
    stored = shared_etcd_server.etcdctl("get", "--print-value-only", f"{prefix}/a/rdzv/record").stdout.strip()
    assert decode_record(stored.encode()) == RoundRecord(0, (A,))  # plain JSON, readable with etcdctl


@pytest.mark.timeout(30)
def test_an_abandoned_record_expires_after_ttl(shared_etcd_server: EtcdServer, run_id: str) -> None:
    connection = connect(shared_etcd_server.endpoint, ttl="2")
    board(connection, run_id).close_round(RoundRecord(0, (A,)), 0)
    connection.close()  # the closer's process ends: its run lease is no longer refreshed
    reader = board(connect(shared_etcd_server.endpoint), run_id)
    assert reader.view(1).record is not None
    started = time.monotonic()
    wait_for(lambda: reader.view(1).record is None, 15, "the record to expire with its lease")
    assert time.monotonic() - started < 10


@pytest.mark.timeout(30)
def test_a_live_node_keeps_the_record_past_the_ttl(shared_etcd_server: EtcdServer, run_id: str) -> None:
    """The node lease's refresh thread keeps this process's run lease, the record's, alive too."""
    live = board(connect(shared_etcd_server.endpoint, ttl="2"), run_id)
    live.start(A, None)
    try:
        assert live.close_round(RoundRecord(0, (A,)), 0)
        reader = board(connect(shared_etcd_server.endpoint), run_id)
        kept_until = time.monotonic() + 5  # well past the 2 s TTL

        def kept_past_the_ttl() -> bool:  # looked at as a waiting node looks, until then
            assert reader.view(1).record == RoundRecord(0, (A,)), "a live node's process lost its record"
            return time.monotonic() >= kept_until

        wait_for(kept_past_the_ttl, 10, "5 s past the record's write")
    finally:
        live.leave()


@pytest.mark.timeout(20)
def test_unreachable_etcd_raises_connection_error_after_retry_budget() -> None:
    dead = f"127.0.0.1:{free_port()}"
    unreachable = board(connect(dead, retry_timeout="1.5"), "run")
    for operation in (lambda: unreachable.view(0), lambda: unreachable.close_round(RoundRecord(0, (A,)), 0)):
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as raised:
            operation()
        assert 1.5 <= time.monotonic() - started < 5
        assert isinstance(raised.value, EtcdUnavailableError)
        assert dead in str(raised.value) and "retry_timeout=1.5s" in str(raised.value)
