"""The agents of `benchmarks.rendezvous_scale`: each in a process of its own, driven by the
measuring process.

    context = agent_processes()
    agent = AgentProcess(context, (backend, endpoint, run_id, max_nodes, is_host))
    agent.wait_built(); agent.start(entering=True); ...; agent.stop(); agent.counts(); agent.kill()

An agent is the handler torchrun builds for the backend (for `elastic-c10d` and `etcd-v3` elastic_ddp's
rendezvous, for torch's own `c10d` its real `DynamicRendezvousHandler`), running torchrun's monitor
loop between rounds. Its processes are forked from a server that
imported torch and this module once (`agent_processes`): 65 agents start in seconds on 2 cores,
where 65 interpreters importing torch would take minutes. Each agent publishes its round, whether
it is in `next_rendezvous` and the waiting count it last saw in shared memory, so the measuring
process watches a phase without asking anyone; with the rendezvous also when it arrived,
closed a round and returned (`MILESTONES`). `benchmarks.cpu_use.CpuUse` profiles each phase.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)

from elastic_ddp.agent.rendezvous.boards.c10d import create_elastic_c10d_handler
from elastic_ddp.agent.rendezvous.boards.etcd import create_etcd_v3_handler
from elastic_ddp.agent.rendezvous.defaults import MONITOR_INTERVAL_S, SHIPPED_RDZV_DEFAULTS
from elastic_ddp.agent.rendezvous.handler import RoundRendezvousHandler

# An agent still in `next_rendezvous` when its phase times out gives up by then too (its join
# timeout), instead of polling through the shipped 300 s and holding up the next measurement.
PHASE_TIMEOUT_S = 60.0


class CountingBackend(RendezvousBackend):
    """A rendezvous backend that counts the state operations going through it (thread-safe); torch's
    heartbeats are state writes too."""

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

    def take(self) -> tuple[int, int, int, int]:
        """(state reads, state writes, lost state writes, 0) since the last `take`, in
        `BoardCounter.take`'s shape (torch has no heartbeat operations apart from state writes)."""
        with self._lock:
            counts = (self.reads, self.writes, self.lost_writes, 0)
            self.reads = self.writes = self.lost_writes = 0
        return counts


class BoardCounter:
    """The rendezvous's requests (`EtcdRoundBoard.counts`, `StoreRoundBoard.counts`) in
    `CountingBackend.take`'s shape: reads, writes (arrivals, closes, lease grants or registration,
    liveness), lost closes, lease refreshes or heartbeats."""

    def __init__(self, handler: RoundRendezvousHandler):
        self._counts = handler._board.counts
        self._taken = dict(self._counts)

    def take(self) -> tuple[int, int, int, int]:
        now = dict(self._counts)
        delta = {key: now.get(key, 0) - self._taken.get(key, 0) for key in now}
        self._taken = now
        return (delta.get("reads", 0), delta.get("writes", 0) + delta.get("closes", 0), delta.get("lost_closes", 0),
                delta.get("refreshes", 0))


@dataclass
class Agent:
    """One agent as torchrun builds it, inside its agent process."""

    handler: DynamicRendezvousHandler | RoundRendezvousHandler
    counter: CountingBackend | BoardCounter
    round: int = 0

    def rendezvous(self) -> None:
        self.handler.next_rendezvous()
        if isinstance(self.handler, RoundRendezvousHandler):
            self.round = self.handler._round.round
        else:
            self.round = self.handler._state_holder.state.round


def _params(backend: str, endpoint: str, run_id: str, max_nodes: int, is_host: bool) -> RendezvousParameters:
    conf = {key: value for key, value in SHIPPED_RDZV_DEFAULTS.items()}
    conf["join_timeout"] = int(PHASE_TIMEOUT_S)
    if backend != "etcd-v3":
        conf["is_host"] = is_host
    return RendezvousParameters(backend, endpoint, run_id, min_nodes=1, max_nodes=max_nodes, local_addr="127.0.0.1",
                                **conf)


def make_agent(backend: str, endpoint: str, run_id: str, max_nodes: int, is_host: bool) -> Agent:
    """An agent as torchrun would build it for `backend` (see the module docstring)."""
    params = _params(backend, endpoint, run_id, max_nodes, is_host)
    if backend == "c10d":
        c10d_backend, store = create_backend(params)
        counter = CountingBackend(c10d_backend)
        return Agent(create_handler(store, counter, params), counter)
    create = create_etcd_v3_handler if backend == "etcd-v3" else create_elastic_c10d_handler
    handler = create(params)
    return Agent(handler, BoardCounter(handler))


# Where each agent process publishes what the parent watches (shared memory, written by the agent).
ROUND, BUSY, WAITING, FAILED = range(4)
# The rendezvous's milestones in a phase, wall-clock microseconds (0: none yet): the agent's
# last arrival written, a round closed by its write, its return from `next_rendezvous`.
ARRIVED, CLOSED, RETURNED = range(4, 7)
MILESTONES = (ARRIVED, CLOSED, RETURNED)
UNKNOWN = -1  # WAITING before the agent's first look in a phase


def _now_us() -> int:
    return time.time_ns() // 1000


def _time_milestones(handler: RoundRendezvousHandler, status: Any) -> None:
    """Have `handler`'s board note its arrivals and won closes in `status` (see MILESTONES)."""
    board = handler._board
    arrive, close_round = board.arrive, board.close_round

    def arrive_timed(*args: Any) -> None:
        arrive(*args)
        status[ARRIVED] = _now_us()

    def close_round_timed(*args: Any) -> bool:
        won = close_round(*args)
        if won:
            status[CLOSED] = _now_us()
        return won

    board.arrive, board.close_round = arrive_timed, close_round_timed


def agent_processes() -> multiprocessing.context.BaseContext:
    """The context for `AgentProcess`: processes forked from a server that imported torch and this
    module once; a fresh agent costs a fork, not an interpreter start, and inherits nothing of the
    measuring process (its threads, its etcd server's pipes)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _agent_main(spec: tuple[str, str, str, int, bool], commands: Connection, status: Any,
                poll_s: float = MONITOR_INTERVAL_S) -> None:
    """An agent process: builds its agent, then obeys `commands` until it is killed.

    "start" (entering?) runs torchrun's monitor loop in a thread: `next_rendezvous` at once if
    entering, then every `poll_s` (MONITOR_INTERVAL_S) a look at `num_nodes_waiting()` and a re-entry when a
    node waits; "stop" ends that loop and replies with its error, if any; "counts" replies with the
    state operations since the last "counts"."""
    agent = make_agent(*spec)
    if isinstance(agent.handler, RoundRendezvousHandler):
        if poll_s != MONITOR_INTERVAL_S:  # a waiting agent's looks at the round too (torch's c10d keeps its 1 s)
            agent.handler._poll_s = poll_s
        _time_milestones(agent.handler, status)
    status[ROUND] = 0
    commands.send("built")
    stop = threading.Event()
    loop: threading.Thread | None = None
    failure: list[str] = []

    def enter() -> None:
        status[BUSY] = 1
        agent.rendezvous()
        status[RETURNED] = _now_us()
        status[ROUND] = agent.round
        status[BUSY] = 0

    def monitor(entering: bool) -> None:
        try:
            if entering:
                enter()
            while not stop.wait(poll_s):
                waiting = agent.handler.num_nodes_waiting()
                status[WAITING] = waiting
                if waiting > 0:
                    enter()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            failure.append(f"{type(exc).__name__}: {exc}")
            status[FAILED] = 1

    while True:
        command, argument = commands.recv()
        if command == "start":
            stop.clear()
            loop = threading.Thread(target=monitor, args=(argument,), daemon=True)
            loop.start()
        elif command == "stop":
            stop.set()
            if loop is not None:
                loop.join()
            commands.send(failure[0] if failure else None)
        elif command == "counts":
            commands.send(agent.counter.take())


class AgentProcess:
    """The parent's handle on one agent process: commands over a pipe, status from shared memory."""

    def __init__(self, context: multiprocessing.context.BaseContext, spec: tuple[str, str, str, int, bool],
                 poll_s: float = MONITOR_INTERVAL_S):
        self.status = context.Array("q", 7, lock=False)
        self.status[ROUND] = UNKNOWN
        self._pipe, child_end = context.Pipe()
        self._process = context.Process(target=_agent_main, args=(spec, child_end, self.status, poll_s),
                                             daemon=True)
        self._process.start()
        child_end.close()

    def wait_built(self) -> None:
        self._reply("build its agent", PHASE_TIMEOUT_S)

    def _call(self, command: str, argument: Any = None) -> Any:
        self._pipe.send((command, argument))
        return self._reply(f"answer '{command}'", PHASE_TIMEOUT_S + 10)  # a `next_rendezvous` ends by its join timeout

    def _reply(self, what: str, timeout: float) -> Any:
        """The agent's next message; TimeoutError or RuntimeError (it died: its exit code) otherwise."""
        if not self._pipe.poll(timeout):
            raise TimeoutError(f"agent process {self._process.pid} did not {what} within {timeout:g} s")
        try:
            return self._pipe.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(f"agent process {self._process.pid} ended before it could {what} "
                               f"(exit code {self._process.exitcode})") from None

    def start(self, entering: bool) -> None:
        self.status[BUSY] = int(entering)  # before it is told: the phase must not look settled meanwhile
        self.status[WAITING] = UNKNOWN
        for slot in MILESTONES:
            self.status[slot] = 0
        self._pipe.send(("start", entering))  # no reply: every agent starts at once

    def stop(self) -> str | None:
        return self._call("stop")

    def counts(self) -> tuple[int, int, int, int]:
        return self._call("counts")

    @property
    def round(self) -> int:
        return self.status[ROUND]

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """None while the process runs; a negative number is the signal that ended it."""
        return self._process.exitcode

    def kill(self) -> None:
        """SIGKILL, as a machine dies: its heartbeats stop, its beacon port and connections close."""
        self._process.kill()
        self._process.join()

    def close(self) -> None:
        if self._process.is_alive():
            self.kill()
        self._pipe.close()
