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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
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

from elastic_ddp.agent.rendezvous.defaults import SYNC_POLL_S
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings, closed_round, may_close, waiting_count
from elastic_ddp.agent.rendezvous.silence import SilenceJudge
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord, node_name

logger = logging.getLogger(__name__)


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
    """See the module docstring. One instance per agent; `next_rendezvous` from one thread."""

    def __init__(self, board: RoundBoard, node: NodeDesc, settings: RendezvousSettings,
                 witness: ExitWitness | None = None, poll_s: float = SYNC_POLL_S) -> None:
        self._board = board
        self._witness = witness or ExitWitness(enabled=False)
        self._silence = SilenceJudge(self._witness)
        self._node = node
        self._settings = settings
        self._poll_s = poll_s
        self._round: RoundRecord | None = None  # the last round this node was a member of
        self._verdict_fault_logged = False
        self._before_joining: Callable[[], object] | None = None

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
        backend stays unreachable."""
        self._board.start(self._node, self._witness.port)
        started = time.monotonic()
        first = self._board.view(0)
        if first.closed:
            raise RendezvousClosedError(f"the rendezvous '{self._settings.run_id}' is closed")
        if self._before_joining is not None and first.record is not None and first.record.rank_of(self._node) is None:
            ready, self._before_joining = self._before_joining, None
            ready()
        target = first.record.round + 1 if first.record is not None else 0
        self._silence.start(self._board.alive)
        self._board.arrive(target, self._node)
        record = self._wait_for(target, started)
        rank = record.rank_of(self._node)
        assert rank is not None
        self._round = record
        # Each member probes the others starting after itself: in one order, every member connected to the
        # same beacon at once (255 connections into one listen backlog at 256 nodes).
        self._witness.observe_soon(self._board.alive, record.members[rank + 1:] + record.members[:rank])
        logger.info("node %s joined round %d of the rendezvous '%s' as rank %d of %d in %.2f s",
                    node_name(self._node), record.round, self._settings.run_id, rank, len(record.members),
                    time.monotonic() - started)
        store = PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{record.round}", self._board.store)
        bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._node.addr)
        self._silence.expect(self._settings.run_id, bootstrap.master_addr, bootstrap.master_port, rank, record)
        return RendezvousInfo(store, rank, len(record.members), bootstrap)

    def _wait_for(self, target: int, started: float) -> RoundRecord:
        """Wait until a round holds this node; arrive again at the next round when one closes without
        it (a spare, or a late arrival)."""
        deadline = started + self._settings.join_timeout
        seen, quiet_since = -1, time.monotonic()
        while True:
            view = self._board.view(target)
            if view.closed:
                raise RendezvousClosedError(f"the rendezvous '{self._settings.run_id}' is closed")
            record = view.record
            if record is not None and record.round >= target:
                if record.rank_of(self._node) is not None and record.round == target:
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
                    f"within join_timeout={self._settings.join_timeout:g} s ({view.arrived} arrived, "
                    f"min_nodes={self._settings.min_nodes})")
            time.sleep(self._poll_s)

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
        only then, while spares wait. Also looks for this node's workers' verdict (`silence`)."""
        if self._round is None:
            return 0
        try:
            self._silence.start(self._board.alive, early=True)
        except Exception:  # torch ends the agent on any error here (findings.md 4); verdicts only hasten recovery
            if not self._verdict_fault_logged:
                logger.exception("could not read this node's workers' verdicts (logged once); silent nodes are left "
                                 "out when their leases end")
                self._verdict_fault_logged = True
        waiting = self._board.waiting(self._round.round + 1)
        count = waiting_count(waiting, self._round, self._settings.max_nodes)
        if count == 0 and waiting:
            alive = self._board.alive()
            if any(member not in alive for member in self._round.members):
                return len(waiting)
        return count

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
        try:
            self._board.set_closed()
            self._board.leave()
        except RendezvousError as exc:  # the keys then expire with the lease
            logger.warning("the rendezvous '%s' could not remove node %s's keys: %s", self._settings.run_id,
                           node_name(self._node), exc)
            return False
        return True
