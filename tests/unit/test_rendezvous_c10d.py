"""The rendezvous in a real TCPStore (`boards.c10d`): handlers of one process, one store.

Each handler has a store client of its own, as each agent has; threads stand in for the agents.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)

from elastic_ddp.agent.rendezvous.boards.c10d import StoreRoundBoard, create_elastic_c10d_handler
from elastic_ddp.agent.rendezvous.c10d import store as c10d_store
from elastic_ddp.agent.rendezvous.c10d.watch import StoreWatch
from elastic_ddp.agent.rendezvous.handler import RoundRendezvousHandler
from elastic_ddp.agent.rendezvous.plugin import elastic_c10d_handler_factory, etcd_v3_handler_factory
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord
from elastic_ddp.testbed.local_cluster import wait_for
from tests.support.rendezvous import Background, ranks_by_node

pytestmark = pytest.mark.timeout(60)

A, B, C = (NodeDesc(f"host{i}", 100 + i, 0) for i in range(3))


MADE: list[RoundRendezvousHandler] = []


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=20))
    yield store
    while MADE:  # their heartbeat threads stop before the store does
        MADE.pop()._board.leave()


def settings(min_nodes: int = 2, max_nodes: int = 2, expiry_beats: int = 5) -> RendezvousSettings:
    return RendezvousSettings("run", min_nodes, max_nodes, join_timeout=30, last_call_timeout=0.3,
                         keep_alive_interval=0.2, keep_alive_max_attempt=expiry_beats, probe_dead_nodes=False)


def handler(server: TCPStore, node: NodeDesc, chosen: RendezvousSettings,
            witness: ExitWitness | None = None) -> RoundRendezvousHandler:
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))
    MADE.append(RoundRendezvousHandler(StoreRoundBoard(client, "run", chosen), node, chosen, witness, poll_s=0.02))
    return MADE[-1]


def test_a_round_ranks_by_node_name_keeps_a_spare_and_takes_it_when_a_member_leaves(server) -> None:
    chosen = settings(max_nodes=2)
    a, b, c = (handler(server, node, chosen) for node in (C, A, B))  # C arrives first: ranks ignore arrival order
    first = ranks_by_node([a, b])
    assert first == {C: (1, 2), A: (0, 2)}
    spare = threading.Thread(target=lambda: ranks_by_node([c]), daemon=True)
    spare.start()
    board = c._board
    while board._slots.get(1) is None:  # the spare has arrived at the next round
        threading.Event().wait(0.01)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0  # a full world is not restarted for a spare
    a._board.leave()  # A is gone (its heartbeat key removed); shutdown would close the run for everyone
    second = ranks_by_node([b])  # B restarts its workers; A left: B and the spare C form round 1
    spare.join(timeout=30)
    assert second == {A: (0, 2)}
    assert board._latest == RoundRecord(1, (A, B))


def test_joining_is_one_add_and_one_set_and_one_node_closes(server) -> None:
    chosen = settings(max_nodes=3)
    handlers = [handler(server, node, chosen) for node in (A, B, C)]
    results = ranks_by_node(handlers)
    assert sorted(results.values()) == [(0, 3), (1, 3), (2, 3)]
    closes = [h._board.counts["closes"] for h in handlers]
    assert sum(closes) >= 1 and sum(h._board.counts["lost_closes"] for h in handlers) == sum(closes) - 1
    for h in handlers:  # the first heartbeat, the arrival's add and set, and the winning closer's hint
        assert h._board.counts["writes"] - (1 if h._board.counts["closes"] - h._board.counts["lost_closes"] else 0) \
            == 3


def test_an_arrival_whose_heartbeats_stop_is_left_out_and_the_next_one_closes(server) -> None:
    chosen = settings(min_nodes=2, max_nodes=3, expiry_beats=2)
    frozen, b, c = (handler(server, node, chosen) for node in (A, B, C))
    frozen._board.start(A, None)
    frozen._board.arrive(0, A)  # the earliest arrival, the closer, then silent (frozen)
    frozen._board._stop.set()
    results = ranks_by_node([b, c])
    assert results == {B: (0, 2), C: (1, 2)}


def test_a_member_whose_beacon_refuses_is_left_out_long_before_its_heartbeat_expires(server) -> None:
    chosen = dataclasses.replace(settings(min_nodes=1, max_nodes=3, expiry_beats=1000), join_timeout=20)
    here, gone = NodeDesc("127.0.0.1", 1, 0), NodeDesc("127.0.0.1", 2, 0)
    survivor, killed = (handler(server, node, chosen, ExitWitness()) for node in (here, gone))
    assert ranks_by_node([survivor, killed]) == {here: (0, 2), gone: (1, 2)}
    wait_for(lambda: survivor._witness._reached, 20, "the survivor reaching the other's beacon")
    killed._board._stop.set()  # "killed": no more heartbeats (the last one stays fresh for 200 s) ...
    killed._witness.close()  # ... and its beacon refuses
    assert ranks_by_node([survivor]) == {here: (0, 1)}  # else RendezvousTimeoutError after join_timeout


def test_the_handler_takes_rdzv_conf_values_and_the_shipped_defaults_for_the_rest(server) -> None:
    params = RendezvousParameters("elastic-c10d", f"127.0.0.1:{server.port}", "conf", 1, 4, local_addr="127.0.0.1",
                                  last_call_timeout="2", is_host="0")
    made = create_elastic_c10d_handler(params)
    MADE.append(made)
    assert (made.settings.last_call_timeout, made.settings.keep_alive_interval, made.settings.lease_ttl,
            made.settings.join_timeout) == (2, 1, 5, 300)
    assert made.get_backend() == "elastic-c10d" and made.get_run_id() == "conf" and not made.use_agent_store
    assert server.check(["rdzv/conf/closed"])  # it reached the store


def test_a_store_that_stops_answering_while_peers_answer_stops_the_node_with_one_line(server, monkeypatch) -> None:
    class FrozenChecks:  # a request that never comes back, as on a connection whose packets vanish
        def __init__(self, store: TCPStore) -> None:
            self._store, self.release = store, threading.Event()

        def __getattr__(self, name: str):
            return getattr(self._store, name)

        def check(self, keys):
            self.release.wait()
            return False

    monkeypatch.setattr(c10d_store, "unanswered", lambda host, port: "no answer within 2 s")
    watch = StoreWatch("127.0.0.1", server.port, silence_s=0.05)
    watch.peers_answer = lambda: True
    store = FrozenChecks(TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20)))
    board = StoreRoundBoard(store, "run", settings(), watch)
    with pytest.raises(RendezvousConnectionError, match=f"--rdzv_endpoint=127.0.0.1:{server.port}"):
        board.view(0)
    store.release.set()


def test_set_closed_ends_a_waiting_node_and_every_later_round(server) -> None:
    chosen = settings(min_nodes=2, max_nodes=2)
    a, b = handler(server, A, chosen), handler(server, B, chosen)
    results: dict = {}
    waiting = threading.Thread(target=lambda: results.update(ranks_by_node([a])), daemon=True)
    waiting.start()
    while a._board._slots.get(0) is None:
        threading.Event().wait(0.01)
    b.set_closed()
    waiting.join(timeout=30)
    assert isinstance(results[A], RendezvousClosedError) and a.is_closed()
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_a_record_that_is_not_our_json_is_refused_never_unpickled(server) -> None:
    server.set("rdzv/run/round/0", pickle.dumps(RoundRecord(0, (A,))))
    with pytest.raises(RendezvousStateError, match="rdzv/run/round/0 is not valid"):
        handler(server, A, settings()).next_rendezvous()
    server.set("rdzv/run/latest", b"__import__('os')")
    with pytest.raises(RendezvousStateError, match="rdzv/run/latest holds .* not a whole number"):
        handler(server, B, settings()).next_rendezvous()


def test_elastic_c10d_takes_the_one_algorithm_by_default_and_names_a_bad_key_before_connecting() -> None:
    create = elastic_c10d_handler_factory()
    for conf in ({}, {"algorithm": "keyed"}):
        with pytest.raises(ValueError, match="--rdzv_conf keep_alive_interval: got 'soon'"):
            create(RendezvousParameters("elastic-c10d", "127.0.0.1:1", "run", 1, 4, keep_alive_interval="soon", **conf))


@pytest.mark.parametrize("backend", ["elastic-c10d", "etcd-v3"])
def test_the_removed_dynamic_algorithm_is_refused_before_anything_else(monkeypatch, backend) -> None:
    """Before any other key is read, anything connects (nothing listens at port 1) or the agent's
    environment changes; the line says to use the default, and where torch's own algorithm is."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    create = elastic_c10d_handler_factory() if backend == "elastic-c10d" else etcd_v3_handler_factory()
    with pytest.raises(ValueError, match=r"^--rdzv_conf algorithm: got 'dynamic', which was removed in this version "
                                         r"of elastic_ddp; expected keyed .*--rdzv_backend=c10d"):
        create(RendezvousParameters(backend, "127.0.0.1:1", "run", 1, 4, algorithm="dynamic", close_timeout="10",
                                    warm_workers="maybe"))
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ


@pytest.mark.parametrize("backend", ["elastic-c10d", "etcd-v3"])
@pytest.mark.parametrize(("key", "value", "reason"), [
    ("close_timeout", "10", "closing a round or the rendezvous is one write"),
    ("heartbeat_timeout", "5", "lease ends"),
    ("extend_last_call", "0", "every arrival restarts the last call"),
    ("extend_last_call", "maybe", "every arrival restarts the last call"),
    ("prompt_completion", "maybe", None),
])
def test_both_boards_check_the_same_keys_and_refuse_those_they_would_ignore(monkeypatch, backend, key, value,
                                                                                  reason) -> None:
    """One set-up for both boards (agent_setup): a key read by neither is refused by both, before
    anything connects (nothing listens at port 1) and before the agent's environment changes."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    create = elastic_c10d_handler_factory() if backend == "elastic-c10d" else etcd_v3_handler_factory()
    expected = (f"--rdzv_conf {key}: got '{value}', which the rendezvous of {backend} does not read: "
                f".*{reason}.*remove the key"
                if reason else f"--rdzv_conf {key}: got '{value}'; expected 1 or 0")
    with pytest.raises(ValueError, match=expected):
        create(RendezvousParameters(backend, "127.0.0.1:1", "run", 1, 4, **{key: value}))
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ


@pytest.mark.parametrize("backend", ["elastic-c10d", "etcd-v3"])
def test_a_key_neither_the_rendezvous_nor_the_board_reads_is_refused(monkeypatch, backend) -> None:
    """A typo would leave the shipped value in force without a word: both boards refuse it, naming
    it and what they accept; torchrun's own `timeout` and each board's keys are accepted."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    create = elastic_c10d_handler_factory() if backend == "elastic-c10d" else etcd_v3_handler_factory()
    with pytest.raises(ValueError, match=rf"^--rdzv_conf last_call_timout: not a key of {backend} \(elastic_ddp's "
                                         r"rendezvous\); expected one of .*join_timeout.*last_call_timeout"):
        create(RendezvousParameters(backend, "127.0.0.1:1", "run", 1, 4, timeout="900", last_call_timout="1"))
    other_board = {"elastic-c10d": {"protocol": "https"}, "etcd-v3": {"is_host": "1"}}[backend]
    with pytest.raises(ValueError, match=rf"^--rdzv_conf {next(iter(other_board))}: not a key of {backend}"):
        create(RendezvousParameters(backend, "127.0.0.1:1", "run", 1, 4, **other_board))
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ


def test_only_a_node_joining_a_running_job_waits_to_be_ready_before_it_arrives(server) -> None:
    """The first round of a job and a member's next round go straight on; a node that finds a round
    closed without it calls its readiness hook once, before its arrival (plugin.ready_handler)."""
    chosen = settings(min_nodes=2, max_nodes=3)
    readied: list[tuple[NodeDesc, list[NodeDesc]]] = []
    a, b, c = (handler(server, node, chosen) for node in (A, B, C))
    for node, made in ((A, a), (B, b), (C, c)):
        made.before_joining_a_running_job(lambda node=node, made=made: readied.append((node, made._board.arrivals(1))))
    assert ranks_by_node([a, b]) == {A: (0, 2), B: (1, 2)}  # the job's first round
    assert readied == []
    joining = Background(c)
    wait_for(lambda: a.num_nodes_waiting() > 0, 10, "the joiner's arrival, seen by a member")
    assert ranks_by_node([a, b]) == {A: (0, 3), B: (1, 3)}  # the members' next round: no wait
    assert (joining.result().rank, joining.result().world_size) == (2, 3)
    [(node, arrived_before)] = readied
    assert node == C and C not in arrived_before


class ObservedWitness(ExitWitness):
    """No beacon; records the members each round asks it to probe, in the order given."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.observed: list[list[NodeDesc]] = []

    def observe_soon(self, read_ports, members) -> None:
        self.observed.append(list(members))


def test_each_member_probes_the_others_starting_after_itself(server) -> None:
    """In one order for all, every member of a round of 256 connected to the same beacon at once."""
    chosen = settings(min_nodes=3, max_nodes=3)
    witnesses = {node: ObservedWitness() for node in (A, B, C)}
    ranks_by_node([handler(server, node, chosen, witnesses[node]) for node in (C, A, B)])
    assert witnesses[A].observed == [[B, C]]
    assert witnesses[B].observed == [[C, A]]
    assert witnesses[C].observed == [[A, B]]
