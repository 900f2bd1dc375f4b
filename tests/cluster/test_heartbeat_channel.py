"""Heartbeats beside the rendezvous state (elastic_ddp/agent/rendezvous/heartbeats.py) with etcd-v3,
against a real etcd: the channel itself, then torch's real handlers using it.

What must hold: a heartbeat alone never writes the state (its revision stays put while nodes
train), yet no live node's heartbeat expires; a node that stops beating still expires; and a
value under the heartbeat prefix that is not one of ours is skipped, not trusted.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous import EtcdConnection, EtcdV3Options
from elastic_ddp.agent.rendezvous.etcd_backend import EtcdV3Heartbeats
from elastic_ddp.agent.rendezvous.etcd_handler import create_etcd_v3_handler
from elastic_ddp.agent.rendezvous.heartbeats import MAX_BEAT_BYTES, encode_beat, node_key
from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc
from elastic_ddp.testbed.local_cluster import wait_for
from tests.support.rendezvous import rendezvous_together

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdServer

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def channel(server: EtcdServer, run_id: str) -> EtcdV3Heartbeats:
    params = RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, 1)
    return EtcdV3Heartbeats(EtcdConnection(EtcdV3Options.from_params(params)), run_id)


def handler(server: EtcdServer, run_id: str, max_nodes: str = "3", **conf):
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, int(max_nodes), **conf))


def state_token(each):
    response = each._state_holder._backend.get_state()
    assert response is not None
    return response[1]


def test_published_beats_are_read_back_newest_first_and_garbage_is_skipped(shared_etcd_server, run_id):
    beats = channel(shared_etcd_server, run_id)
    first, second = NodeDesc("10.0.0.1", 11, 0), NodeDesc("host-b", 22, 1)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    beats.publish(first, now - timedelta(seconds=3))
    beats.publish(first, now)
    beats.publish(second, now - timedelta(seconds=1))
    for name, value in [("garbage", b"\xff not json"), ("list", b"[1, 2]"), ("nan", (b'{"addr": "x", "pid": 1, '
                        b'"local_id": 0, "beat": NaN}')), ("huge", b" " * (MAX_BEAT_BYTES + 1) + b"{}"),
                        ("bool-pid", b'{"addr": "x", "pid": true, "local_id": 0, "beat": 1.0}'),
                        ("far", b'{"addr": "x", "pid": 1, "local_id": 0, "beat": 1e300}')]:
        shared_etcd_server.etcdctl("put", beats.prefix + name, value.decode("latin-1"))
    assert beats.read() == {first: now, second: now - timedelta(seconds=1)}
    stored = shared_etcd_server.etcdctl("get", "--print-value-only", beats.prefix + node_key(first)).stdout.strip()
    assert stored.encode() == encode_beat(first, now)


class PageRecordingConnection(EtcdConnection):
    """Records (limit asked, keys answered, more) of every range request its operations send."""

    def __init__(self, options: EtcdV3Options) -> None:
        super().__init__(options)
        self.pages: list[tuple[int, int, bool]] = []

    def call(self, what, operation):
        def recorded(client):
            real_range = client.kvstub.Range

            def recording_range(request, *args, **kwargs):
                answer = real_range(request, *args, **kwargs)
                self.pages.append((request.limit, len(answer.kvs), answer.more))
                return answer

            client.kvstub.Range = recording_range
            try:
                return operation(client)
            finally:
                client.kvstub.Range = real_range

        return super().call(what, recorded)


def test_every_heartbeat_key_is_read_in_pages_of_page_keys(shared_etcd_server, run_id):
    """25 beats and 5 foreign values in pages of 10: every beat is read, no answer holds more
    than 10 keys (etcd3 0.12's get_prefix sends no limit: one answer held all 30)."""
    params = RendezvousParameters("etcd-v3", shared_etcd_server.endpoint, run_id, 1, 1)
    connection = PageRecordingConnection(EtcdV3Options.from_params(params))
    beats = EtcdV3Heartbeats(connection, run_id, page_keys=10)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    nodes = [NodeDesc(f"10.0.0.{index}", 100 + index, 0) for index in range(25)]
    for index, node in enumerate(nodes):
        beats.publish(node, now - timedelta(seconds=index))
        if index % 5 == 0:
            shared_etcd_server.etcdctl("put", beats.prefix + node_key(node) + "-garbage", "not json")
    connection.pages.clear()
    assert beats.read() == {node: now - timedelta(seconds=index) for index, node in enumerate(nodes)}
    assert connection.pages == [(10, 10, True), (10, 10, True), (10, 10, False)]


def test_more_heartbeat_keys_than_one_grpc_message_holds_are_all_read(etcd_server, run_id):
    """7500 nodes with 250-character host names hold 4.8 MB of heartbeats, more than gRPC
    receives in one message (4 MiB): read in one answer, the read failed for the whole
    retry_timeout and raised "no etcd endpoint answered", which ends a torchrun agent."""
    params = RendezvousParameters("etcd-v3", etcd_server.endpoint, run_id, 1, 1, retry_timeout="3")
    connection = EtcdConnection(EtcdV3Options.from_params(params))
    beats = EtcdV3Heartbeats(connection, run_id)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    nodes = [NodeDesc(f"node-{index:05d}." + "x" * 240, 1000 + index, 0) for index in range(7500)]
    for first in range(0, len(nodes), 100):
        batch = nodes[first:first + 100]
        connection.call("write heartbeats", lambda client, batch=batch: client.transaction(
            compare=[], failure=[], success=[client.transactions.put(beats.prefix + node_key(node),
                                                                     encode_beat(node, now)) for node in batch]))
    assert beats.read() == dict.fromkeys(nodes, now)


def test_heartbeats_of_a_formed_round_leave_the_state_alone_and_keep_every_live_node(shared_etcd_server, run_id):
    """Two nodes beat every second with an expiry of 2 s. Over two expiries, the state's
    revision does not move (no heartbeat went through it), both nodes publish on the channel, and
    neither is dropped from the other's view of the round."""
    nodes = [handler(shared_etcd_server, run_id, keep_alive_interval="1", keep_alive_max_attempt="2")
             for _ in range(2)]
    assert [getattr(info, "world_size", info) for info in rendezvous_together(nodes)] == [2, 2]
    token = state_token(nodes[0])
    beats = channel(shared_etcd_server, run_id)
    started = datetime.now(timezone.utc)
    ends = time.monotonic() + 4

    def both_beat_and_time_is_up() -> bool:
        for each in nodes:  # torchrun's monitor loop asks this every 0.1 s while workers train
            assert each.num_nodes_waiting() == 0
            assert len(each._state_holder.state.participants) == 2, "a live node was dropped"
        return time.monotonic() > ends and len([beat for beat in beats.read().values() if beat > started]) == 2

    wait_for(both_beat_and_time_is_up, 20, "4 s of heartbeats by both nodes", interval=0.1)
    assert state_token(nodes[0]) == token, "a heartbeat wrote the rendezvous state"
    for each in nodes:
        each._stop_heartbeats()


def test_a_node_that_stops_beating_still_expires(shared_etcd_server, run_id):
    """Its peer drops it after the expiry (probes off, so only the heartbeat can tell)."""
    nodes = [handler(shared_etcd_server, run_id, keep_alive_interval="1", keep_alive_max_attempt="2",
                     probe_dead_nodes="0") for _ in range(2)]
    assert [getattr(info, "world_size", info) for info in rendezvous_together(nodes)] == [2, 2]
    silent, survivor = nodes
    silent._stop_heartbeats()
    stopped = time.monotonic()
    gone = torch_node(silent)
    wait_for(lambda: survivor.num_nodes_waiting() == 0 and gone not in survivor._state_holder.state.last_heartbeats,
             20, "the silent node's heartbeat to expire", interval=0.1)
    assert time.monotonic() - stopped >= 1.0  # not before it could have expired
    survivor._stop_heartbeats()


def torch_node(each) -> NodeDesc:
    return each._this_node


def test_nodes_waiting_in_a_round_that_forms_for_longer_than_the_expiry_stay_in_it(shared_etcd_server, run_id):
    """A last call of 5 s against an expiry of 2 s: the waiting nodes beat on the channel only,
    and the round completes with all three."""
    nodes = [handler(shared_etcd_server, run_id, keep_alive_interval="1", keep_alive_max_attempt="2",
                     last_call_timeout="5", max_nodes="4") for _ in range(3)]
    started = time.monotonic()
    assert [getattr(info, "world_size", info) for info in rendezvous_together(nodes)] == [3, 3, 3]
    assert time.monotonic() - started >= 4  # the round did form for longer than the expiry
    for each in nodes:
        each._stop_heartbeats()


def test_a_node_busy_in_the_rendezvous_keeps_beating_on_the_channel(shared_etcd_server, run_id):
    """torch stops a node's heartbeat thread while it is in `next_rendezvous`, and leaving a round
    sends no heartbeat: 63 agents leaving at once each waited seconds for a winning write and
    expired meanwhile (docs/benchmarks-history.md). Every sync of our state holder now beats on the
    channel when the last beat is an interval old: here a node whose heartbeat thread is stopped
    only syncs, for two expiries, and its peer keeps it."""
    busy, peer = [handler(shared_etcd_server, run_id, keep_alive_interval="1", keep_alive_max_attempt="2",
                          probe_dead_nodes="0") for _ in range(2)]
    assert [getattr(info, "world_size", info) for info in rendezvous_together([busy, peer])] == [2, 2]
    busy._stop_heartbeats()
    ends = time.monotonic() + 4

    def synced_long_enough() -> bool:
        busy._state_holder.sync()  # what torch's rendezvous loop does while the node waits
        peer.num_nodes_waiting()
        assert torch_node(busy) in peer._state_holder.state.last_heartbeats, "the busy node was dropped"
        return time.monotonic() > ends

    wait_for(synced_long_enough, 20, "4 s of syncs by the busy node", interval=0.1)
    peer._stop_heartbeats()


def test_etcd_agents_read_the_state_less_often_the_more_nodes_it_holds(shared_etcd_server, run_id):
    """With `nodes_per_poll` a read state is reused for 0.1 s per that many nodes: two nodes at one
    node per poll reuse it for 0.2 s, so a node whose monitor loop looks every 0.05 s for a second
    reads it at most 6 times (with 0.1 s it would be 10 or more)."""
    from elastic_ddp.agent.rendezvous.etcd_backend import EtcdV3RendezvousBackend
    from elastic_ddp.agent.rendezvous.etcd_store import EtcdV3Store
    from elastic_ddp.agent.rendezvous.handler import elastic_handler

    class CountingBackend(EtcdV3RendezvousBackend):
        reads = 0

        def get_state(self):
            self.reads += 1
            return super().get_state()

    nodes, backends = [], []
    for _ in range(2):
        params = RendezvousParameters("etcd-v3", shared_etcd_server.endpoint, run_id, 1, 2)
        connection = EtcdConnection(EtcdV3Options.from_params(params))
        backends.append(CountingBackend(connection, run_id))
        nodes.append(elastic_handler(params, EtcdV3Store(connection, run_id), backends[-1],
                                     EtcdV3Heartbeats(connection, run_id), nodes_per_poll=1))
    assert [getattr(info, "world_size", info) for info in rendezvous_together(nodes)] == [2, 2]
    backends[0].reads = 0
    looks = []
    ends = time.monotonic() + 1

    def looked_for_a_second() -> bool:  # torchrun's monitor loop, at the pace of wait_for's interval
        assert nodes[0].num_nodes_waiting() == 0
        looks.append(time.monotonic())
        return looks[-1] > ends

    wait_for(looked_for_a_second, 10, "a second of looks at the waiting nodes", interval=0.05)
    assert len(looks) >= 10 and backends[0].reads <= 6, (len(looks), backends[0].reads)
    for each in nodes:
        each._stop_heartbeats()
