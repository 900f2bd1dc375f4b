"""The rendezvous's node lease and reads on etcd (`boards.etcd.EtcdRoundBoard`,
`etcd.connection.keep_alive`).

etcd's Lease and KV services are served here by an in-process gRPC server (`_Etcd`: leases, and
transactions of puts, deletes and range reads of a key or a prefix with a revision comparison; no
subprocess), so the tests can count the keep-alive streams the client opens, hold a keep-alive
answer back, say that a lease expired, end a stream, or count the record values it sends. The client under test is
the real one (etcd3's stubs over a real gRPC channel, `EtcdConnection`'s retries). The rest of the
board against a real etcd: tests/cluster/test_rendezvous_handler.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent import futures
from datetime import timedelta
from types import SimpleNamespace

import grpc
import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.boards.etcd import EtcdRoundBoard
from elastic_ddp.agent.rendezvous.etcd.client import etcdrpc
from elastic_ddp.agent.rendezvous.etcd.connection import EtcdConnection
from elastic_ddp.agent.rendezvous.etcd.options import EtcdV3Options
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord
from elastic_ddp.testbed.local_cluster import wait_for

pytestmark = pytest.mark.timeout(60)

KeyValue = etcdrpc.kv_pb2.KeyValue  # etcd's mvccpb.KeyValue

NODE = NodeDesc("127.0.0.1", 4242, 0)


class _Etcd(etcdrpc.LeaseServicer, etcdrpc.KVServicer):
    """etcd's lease grant, keep-alive, revoke and transactions of puts; see the module docstring."""

    def __init__(self) -> None:
        self.leases: set[int] = set()
        self.ids = itertools.count(100)
        self.streams = 0  # keep-alive streams opened
        self.asked = 0  # keep-alive requests received
        self.keep_alives = 0  # keep-alive requests answered
        self.puts: list[tuple[str, int]] = []  # (key, lease)
        self.kvs: dict[bytes, KeyValue] = {}
        self.revision = 1
        self.values_sent: list[bytes] = []  # keys whose value a range read returned
        self.answer_keep_alives = threading.Event()  # cleared: keep-alive answers are held back
        self.answer_keep_alives.set()
        self.end_next_stream = False
        self.lock = threading.Lock()

    def LeaseGrant(self, request, context):
        with self.lock:
            lease = next(self.ids)
            self.leases.add(lease)
        return etcdrpc.LeaseGrantResponse(ID=lease, TTL=request.TTL)

    def LeaseRevoke(self, request, context):
        with self.lock:
            self.leases.discard(request.ID)
        return etcdrpc.LeaseRevokeResponse()

    def LeaseKeepAlive(self, request_iterator, context):
        with self.lock:
            self.streams += 1
            if self.end_next_stream:
                self.end_next_stream = False
                context.abort(grpc.StatusCode.UNAVAILABLE, "etcd went away")
        for request in request_iterator:
            with self.lock:
                self.asked += 1
            self.answer_keep_alives.wait()
            with self.lock:
                self.keep_alives += 1
                alive = request.ID in self.leases
            yield etcdrpc.LeaseKeepAliveResponse(ID=request.ID, TTL=5 if alive else 0)

    def Txn(self, request, context):
        with self.lock:
            succeeded = all(self._mod(c.key) == c.mod_revision for c in request.compare)  # MOD EQUAL only
            ops = request.success if succeeded else request.failure
            for op in ops:
                if op.request_put.lease and op.request_put.lease not in self.leases:
                    context.abort(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
            self.revision += any(op.HasField("request_put") or op.HasField("request_delete_range") for op in ops)
            return etcdrpc.TxnResponse(succeeded=succeeded, responses=[self._do(op) for op in ops])

    def _mod(self, key: bytes) -> int:
        return self.kvs[key].mod_revision if key in self.kvs else 0

    def _do(self, op):
        if op.HasField("request_put"):
            put = op.request_put
            self.puts.append((put.key.decode(), put.lease))
            created = self.kvs[put.key].create_revision if put.key in self.kvs else self.revision
            self.kvs[put.key] = KeyValue(key=put.key, value=put.value, lease=put.lease,
                                                 mod_revision=self.revision, create_revision=created)
            return etcdrpc.ResponseOp(response_put=etcdrpc.PutResponse())
        if op.HasField("request_delete_range"):
            self.kvs.pop(op.request_delete_range.key, None)
            return etcdrpc.ResponseOp(response_delete_range=etcdrpc.DeleteRangeResponse())
        read = op.request_range
        found = sorted((kv for key, kv in self.kvs.items()
                        if key == read.key or (read.range_end and read.key <= key < read.range_end)),
                       key=lambda kv: kv.create_revision)
        shown = found[:read.limit] if read.limit else found
        kvs = [KeyValue(key=kv.key, mod_revision=kv.mod_revision, create_revision=kv.create_revision,
                                value=b"" if read.keys_only else kv.value) for kv in shown]
        self.values_sent += [kv.key for kv in kvs if kv.value]
        return etcdrpc.ResponseOp(response_range=etcdrpc.RangeResponse(kvs=kvs, count=len(found)))


@pytest.fixture
def etcd():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    fake = _Etcd()
    etcdrpc.add_LeaseServicer_to_server(fake, server)
    etcdrpc.add_KVServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    fake.port = port
    yield fake
    fake.answer_keep_alives.set()
    server.stop(grace=None)


@pytest.fixture
def make_board(etcd):
    made: list[EtcdRoundBoard] = []

    def make(keep_alive_interval: float) -> EtcdRoundBoard:
        connection = EtcdConnection(EtcdV3Options(endpoints=(("127.0.0.1", etcd.port),), read_timeout=20.0,
                                                  retry_timeout=30.0))
        settings = RendezvousSettings(run_id="run", min_nodes=1, max_nodes=2, join_timeout=30.0, last_call_timeout=1.0,
                                 keep_alive_interval=keep_alive_interval, keep_alive_max_attempt=5)
        made.append(EtcdRoundBoard(connection, store=None, run_id="run", settings=settings))
        made[-1].start(NODE, port=None)
        return made[-1]

    yield make
    etcd.answer_keep_alives.set()
    for board in made:
        board.leave()
        board._connection.close()


@pytest.fixture
def board(make_board):
    return make_board(keep_alive_interval=1000.0)  # the tests refresh by hand, the lease-refresh thread never does


def test_lease_refreshes_share_one_long_lived_keep_alive_stream(etcd, board) -> None:
    """etcd3's refresh_lease opened a stream per refresh, and grpc-python a thread for each."""
    for _ in range(20):
        board._refresh()
    assert etcd.keep_alives == 20
    assert etcd.streams == 1


def test_a_refresh_waiting_for_etcd_does_not_hold_up_an_arrival(etcd, make_board) -> None:
    """The lease-refresh thread used to hold the board's lock while it retried (up to retry_timeout, 30 s)."""
    etcd.answer_keep_alives.clear()
    board = make_board(keep_alive_interval=0.05)
    wait_for(lambda: etcd.asked == 1, 10, "the lease-refresh thread to ask etcd")
    arrival = threading.Thread(target=board.arrive, args=(0, NODE), daemon=True)
    arrival.start()
    arrival.join(timeout=10)  # the refresh's answer is held back for as long as the arrival takes
    assert not arrival.is_alive(), "the arrival waited for the lease refresh"
    assert etcd.keep_alives == 0  # the refresh still waits
    assert (board._base + "arrivals/0/127.0.0.1_4242_0", board._lease) in etcd.puts
    etcd.answer_keep_alives.set()
    wait_for(lambda: etcd.keep_alives >= 2, 10, "the refreshes to go on")


def test_a_lease_found_expired_by_a_refresh_is_taken_again_with_the_node_keys(etcd, board) -> None:
    board.arrive(3, NODE)
    expired = board._lease
    etcd.leases.discard(expired)  # as etcd does when the refreshes stopped for the whole TTL
    board._refresh()
    assert board._lease not in (None, expired)
    rewritten = {key.rsplit("/rdzv/", 1)[1] for key, lease in etcd.puts if lease == board._lease}
    assert rewritten == {"alive/127.0.0.1_4242_0", "arrivals/3/127.0.0.1_4242_0"}


def test_a_keep_alive_stream_that_etcd_ended_is_opened_again(etcd, board) -> None:
    board._refresh()
    board._connection.close()  # the stream with it; the next refresh meets a stream etcd ends at once
    etcd.end_next_stream = True
    board._refresh()
    assert etcd.streams == 3 and etcd.keep_alives == 2
    assert board.counts["refreshes"] == 2


def test_a_view_sends_the_round_record_only_when_it_changed(etcd, board) -> None:
    """The record holds every member (about 80 bytes each): read at every 0.1 s look, each waiting
    node's reads grew with the number of nodes."""
    board.arrive(0, NODE)
    assert board.view(0).record is None
    record = RoundRecord(0, (NODE,), ())
    assert board.close_round(record, token=0)
    key = (board._base + "record").encode()
    looks = [board.view(1) for _ in range(10)]
    assert all(look.record == record and look.token == looks[0].token > 0 for look in looks)
    assert etcd.values_sent.count(key) == 1
    newer = RoundRecord(1, (NODE, NodeDesc("127.0.0.1", 4343, 0)), ())
    assert board.close_round(newer, token=looks[0].token)
    assert board.view(2).record == newer and board.view(2).record == newer
    assert etcd.values_sent.count(key) == 2
    etcd.kvs.pop(key)  # its lease expired
    assert board.view(2).record is None and board.view(2).token == 0


def test_the_agents_store_of_the_rendezvous_looks_at_least_every_50_ms(etcd, monkeypatch) -> None:
    """Members read rank 0's address from the store when they see a new round, often before rank 0
    wrote it; at the store's 250 ms back-off they saw it up to 250 ms late (64 agents)."""
    from elastic_ddp.agent.rendezvous.boards import etcd as etcd_board
    from elastic_ddp.agent.rendezvous.etcd import store as etcd_store

    monkeypatch.setattr(etcd_board.EtcdRoundBoard, "view", lambda self, round_number: None)  # no Range here
    handler = etcd_board.create_etcd_v3_handler(RendezvousParameters(
        "etcd-v3", f"127.0.0.1:{etcd.port}", "run", 1, 2, local_addr="127.0.0.1"))
    pauses: list[float] = []
    monkeypatch.setattr(etcd_store, "time", SimpleNamespace(monotonic=time.monotonic, sleep=pauses.append))
    looks = iter([None] * 12 + [b"127.0.0.1"])
    try:
        store = handler._board.store.clone()  # what torch's PrefixStore may use
        assert store._poll("get", timedelta(seconds=60), lambda: next(looks), str) == b"127.0.0.1"
    finally:
        handler._witness.close()
        handler._board._connection.close()
    assert len(pauses) == 12 and max(pauses) == 0.05 and pauses[0] == 0.01
