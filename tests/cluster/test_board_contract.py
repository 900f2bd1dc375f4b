"""The contract of the rendezvous's board (`handler.RoundBoard`), written once and run
against every board on a real server: `EtcdRoundBoard` on an etcd member, `StoreRoundBoard` on a
`torch.distributed.TCPStore` (as torch's `RendezvousBackendTestMixin` runs against each backend).

Each board a test makes is one agent: a connection (a store client) and liveness of its own, on one
run of the server. What the handler relies on is tested here; what one board alone does (etcd's
key prefix, TTL of the round record, retries; the c10d store's slots and hint) stays in
tests/cluster/test_etcd_backend.py, tests/unit/test_rendezvous_etcd_lease.py and tests/unit/test_rendezvous_c10d.py.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/cluster/test_board_contract.py
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.boards.c10d import StoreRoundBoard
from elastic_ddp.agent.rendezvous.boards.etcd import EtcdRoundBoard
from elastic_ddp.agent.rendezvous.etcd.connection import EtcdConnection
from elastic_ddp.agent.rendezvous.etcd.options import EtcdV3Options
from elastic_ddp.agent.rendezvous.etcd.store import EtcdV3Store
from elastic_ddp.agent.rendezvous.handler import BoardView, RoundBoard
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord, node_name
from elastic_ddp.testbed.local_cluster import wait_for

pytestmark = pytest.mark.timeout(30)

A, B, C = (NodeDesc("127.0.0.1", 1000 + index, 0) for index in range(3))
PORT = {A: 40001, B: None, C: 40003}  # beacon ports; None: dead-node probes off

# Short liveness, for the expiry contract: c10d heartbeats expire after 0.25 s x 4; etcd's node
# lease after max(2, that) s (`RendezvousSettings.lease_ttl`).
SETTINGS = RendezvousSettings("contract", 1, 3, join_timeout=30, last_call_timeout=0.5, keep_alive_interval=0.25,
                         keep_alive_max_attempt=4)

MakeBoard = Callable[..., RoundBoard]


def at_once(calls: list[Callable[[], bool]]) -> list[bool | None]:
    """Each call's result, the calls made together in threads of their own (None: it raised)."""
    results: list[bool | None] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(index: int) -> None:
        start.wait(timeout=10)
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads), "a call did not return"
    return results


class BoardContract:
    """The tests of every board. A subclass names its board: `name`, and `make_board`, a fixture that
    yields `make(run_id=<the test's run id>)`, which returns a new board of that run on the test's
    server at each call (another agent), every one of them left at the end."""

    name: str  # the backend name the board reports

    @pytest.fixture
    def make_board(self) -> Iterator[MakeBoard]:
        raise NotImplementedError

    @staticmethod
    def started(make_board: MakeBoard, node: NodeDesc) -> RoundBoard:
        board = make_board()
        board.start(node, PORT[node])
        return board

    @staticmethod
    def close(board: RoundBoard, record: RoundRecord) -> None:
        assert board.close_round(record, board.view(record.round).token), f"round {record.round} was closed already"

    @staticmethod
    def stop_liveness(board: RoundBoard) -> None:
        """Stop `board`'s liveness refreshes without a word to the server, as a SIGKILL does."""
        board._stop.set()  # both boards' refresh thread waits on this event

    def test_names_its_backend_and_shares_the_agents_store_of_its_run(self, make_board) -> None:
        first, second = make_board(), make_board()
        assert first.name == self.name
        first.store.set("rank0", b"127.0.0.1:29500")
        assert second.store.get("rank0") == b"127.0.0.1:29500"

    def test_an_empty_run_has_no_record_no_arrival_and_is_open(self, make_board) -> None:
        board = make_board()
        assert board.view(0) == BoardView(record=None, token=0, closed=False, arrived=0, first=None)
        assert board.arrivals(0) == board.waiting(0) == []
        assert not board.is_closed()

    def test_runs_keep_apart(self, make_board) -> None:
        board, other_run = self.started(make_board, A), make_board(run_id="other")
        board.arrive(0, A)
        self.close(board, RoundRecord(0, (A,)))
        board.set_closed()
        assert other_run.view(0) == BoardView(None, 0, False, 0, None) and not other_run.is_closed()

    def test_arrivals_come_in_arrival_order_and_the_first_is_named(self, make_board) -> None:
        boards = {node: self.started(make_board, node) for node in (C, A, B)}
        for node, board in boards.items():  # C first: not the order of the nodes' names
            board.arrive(0, node)
        observer = make_board()
        view = observer.view(0)
        assert (view.arrived, view.first) == (3, node_name(C))
        assert observer.arrivals(0) == observer.waiting(0) == [C, A, B]
        assert observer.arrivals(1) == [] and observer.view(1).first is None

    def test_arriving_again_at_a_round_keeps_the_node_once_in_its_place(self, make_board) -> None:
        a, b = self.started(make_board, A), self.started(make_board, B)
        a.arrive(0, A)
        b.arrive(0, B)
        a.arrive(0, A)  # as etcd's board does on a new lease after losing the old one
        assert make_board().arrivals(0) == [A, B]

    def test_arriving_at_a_later_round_drops_the_earlier_arrival(self, make_board) -> None:
        a, b = self.started(make_board, A), self.started(make_board, B)
        a.arrive(0, A)
        b.arrive(0, B)
        a.arrive(1, A)  # round 0 closed without A (a spare, or late): A waits for round 1
        observer = make_board()
        assert observer.arrivals(1) == [A]
        assert observer.arrivals(0) == observer.waiting(0) == [B]

    def test_the_view_shows_the_last_closed_round_and_the_token_that_closes_the_next(self, make_board) -> None:
        a, b = self.started(make_board, A), self.started(make_board, B)
        for board, node in ((a, A), (b, B)):
            board.arrive(0, node)
        first = RoundRecord(0, (A, B))
        self.close(a, first)
        assert b.view(1).record == first and b.view(0).record == first
        second = RoundRecord(1, (B,), (A,))
        assert b.close_round(second, b.view(1).token)
        assert a.view(2).record == second == make_board().view(2).record

    def test_of_racing_closers_exactly_one_wins_and_everyone_sees_its_record(self, make_board) -> None:
        racers = [make_board() for _ in range(3)]
        observer = make_board()
        for round_number in range(3):
            closes = [partial(racer.close_round, RoundRecord(round_number, (node,)), racer.view(round_number).token)
                      for racer, node in zip(racers, (A, B, C), strict=True)]
            won = at_once(closes)
            assert sorted(won) == [False, False, True], won
            winner = RoundRecord(round_number, ((A, B, C)[won.index(True)],))
            assert all(board.view(round_number + 1).record == winner for board in [*racers, observer])
        # Both boards count their closing writes for the benchmarks.
        assert sum(racer.counts["closes"] for racer in racers) == 9
        assert sum(racer.counts["lost_closes"] for racer in racers) == 6

    def test_a_close_written_again_changes_nothing(self, make_board) -> None:
        """What a retried request does when the first one landed and its answer was lost (etcd's
        connection retries; etcd.connection, "Limits"): the record stays as first written, and a
        close of another record with the same token still loses. Whether the second call reports
        True (c10d: compare_set finds its own value) or False (etcd: the revision moved) is not
        part of the contract; the handler only logs it."""
        closer, racer = make_board(), make_board()
        token = closer.view(0).token
        record = RoundRecord(0, (A, B))
        assert closer.close_round(record, token)
        closer.close_round(record, token)
        assert not racer.close_round(RoundRecord(0, (C,)), token)
        assert racer.view(1).record == record
        assert racer.close_round(RoundRecord(1, (A,)), racer.view(1).token)  # the next round closes as usual

    def test_alive_holds_the_live_nodes_of_the_last_round_with_their_beacon_ports(self, make_board) -> None:
        boards = {node: self.started(make_board, node) for node in (A, B, C)}
        self.close(boards[A], RoundRecord(0, (A, C), (B,)))  # members and a spare
        observer = make_board()
        observer.view(1)  # the handler looks first (c10d's alive() knows only the rounds its view saw)
        assert observer.alive() == {A: PORT[A], B: PORT[B], C: PORT[C]}

    def test_starting_twice_is_starting_once(self, make_board) -> None:
        board = self.started(make_board, A)
        board.start(A, PORT[A])
        self.close(board, RoundRecord(0, (A,)))
        board.arrive(1, A)
        observer = make_board()
        observer.view(1)
        assert observer.alive() == {A: PORT[A]} and observer.arrivals(1) == [A]

    def test_a_node_that_leaves_is_gone_at_once_and_the_next_arrival_is_first(self, make_board) -> None:
        a, b = self.started(make_board, A), self.started(make_board, B)
        self.close(a, RoundRecord(0, (A, B)))
        a.arrive(1, A)
        b.arrive(1, B)
        observer = make_board()
        assert observer.view(1).first == node_name(A)
        a.leave()
        assert observer.alive() == {B: PORT[B]}
        assert observer.arrivals(1) == observer.waiting(1) == [B]
        assert observer.view(1).first == node_name(B)  # B closes round 1 now

    def test_a_node_whose_liveness_stops_is_gone_once_it_expires(self, make_board) -> None:
        """As when its agent is SIGKILLed: its lease (its heartbeat) is no longer refreshed."""
        a, b = self.started(make_board, A), self.started(make_board, B)
        self.close(a, RoundRecord(0, (A, B)))
        a.arrive(1, A)
        b.arrive(1, B)
        observer = make_board()
        observer.view(1)
        self.stop_liveness(a)
        assert A in observer.alive()  # not before it expires
        expiry = max(SETTINGS.lease_ttl, SETTINGS.keep_alive_interval * SETTINGS.keep_alive_max_attempt)
        wait_for(lambda: A not in observer.alive(), expiry + 3, "the stopped node to expire", interval=0.05)
        assert observer.arrivals(1) == [B] and observer.view(1).first == node_name(B)
        assert B in observer.alive()  # a live node's refreshes keep it

    def test_set_closed_is_seen_by_every_agent_and_stays(self, make_board) -> None:
        closer, other = make_board(), make_board()
        closer.set_closed()
        closer.set_closed()
        assert closer.is_closed() and other.is_closed()
        assert other.view(0).closed and other.view(5).closed



class TestEtcdRoundBoard(BoardContract):
    name = "etcd-v3"

    @pytest.fixture
    def make_board(self, shared_etcd_server, run_id) -> Iterator[MakeBoard]:
        made: list[tuple[EtcdRoundBoard, EtcdConnection]] = []

        def make(run_id: str = run_id) -> EtcdRoundBoard:
            params = RendezvousParameters("etcd-v3", shared_etcd_server.endpoint, run_id, 1, 3)
            connection = EtcdConnection(EtcdV3Options.from_params(params))
            made.append((EtcdRoundBoard(connection, EtcdV3Store(connection, run_id), run_id, SETTINGS), connection))
            return made[-1][0]

        yield make
        for board, connection in made:
            board.leave()
            connection.close()


class TestStoreRoundBoard(BoardContract):
    name = "elastic-c10d"

    @pytest.fixture
    def make_board(self, run_id) -> Iterator[MakeBoard]:
        server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))
        made: list[StoreRoundBoard] = []

        def make(run_id: str = run_id) -> StoreRoundBoard:
            client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
            made.append(StoreRoundBoard(client, run_id, SETTINGS))
            return made[-1]

        yield make
        for board in made:  # their heartbeat threads stop before the store does
            board.leave()

