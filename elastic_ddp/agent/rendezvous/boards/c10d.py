"""The rendezvous's board in the c10d TCPStore (`StoreRoundBoard`), and
`create_elastic_c10d_handler`, what `--rdzv_backend=elastic-c10d` builds.

Keys of run `R`, under `rdzv/R/` in the store at `--rdzv_endpoint` (hosted as `c10d.store` says):

    latest                    a hint: the number of the last closed round (set by its closer)
    round/<n>                 round n's record (`state.RoundRecord`, JSON), written once, by its closer
    closed                    a counter, above 0 once `set_closed` was called
    arrivals/<n>/count        a counter: `add` hands each node arriving at round n a slot of its own
    arrivals/<n>/<slot>       the node in that slot (`state.encode_arrival`), or `WITHDRAWN`
    alive/<node>              the node's heartbeat: its name, beacon port and wall-clock time

Arriving is one atomic `add` and one `set` of the node's own slot; closing round n is one
`compare_set` of `round/<n>` from absent (the first closer wins; a second finds the record there),
then the `latest` hint. A waiting node checks every `SYNC_POLL_S` whether `round/<n>` exists
(`check`: one key, no value read) and reads two counters and the heartbeat of the earliest live
arrival (the closer): a constant number of requests of constant size, whatever the number of
nodes. Only the closer reads all the arrivals and their heartbeats, and those of the last round's
members (`alive`). The store's `wait` with a timeout
would do instead of `check`, but torch 2.13 logs two warning lines at every such timeout.

The store has no leases, so liveness is by heartbeat time, as in torch's dynamic rendezvous: a
thread rewrites the node's `alive` key every `keep_alive_interval` with its wall-clock time (on a
connection of its own), and a reader counts a node dead when that time is older than
`keep_alive_interval x keep_alive_max_attempt` by its own clock, or the node left (`leave` writes
time 0). The nodes' clocks must agree to well within that (5 s shipped), as with torch. Arrivals of
dead nodes are skipped, so a closer killed while it waits is replaced by the next live arrival
after the expiry; dead-node probes (`probes`) find a killed member sooner.

Every value read is decoded by `state` (JSON, schema checked); a record that does not decode
raises `RendezvousStateError`, an arrival or heartbeat that does not counts as no node. `counts`
counts this board's requests by kind, for the benchmarks, as `boards.etcd`'s.

Not guaranteed: the keys of past rounds stay in the store (about 100 bytes per node per round).
A store whose node is cut off while other nodes' beacons answer stops this node with one line
after `keep_alive_interval x keep_alive_max_attempt` seconds without an answer (`c10d.watch`); the
heartbeat thread's own requests are not watched.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from datetime import timedelta

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from elastic_ddp.agent.rendezvous import addresses
from elastic_ddp.agent.rendezvous.agent_setup import local_node, prepare_agent
from elastic_ddp.agent.rendezvous.c10d.store import create_tcp_store, endpoint_of, hosts_store
from elastic_ddp.agent.rendezvous.c10d.watch import StoreWatch
from elastic_ddp.agent.rendezvous.handler import BoardView, RoundRendezvousHandler
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import (
    NodeDesc,
    RoundRecord,
    decode_arrival,
    decode_heartbeat,
    decode_record,
    encode_alive,
    encode_arrival,
    node_name,
)

logger = logging.getLogger(__name__)

BACKEND_NAME = "elastic-c10d"
# Seconds `arrivals` waits for a slot taken but not yet written (the add and the set are two requests).
SLOT_WAIT_S = 1.0
# What a node writes into its slot at a round it no longer waits for: not an arrival (`state.decode_arrival`).
WITHDRAWN = b"withdrawn"



class StoreRoundBoard:
    """A `handler.RoundBoard` in a c10d store (module docstring). Thread-safe."""

    name = BACKEND_NAME

    def __init__(self, store: Store, run_id: str, settings: RendezvousSettings, watch: StoreWatch | None = None) -> None:
        self.store = store
        self._watch = watch  # runs the requests of this board's connection (not the heartbeats')
        self._base = f"rdzv/{run_id}/"
        self._settings = settings
        self._lock = threading.Lock()
        self._node: NodeDesc | None = None
        self._port: int | None = None
        self._slots: dict[int, int] = {}  # round -> this node's slot
        self._names: dict[str, NodeDesc | None] = {}  # slot key -> its node (None: not a valid arrival)
        self._dead: dict[int, set[int]] = collections.defaultdict(set)  # round -> slots found dead
        self._latest: RoundRecord | None = None
        self._counted: set[int] = set()  # rounds whose arrival counter exists
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None
        # Heartbeats on a connection of their own, opened now: opened by every agent at the start of
        # a round, 64 of them at once waited up to 10 s for the store to accept.
        self._beats = store.clone() if hasattr(store, "clone") else store
        self.counts: collections.Counter[str] = collections.Counter()
        self._add("closed", 0)

    # --- requests ----------------------------------------------------------------------------

    def _call(self, what: str, request):
        return request() if self._watch is None else self._watch.call(what, request)

    def _add(self, key: str, amount: int) -> int:
        self.counts["writes" if amount else "reads"] += 1
        return int(self._call("count", lambda: self.store.add(self._base + key, amount)))

    def _set(self, key: str, value: bytes, kind: str = "writes") -> None:
        self.counts[kind] += 1
        self._call("write a key", lambda: self.store.set(self._base + key, value))

    def _check(self, key: str) -> bool:
        self.counts["reads"] += 1
        return bool(self._call("check a key", lambda: self.store.check([self._base + key])))

    def _get_many(self, keys: list[str]) -> list[bytes]:
        """Values of `keys`, which must exist (a get of a missing key waits for the store's timeout)."""
        if not keys:
            return []
        self.counts["reads"] += 1
        return list(self._call("read keys", lambda: self.store.multi_get([self._base + key for key in keys])))

    # --- liveness ----------------------------------------------------------------------------

    def _heartbeat(self, at: float) -> bytes:
        assert self._node is not None
        return encode_alive(self._node, self._port, at=at)

    def start(self, node: NodeDesc, port: int | None) -> None:
        """See `RoundBoard`: write the heartbeat, start beating."""
        with self._lock:
            if self._beater is not None:
                return
            self._node, self._port = node, port
            self._set(f"alive/{node_name(node)}", self._heartbeat(time.time()))
            self._beater = threading.Thread(target=self._beat, args=(self._beats,), name="rdzv-heartbeat",
                                            daemon=True)
            self._beater.start()

    def _beat(self, store: Store) -> None:
        key = self._base + f"alive/{node_name(self._node)}"
        failing = False
        while not self._stop.wait(self._settings.keep_alive_interval):
            try:
                self.counts["refreshes"] += 1
                store.set(key, self._heartbeat(time.time()))
                failing = False
            except Exception as exc:  # noqa: BLE001 - the store unreachable: try again next tick
                if not failing and not self._stop.is_set():  # once per outage
                    logger.warning("the rendezvous could not write node %s's heartbeat: %s",
                                   node_name(self._node), exc)
                failing = True

    def leave(self) -> None:
        """See `RoundBoard`: stop beating and mark the node gone (time 0)."""
        self._stop.set()
        if self._beater is not None and self._beater is not threading.current_thread():
            self._beater.join(timeout=self._settings.keep_alive_interval + 1)
        if self._node is not None:
            self._set(f"alive/{node_name(self._node)}", self._heartbeat(0.0))

    def _fresh(self, values: list[bytes]) -> list[tuple[NodeDesc, int | None] | None]:
        """(node, beacon port) for each heartbeat value that is valid and recent, else None."""
        expiry, now = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt, time.time()
        found = []
        for value in values:
            beat = decode_heartbeat(value)
            found.append(None if beat is None or beat[2] <= 0 or now - beat[2] > expiry else beat[:2])
        return found

    def _nodes_at(self, keys: list[str]) -> list[NodeDesc | None]:
        """The nodes named in the slot `keys` (cached: a slot is written once); None for a slot that
        is not written after `SLOT_WAIT_S` (its node died between its add and its set) or not valid."""
        missing = [key for key in keys if key not in self._names]
        if missing:
            full = [self._base + key for key in missing]
            try:
                self.counts["reads"] += 1
                self._call("wait for arrivals", lambda: self.store.wait(full, timedelta(seconds=SLOT_WAIT_S)))
                present = missing
            except Exception:  # noqa: BLE001 - a slot never written: read the others
                present = [key for key in missing if self._check(key)]
            for key, value in zip(present, self._get_many(present), strict=True):
                self._names[key] = decode_arrival(value)
        return [self._names.get(key) for key in keys]

    def _live(self, nodes: list[NodeDesc | None]) -> list[tuple[NodeDesc, int | None] | None]:
        named = [node for node in nodes if node is not None]
        beats = iter(self._fresh(self._get_many([f"alive/{node_name(node)}" for node in named])))
        return [next(beats) if node is not None else None for node in nodes]

    def alive(self) -> dict[NodeDesc, int | None]:
        """See `RoundBoard`, for the nodes of the last closed round (members and spares), the only
        ones the handler asks about: those whose heartbeat is recent. One read."""
        with self._lock:
            latest = self._latest
        nodes = list(latest.members + latest.spares) if latest is not None else []
        return dict(entry for entry in self._live(nodes) if entry is not None)

    # --- rounds ------------------------------------------------------------------------------

    def arrive(self, round_number: int, node: NodeDesc) -> None:
        """See `RoundBoard`: one `add` for a slot, one `set` of it (at most once per round).

        This node's arrival at an earlier round that is not known closed is withdrawn: its slot is
        written again with `WITHDRAWN`, which no reader takes for a node. A reader that read the slot
        before keeps its node (slots are cached); only the closer of that round could, and a node
        moves on to a later round once it has seen that round closed, which costs no write."""
        with self._lock:
            if round_number in self._slots:
                return
            slot = self._add(f"arrivals/{round_number}/count", 1)
            self._set(f"arrivals/{round_number}/{slot}", encode_arrival(node))
            closed_up_to = self._latest.round if self._latest is not None else -1
            for earlier in [number for number in self._slots if number < round_number]:
                if earlier > closed_up_to:
                    self._set(f"arrivals/{earlier}/{self._slots[earlier]}", WITHDRAWN)
                del self._slots[earlier]
            self._slots[round_number] = slot
            self._counted.add(round_number)

    def _number(self, key: str, value: bytes) -> int:
        """The whole number >= 0 that `key` holds (a counter or the hint); RendezvousStateError otherwise."""
        text = bytes(value).decode("ascii", errors="replace")
        if not (text.isdigit() and len(text) < 19):
            raise RendezvousStateError(f"{self._base}{key} holds {text[:40]!r}, not a whole number: not written "
                                       "by elastic_ddp's rendezvous (elastic_ddp.agent.rendezvous.boards.c10d)")
        return int(text)

    def _record(self, number: int) -> RoundRecord:
        key = f"round/{number}"
        record = decode_record(self._get_many([key])[0])
        if record is None or record.round != number:
            raise RendezvousStateError(f"the round record at {self._base}{key} is not valid (schema: "
                                       "elastic_ddp.agent.rendezvous.state)")
        return record

    def _refresh_latest(self) -> RoundRecord | None:
        """The last closed round: from the one known (or the `latest` hint), the rounds after it."""
        with self._lock:
            latest = self._latest
        if latest is None and self._check("latest"):
            latest = self._record(self._number("latest", self._get_many(["latest"])[0]))
        while self._check(f"round/{latest.round + 1 if latest else 0}"):
            latest = self._record(latest.round + 1 if latest else 0)
        with self._lock:
            if latest is not None and (self._latest is None or self._latest.round < latest.round):
                self._latest = latest
            return self._latest

    def view(self, round_number: int) -> BoardView:
        """See `RoundBoard`. About three requests: the round's key, two counters, the closer's heartbeat."""
        record = self._refresh_latest()
        if round_number < 0:
            return BoardView(record, 0, self._add("closed", 0) > 0, 0, None)
        if round_number not in self._counted:
            self._add(f"arrivals/{round_number}/count", 0)  # the counter exists from here on
            self._counted.add(round_number)
        keys = ["closed", f"arrivals/{round_number}/count"]
        closed, count = (self._number(key, value) for key, value in zip(keys, self._get_many(keys), strict=True))
        return BoardView(record, 0, closed > 0, count, self._first(round_number, count))

    def _first(self, round_number: int, count: int) -> str | None:
        """The name of the earliest live arrival at `round_number` (the closer), None if unknown yet."""
        dead, mine = self._dead[round_number], self._slots.get(round_number)
        for slot in range(1, count + 1):
            if slot in dead:
                continue
            if slot == mine:
                return node_name(self._node)
            node = self._nodes_at([f"arrivals/{round_number}/{slot}"])[0]
            if node is not None and self._live([node])[0] is not None:
                return node_name(node)
            dead.add(slot)  # a wrong guess only makes a second node try to close: the store decides
        return None

    def arrivals(self, round_number: int) -> list[NodeDesc]:
        """See `RoundBoard`: live arrivals in slot order, each node once."""
        count = self._add(f"arrivals/{round_number}/count", 0)
        nodes = self._nodes_at([f"arrivals/{round_number}/{slot}" for slot in range(1, count + 1)])
        live = [entry[0] for entry in self._live(nodes) if entry is not None]
        return list(dict.fromkeys(live))

    def waiting(self, round_number: int) -> list[NodeDesc]:
        """See `RoundBoard`."""
        return self.arrivals(round_number)

    def close_round(self, record: RoundRecord, token: int) -> bool:
        """See `RoundBoard`: write `record` unless its round has one already; `token` is not used."""
        value = record.encode()
        self.counts["closes"] += 1
        key = self._base + f"round/{record.round}"
        won = bytes(self._call("close a round", lambda: self.store.compare_set(key, "", value))) == value
        self.counts["lost_closes"] += int(not won)
        if won:
            self._set("latest", str(record.round).encode())
        return won

    def set_closed(self) -> None:
        """See `RoundBoard`."""
        self._add("closed", 1)

    def is_closed(self) -> bool:
        """See `RoundBoard`."""
        return self._add("closed", 0) > 0


# The --rdzv_conf keys of the c10d-store board (c10d.store: where the store is and how long a read may take).
C10D_KEYS = frozenset({"store_type", "is_host", "read_timeout"})


def create_elastic_c10d_handler(params: RendezvousParameters) -> RoundRendezvousHandler:
    """The rendezvous in the elastic-c10d TCPStore (`handler`).

    Raises ValueError for a bad `--rdzv_conf` value (or `store_type` other than tcp) before any
    connection, RendezvousConnectionError (one line) when the store cannot be reached.
    """
    settings = prepare_agent(params, C10D_KEYS)
    if params.get("store_type", "tcp").strip().lower() != "tcp":
        raise ValueError(f"--rdzv_conf store_type: got {params.get('store_type')!r}; elastic_ddp's rendezvous needs tcp")
    host, port = endpoint_of(params)
    is_host, _ = hosts_store(params)
    problem = addresses.loopback_problem(params.local_addr, host, port)
    if problem is not None and not is_host:
        raise ValueError(problem)
    if problem is not None:
        logger.warning("%s (unless every node of the job runs on this machine)", problem)
    witness = ExitWitness(settings.probe_dead_nodes)
    watch = StoreWatch(host, port, silence_s=settings.keep_alive_interval * settings.keep_alive_max_attempt)
    watch.peers_answer = witness.any_answers
    board = StoreRoundBoard(create_tcp_store(params), params.run_id, settings, watch)
    logger.info("elastic-c10d rendezvous '%s' on %s:%d: last call %g s, heartbeat expiry %d s, join timeout %g s",
                params.run_id, host, port, settings.last_call_timeout, settings.lease_ttl, settings.join_timeout)
    return RoundRendezvousHandler(board, local_node(params), settings, witness)
