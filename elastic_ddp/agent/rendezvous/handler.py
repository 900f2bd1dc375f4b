"""elastic_ddp's rendezvous (`RoundRendezvousHandler`): torchrun's `RendezvousHandler` at a cost per
node that does not grow with the number of nodes: nodes arrive at numbered rounds on a board, and
the first live arrival closes a round by writing its record. What etcd-v3 (`boards.etcd`) and
elastic-c10d (in the TCPStore: `boards.c10d`, where leases are heartbeat times and the closing
write a `compare_set` of the round's own key) run. What follows says it for etcd.

torch's dynamic rendezvous keeps one state value that every node changes by compare-and-set:
three winning writes per node per phase (leave, wait list, join), serialised, so N nodes need
about 3N winning writes one after another and lose most of their attempts (docs/benchmarks-history.md).
Here each node writes only keys of its own, and one write closes a round:

1. **Arrive.** A node reads the last closed round `R` (the *round record*) and writes its arrival
   for round `R + 1` in a key of its own, bound to its liveness (etcd: its lease; its previous
   arrival is deleted in the same write). One write per node, never a read-modify-write.
2. **Wait.** Every `SYNC_POLL_S` it reads, in one request, the round record, the closed flag and
   the number of arrivals with the earliest one: a constant number of reads per second, each of
   constant size, whatever the number of nodes.
3. **Close.** The earliest arrival is the *closer*. It reads the arrivals and, when the completion
   rule holds (`rounds.may_close`: at least min_nodes in; no live member of the last round
   missing; then at once with max_nodes, at once with prompt completion after a first round, else
   after a last call of `last_call_timeout` with no new arrival), writes the new round record with
   one conditional write (etcd: a transaction comparing the record's revision with the one it read).
   If the closer dies its arrival vanishes with its lease and the next earliest takes over.
4. **Learn.** The others see the new record at their next read: members return their rank (torch's
   order, sorted node names); spares (arrivals beyond max_nodes, the redundancy list) and late
   arrivals arrive again for the round after.

Dead nodes: a node's keys live on its lease, refreshed every `keep_alive_interval`; a killed node's
lease expires after `keep_alive_interval x keep_alive_max_attempt` (5 s shipped) and its liveness
key goes, so the closer stops waiting for it. Sooner, with dead-node probes (`probes`, on
unless `probe_dead_nodes=0`): the closer probes the beacon of a missing member it reached before,
and a refusal (the agent process has exited) counts as dead. A frozen or cut-off member refuses
nothing; it counts as dead once this node's workers' watchdog named it and its beacon does not
answer within 0.3 s either (`silence`). `shutdown` revokes the lease at once.
`num_nodes_waiting` counts the arrivals at the next round (one keys-only read), except when the
round is full and only spares wait. `set_closed` writes a closed flag that every waiting node sees
at its next read and every later `next_rendezvous` raises on.

Writes per node per phase: one arrival, plus one for the closer, plus rank 0's two store keys for
the workers' address; lease refreshes are one per node per `keep_alive_interval`.

In-process rounds (`in_process=1` of `--rdzv_conf`, the default; issue 44). Every round a node
joins through `next_rendezvous` is told to its workers (`round_handoff`: round.json, `in_process`
false: torchrun starts them in it). While they train, torch's agent calls `num_nodes_waiting` every
monitor interval; once every local worker declared itself capable of re-forming, that call runs
the next round itself, for the workers, when one of them asked (its group of the current round
broke: a lost node, or its watchdog found one silent), when newcomers that the round would take
wait at the next one (a join), or when members of the current round wait there, each with the
in-process mark. It writes its own mark (a store key, before its arrival, holding which of
torch's rounds its agent holds and its number of workers), arrives, and waits and closes as above
(same loop, same closing rule: the lost member is out once its beacon refuses), looking every
`REFORM_POLL_S` for at most `REFORM_TIMEOUT_S`. Then the first node to decide writes the round's outcome (one `compare_set`) and every node follows it, so that no node
takes the round in process while another gave it up. Outcomes:

- the round holds this node, and every member of the last round in it is marked: this node takes
  it as its round (store, bootstrap address, verdicts, probes, as `next_rendezvous`), announces it
  with `in_process` true and the number of newcomers, and answers 0: torch sees healthy workers and
  nobody waiting. Newcomers come through their own `next_rendezvous`, and their torch agents then
  assign ranks over the round's store: the members' handlers do their agents' part of it
  (`torch_internals.take_part_in_rank_assignment`). The first member that was in the last round also settles
  torch's exit barriers: each member's agent waits at the job's end on the round torch last gave
  it, for as many agents as that round had; the missing ones (lost nodes, and members that moved
  on in process) are credited once, so that nobody waits 300 s for them (`_settle_exit_barriers`).
- anything else (a timeout, a board error, a round without this node, a member that arrived with
  its workers stopped, another node's outcome, a member whose workers this node's workers found
  silent while its agent answers its beacon: only torchrun's restart ends such workers, so this is
  decided before this node arrives): one warning naming why, an announcement with `in_process`
  false (waiting workers exit at once), and at least 1: torch restarts the workers, and its
  `next_rendezvous` waits for that round, not the one after it (the other nodes are in it).
- the announcement of a round taken in process carries the ranks of this node's workers in it:
  torch's assignment (`take_part_in_rank_assignment`) when newcomers came, else each member's
  mark's number of workers in group-rank order, so nodes of different sizes re-form too.

Spares of a full round take the restart path, as without in-process rounds. Not guaranteed: a node
whose in-process round fails after the outcome said "in process" (a store error while it enters
the round) has its workers restarted into that round while the others re-form in process; its
torch agent then waits, until torch's own timeouts, for a rank assignment and an exit barrier that
the other agents take no part in. While the round runs, torch's agent does not look at its
workers (at most `REFORM_TIMEOUT_S`).

Not guaranteed: a frozen, powered-off or cut-off node that the closer's own workers did not name
(they failed otherwise, or a closer without workers in that round) holds the next round up for its
lease expiry, as in torch; so does a closer killed while it waits (nobody probes a waiting node's
beacon: the next earliest arrival takes over when its lease expires); a node partitioned from etcd for longer than
its lease loses its keys and comes back as a new arrival. The round record is bound to the closer's
process lease (`ttl`, 2 h by default): a job that runs longer than that without a new round after
its closer's process ended loses the record, and its next round starts again from round 0 (ranks
still consistent, since every node then waits for that round 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_ddp.agent.rendezvous.defaults import REFORM_POLL_S, REFORM_TIMEOUT_S, SYNC_POLL_S
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings, closed_round, may_close, waiting_count
from elastic_ddp.agent.rendezvous.silence import ANSWER_S, SilenceJudge
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord, node_name
from elastic_ddp.agent.rendezvous.torch_internals import exit_barrier_keys, take_part_in_rank_assignment
from elastic_ddp.handoff import rounds as round_handoff
from elastic_ddp.handoff.rounds import RoundAnnouncement

logger = logging.getLogger(__name__)

# What a round's outcome key holds when every node takes the round in process (`_agree`).
IN_PROCESS_OUTCOME = b"in_process"


@dataclass(frozen=True)
class BoardView:
    """One read of the board while waiting for round `round`."""

    record: RoundRecord | None  # the last closed round
    token: int  # what the closing write compares (etcd: the record's mod revision; 0: no record)
    closed: bool  # set_closed was called
    arrived: int  # arrivals at the round waited for (c10d: those of nodes gone since too)
    first: str | None  # node name of the earliest live one (the closer)


class RoundBoard(Protocol):
    """Where the nodes of one run meet: a backend (etcd-v3: `boards.etcd`; a c10d store: `boards.c10d`). Thread-safe.
    tests/cluster/test_board_contract.py holds every board to the promises below."""

    name: str  # the backend's name (`get_backend`)
    store: Store  # the agents' store (torchrun's, and rank 0's address for the workers)

    def start(self, node: NodeDesc, port: int | None) -> None: ...  # liveness (and beacon port) on; idempotent

    def arrive(self, round_number: int, node: NodeDesc) -> None: ...  # and drop this node's earlier arrival

    def view(self, round_number: int) -> BoardView: ...

    def arrivals(self, round_number: int) -> list[NodeDesc]: ...  # the live ones, in arrival order

    # Live nodes and their beacon ports: at least the members and spares of the last closed round
    # that this board's `view` returned (c10d: only those).
    def alive(self) -> dict[NodeDesc, int | None]: ...

    # True if this write won: one of the closers of a round wins. Writing the record again changes
    # nothing (a retried request; etcd then says False, as the record's revision moved).
    def close_round(self, record: RoundRecord, token: int) -> bool: ...

    def waiting(self, round_number: int) -> list[NodeDesc]: ...  # the live arrivals at the round

    def set_closed(self) -> None: ...

    def is_closed(self) -> bool: ...

    def leave(self) -> None: ...  # liveness off, this node's keys gone


class RoundRendezvousHandler(RendezvousHandler):
    """See the module docstring. One instance per agent; `next_rendezvous` and `num_nodes_waiting`
    from one thread (torch's agent calls both from its main loop)."""

    def __init__(self, board: RoundBoard, node: NodeDesc, settings: RendezvousSettings,
                 witness: ExitWitness | None = None, poll_s: float = SYNC_POLL_S) -> None:
        self._board = board
        self._witness = witness or ExitWitness(enabled=False)
        self._silence = SilenceJudge(self._witness)
        self._node = node
        self._settings = settings
        self._poll_s = poll_s
        self._round: RoundRecord | None = None  # the last round this node was a member of
        self._store_info: RendezvousStoreInfo | None = None  # the workers' store of that round
        self._torch_round: RoundRecord | None = None  # the last round torch's agent got (its exit barrier's)
        self._pending: int | None = None  # the round this node arrived at in process, then gave to torch's restart
        self._announced: RoundAnnouncement | None = None  # what this node's workers were told last
        self._verdict_fault_logged = False
        self._reform_fault_logged = False
        self._before_joining: Callable[[], object] | None = None
        # The torchrun agent whose workers this handler tells its rounds (`round_handoff`): this
        # process; tests that run several handlers in one process give each a pid of its own.
        self.agent_pid = os.getpid()

    def before_joining_a_running_job(self, ready: Callable[[], object]) -> None:
        """Call `ready` (once, blocking) before this node first arrives at a round of a job that runs
        without it: its round stops the running nodes, so a joiner comes with its warm-worker server's
        imports done (the plugin). Not called when the job starts, nor for a member's next round."""
        self._before_joining = ready

    @property
    def node(self) -> NodeDesc:
        return self._node

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    def get_backend(self) -> str:
        """See base class."""
        return self._board.name

    @property
    def use_agent_store(self) -> bool:
        """See base class. False: workers never share the agent's store (pytorch/pytorch#135712)."""
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class. Raises RendezvousClosedError once the run is closed, RendezvousTimeoutError
        after `join_timeout` without a round (not while a spare), and what the board raises when its
        backend stays unreachable. After an in-process round given up (`num_nodes_waiting`), waits for
        that round, not the one after it: the other nodes are in it."""
        self._board.start(self._node, self._witness.port)
        started = time.monotonic()
        first = self._board.view(0)
        if first.closed:
            raise RendezvousClosedError(f"the rendezvous '{self._settings.run_id}' is closed")
        self._open_handoff()
        pending, self._pending = self._pending, None
        if pending is not None and (first.record is None or first.record.round <= pending):
            target = pending  # the other nodes are in (or coming to) that round: not the one after it
        else:
            if self._before_joining is not None and first.record is not None \
                    and first.record.rank_of(self._node) is None:
                ready, self._before_joining = self._before_joining, None
                ready()
            target = first.record.round + 1 if first.record is not None else 0
        self._silence.start(self._board.alive)
        self._board.arrive(target, self._node)  # at a pending round, the arrival it made (both boards keep its place)
        record = self._wait_for(target, started)
        store, rank, bootstrap = self._enter(record)
        self._torch_round = record
        logger.info("node %s joined round %d of the rendezvous '%s' as rank %d of %d in %.2f s",
                    node_name(self._node), record.round, self._settings.run_id, rank, len(record.members),
                    time.monotonic() - started)
        self._announce(RoundAnnouncement(record.round, rank, len(record.members), bootstrap.master_addr,
                                         bootstrap.master_port, in_process=False, reason="started by torchrun"))
        return RendezvousInfo(store, rank, len(record.members), bootstrap)

    def _enter(self, record: RoundRecord) -> tuple[Store, int, RendezvousStoreInfo]:
        """Make `record`, which holds this node, its round: the round's store for torch's agent, this
        node's rank, and where the workers' store is (group rank 0 picks a free port and publishes it;
        asked again for the same round, the same answer). Then expect the workers' verdicts of
        that round and probe the fellow members' beacons."""
        rank = record.rank_of(self._node)
        assert rank is not None
        store = PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{record.round}", self._board.store)
        if record == self._round and self._store_info is not None:
            bootstrap = self._store_info
        else:
            bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._node.addr)
        self._silence.expect(self._settings.run_id, bootstrap.master_addr, bootstrap.master_port, rank, record)
        # Each member probes the others starting after itself: in one order, every member connected to the
        # same beacon at once (255 connections into one listen backlog at 256 nodes).
        self._witness.observe_soon(self._board.alive, record.members[rank + 1:] + record.members[:rank])
        self._round, self._store_info = record, bootstrap
        return store, rank, bootstrap

    def _wait_for(self, target: int, started: float) -> RoundRecord:
        """Wait until a round holds this node; arrive again at the next round when one closes without
        it (a spare, or a late arrival)."""
        deadline = started + self._settings.join_timeout
        return self._await_round(target, deadline, f"join_timeout={self._settings.join_timeout:g} s",
                                 self._poll_s, follow=True)

    def _await_round(self, target: int, deadline: float, limit: str, poll_s: float, follow: bool) -> RoundRecord:
        """The record of the first round >= `target` that closes, looking every `poll_s` and closing
        `target` when this node is its closer. `follow`: a round that closes without this node (or a
        later one) makes it arrive at the round after and wait on; else that record is returned.
        RendezvousTimeoutError past `deadline` (`limit` says what set it), not while a spare."""
        seen, quiet_since = -1, time.monotonic()
        while True:
            view = self._board.view(target)
            if view.closed:
                raise RendezvousClosedError(f"the rendezvous '{self._settings.run_id}' is closed")
            record = view.record
            if record is not None and record.round >= target:
                if not follow or (record.rank_of(self._node) is not None and record.round == target):
                    return record
                target = record.round + 1
                self._board.arrive(target, self._node)
                seen, quiet_since = -1, time.monotonic()
                continue
            if view.arrived != seen:
                seen, quiet_since = view.arrived, time.monotonic()
            if view.first == node_name(self._node) and view.arrived >= self._settings.min_nodes:
                self._try_to_close(target, view, time.monotonic() - quiet_since)
            spare = record is not None and len(record.members) >= self._settings.max_nodes \
                and record.rank_of(self._node) is None
            if not spare and time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"no round of the rendezvous '{self._settings.run_id}' took node {node_name(self._node)} "
                    f"within {limit} ({view.arrived} arrived, min_nodes={self._settings.min_nodes})")
            time.sleep(poll_s)

    def _try_to_close(self, target: int, view: BoardView, quiet_for: float) -> None:
        arrivals = self._board.arrivals(target)
        alive: set[NodeDesc] = set()
        if view.record is not None:
            ports = self._board.alive()
            arrived = set(arrivals)
            asked = self._silence.asked(view.record)
            suspects = {m: ports[m] for m in view.record.members if m in ports and m not in arrived | asked}
            alive = set(ports) - self._witness.exited(suspects) - self._silence.silent(view.record)
        if may_close(arrivals, view.record, alive, self._settings, quiet_for):
            record = closed_round(target, arrivals, view.record, self._settings.max_nodes)
            if self._board.close_round(record, view.token):
                logger.info("node %s closed round %d of '%s': %d members, %d spares", node_name(self._node),
                            target, self._settings.run_id, len(record.members), len(record.spares))

    def is_closed(self) -> bool:
        """See base class."""
        return self._board.is_closed()

    def set_closed(self) -> None:
        """See base class."""
        self._board.set_closed()

    def num_nodes_waiting(self) -> int:
        """See base class. 0 before this node's first round. Spares beyond a full round count once a
        member of it is no longer alive (torch moves them to its wait list then): the survivors
        restart for the spare, whether or not their workers noticed the loss. Liveness is read
        only then, while spares wait. Also looks for this node's workers' verdict (`silence`).

        With `in_process` on and every local worker capable, a lost member is answered here instead:
        the next round is run in process, for up to `REFORM_TIMEOUT_S` ("In-process rounds" in the
        module docstring); 0 when this node's workers re-form in it, else at least 1 (torch restarts
        them). Never raises for the in-process round: torch ends the agent on any error here (findings.md 4)."""
        if self._round is None:
            return 0
        try:
            self._silence.start(self._board.alive, early=True)
        except Exception:  # torch ends the agent on any error here (findings.md 4); verdicts only hasten recovery
            if not self._verdict_fault_logged:
                logger.exception("could not read this node's workers' verdicts (logged once); silent nodes are left "
                                 "out when their leases end")
                self._verdict_fault_logged = True
        current = self._round
        waiting = self._board.waiting(current.round + 1)
        count = waiting_count(waiting, current, self._settings.max_nodes)
        if count == 0 and waiting:
            alive = self._board.alive()
            if any(member not in alive for member in current.members):
                count = len(waiting)
        if self._settings.in_process and self._reform_wanted(current, waiting, count):
            return self.reform_in_process(current, count)
        return count

    # --- in-process rounds (module docstring) --------------------------------------------------

    def _mark_key(self, round_number: int, node: NodeDesc) -> str:
        """The board store's key that says `node` arrived at `round_number` for an in-process round."""
        return f"rdzv/{self._settings.run_id}/in_process/{round_number}/{node_name(node)}"

    def _marks(self, round_number: int, nodes: list[NodeDesc]) -> list[tuple[int, int, int]]:
        """The in-process marks of `nodes` at `round_number` (all there: `_unmarked` said so), one
        request: (torch's round its agent holds, that round's members, its number of workers) each
        (`_torch_round_mark`)."""
        marks = self._board.store.multi_get([self._mark_key(round_number, node) for node in nodes])
        return [tuple(int(part) for part in bytes(mark).split()) for mark in marks]

    def _outcome_key(self, round_number: int) -> str:
        """The board store's key that says, once for every node, whether `round_number` was taken in process."""
        return f"rdzv/{self._settings.run_id}/in_process_outcome/{round_number}"

    def _unmarked(self, round_number: int, nodes: tuple[NodeDesc, ...] | list[NodeDesc]) -> list[NodeDesc]:
        """Those of `nodes` that arrived at `round_number` without the in-process mark (one request
        when all have it). `check`, not `get`: a get of a missing key waits for the store's timeout."""
        store = self._board.store
        if store.check([self._mark_key(round_number, node) for node in nodes]):
            return []
        return [node for node in nodes if not store.check([self._mark_key(round_number, node)])]

    def _reform_wanted(self, current: RoundRecord, waiting: list[NodeDesc], count: int) -> bool:
        """Whether to run round `current + 1` in process now: every local worker is capable, and one
        of them asked for it (its group of `current` broke), or nodes wait at it: newcomers that the
        round would take (`count` > 0: not spares of a full round), or members of `current` that run
        it in process (each waiting member has the in-process mark); and no node decided that
        round's outcome yet, or one decided a restart while this node's workers asked (they are told
        at once). False (today's answer) when that cannot be read."""
        try:
            if current.rank_of(self._node) is None or round_handoff.all_workers_capable(self.agent_pid) is None:
                return False
            requests = round_handoff.reform_requests(self.agent_pid).values()
            asked = any(request.broken_round == current.round for request in requests)
            members_waiting = [node for node in waiting if node in current.members]
            joining = count > 0 and len(members_waiting) < len(waiting)
            if not asked and not ((joining or members_waiting)
                                  and not self._unmarked(current.round + 1, members_waiting)):
                return False
            outcome = self._outcome_key(current.round + 1)
            if not self._board.store.check([outcome]):
                return True  # not decided yet
            # Decided a restart by another node while this node's workers wait for an answer: follow it
            # now (they would wait for their own deadline); `reform_in_process` comes to the same outcome.
            return asked and bytes(self._board.store.get(outcome)) != IN_PROCESS_OUTCOME
        except Exception:  # never raise to torch's monitor loop (findings.md 4)
            if not self._reform_fault_logged:
                logger.exception("could not tell whether to re-form in process (logged once); torchrun restarts "
                                 "this node's workers on a change of membership instead")
                self._reform_fault_logged = True
            return False

    def reform_in_process(self, current: RoundRecord, count: int) -> int:
        """Run round `current + 1` in process; 0 when this node's workers re-form in it, else
        `max(count, 1)` once they were told to exit (torch restarts them, into that round). Called
        by `num_nodes_waiting`; public so that the agent's metrics count these rounds
        (agent/rendezvous_metrics.py)."""
        started, target = time.monotonic(), current.round + 1
        record: RoundRecord | None = None
        try:
            self._silence.start(self._board.alive)
            problem = self._workers_alone_silent(current)
            if self._board.store.check([self._outcome_key(target)]):  # (only ever a restart, `_reform_wanted`)
                problem = f"another node gave round {target} up"
            if problem is None:
                # Before the arrival: readers trust it. It says which of torch's rounds this node's agent
                # holds, for the exit barriers (`_settle_exit_barriers`).
                self._board.store.set(self._mark_key(target, self._node), self._torch_round_mark())
                self._board.arrive(target, self._node)
                record, problem = self._close_in_process(current)
            if problem is None and round_handoff.all_workers_capable(self.agent_pid) is None:
                # (a worker that failed otherwise while the round ran: torchrun restarts it, into this round)
                problem = "a worker of this node ended or withdrew during the round"
            taken = self._agree(target, problem is None)
            if taken and record is None:  # this node gave up, but another one had taken the round in process
                record = self._board.view(target).record
                problem = "no round record" if record is None else self._not_in_process(record, current)
            elif not taken and problem is None:
                problem = f"another node gave round {target} up"
            if problem is None:
                self._reformed(record, current, started)
                return 0
        except Exception as exc:  # noqa: BLE001 - never raise to torch's monitor loop (findings.md 4)
            problem = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):  # so that no other node takes the round in process without this one
                self._agree(target, False)
        self._pending = target
        logger.warning("node %s: round %d of '%s' is not run in process (%s); torchrun restarts this node's workers",
                       node_name(self._node), target, self._settings.run_id, problem)
        if self._announced is not None:
            self._announce(dataclasses.replace(self._announced, round=target, in_process=False, reason=problem))
        return max(count, 1)

    def _workers_alone_silent(self, current: RoundRecord) -> str | None:
        """Why the round cannot be taken in process when this node's workers named a member of
        `current` silent whose beacon answers (None: none did). Its agent runs, and would take the
        round in process for workers that never come; only torchrun's restart ends them. Decided
        before this node arrives, so before any node can take the round (the round waits for
        this node, a live member), and after this node's beacon questions (`ANSWER_S` at most)."""
        alone = self._silence.answering(current, 2 * ANSWER_S)
        if not alone:
            return None
        return f"node {node_name(min(alone))}'s workers were found silent while its agent answers"

    def _close_in_process(self, current: RoundRecord) -> tuple[RoundRecord | None, str | None]:
        """Wait (and close, as the closer) round `current + 1`, already arrived at: its record, or None
        after `REFORM_TIMEOUT_S`; and why it cannot be taken in process (None: it can)."""
        target = current.round + 1
        try:
            record = self._await_round(target, time.monotonic() + REFORM_TIMEOUT_S,
                                       f"{REFORM_TIMEOUT_S:g} s (an in-process round)", REFORM_POLL_S, follow=False)
        except RendezvousTimeoutError as exc:
            return None, str(exc)
        return record, self._not_in_process(record, current)

    def _agree(self, round_number: int, in_process: bool) -> bool:
        """Whether every node takes `round_number` in process: the first node to decide writes the
        outcome (one `compare_set`), the others follow it. `in_process`: what this node would do."""
        verdict = IN_PROCESS_OUTCOME if in_process else b"restart"
        return bytes(self._board.store.compare_set(self._outcome_key(round_number), "", verdict)) == IN_PROCESS_OUTCOME

    def _not_in_process(self, record: RoundRecord, current: RoundRecord) -> str | None:
        """Why the workers cannot re-form in process in `record`, the round closed after `current`;
        None if they can: it holds this node, and every member of `current` in it arrived for it in
        process (newcomers come through torchrun's `next_rendezvous`, their workers fresh)."""
        target = current.round + 1
        if record.round != target or record.rank_of(self._node) is None:
            return f"round {record.round} closed without this node"
        unmarked = self._unmarked(target, [node for node in record.members if node in current.members])
        if unmarked:
            return f"node {unmarked[0]} arrived at round {target} with its workers stopped"
        return None

    def _reformed(self, record: RoundRecord, current: RoundRecord, started: float) -> None:
        """This node's workers re-form in `record`: enter it, answer the newcomers' torch agents'
        rank assignment, settle torch's exit barriers (the first member of `record` that was in
        `current`: a newcomer may be group rank 0), and tell the workers."""
        store, rank, bootstrap = self._enter(record)
        newcomers = [node for node in record.members if node not in current.members]
        old_members = [node for node in record.members if node not in newcomers]
        marks = self._marks(record.round, old_members)
        if newcomers:
            first_rank, world_size = self._assign_ranks_as_torch(store, rank, len(record.members))
        else:  # the members' workers in group-rank order, as torch's assignment orders them
            workers = [mark[2] for mark in marks]
            first_rank, world_size = sum(workers[:rank]), sum(workers)
        if self._node == old_members[0]:
            self._settle_exit_barriers(record, len(newcomers), marks)
        round_handoff.clear_requests(self.agent_pid)  # before the round: a request of the new round must stay
        self._announce(RoundAnnouncement(record.round, rank, len(record.members), bootstrap.master_addr,
                                         bootstrap.master_port, in_process=True, joined=len(newcomers),
                                         first_rank=first_rank, world_size=world_size))
        logger.info("node %s re-formed round %d of '%s' in process: rank %d of %d (%d new) in %.2f s",
                    node_name(self._node), record.round, self._settings.run_id, rank, len(record.members),
                    len(newcomers), time.monotonic() - started)

    def _assign_ranks_as_torch(self, store: Store, rank: int, world_size: int) -> tuple[int, int]:
        """Take this node's part in the rank assignment that a newcomer's torch agent runs on the
        round's store after `next_rendezvous` (`torch_internals.take_part_in_rank_assignment`): (the
        global rank of this node's first worker, the world size), which its re-formed workers take."""
        local_world_size = round_handoff.all_workers_capable(self.agent_pid)
        if local_world_size is None:
            raise RendezvousError("a worker of this node ended before the newcomers' ranks were assigned")
        return take_part_in_rank_assignment(store, rank, world_size, local_world_size,
                                            timedelta(seconds=REFORM_TIMEOUT_S))

    def _torch_round_mark(self) -> bytes:
        """The in-process mark's value: "<round> <members> <workers>": the round torch's agent holds (set
        with this node's first round, before any round in process), its number of members, and this
        node's number of workers."""
        held, workers = self._torch_round, round_handoff.all_workers_capable(self.agent_pid)
        assert held is not None
        if workers is None:
            raise RendezvousError("a worker of this node ended before the round")
        return f"{held.round} {len(held.members)} {workers}".encode()

    def _settle_exit_barriers(self, record: RoundRecord, newcomers: int, marks: list[tuple[int, int, int]]) -> None:
        """Make torch's exit barriers end for the members of `record`, which hold different rounds
        of torch's: the survivors the round torch last started them in, the newcomers `record`.
        torch's agent waits at the end of the job until as many agents as its round had reached
        the barrier of that round (`torch_internals.exit_barrier_keys`); nodes lost since, or
        members that went on to a later round in process, never will. So for each of torch's
        rounds that members of `record` hold, the missing count is credited once (a credit key per
        round remembers what earlier in-process rounds added): else they would wait out the
        barrier's timeout (300 s). A member then waits at the end only for the members that hold
        the same round of torch's (a newcomer for nobody). `marks`: the old members' (`_marks`)."""
        rounds_held = [(record.round, len(record.members))] * newcomers  # (torch's round, its members)
        rounds_held += [(torch_round, members) for torch_round, members, _ in marks]
        held: dict[int, list[int]] = {}  # torch's round -> [its members, members of `record` that hold it]
        for torch_round, members in rounds_held:
            held.setdefault(torch_round, [members, 0])[1] += 1
        for torch_round, (members, holding) in held.items():
            credit_key = f"rdzv/{self._settings.run_id}/exit_barrier_credit/{torch_round}"
            missing = members - holding - self._board.store.add(credit_key, 0)
            if missing <= 0:
                continue
            self._board.store.add(credit_key, missing)
            counter, last_member = exit_barrier_keys()
            store = PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{torch_round}", self._board.store)
            # >=, where torch's barrier has ==: a node lost while it waited at the barrier counts twice.
            if store.add(counter, missing) >= members:
                store.set(last_member, "<val_ignored>")

    def _open_handoff(self) -> None:
        """Empty this agent's hand-off directory (torch starts fresh workers); nothing with `in_process` off."""
        self._announced = None
        if not self._settings.in_process:
            return
        try:
            round_handoff.open_handoff(self.agent_pid)
        except OSError as exc:
            logger.warning("this node's workers cannot re-form in process (%s); torchrun restarts them on a change "
                           "of membership", exc)

    def _announce(self, announcement: RoundAnnouncement) -> None:
        """Tell this node's workers `announcement` (round.json), if the hand-off directory is there."""
        if not self._settings.in_process:
            return
        try:
            round_handoff.publish_round(self.agent_pid, announcement)
        except OSError as exc:
            logger.warning("could not tell this node's workers round %d: %s", announcement.round, exc)
            return
        self._announced = announcement

    def get_run_id(self) -> str:
        """See base class."""
        return self._settings.run_id

    def shutdown(self) -> bool:
        """See base class. Closes the rendezvous for every node, as torch's handler does (torchrun calls
        this when its agent ends without a signal: the job succeeded here, or this node ran out of
        restarts; docs/failure-semantics.md, "When torchrun closes the rendezvous for everyone"), then
        revokes this node's liveness: its keys go at once."""
        self._witness.close()
        self._silence.forget()
        if self._settings.in_process:
            round_handoff.close_handoff(self.agent_pid)
        try:
            self._board.set_closed()
            self._board.leave()
        except RendezvousError as exc:  # the keys then expire with the lease
            logger.warning("the rendezvous '%s' could not remove node %s's keys: %s", self._settings.run_id,
                           node_name(self._node), exc)
            return False
        return True
