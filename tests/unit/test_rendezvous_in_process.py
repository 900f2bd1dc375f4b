"""In-process rounds of the rendezvous (`handler`, "In-process rounds"): handlers of one process as
the agents, one real TCPStore (the elastic-c10d board), real beacons, and each handler's hand-off
directory (`round_handoff`) under a TMPDIR of the test, with a fake agent pid of its own. The
"workers" are this test: it declares them capable (with this process's pid, which runs) and
writes their requests, as `training.in_process` does.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID, SimpleElasticAgent, WorkerSpec
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.utils import store as store_util

from elastic_ddp.agent.rendezvous import handler as handler_module
from elastic_ddp.agent.rendezvous.agent_setup import prepare_agent
from elastic_ddp.agent.rendezvous.boards.c10d import C10D_KEYS, StoreRoundBoard
from elastic_ddp.agent.rendezvous.defaults import MONITOR_INTERVAL_S
from elastic_ddp.agent.rendezvous.handler import RoundRendezvousHandler
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord
from elastic_ddp.handoff import rounds as round_handoff
from elastic_ddp.handoff.rounds import IN_PROCESS_ENV
from elastic_ddp.handoff.verdicts import send_verdict, verdict_address
from elastic_ddp.testbed.local_cluster import wait_for
from tests.support.rendezvous import Background, each_together, ranks_by_node, serving_board

pytestmark = pytest.mark.timeout(60)

A, B, C = (NodeDesc("127.0.0.1", 101 + i, 0) for i in range(3))  # ranks A, B, C: names sort so
FAKE_AGENT_PIDS = {A: 4_000_001, B: 4_000_002, C: 4_000_003, NodeDesc("127.0.0.1", 100, 0): 4_000_004}  # above Linux's pid_max: no real agent

MADE: list[RoundRendezvousHandler] = []


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the hand-off directories of this test
    with serving_board(MADE) as store:
        yield store


def settings(in_process: bool = True) -> RendezvousSettings:
    """Heartbeats that never expire within a test: a lost node is found by its beacon only."""
    return RendezvousSettings("run", 1, 3, join_timeout=30, last_call_timeout=0.3, keep_alive_interval=0.2,
                              keep_alive_max_attempt=1000, in_process=in_process)


def handler(server: TCPStore, node: NodeDesc, chosen: RendezvousSettings) -> RoundRendezvousHandler:
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))
    made = RoundRendezvousHandler(StoreRoundBoard(client, "run", chosen), node, chosen, ExitWitness(), poll_s=0.02)
    made.agent_pid = FAKE_AGENT_PIDS[node]
    MADE.append(made)
    return made


def first_round(server: TCPStore, nodes, chosen: RendezvousSettings | None = None) -> list[RoundRendezvousHandler]:
    """Handlers of `nodes` in round 0, each with its one worker capable and every beacon reached."""
    made = [handler(server, node, chosen or settings()) for node in nodes]
    assert ranks_by_node(made) == {node: (rank, len(nodes)) for rank, node in enumerate(nodes)}
    for each in made:
        if each.settings.in_process:
            round_handoff.declare_capable(each.agent_pid, 0, 1)
        wait_for(lambda each=each: len(each._witness._reached) == len(nodes) - 1, 20, "the other beacons reached")
    return made


def lose(lost: RoundRendezvousHandler) -> None:
    """As a SIGKILL of its agent looks to the others: no more heartbeats (the last one stays fresh
    here) and a beacon that refuses."""
    lost._board._stop.set()
    lost._witness.close()


def monitor(made: RoundRendezvousHandler, until, timeout: float = 20) -> list[int]:
    """torch's monitor loop: `num_nodes_waiting()` every monitor interval until `until()` holds; what it returned."""
    answers, deadline = [], time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"num_nodes_waiting answered {answers[-5:]} for {timeout} s"
        answers.append(made.num_nodes_waiting())
        time.sleep(MONITOR_INTERVAL_S)
    return answers


def monitor_together(handlers, until) -> list[list[int]]:
    """`monitor` of each handler, each in a thread of its own (each agent's main loop)."""
    answers = each_together(handlers, lambda made: monitor(made, lambda: until(made)), 40, "a monitor loop")
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return answers


def announced(made: RoundRendezvousHandler) -> round_handoff.RoundAnnouncement | None:
    return round_handoff.read_round(made.agent_pid)


def arrivals_at(server: TCPStore, round_number: int) -> int:
    return int(server.add(f"rdzv/run/arrivals/{round_number}/count", 0))


def test_the_survivors_of_a_lost_node_run_the_next_round_in_process_and_torch_sees_nothing(server) -> None:
    a, b, c = first_round(server, [A, B, C])
    baseline = announced(a)
    assert (baseline.round, baseline.in_process, baseline.reason) == (0, False, "started by torchrun")
    lose(c)
    round_handoff.request_reform(a.agent_pid, 0, 0, "gloo: connection reset by peer")  # A's worker saw it first

    answers = monitor_together([a, b], lambda made: (announced(made) or baseline).round == 1)

    assert all(answer == 0 for each in answers for answer in each)  # never a restart, never an error
    first, second = announced(a), announced(b)
    assert (first.round, first.group_rank, first.group_world_size, first.in_process) == (1, 0, 2, True)
    assert (second.round, second.group_rank, second.group_world_size, second.in_process) == (1, 1, 2, True)
    assert (first.first_rank, first.world_size, second.first_rank, second.world_size) == (0, 2, 1, 2)
    assert (first.master_addr, first.master_port) == (second.master_addr, second.master_port) == ("127.0.0.1",
                                                                                                  first.master_port)
    assert round_handoff.reform_requests(a.agent_pid) == {}
    assert a._round == b._round == RoundRecord(1, (A, B))
    assert server.get("rdzv/run/in_process_outcome/1") == b"in_process"
    assert a._torch_round.round == 0  # torch's agent still holds round 0 and its store ...
    assert int(server.add(f"torch.rendezvous.run.0/{_TERMINAL_STATE_SYNC_ID}/num_members", 0)) == 1  # ... C counted

    # The job ends: torch's own exit barrier, over the store and the world size torch holds, lets the
    # two survivors go at once (C never comes), not after its 300 s.
    ended = []

    def exit_barrier(made: RoundRendezvousHandler) -> None:
        store = PrefixStore("torch.rendezvous.run.0",
                            TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20)))
        store_util.barrier(store, 3, key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=10)
        ended.append(made.node)

    barriers = [threading.Thread(target=exit_barrier, args=(made,), daemon=True) for made in (a, b)]
    for barrier in barriers:
        barrier.start()
    for barrier in barriers:
        barrier.join(timeout=15)
    assert sorted(ended) == [A, B]


def test_the_exit_barrier_counts_the_lost_node_in_whether_the_survivors_end_before_or_after(server) -> None:
    """torch's `_barrier_nonblocking` sets the last-member key only on the add that makes the count
    equal the world size: the count of the lost node may come before or after the survivors'."""
    assert ended_together(server, "p0", lost_counted_first=False) == [1, 1]
    assert ended_together(server, "p1", lost_counted_first=True) == [1, 1]


def ended_together(server: TCPStore, run_id: str, lost_counted_first: bool) -> list[int]:
    """Two survivors of torch's round 0 of 3 nodes in torch's exit barrier; the third counted in
    by the handler of group rank 0 of the in-process round 1 before or after they reach it. One 1
    per survivor that passed. Each agent has a store client of its own (a client's `wait` holds its
    connection)."""
    def client() -> PrefixStore:
        return PrefixStore(f"torch.rendezvous.{run_id}.0",
                           TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20)))

    made = RoundRendezvousHandler.__new__(RoundRendezvousHandler)  # only the board's store and the run id are read
    made._board, made._settings = SimpleNamespace(store=server), SimpleNamespace(run_id=run_id)
    for node in (A, B):  # the survivors' in-process marks: torch's round 0, of 3 nodes; one worker each
        server.set(made._mark_key(1, node), b"0 3 1")
    passed: list[int] = []

    def end(store: PrefixStore) -> None:
        store_util.barrier(store, 3, key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=10)
        passed.append(1)

    if lost_counted_first:
        made._settle_exit_barriers(RoundRecord(1, (A, B)), 0, made._marks(1, [A, B]))
    survivors = [threading.Thread(target=end, args=(client(),), daemon=True) for _ in range(2)]
    for survivor in survivors:
        survivor.start()
    if not lost_counted_first:
        counter = f"{_TERMINAL_STATE_SYNC_ID}/num_members"
        wait_for(lambda: int(client().add(counter, 0)) == 2, 10, "both survivors at the barrier")
        assert not passed
        made._settle_exit_barriers(RoundRecord(1, (A, B)), 0, made._marks(1, [A, B]))
    made._settle_exit_barriers(RoundRecord(1, (A, B)), 0, made._marks(1, [A, B]))  # again (a retried round): counted once
    for survivor in survivors:
        survivor.join(timeout=15)
    assert int(client().add(f"{_TERMINAL_STATE_SYNC_ID}/num_members", 0)) == 3
    return passed


def torch_assigns_ranks(info, local_world_size: int = 1) -> list[tuple[int, int]]:
    """What torch's agent does after `next_rendezvous` (its slow path, over the round's store): the
    (global rank, world size) of each of its workers."""
    spec = WorkerSpec(role="default", local_world_size=local_world_size, rdzv_handler=None, entrypoint="train.py")
    workers = SimpleElasticAgent._assign_worker_ranks(None, info.store, info.rank, info.world_size, spec)
    return [(worker.global_rank, worker.world_size) for worker in workers]


@pytest.mark.parametrize("joiner", [C, NodeDesc("127.0.0.1", 100, 0)], ids=["ranked-last", "ranked-first"])
def test_a_joiner_is_taken_in_process_by_the_members_and_torch_assigns_its_ranks(server, joiner) -> None:
    """The members' workers stay; the joiner's torch agent assigns its workers' ranks over the
    round's store, with the members' handlers doing their agents' part (group rank 0's computing
    when a member is it; torch's own code when the joiner is), and tell their workers the ranks it
    gave them: the joiner runs two workers, the members one each. Every exit barrier then ends."""
    a, b = first_round(server, [A, B])
    joining = Background(handler(server, joiner, settings()))
    wait_for(lambda: arrivals_at(server, 1) >= 1, 10, "the joiner's arrival")
    joined_ranks: list = []
    answers = each_together([a, b, None], lambda made: monitor(made, lambda: announced(made).round == 1) if made
                            else joined_ranks.append(torch_assigns_ranks(joining.result(), 2)), 40, "an agent")
    assert not [answer for answer in answers if isinstance(answer, BaseException)], answers
    assert all(answer == 0 for each in answers[:2] for answer in each)  # torch never restarts A's and B's workers
    order = sorted([A, B, joiner])
    joined = joining.result()
    assert (joined.rank, joined.world_size) == (order.index(joiner), 3)
    workers = {A: 1, B: 1, joiner: 2}
    first_rank = {node: sum(workers[before] for before in order[:order.index(node)]) for node in order}
    # torch's own rank assignment of the joiner's two workers
    assert joined_ranks == [[(first_rank[joiner], 4), (first_rank[joiner] + 1, 4)]]
    for made, node in ((a, A), (b, B)):
        told = announced(made)
        assert (told.round, told.group_rank, told.group_world_size, told.in_process, told.joined) == \
            (1, order.index(node), 3, True, 1)
        assert (told.first_rank, told.world_size) == (first_rank[node], 4)
        assert (told.master_addr, told.master_port) == (joined.bootstrap_store_info.master_addr,
                                                        joined.bootstrap_store_info.master_port)
        assert made._torch_round.round == 0 and made._round == RoundRecord(1, tuple(order))
    assert arrivals_at(server, 1) == 3

    # The job ends: A and B wait on torch's round 0 (2 nodes), the joiner on round 1 (3 nodes).
    ended = []

    def exit_barrier(torch_round: int, world_size: int) -> None:
        store = PrefixStore(f"torch.rendezvous.run.{torch_round}",
                            TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20)))
        store_util.barrier(store, world_size, key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=10)
        ended.append(torch_round)

    each_together([(0, 2), (0, 2), (1, 3)], lambda held: exit_barrier(*held), 15, "an exit barrier")
    assert sorted(ended) == [0, 0, 1]


def test_a_joiner_takes_the_restart_path_when_the_members_workers_cannot_re_form(server) -> None:
    a, b = first_round(server, [A, B])
    for made in (a, b):
        round_handoff.withdraw_capable(made.agent_pid, 0)  # (a script without ElasticRun, --sharding fsdp)
    joining = Background(handler(server, C, settings()))
    wait_for(lambda: arrivals_at(server, 1) == 1, 10, "the joiner's arrival")
    assert a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1  # torch restarts A's and B's workers
    assert not server.check(["rdzv/run/in_process/1/127.0.0.1_101_0"]) and arrivals_at(server, 1) == 1
    assert ranks_by_node([a, b]) == {A: (0, 3), B: (1, 3)}  # torch's restart: the round closes as before
    assert (joining.result().rank, joining.result().world_size) == (2, 3)
    for made in (a, b):
        told = announced(made)
        assert (told.round, told.group_world_size, told.in_process) == (1, 3, False)
        assert round_handoff.all_workers_capable(made.agent_pid) is None  # torch starts fresh workers


def test_a_member_restarted_by_torchrun_makes_the_round_a_restart_and_the_restart_takes_that_round(server) -> None:
    a, b, c = first_round(server, [A, B, C])
    restarted = Background(c)  # C's workers failed: its torchrun restarted them, its agent arrives unmarked
    wait_for(lambda: arrivals_at(server, 1) == 1, 10, "C's arrival")
    round_handoff.request_reform(a.agent_pid, 0, 0, "gloo: connection reset by peer")
    answer: list = []
    reforming = threading.Thread(target=lambda: answer.append(a.num_nodes_waiting()), daemon=True)
    reforming.start()
    wait_for(lambda: arrivals_at(server, 1) == 2, 10, "A's arrival for an in-process round")
    assert b.num_nodes_waiting() == 2  # C is no member that runs it in process: B restarts as today
    b_info = Background(b)
    reforming.join(timeout=20)
    assert answer and answer[0] >= 1  # torch restarts A's workers ...
    told = announced(a)
    assert (told.round, told.in_process) == (1, False) and "with its workers stopped" in told.reason  # ... at once
    a_info = a.next_rendezvous()  # torch's restart: round 1, as it closed, without a new arrival
    infos = {A: a_info, B: b_info.result(), C: restarted.result()}
    assert {node: (info.rank, info.world_size) for node, info in infos.items()} == {A: (0, 3), B: (1, 3), C: (2, 3)}
    assert len({(info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port)
                for info in infos.values()}) == 1
    assert arrivals_at(server, 1) == 3 and arrivals_at(server, 2) == 0
    assert a._round == a._torch_round == RoundRecord(1, (A, B, C)) and a._pending is None


def test_a_round_that_does_not_close_in_time_is_given_up_for_every_node_and_restarted_into(server,
                                                                                         monkeypatch) -> None:
    """B's agent does not come (busy, frozen): A gives the round up after the bound, and its
    outcome keeps B from taking it in process later; torch's restarts then meet in that round."""
    monkeypatch.setattr(handler_module, "REFORM_TIMEOUT_S", 0.5)
    a, b = first_round(server, [A, B])
    round_handoff.request_reform(a.agent_pid, 0, 0, "gloo: connection reset by peer")
    assert a.num_nodes_waiting() == 1  # torch restarts A's workers ...
    told = announced(a)
    assert (told.round, told.in_process) == (1, False) and "within 0.5 s" in told.reason  # ... which exit at once
    assert server.get("rdzv/run/in_process_outcome/1") == b"restart"
    assert b.num_nodes_waiting() == 1 and announced(b).round == 0  # B sees A's marked arrival: too late
    assert ranks_by_node([a, b]) == {A: (0, 2), B: (1, 2)}
    assert arrivals_at(server, 1) == 2 and arrivals_at(server, 2) == 0  # A did not arrive again


def test_a_worker_that_ends_while_its_node_runs_the_round_makes_the_round_a_restart_for_every_node(
        server, monkeypatch) -> None:
    """A's worker failed otherwise (it withdrew its mark on its way out) while A's agent ran the
    round: A gives the round up, and B, which decides after A, follows."""
    a, b, c = first_round(server, [A, B, C])
    lose(c)
    round_handoff.request_reform(a.agent_pid, 0, 0, "gloo: connection reset by peer")
    close = a._close_in_process

    def closed_as_the_worker_leaves(current):
        closed = close(current)
        round_handoff.withdraw_capable(a.agent_pid, 0)
        return closed

    agree = b._agree

    def after_a(round_number, in_process):
        wait_for(lambda: server.check(["rdzv/run/in_process_outcome/1"]), 20, "A's outcome")
        return agree(round_number, in_process)

    monkeypatch.setattr(a, "_close_in_process", closed_as_the_worker_leaves)
    monkeypatch.setattr(b, "_agree", after_a)
    answers = monitor_together([a, b], lambda made: (announced(made).round == 1))
    assert all(each[-1] >= 1 for each in answers), answers  # torch restarts the workers of both
    assert server.get("rdzv/run/in_process_outcome/1") == b"restart"
    assert "a worker of this node ended or withdrew during the round" in announced(a).reason
    assert (announced(b).in_process, announced(b).reason) == (False, "another node gave round 1 up")


def test_a_member_whose_workers_were_found_silent_while_its_agent_answers_makes_the_round_a_restart(server) -> None:
    """A's workers' watchdog named C silent (a real verdict), but C's agent answers its beacon: only
    its workers froze, which no in-process round can end (C's agent would take the round for them).
    A decides the round is a restart before it arrives, so no node can take it in process first."""
    a, b, c = first_round(server, [A, B, C])
    mine = announced(a)
    assert send_verdict(verdict_address("run", mine.master_addr, mine.master_port, mine.group_rank), [2])
    round_handoff.request_reform(a.agent_pid, 0, 0, "peer watchdog: rank(s) [2] sent no heartbeat for over 3 s")

    [answers] = monitor_together([a], lambda made: announced(made).round == 1)

    assert answers[-1] >= 1, answers  # torch restarts A's workers, into round 1
    assert server.get("rdzv/run/in_process_outcome/1") == b"restart"
    assert announced(a).reason == "node 127.0.0.1_103_0's workers were found silent while its agent answers"
    assert arrivals_at(server, 1) == 0  # A never arrived in process: its restart's torchrun arrives
    assert c.num_nodes_waiting() == 0 and c._round.round == 0 and announced(c).round == 0  # nobody takes it
    # B's workers, blocked on C as A's were, asked too (without a verdict of their own yet): B follows
    # A's outcome at once and tells them, rather than let them wait for their own deadline.
    round_handoff.request_reform(b.agent_pid, 0, 0, "peer watchdog: rank(s) [2] sent no heartbeat for over 3 s")
    [followed] = monitor_together([b], lambda made: announced(made).round == 1)
    assert followed == [1] and not announced(b).in_process, (followed, announced(b))  # at its first poll
    assert announced(b).reason == "another node gave round 1 up"
    assert server.get("rdzv/run/in_process_outcome/1") == b"restart"


def test_a_board_error_in_an_in_process_round_is_a_restart_never_an_error_to_torch(server, monkeypatch) -> None:
    a, b = first_round(server, [A, B])
    round_handoff.request_reform(a.agent_pid, 0, 0, "gloo: connection reset by peer")

    def unreachable(round_number, node):
        raise RendezvousConnectionError("the store did not answer")

    monkeypatch.setattr(a._board, "arrive", unreachable)
    assert a.num_nodes_waiting() == 1
    told = announced(a)
    assert (told.round, told.in_process) == (1, False) and "RendezvousConnectionError" in told.reason
    assert server.get("rdzv/run/in_process_outcome/1") == b"restart"  # B cannot take round 1 in process without A
    assert b.num_nodes_waiting() == 0 and announced(b).round == 0  # until torch's restart of A arrives


def test_with_in_process_off_a_lost_node_is_todays_restart(server) -> None:
    a, b, c = first_round(server, [A, B, C], settings(in_process=False))
    assert announced(a) is None  # no hand-off directory at all
    round_handoff.open_handoff(a.agent_pid)  # as if workers asked anyway
    round_handoff.declare_capable(a.agent_pid, 0, 1)
    round_handoff.request_reform(a.agent_pid, 0, 0, "gloo: connection reset by peer")
    lose(c)
    assert [a.num_nodes_waiting() for _ in range(5)] == [0] * 5  # the workers fail; torch restarts them
    assert arrivals_at(server, 1) == 0 and announced(a) is None
    assert ranks_by_node([a, b]) == {A: (0, 2), B: (1, 2)}  # torch's restart, as before


def test_unless_every_local_worker_is_capable_a_lost_node_is_todays_restart(server) -> None:
    a, b, c = (handler(server, node, settings()) for node in (A, B, C))
    assert ranks_by_node([a, b, c]) == {A: (0, 3), B: (1, 3), C: (2, 3)}
    round_handoff.declare_capable(a.agent_pid, 0, 2)  # local rank 1 of 2 never declared itself
    round_handoff.request_reform(a.agent_pid, 0, 0, "gloo: connection reset by peer")
    lose(c)
    assert [a.num_nodes_waiting() for _ in range(5)] == [0] * 5
    assert arrivals_at(server, 1) == 0 and announced(a).round == 0


def test_in_process_is_a_switch_of_rdzv_conf_exported_to_the_workers(monkeypatch) -> None:
    monkeypatch.delenv(IN_PROCESS_ENV, raising=False)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    for value, expected in ((None, "1"), ("0", "0"), ("1", "1")):
        conf = {} if value is None else {"in_process": value}
        chosen = prepare_agent(RendezvousParameters("elastic-c10d", "127.0.0.1:1", "run", 1, 4, local_addr="127.0.0.1",
                                                    **conf), C10D_KEYS)
        assert chosen.in_process is (expected == "1")
        assert os.environ[IN_PROCESS_ENV] == expected
    with pytest.raises(ValueError, match=r"^--rdzv_conf in_process: got 'maybe'; expected 1 or 0"):
        prepare_agent(RendezvousParameters("elastic-c10d", "127.0.0.1:1", "run", 1, 4, in_process="maybe"), C10D_KEYS)
