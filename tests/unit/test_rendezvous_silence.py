"""Silent members of the rendezvous (`silence`): the beacon's answer, the workers' verdict
file, and handlers on a real TCPStore (threads stand in for the agents, real beacons and sockets for
their ports; a socket that listens but never accepts stands in for a frozen agent's, whose kernel
still completes the handshake)."""

from __future__ import annotations

import os
import pwd
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

from elastic_ddp.agent.rendezvous.boards.c10d import StoreRoundBoard
from elastic_ddp.agent.rendezvous.handler import RoundRendezvousHandler
from elastic_ddp.agent.rendezvous.liveness import Beacon
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.silence import Reply, ask
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord
from elastic_ddp.handoff.verdicts import (
    MAX_VERDICT_BYTES,
    VERDICT_SEND_S,
    VerdictInbox,
    send_suspicion,
    send_verdict,
    verdict_address,
)
from elastic_ddp.testbed.local_cluster import wait_for
from tests.support.rendezvous import ranks_by_node, serving_board

pytestmark = pytest.mark.timeout(60)

HERE, OTHER = NodeDesc("127.0.0.1", 1, 0), NodeDesc("127.0.0.1", 2, 0)
MADE: list[RoundRendezvousHandler] = []


class FrozenBeacon:
    """A frozen agent's beacon port: it listens (the kernel completes handshakes into the backlog)
    but nothing accepts, so nothing answers."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.port = self._socket.getsockname()[1]

    def close(self) -> None:
        self._socket.close()


@pytest.fixture
def server():
    with serving_board(MADE) as store:
        yield store


def handler(server: TCPStore, node, witness: ExitWitness, join_timeout: float = 15) -> RoundRendezvousHandler:
    # Leases of 200 s: a member left out within the test was left out by the evidence, not its lease.
    chosen = RendezvousSettings("run", 1, 2, join_timeout=join_timeout, last_call_timeout=0.3, keep_alive_interval=0.2,
                           keep_alive_max_attempt=1000, probe_dead_nodes=witness.port is not None)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))
    MADE.append(RoundRendezvousHandler(StoreRoundBoard(client, "run", chosen), node, chosen, witness, poll_s=0.02))
    return MADE[-1]


def formed_pair(server, other_beacon, probes: bool = True) -> tuple[RoundRendezvousHandler, RoundRendezvousHandler]:
    """Round 0 of HERE and OTHER; HERE's beacon probes (unless not `probes`) reached OTHER's
    beacon, whose port is then `other_beacon`'s (a live one, or a frozen one)."""
    other_witness = ExitWitness()
    other_witness._beacon.close()
    other_witness._beacon = other_beacon
    survivor = handler(server, HERE, ExitWitness(enabled=probes), join_timeout=15 if probes else 2)
    other = handler(server, OTHER, other_witness)
    assert ranks_by_node([survivor, other]) == {HERE: (0, 2), OTHER: (1, 2)}
    if probes:
        wait_for(lambda: survivor._witness._reached, 20, "the survivor reaching the other's beacon")
    return survivor, other


def workers_name(survivor: RoundRendezvousHandler, node) -> None:
    """What the survivor's workers' watchdog writes when it fires: `node`'s rank in the round."""
    inbox, record = survivor._silence._expected
    assert send_verdict(inbox.address, {record.rank_of(node)})


def test_a_beacon_answers_and_a_frozen_or_closed_port_or_an_old_beacon_does_not() -> None:
    live, frozen = Beacon(), FrozenBeacon()
    assert ask(("127.0.0.1", live.port)) is Reply.ANSWERED
    started = time.monotonic()
    assert ask(("127.0.0.1", frozen.port), answer_s=0.3) is Reply.SILENT  # connected, but no answer
    assert time.monotonic() - started < 5
    frozen.close()
    assert ask(("127.0.0.1", frozen.port)) is Reply.SILENT  # refused
    with socket.create_server(("127.0.0.1", 0)) as old:  # accepts and closes without a word
        threading.Thread(target=lambda: old.accept()[0].close(), daemon=True).start()
        assert ask(("127.0.0.1", old.getsockname()[1]), answer_s=5) is Reply.UNKNOWN
    live.close()


def test_a_verdict_reaches_only_an_agent_that_reads_them_and_anything_but_ours_is_no_verdict() -> None:
    address = verdict_address("run", "10.0.0.1", 29511, 2)
    assert address != verdict_address("run", "10.0.0.1", 29512, 2)  # another round
    assert address.startswith(b"\0") and b"/" not in verdict_address("../x", "a", 1, 0)  # abstract: no file
    assert not send_verdict(address, {1, 3})  # no agent reads verdicts there (torch's c10d): nothing sent
    inbox = VerdictInbox(address)
    assert not inbox.waiting() and inbox.take() == set()
    assert send_verdict(address, {1, 3}) and inbox.waiting()
    assert send_verdict(address, {4})  # another worker of the node
    assert inbox.take() == {1, 3, 4}
    planted = [b'{"silent_node_ranks": [1, "2"]}', b"[5]", b"\xff", b'{"silent_node_ranks": [true]}',
               b'{"silent_node_ranks": [' + b"6, " * MAX_VERDICT_BYTES + b"6]}"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as forger:
        for datagram in planted:
            try:
                forger.sendto(datagram, address)
            except OSError:
                pass  # larger than the socket takes
    assert inbox.take() == {1, 3, 4}  # none of them added anything
    inbox.close()
    assert not send_verdict(address, {1})  # the agent's end is gone with it: nothing left behind


def fill_as(uid: int, address: bytes) -> int:
    """How many empty datagrams a process of user `uid` (a forked child of this test) put in the
    queue at `address` before it was full."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            sent = 0
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as flooder:
                flooder.setblocking(False)
                try:
                    while True:
                        flooder.sendto(b"", address)
                        sent += 1
                except BlockingIOError:
                    pass
            os.write(write_end, str(sent).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        sent = int(pipe.read() or b"0")
    os.waitpid(pid, 0)
    return sent


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send as another user (nobody)")
def test_a_queue_filled_by_another_user_neither_blocks_a_worker_nor_outlives_the_next_poll() -> None:
    address = verdict_address("run", "10.0.0.1", 29511, 2)
    inbox = VerdictInbox(address)
    assert fill_as(pwd.getpwnam("nobody").pw_uid, address) > 0
    sending = threading.Thread(target=lambda: outcome.append(try_send(address, {1})), daemon=True)
    outcome: list[object] = []
    sending.start()
    sending.join(timeout=10 * VERDICT_SEND_S)
    assert not sending.is_alive(), "the worker's send blocked on a full queue"  # its watchdog goes on
    assert isinstance(outcome[0], TimeoutError), outcome
    assert not inbox.waiting()  # the poll sees the empty datagrams, drops them all, finds no verdict
    assert send_verdict(address, {1}) and inbox.waiting() and inbox.take() == {1}
    inbox.close()


def try_send(address: bytes, ranks: set[int]) -> object:
    try:
        return send_verdict(address, ranks)
    except OSError as exc:
        return exc


def test_a_deeply_nested_datagram_is_no_verdict_and_ends_no_agent(server) -> None:
    survivor, _ = formed_pair(server, Beacon())
    inbox, record = survivor._silence._expected
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"[" * 60_000, inbox.address)
        sender.sendto(b'{"silent_node_ranks": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", inbox.address)
    assert survivor.num_nodes_waiting() == 0  # before: RecursionError, and torch ends the agent
    assert not inbox.waiting() and inbox.take() == set()
    workers_name(survivor, OTHER)  # the real verdict still gets through
    assert inbox.take() == {record.rank_of(OTHER)}


def test_no_fault_in_reading_verdicts_leaves_num_nodes_waiting(server, monkeypatch, caplog) -> None:
    survivor, _ = formed_pair(server, Beacon())
    def fails(*args, **kwargs) -> None:
        raise RuntimeError("can't start new thread")  # what pids.max does to the beacon probes' thread

    monkeypatch.setattr(survivor._silence, "start", fails)
    assert survivor.num_nodes_waiting() == 0 and survivor.num_nodes_waiting() == 0
    assert caplog.text.count("could not read this node's workers' verdicts") == 1


def test_a_frozen_member_named_by_the_workers_is_left_out_before_its_lease_ends_and_rejoins(server) -> None:
    frozen_beacon = FrozenBeacon()
    survivor, frozen = formed_pair(server, frozen_beacon)
    frozen._board._stop.set()  # frozen: no more heartbeats; its last one stays fresh for 200 s
    workers_name(survivor, OTHER)
    assert ranks_by_node([survivor]) == {HERE: (0, 1)}  # before: RendezvousTimeoutError after join_timeout
    assert survivor._board._latest == RoundRecord(1, (HERE,))
    # Thawed (it was only slow after all): it arrives at the next round, the survivor sees it
    # waiting and restarts, and the round after holds both again.
    frozen._board._stop.clear()
    frozen_beacon.close()
    rejoined = threading.Thread(target=lambda: ranks_by_node([frozen]), daemon=True)
    rejoined.start()
    wait_for(lambda: survivor.num_nodes_waiting() > 0, 20, "the survivor seeing the left-out node wait")
    assert ranks_by_node([survivor]) == {HERE: (0, 2)}
    rejoined.join(timeout=30)
    assert survivor._board._latest.members == (HERE, OTHER)


def test_a_verdict_found_while_the_workers_end_is_asked_at_once_and_kept_for_the_next_round(server) -> None:
    frozen_beacon = FrozenBeacon()
    survivor, frozen = formed_pair(server, frozen_beacon)
    frozen._board._stop.set()
    assert survivor.num_nodes_waiting() == 0  # no verdict yet: nothing asked
    assert survivor._silence._probes == []
    workers_name(survivor, OTHER)
    assert survivor.num_nodes_waiting() == 0  # torchrun's monitor poll finds the verdict: asked now
    wait_for(lambda: survivor._silence.wait(0.1), 20, "the survivor asking the frozen node's beacon")
    assert survivor._silence.silent(RoundRecord(0, (HERE, OTHER))) == {OTHER}
    assert ranks_by_node([survivor]) == {HERE: (0, 1)}
    frozen_beacon.close()


def test_a_suspect_is_asked_before_the_verdict_which_then_leaves_it_out_at_once(server) -> None:
    """The workers name the frozen node as suspect before their watchdog's deadline: its beacon is
    asked at the next monitor poll, and its silence alone leaves nobody out; the verdict that follows
    does, without asking again (what saves the 0.3 s answer in the round after a freeze)."""
    survivor, frozen = formed_pair(server, FrozenBeacon())
    frozen._board._stop.set()
    inbox, record = survivor._silence._expected
    assert send_suspicion(inbox.address, {record.rank_of(OTHER)})
    assert survivor.num_nodes_waiting() == 0  # torchrun's monitor poll: the suspect's beacon is asked
    wait_for(lambda: survivor._silence.wait(0.1), 20, "the survivor asking the suspect's beacon")
    assert survivor._silence.silent(record) == set()  # a suspicion is no verdict
    probes = len(survivor._silence._probes)
    workers_name(survivor, OTHER)
    assert survivor.num_nodes_waiting() == 0
    assert survivor._silence.silent(record) == {OTHER}
    assert len(survivor._silence._probes) == probes  # not asked again
    assert ranks_by_node([survivor]) == {HERE: (0, 1)}


def test_an_agent_that_shuts_down_reads_no_more_verdicts(server) -> None:
    survivor, _ = formed_pair(server, Beacon())
    inbox, record = survivor._silence._expected
    survivor.shutdown()
    assert not send_verdict(inbox.address, {record.rank_of(OTHER)})


def test_a_member_named_by_the_workers_whose_beacon_answers_is_kept(server) -> None:
    survivor, slow = formed_pair(server, Beacon())
    workers_name(survivor, OTHER)
    results: dict = {}
    waiting = threading.Thread(target=lambda: results.update(ranks_by_node([survivor])), daemon=True)
    waiting.start()
    wait_for(lambda: survivor._silence.wait(0.1), 20, "the survivor asking the slow node's beacon")
    assert survivor._silence._probes == []  # the probes that ended are forgotten
    assert survivor._silence.silent(RoundRecord(0, (HERE, OTHER))) == set()
    assert waiting.is_alive(), results  # still waiting for the slow member
    assert ranks_by_node([slow]) == {OTHER: (1, 2)}  # it arrives: the round holds both
    waiting.join(timeout=30)
    assert results == {HERE: (0, 2)}


def test_with_probes_off_a_verdict_changes_nothing(server) -> None:
    """`probe_dead_nodes=0`: no beacon reached, so the frozen member holds the round up until its lease."""
    survivor, frozen = formed_pair(server, FrozenBeacon(), probes=False)
    frozen._board._stop.set()
    workers_name(survivor, OTHER)
    assert isinstance(ranks_by_node([survivor])[HERE], RendezvousTimeoutError)  # join_timeout of 2 s
