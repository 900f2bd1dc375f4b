"""The peer watchdog (elastic_ddp/runtime/watchdog.py) on a real TCPStore in this process: a rank whose
heartbeat stops is found silent, one that left is not, and a store that stops answering counts as
every peer silent."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_ddp.handoff.verdicts import VerdictInbox, verdict_address
from elastic_ddp.runtime.watchdog import PeerWatchdog

pytestmark = pytest.mark.timeout(60)

BOUND_S, INTERVAL_S = 1.0, 0.05
QUIET_WINDOW_S = 4 * BOUND_S  # how long "never fires" is watched


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield server
    del server


def client(store) -> dist.TCPStore:
    # 5 s to connect: a loaded 2-core machine (load average 11) took over 1 s.
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))


def watchdogs(store, world_size: int, incarnation: int = 1):
    """One watchdog per rank; each records the reason it fired with."""
    fired = [threading.Event() for _ in range(world_size)]
    reasons: list[str | None] = [None] * world_size

    def on_silent(rank):
        def record(reason, connected):
            reasons[rank] = f"{reason} ({'connected' if connected else 'not connected'})"
            fired[rank].set()
        return record

    dogs = [PeerWatchdog(rank, world_size, incarnation, BOUND_S, on_silent(rank), INTERVAL_S, store=client(store))
            for rank in range(world_size)]
    return dogs, fired, reasons


def none_fire(fired: list[threading.Event], window_s: float) -> bool:
    """Whether any of `fired` was set within `window_s` (an event once set stays set)."""
    fired[0].wait(window_s)
    return any(event.is_set() for event in fired)


def test_live_peers_are_never_silent_and_a_stopped_one_is(store):
    dogs, fired, reasons = watchdogs(store, 3)
    for dog in dogs:
        dog.start()
    assert not none_fire(fired, QUIET_WINDOW_S / 3), reasons
    dogs[2].stop()  # frozen: no more heartbeats, no goodbye
    assert fired[0].wait(10) and fired[1].wait(10)
    assert "rank(s) [2] sent no heartbeat for over 1 s" in reasons[0] and reasons[0].endswith("(connected)")
    assert not fired[2].is_set()
    assert dogs[0].longest_gap_s < BOUND_S


def test_a_firing_watchdog_names_the_silent_ranks_nodes_in_its_verdict_for_the_agent(store):
    """Ranks 0 and 1 on node 0, rank 2 on node 1 (GROUP_RANK): rank 2 stops; rank 0's verdict
    names node 1, never its own node. Rank 1's agent reads no verdicts (torch's own c10d): nothing is
    bound at its address, and its watchdog sends nothing and still fires."""
    fired = [threading.Event() for _ in range(3)]
    addresses = [verdict_address("watchdog-test", "127.0.0.1", store.port, rank) for rank in range(3)]
    inboxes = {rank: VerdictInbox(addresses[rank]) for rank in (0, 2)}  # their agents read verdicts
    dogs = [PeerWatchdog(rank, 3, 1, BOUND_S, lambda reason, connected, rank=rank: fired[rank].set(), INTERVAL_S,
                         store=client(store), node_rank=rank // 2, verdict_address=addresses[rank]).start()
            for rank in range(3)]
    assert not none_fire(fired, QUIET_WINDOW_S / 4)
    dogs[2].stop()
    assert fired[0].wait(10) and fired[1].wait(10)
    assert inboxes[0].take() == {1}
    assert inboxes[0].suspects() == {1}  # named as suspect first, half a bound before (SUSPECT_LEAD_S)
    assert not inboxes[2].waiting()
    for dog in dogs[:2]:
        dog.stop()
    for inbox in inboxes.values():
        inbox.close()


def test_a_rank_that_left_is_not_watched(store):
    dogs, fired, reasons = watchdogs(store, 2)
    for dog in dogs:
        dog.start()
    dogs[1].leave()  # finished (or drained) on its own
    assert not fired[0].wait(QUIET_WINDOW_S), reasons
    dogs[0].leave()


def test_a_rank_that_switched_to_the_next_round_is_not_watched_and_its_step_is_handed_on(store):
    """A rank that leaves the group for the agent's next round in process tells its peers the
    committed step it left after, in place of its heartbeat: they stop watching it (never silent)
    and hear the step once, from `on_switched`."""
    fired = [threading.Event(), threading.Event()]
    switched: list[int] = []
    heard = threading.Event()
    dogs = [PeerWatchdog(rank, 2, 1, BOUND_S, lambda reason, connected, rank=rank: fired[rank].set(), INTERVAL_S,
                         store=client(store), on_switched=lambda step: switched.append(step) or heard.set()).start()
            for rank in range(2)]
    dogs[1].stop(wait=False, switched_after=759)
    assert heard.wait(10)
    assert not fired[0].wait(QUIET_WINDOW_S)
    assert switched == [759]
    dogs[0].leave()


def test_a_peer_that_never_published_is_silent_after_the_bound(store):
    dogs, fired, reasons = watchdogs(store, 2)
    dogs[0].start()  # rank 1 never starts
    assert fired[0].wait(10)
    assert "rank(s) [1]" in reasons[0]


def test_a_store_whose_process_ended_leaves_the_peers_deadlines_standing_without_a_read():
    """Rank 2 stops; then rank 0's worker, which hosts the store, ends (its own watchdog fired on
    rank 2 a moment before this one would have). The store refuses every request since, so no read
    can confirm rank 2's silence: rank 2's deadline alone makes it silent, instead of the store
    counting as silent one bound after the first refused request (3 s more in a benchmark run)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    dogs, fired, reasons = watchdogs(server, 3)
    for dog in dogs:
        dog.start()
    assert not none_fire(fired, QUIET_WINDOW_S / 8), reasons
    dogs[2].stop()
    assert not fired[1].wait(BOUND_S / 2)  # rank 0 beats on meanwhile
    del server
    assert fired[1].wait(15)
    assert "rank(s) [2] sent no heartbeat for over 1 s that this rank could see, and none can come: the worker " \
           "group's store (rank 0's) closed its connection (not connected)" in reasons[1]


def test_a_store_that_never_answers_stops_the_worker_within_the_bound(tmp_path):
    """A store cut off by a partition, or whose process is frozen, never answers: its requests
    block for ever whatever their timeout (a TCPStore whose process got SIGSTOP here). Before the
    heartbeats moved to a thread of their own the watchdog blocked with them and never fired."""
    port_file = tmp_path / "port"
    server = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
        "wait_for_workers=False); open(sys.argv[1], 'w').write(str(s.port)); time.sleep(600)"), str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text()):
            assert time.monotonic() < deadline and server.poll() is None, "the store process did not start"
            time.sleep(0.05)
        stores = [dist.TCPStore("127.0.0.1", int(port_file.read_text()), is_master=False,
                                timeout=timedelta(seconds=5)) for _ in range(2)]
        fired = [threading.Event(), threading.Event()]
        reasons: list[str] = []
        bound_s = 2 * BOUND_S  # the store is another process: round trips are slower on a loaded machine
        dogs = [PeerWatchdog(rank, 2, 1, bound_s, lambda reason, connected, rank=rank: (reasons.append(f"{reason} ({'connected' if connected else 'not connected'})"),
                                                                    fired[rank].set()),
                             INTERVAL_S, store=stores[rank]).start() for rank in range(2)]
        assert not fired[0].wait(QUIET_WINDOW_S / 4), reasons  # both beat: nothing to see
        server.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert fired[0].wait(10) and fired[1].wait(10), "the watchdog waited on the store"
        assert time.monotonic() - frozen_at < bound_s + 1.0
        assert "the worker group's store (rank 0's) has not answered" in reasons[0]
        assert reasons[0].endswith("(not connected)")  # this node may be the one cut off
        for dog in dogs:
            dog.stop()
    finally:
        server.kill()
        server.wait(timeout=10)


def test_heartbeats_of_another_incarnation_do_not_count(store):
    old, _, _ = watchdogs(store, 2, incarnation=1)
    for dog in old:
        dog.start()
    new, fired, reasons = watchdogs(store, 2, incarnation=2)
    new[0].start()  # rank 1 of the new incarnation never comes; the old one's heartbeats go on
    assert fired[0].wait(10) and "rank(s) [1]" in reasons[0]
    for dog in old:
        dog.stop()


def test_each_new_longest_gap_is_reported_through_on_gap(store):
    """The live metrics learn the watchdog's longest heartbeat gap from `on_gap` (runlog/metrics.py)."""
    gaps: list[float] = []
    reported = threading.Condition()

    def on_gap(seconds):
        with reported:
            gaps.append(seconds)
            reported.notify_all()

    dog = PeerWatchdog(0, 2, 1, BOUND_S, lambda reason, connected: None, INTERVAL_S, store=client(store), on_gap=on_gap).start()
    peer = dist.PrefixStore("elastic_ddp/runtime/watchdog/1/", client(store))
    peer.set("1", "1")
    with reported:  # a first gap is reported once the heartbeat changes after the watchdog saw it
        deadline = time.monotonic() + 10
        while not gaps and time.monotonic() < deadline:
            peer.set("1", str(int(peer.get("1")) + 1))
            reported.wait(INTERVAL_S)
    pause_s = BOUND_S / 2  # the scenario: one heartbeat half a bound late
    time.sleep(pause_s)
    peer.set("1", "100")
    # The watchdog sees a heartbeat change at its next poll: a gap it measures can be up to one
    # poll interval shorter than the pause (0.456 s for a 0.5 s pause on a 16-core machine); one more
    # interval of margin for the polling thread's scheduling.
    with reported:
        assert reported.wait_for(lambda: gaps[-1] >= pause_s - 2 * INTERVAL_S, timeout=10), gaps
    dog.leave()
    assert gaps == sorted(gaps) and len(set(gaps)) == len(gaps), gaps  # only new longest gaps
    assert dog.longest_gap_s == gaps[-1] < BOUND_S


class CountingStore(dist.Store):
    """A store in this process that counts the heartbeat thread's reads (`check`, which every read
    starts with) and lets a test hold every request (`held`): a store whose process stops answering."""

    def __init__(self) -> None:
        super().__init__()
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.reads = 0
        self.held = threading.Event()
        self.released = threading.Event()

    def _wait_if_held(self) -> None:
        if self.held.is_set():
            self.released.wait(30)

    def set(self, key, value):
        self._wait_if_held()
        with self._lock:
            self._values[key] = value

    def get(self, key):
        self._wait_if_held()
        with self._lock:
            return self._values[key]

    def check(self, keys):
        self._wait_if_held()
        with self._lock:
            self.reads += 1
            return all(key in self._values for key in keys)

    def multi_get(self, keys):
        self._wait_if_held()
        with self._lock:
            return [self._values[key] for key in keys]


class PausableEvent(threading.Event):
    """The heartbeat thread's wake-up, whose `wait` a test can hold: a heartbeat thread starved of
    CPU (it asks the store nothing meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = threading.Event()
        self.running.set()

    def wait(self, timeout=None):
        woken = super().wait(timeout)
        self.running.wait(30)
        return woken


def test_a_peer_is_found_silent_one_bound_after_its_last_change_was_seen_not_at_the_next_interval():
    """With heartbeats read every 10 s, a peer that stopped is still found silent about one bound
    after the read that saw its last change: the watching thread wakes at that deadline and asks for
    one read at once (two reads in all here, one per deadline), instead of waiting for the next
    interval (10-20 s before). Never earlier than the bound after that change was seen."""
    store = CountingStore()
    dist.PrefixStore("elastic_ddp/runtime/watchdog/1/", store).set("1", "7@1")  # rank 1's last heartbeat
    fired = threading.Event()
    fired_at: list[float] = []
    dog = PeerWatchdog(0, 2, 1, BOUND_S, lambda reason, connected: (fired_at.append(time.monotonic()), fired.set()),
                       interval_s=10.0, store=store)
    started = time.monotonic()
    dog.start()
    # Deadline 1 (start + bound): a read sees "7@1", a change from nothing; deadline 2, one bound
    # later: a read finds it unchanged. 3 s of margin for a loaded machine, far below the 10 s interval.
    assert fired.wait(2 * BOUND_S + 3.0), "not found silent before the next interval's read"
    assert fired_at[0] - started >= 2 * BOUND_S
    assert store.reads == 2
    dog.stop()


def test_a_starved_heartbeat_thread_makes_no_peer_silent():
    """The heartbeat thread held (starved of CPU: it reads nothing) for one and a half bounds while
    the peer beats on: the deadline passes, the watching thread asks for a read, none comes, and it
    waits; the first read after the hold sees the peer's new heartbeat, and nothing fires. Once the
    peer really stops, the watchdog fires."""
    store = CountingStore()
    peer = dist.PrefixStore("elastic_ddp/runtime/watchdog/1/", store)
    fired = threading.Event()
    dog = PeerWatchdog(0, 2, 1, BOUND_S, lambda reason, connected: fired.set(), INTERVAL_S, store=store)
    dog._read_now = starved = PausableEvent()
    beats = 0

    def beat_until(done: Callable[[], bool]) -> None:
        nonlocal beats
        deadline = time.monotonic() + 10
        while not done() and not fired.is_set():
            assert time.monotonic() < deadline
            beats += 1
            peer.set("1", f"{beats}@1")
            fired.wait(INTERVAL_S)

    dog.start()
    beat_until(lambda: store.reads >= 3)  # the watchdog has seen the peer beat
    starved.running.clear()
    held_at, reads = time.monotonic(), store.reads
    beat_until(lambda: time.monotonic() - held_at > 1.5 * BOUND_S)
    assert store.reads <= reads + 1  # at most the read that was under way
    starved.running.set()
    reads = store.reads
    beat_until(lambda: store.reads > reads + 1)  # a whole read after the hold
    assert not fired.is_set(), "the watchdog judged the peer by reads it never made"
    assert fired.wait(10), "a peer that stopped was not found silent"
    dog.stop()


def test_a_store_that_holds_every_request_stops_the_worker_about_one_bound_after_the_first_one():
    """Requests to the store that never return (its process frozen, or cut off): the watchdog fires
    about one bound after the first unanswered request was made, not after the next interval."""
    store = CountingStore()
    dist.PrefixStore("elastic_ddp/runtime/watchdog/1/", store).set("1", "1@1")
    reasons: list[str] = []
    fired = threading.Event()
    dog = PeerWatchdog(0, 2, 1, BOUND_S, lambda reason, connected: (reasons.append(f"{reason} ({'connected' if connected else 'not connected'})"),
                                                       fired.set()), interval_s=0.2,
                       store=store)
    dog.start()
    store.held.set()
    held_at = time.monotonic()
    try:
        assert fired.wait(10)
        # the first request held was made within an interval of the hold; 2 s of margin
        assert time.monotonic() - held_at < BOUND_S + 0.2 + 2.0
        assert "the worker group's store (rank 0's) has not answered" in reasons[0]
        assert reasons[0].endswith("(not connected)")  # this node may be the one cut off
    finally:
        store.released.set()
        dog.stop()
