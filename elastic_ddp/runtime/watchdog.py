"""The peer watchdog: a frozen or dead peer stops this worker within a bound, whatever the collectives.

A peer that dies makes gloo raise at once, but one that freezes (SIGSTOP, a hung driver, a network
partition that keeps sockets open) leaves the survivors waiting in their next collective until the
collective timeout (60 s by default), and NCCL usually waits like that for a dead peer too. So each
rank runs `PeerWatchdog`, a heartbeat thread that, every `interval_s`:

- writes its heartbeat, a counter, under its rank in the worker group's store (the TCPStore every
  worker already reaches at MASTER_ADDR:MASTER_PORT, through a connection of its own); and
- reads every other rank's heartbeat in one request, and notes, by its own clock, when each one
  last changed.

and a watching thread that never touches the store: a TCPStore request to a store that is cut off
by a partition, or whose process is frozen, can block for ever whatever its timeout, so the
heartbeat thread may block while the watching one goes on judging. The watching thread judges each
read as it comes and wakes at the earliest deadline.

A peer whose heartbeat has not changed for `bound_s` is *silent*: counted from the read that first
showed its last change, and confirmed by a read asked for after that deadline (the watching thread
asks the heartbeat thread for one at once), so a heartbeat thread starved of CPU, which read nothing
meanwhile, delays the verdict and never makes it; a store that closed its connections (its host,
rank 0's worker, ended: often its own watchdog fired on the same peer a moment earlier) can confirm
nothing, and a deadline alone is enough then. All peers are silent when a request to the store has
waited unanswered for `bound_s` (its host is frozen, gone or cut off). Then the watchdog calls
`on_silent(reason, connected)` once, from the watching thread; `connected`: the store answered the
read that found the peers silent, so this node is not the one cut off (a store that does not
answer, or closed its connection, leaves that open). A worker that re-forms in process asks its
agent for a round without the silent node when connected (training/stop_guard.py); any other
keeps its last committed step in node memory and ends with `SILENT_PEER_EXIT_CODE`, the same way
out as a failed collective, so torchrun re-forms the group without the silent node and nothing
committed is lost.
With a `verdict_address`, it first sends there which nodes were silent (`elastic_ddp.handoff.verdicts`: their
`GROUP_RANK`s, which every heartbeat carries; rank 0's node when the store went silent), for this
node's torchrun agent: our rendezvous (elastic-c10d, etcd-v3) then leaves such a node out of the
next round as soon as the node's beacon does not answer either, instead of waiting for its lease
to expire (elastic_ddp/agent/rendezvous/silence.py); it names them as suspects `SUSPECT_LEAD_S` before.
`on_gap(seconds)`, when given, is called from the same thread each time a live peer's heartbeat
gap sets a new longest (`longest_gap_s`): what the layer above reports (the live metrics).

Its heartbeats also carry each rank's pace, its own time per sample (`pace`, given by the
training layer: training/stragglers.py), and it hands every rank's, as read, to `on_paces`: so the
straggler judge needs no collective and no thread of its own.

What it never does: judge a peer by how fast it trains. A heartbeat comes from a thread that does
nothing else, so a slow step, a long snapshot write or a busy CPU delays it by scheduling jitter
only; `bound_s` (default `--watchdog_timeout_s`) leaves a wide margin for that (docs/failure-semantics.md,
"The watchdog"). A rank that leaves training on its own (finished, drained, failed) marks its
heartbeat `left`, and its peers stop watching it. One that leaves the group for the agent's next
round, in process, marks it `switched after N`, N the committed step it left after: its peers
stop watching it too and hand N on (`on_switched`), so that every rank leaves after the same step
(a rank whose agent announced the round later would wait in step N + 1's collectives for it).
Heartbeats are stored per incarnation, so a store shared across rounds cannot mix them.

Cost: nothing on the training thread; per rank, one small write and one read of `world_size`
small values per `interval_s` on rank 0's store (tens of µs each on loopback), and one more of each
per deadline reached (a peer's, once).
Limits: the watchdog fires `bound_s` after the read that saw a frozen peer's last heartbeat (plus
one read's round trip and scheduling), which comes up to one `interval_s` after that heartbeat: so
between `bound_s` - `interval_s` and `bound_s` + `interval_s` after the freeze, and never before the
peer's heartbeat has stopped for `bound_s`. A process whose whole machine is frozen is left behind
by the others, and when it is thawed its own watchdog finds the others silent and ends it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from elastic_ddp.handoff.verdicts import SUSPECT_LEAD_S, send_suspicion, send_verdict

logger = logging.getLogger(__name__)

# EX_UNAVAILABLE from sysexits.h: a service this worker needs (a peer) is unavailable.
SILENT_PEER_EXIT_CODE = 69
LEFT = b"left"
# What a rank that left the group for the agent's next round, in process, writes in place of its
# heartbeat: the committed step it left after (its peers then leave after that step too).
SWITCHED_PREFIX = b"switched after "
# A heartbeat is b"<count>@<GROUP_RANK>": its writer's node travels with it, for the verdict; then,
# once its writer has one, b" <pace>": its own time per sample (training/stragglers.py), in seconds.
_NODE_SEPARATOR = b"@"
_PACE_SEPARATOR = b" "


def switched_after(heartbeat: bytes | None) -> int | None:
    """The committed step a `SWITCHED_PREFIX` heartbeat names, or None (any other heartbeat)."""
    if not heartbeat or not heartbeat.startswith(SWITCHED_PREFIX):
        return None
    text = heartbeat[len(SWITCHED_PREFIX):]
    return int(text) if text.isdigit() and len(text) < 19 else None


def node_rank_of(heartbeat: bytes | None) -> int | None:
    """The GROUP_RANK a heartbeat names, or None (none yet, `LEFT`, or a heartbeat without one)."""
    if not heartbeat or _NODE_SEPARATOR not in heartbeat:
        return None
    text = heartbeat.partition(_PACE_SEPARATOR)[0].rpartition(_NODE_SEPARATOR)[2]
    return int(text) if text.isdigit() and len(text) < 10 else None


def pace_of(heartbeat: bytes | None) -> float | None:
    """The pace a heartbeat carries (positive and finite), or None."""
    if not heartbeat or _PACE_SEPARATOR not in heartbeat or heartbeat.startswith(SWITCHED_PREFIX):
        return None
    text = heartbeat.partition(_PACE_SEPARATOR)[2]
    try:
        pace = float(text) if len(text) < 32 else None
    except ValueError:
        return None
    return pace if pace is not None and 0 < pace < float("inf") else None


class _Answer(NamedTuple):
    """One read of the peers' heartbeats: when it was asked for and answered (monotonic), what."""
    asked_at: float
    answered_at: float
    values: dict[int, bytes | None]


class _Judge:
    """The watching thread's view of the peers: when each one's heartbeat last changed, by this
    process's clock (the answer that first showed the new value), and which ones are silent."""

    def __init__(self, peers: list[int], bound_s: float, started: float, on_gap: Callable[[float], None]):
        self.bound_s = bound_s
        self.last_value: dict[int, bytes | None] = {rank: None for rank in peers}
        self.changed_at = {rank: started for rank in peers}  # watched peers only: `left` ones go
        self.longest_gap_s = 0.0
        self.switches: list[int] = []  # steps after which peers left for the next round, not yet handed on
        self._on_gap = on_gap
        self._asked_for: float | None = None
        self._suspected_for: float | None = None

    def read(self, answer: _Answer) -> list[int]:
        """Take one answer in; the peers it finds silent: unchanged, and asked for at least
        `bound_s` after their last change (so their heartbeat really stopped for the bound, whenever
        this process got to read it)."""
        silent = []
        for rank, value in answer.values.items():
            if rank not in self.changed_at:
                continue
            if value == LEFT:
                del self.changed_at[rank]
            elif (step := switched_after(value)) is not None:
                del self.changed_at[rank]
                self.switches.append(step)
            elif value != self.last_value[rank]:
                gap = answer.answered_at - self.changed_at[rank]
                if self.last_value[rank] is not None and gap > self.longest_gap_s:
                    self.longest_gap_s = gap
                    self._on_gap(gap)
                self.last_value[rank], self.changed_at[rank] = value, answer.answered_at
            elif answer.asked_at >= self.changed_at[rank] + self.bound_s:
                silent.append(rank)
        return silent

    def deadline(self) -> float | None:
        """When the first watched peer becomes silent unless a read shows it changed; None if none is watched."""
        return min(self.changed_at.values()) + self.bound_s if self.changed_at else None

    def past_deadline(self, now: float) -> list[int]:
        return sorted(rank for rank, changed_at in self.changed_at.items() if now >= changed_at + self.bound_s)

    def ask_for(self, deadline: float) -> bool:
        """Whether to ask for a read at once for `deadline` (once per deadline: the cost stays one read)."""
        if self._asked_for == deadline:
            return False
        self._asked_for = deadline
        return True

    def suspect_for(self, deadline: float) -> bool:
        """Whether to name the peers near `deadline` as suspects (once per deadline)."""
        if self._suspected_for == deadline:
            return False
        self._suspected_for = deadline
        return True

    def nodes_of(self, ranks: list[int]) -> set[int | None]:
        return {node_rank_of(self.last_value[rank]) for rank in ranks}


class PeerWatchdog:
    """Heartbeats of every rank of one incarnation through the worker group's store (module docstring)."""

    def __init__(self, rank: int, world_size: int, incarnation: int, bound_s: float,
                 on_silent: Callable[[str, bool], None], interval_s: float | None = None,
                 store: dist.Store | None = None, on_gap: Callable[[float], None] | None = None,
                 node_rank: int | None = None, verdict_address: bytes | None = None,
                 on_switched: Callable[[int], None] | None = None, pace: Callable[[], float | None] | None = None,
                 on_paces: Callable[[dict[int, tuple[float, int | None]]], None] | None = None):
        self.rank, self.world_size = rank, world_size
        self.bound_s = bound_s
        self.interval_s = interval_s if interval_s is not None else min(1.0, bound_s / 8)
        self.on_silent = on_silent
        self.on_gap = on_gap
        self.on_switched = on_switched
        self.pace, self.on_paces = pace, on_paces  # this rank's pace, to carry; every rank's, as read
        self.node_rank = node_rank  # this rank's GROUP_RANK, carried by its heartbeats
        self.verdict_address = verdict_address
        self._suspect_lead_s = min(SUSPECT_LEAD_S, bound_s / 2)
        self._store = store
        self._prefix = f"elastic_ddp/runtime/watchdog/{incarnation}/"
        self._stop = threading.Event()
        self._read_now = threading.Event()  # the watching thread asks for a read at once (or stop)
        self._news = threading.Condition()  # guards the three below; notified at each answer and at stop
        self._answer: _Answer | None = None  # the newest read of the peers' heartbeats
        self._asked_at: float | None = None  # when the oldest request still unanswered was made
        self._closed = False  # the store closed this connection: no read can come any more
        self._thread: threading.Thread | None = None  # watches
        self._exchanger: threading.Thread | None = None  # beats and reads
        self._beats = 0
        self._last_pace = ""  # the pace part of this rank's last heartbeat
        self.longest_gap_s = 0.0  # the longest a live peer's heartbeat stayed unchanged, for the record

    def start(self) -> PeerWatchdog:
        """Connect to the store, publish the first heartbeat and start watching (two threads)."""
        if self._store is None:
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=timedelta(seconds=max(1.0, self.interval_s * 2)),
                                        wait_for_workers=False)
        self._store = dist.PrefixStore(self._prefix, self._store)
        self._beat()
        self._exchanger = threading.Thread(target=self._exchange, name="elastic-ddp-heartbeat", daemon=True)
        self._thread = threading.Thread(target=self._watch, name="elastic-ddp-watchdog", daemon=True)
        self._exchanger.start()
        self._thread.start()
        return self

    def stop(self, wait: bool = True, switched_after: int | None = None) -> None:
        """Stop watching (and heartbeating): after the bound, peers find this rank silent. `wait`:
        for the threads to end, a few intervals at most; not when the group is left for another (a
        heartbeat thread blocked on a frozen store never ends, and the threads are daemons).
        `switched_after`: this rank leaves the group for the agent's next round, in process, after
        that committed step; its peers are told so in place of its heartbeat (`on_switched`), from a
        thread of its own that nothing waits for (the store may not answer)."""
        self._stop.set()
        self._wake()
        for thread in (self._thread, self._exchanger) if wait else ():
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self.interval_s * 4)
        if switched_after is not None:
            self._mark(SWITCHED_PREFIX + str(switched_after).encode(), wait_s=0)

    def _mark(self, value: bytes, wait_s: float) -> None:
        """Write `value` in place of this rank's heartbeat, from a thread of its own (the store may
        not answer), once the heartbeat thread's last beat is done (it must not overwrite the
        mark); wait at most `wait_s` for the write."""
        def mark() -> None:
            if self._exchanger is not None:
                self._exchanger.join(timeout=self.bound_s)
            try:
                self._store.set(str(self.rank), value)
            except Exception as exc:  # noqa: BLE001 - the group may be gone already; nothing to tell then
                logger.debug("could not mark rank %d as %r: %s", self.rank, value, exc)
        marking = threading.Thread(target=mark, name="elastic-ddp-watchdog-mark", daemon=True)
        marking.start()
        marking.join(timeout=wait_s)

    def leave(self) -> None:
        """This rank stops training on its own: peers stop watching it; this watchdog stops. Waits
        at most a few intervals for the store (a store cut off from this node never answers)."""
        self.stop()
        # A warning when the margin to the bound got thin, so that every rank reports it.
        log = logger.warning if self.longest_gap_s > self.bound_s / 2 else logger.info
        log("peer watchdog: the longest a peer's heartbeat stayed unchanged was %.2f s (bound %g s)",
            self.longest_gap_s, self.bound_s)
        self._mark(LEFT, wait_s=self.interval_s * 4)

    def _wake(self) -> None:
        self._read_now.set()
        with self._news:
            self._news.notify_all()

    def _beat(self) -> None:
        self._beats += 1
        node = "" if self.node_rank is None else f"{_NODE_SEPARATOR.decode()}{self.node_rank}"
        pace = self.pace() if self.pace is not None else None
        self._last_pace = f"{_PACE_SEPARATOR.decode()}{pace:.6g}" if pace is not None else ""
        self._store.set(str(self.rank), f"{self._beats}{node}{self._last_pace}")

    def _exchange(self) -> None:
        """The heartbeat thread: beat and read the peers' heartbeats every interval, and at once when
        the watching thread asks (`_read_now`). A store request can block for ever (a TCPStore cut
        off by a partition, or whose process is frozen, never answers, whatever its timeout: seen
        with torch 2.13), so the watching happens elsewhere."""
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        while True:
            self._read_now.wait(self.interval_s)
            self._read_now.clear()  # a read asked for before this point is the one below
            if self._stop.is_set():
                return
            asked_at = time.monotonic()
            with self._news:
                if self._asked_at is None:
                    self._asked_at = asked_at  # cleared once the store answered
            try:
                self._beat()
                values = self._read(peers)
            except Exception as exc:  # noqa: BLE001 - a store that does not answer is what is watched
                logger.debug("peer watchdog: the store did not answer: %s", exc)
                if isinstance(exc, dist.DistNetworkError):  # refused, reset, broken pipe: its process ended
                    with self._news:
                        self._closed = True
                        self._news.notify_all()
                continue
            with self._news:
                self._answer = _Answer(asked_at, time.monotonic(), values)
                self._asked_at, self._closed = None, False
                self._news.notify_all()

    def _watch(self) -> None:
        """The watching thread: judges each new read of the other thread as it comes, and wakes at the
        earliest deadline (a watched peer's last change + `bound_s`, the oldest unanswered request
        + `bound_s`), without ever waiting on the store itself. A peer is found silent only by a read
        asked after its deadline: at the deadline this thread asks for one at once, so a heartbeat
        thread starved of CPU (it read nothing since) delays the verdict instead of making it."""
        judge = _Judge([rank for rank in range(self.world_size) if rank != self.rank], self.bound_s,
                       time.monotonic(), self._new_longest_gap)
        judged: _Answer | None = None
        wake_at = time.monotonic()
        while True:
            with self._news:
                if self._answer is judged and not self._stop.is_set():
                    self._news.wait(max(0.0, wake_at - time.monotonic()))
                answer, asked_at, closed = self._answer, self._asked_at, self._closed
            if self._stop.is_set():
                return
            now = time.monotonic()
            # Counted from the first unanswered request, not from the last answer: a heartbeat
            # thread starved of CPU (it asked nothing) is not a silent store.
            if asked_at is not None and now - asked_at >= self.bound_s:
                self._fire(f"the worker group's store (rank 0's) has not answered for {now - asked_at:.1f} s "
                           "(cut off, frozen or gone)", silent_nodes={0}, connected=False)
                return
            if answer is not judged:
                judged = answer
                silent = judge.read(answer)
                self._hand_on_switches(judge)
                self._hand_on_paces(answer)
                if silent:
                    self._fire(f"rank(s) {silent} sent no heartbeat for over {self.bound_s:g} s (frozen, or gone "
                               "without closing their connections)", silent_nodes=judge.nodes_of(silent),
                               connected=True)
                    return
            deadline = judge.deadline()
            if deadline is not None and now >= deadline and closed:
                # No read can show a change any more: rank 0's worker ended (its own watchdog may
                # have fired a moment before this one would have, on the same silent peer).
                silent = judge.past_deadline(now)
                self._fire(f"rank(s) {silent} sent no heartbeat for over {self.bound_s:g} s that this rank could "
                           "see, and none can come: the worker group's store (rank 0's) closed its connection",
                           silent_nodes=judge.nodes_of(silent), connected=False)
                return
            if deadline is not None and now >= deadline and judge.ask_for(deadline):
                self._read_now.set()
            suspect_at = deadline - self._suspect_lead_s if deadline is not None and self.verdict_address else None
            if suspect_at is not None and now >= suspect_at and judge.suspect_for(deadline):
                self._suspect(judge.nodes_of(judge.past_deadline(now + self._suspect_lead_s)))
            # Past every deadline (a read asked for and not in yet, a request not yet made): look again
            # after an interval, as often as the heartbeat thread reads.
            store_deadline = asked_at + self.bound_s if asked_at is not None else None
            wake_at = min((t for t in (suspect_at, deadline, store_deadline) if t is not None and t > now),
                          default=now + self.interval_s)

    def _hand_on_switches(self, judge: _Judge) -> None:
        switches, judge.switches = judge.switches, []
        for step in switches:
            logger.info("peer watchdog: a peer left the group for the next round after step %d", step)
            if self.on_switched is not None:
                self.on_switched(step)

    def _hand_on_paces(self, answer: _Answer) -> None:
        """Every rank's pace (this one's included) as of this read, to `on_paces`."""
        if self.on_paces is None:
            return
        paces = {rank: (pace, node_rank_of(value)) for rank, value in answer.values.items()
                 if (pace := pace_of(value)) is not None}
        own = pace_of(self._last_pace.encode())
        if own is not None:
            paces[self.rank] = (own, self.node_rank)
        try:
            self.on_paces(paces)
        except Exception as exc:  # noqa: BLE001 - reporting must never stop the watching
            logger.warning("peer watchdog: judging the ranks' paces failed: %s", exc)

    def _new_longest_gap(self, gap_s: float) -> None:
        self.longest_gap_s = gap_s
        if self.on_gap is not None:
            try:
                self.on_gap(gap_s)
            except Exception as exc:  # noqa: BLE001 - reporting must never stop the watching
                logger.debug("peer watchdog: on_gap failed: %s", exc)

    def _read(self, peers: list[int]) -> dict[int, bytes | None]:
        """Every peer's heartbeat (None for a peer that has published none yet), in one request
        once all have published."""
        keys = [str(rank) for rank in peers]
        if not keys:
            return {}
        if self._store.check(keys):
            return dict(zip(peers, self._store.multi_get(keys)))
        return {rank: self._store.get(str(rank)) if self._store.check([str(rank)]) else None for rank in peers}

    def _suspect(self, nodes: set[int | None]) -> None:
        """Name `nodes` to this node's agent as suspects: it asks their beacons while this watchdog
        confirms (`elastic_ddp.handoff.verdicts`); a hint, which alone leaves nobody out."""
        named = {node for node in nodes if node is not None and node != self.node_rank}
        if named:
            try:
                send_suspicion(self.verdict_address, named)
            except OSError as exc:
                logger.debug("peer watchdog: could not name suspects to this node's agent: %s", exc)

    def _fire(self, reason: str, silent_nodes: set[int | None], connected: bool) -> None:
        logger.error("peer watchdog: %s: the group is re-formed without it", reason)
        self._stop.set()  # the heartbeat thread too: this worker is ending
        self._read_now.set()
        # This node's own rank never: its store going silent may be this node cut off.
        named = {node for node in silent_nodes if node is not None and node != self.node_rank}
        if self.verdict_address is not None and named:
            try:
                written = send_verdict(self.verdict_address, named)
                logger.info("peer watchdog: %s", f"node(s) {sorted(named)} named to this node's agent" if written
                            else "this node's agent reads no verdicts (not elastic_ddp's rendezvous): none sent")
            except OSError as exc:  # the agent then waits for the silent node's lease, as without a verdict
                logger.warning("peer watchdog: could not send the verdict to this node's agent: %s", exc)
        self.on_silent(reason, connected)
