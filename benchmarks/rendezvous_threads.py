"""The rendezvous at sizes that one process per agent cannot reach on a small machine: N simulated
agents as threads of one process.

    python -m benchmarks.rendezvous_threads                           # 8..256 agents on etcd-v3
    python -m benchmarks.rendezvous_threads --agents 64 256 --json out.json
    python -m benchmarks.rendezvous_threads --agents 256 --poll 1     # agents look every 1 s, not every 0.1 s

The phases, the agents and what is counted are those of `benchmarks.rendezvous_scale` (read its
docstring): each agent is the handler torchrun builds for etcd-v3, elastic_ddp's rendezvous
(`rendezvous_agents.make_agent`), running torchrun's monitor loop, through a first round, the kill
of one agent and the join of one, on one local etcd. What differs is that every agent is a thread
here, so that 256 of them fit on 2 cores (256 agent processes saturated them and the local etcd
answered too late; docs/benchmarks-history.md, "Rendezvous at scale"). A thread cannot be SIGKILLed, so the kill is what a SIGKILL does to an agent
as the others see it: its lease is no longer refreshed and its beacon refuses connections (its etcd
connection stays open, idle).

What this changes, and so how to read the figures: all agents share one interpreter lock, so a
phase's seconds include queueing for it (with 256 agents, tens of reads a second each in pure-Python
protobuf), and they are an upper bound of what agents with a machine each would see. The
machine-independent figures are the operations: etcd writes and reads per agent per phase, and
reads per agent per second of the phase. `--poll S` makes every agent look less often (torchrun's
monitor loop and a waiting agent's look at the round, both 0.1 s as shipped), so that 256 of them
fit in one interpreter; the writes per agent do not depend on it. A phase that does not settle within `PHASE_TIMEOUT_S` is
recorded as a timeout (the agents of that measurement are then closed out with `set_closed`), and
the next size goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousError

from benchmarks.cpu_use import CpuUse
from benchmarks.rendezvous_agents import BUSY, FAILED, ROUND, UNKNOWN, WAITING, Agent, make_agent
from benchmarks.rendezvous_scale import PHASES, _counts, _settle
from elastic_ddp.agent.rendezvous.defaults import MONITOR_INTERVAL_S

AGENT_COUNTS = (8, 16, 32, 64, 256)
BACKEND = "etcd-v3"
STOP_TIMEOUT_S = 90.0  # an agent's loop ends by then: its `next_rendezvous` ends by its join timeout


class ThreadAgent:
    """One agent in a thread, with `rendezvous_agents.AgentProcess`'s face (what `_settle` uses)."""

    def __init__(self, endpoint: str, run_id: str, max_nodes: int, poll_s: float) -> None:
        self.agent: Agent = make_agent(BACKEND, endpoint, run_id, max_nodes, False)
        self._poll_s = poll_s
        self.agent.handler._poll_s = poll_s
        self.status = [0, 0, 0, 0]
        self.status[ROUND] = 0
        self.exitcode = None  # a thread never exits like a process: _settle reads this
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._failure: list[str] = []

    def start(self, entering: bool) -> None:
        self.status[BUSY] = int(entering)
        self.status[WAITING] = UNKNOWN
        self._stop.clear()
        self._loop = threading.Thread(target=self._monitor, args=(entering,), daemon=True)
        self._loop.start()

    def _enter(self) -> None:
        self.status[BUSY] = 1
        self.agent.rendezvous()
        self.status[ROUND] = self.agent.round
        self.status[BUSY] = 0

    def _monitor(self, entering: bool) -> None:
        """torchrun's monitor loop, as `rendezvous_agents._agent_main` runs it."""
        try:
            if entering:
                self._enter()
            while not self._stop.wait(self._poll_s):
                waiting = self.agent.handler.num_nodes_waiting()
                self.status[WAITING] = waiting
                if waiting > 0:
                    self._enter()
        except BaseException as exc:  # noqa: BLE001 - reported to the measurement
            self._failure.append(f"{type(exc).__name__}: {exc}")
            self.status[FAILED] = 1

    def stop(self) -> str | None:
        self._stop.set()
        if self._loop is not None:
            self._loop.join(STOP_TIMEOUT_S)
            if self._loop.is_alive():
                return f"the agent's loop did not end within {STOP_TIMEOUT_S:g} s"
        return self._failure[0] if self._failure else None

    def counts(self) -> tuple[int, int, int, int]:
        return self.agent.counter.take()

    @property
    def round(self) -> int:
        return self.status[ROUND]

    def kill(self) -> None:
        """What a SIGKILL does to this agent, as the others see it (module docstring)."""
        handler = self.agent.handler
        handler._board._stop.set()
        handler._witness.close()

    def close(self) -> None:
        """End this agent: its loop, its lease (revoked), its etcd connection."""
        self._stop.set()
        self.kill()
        handler = self.agent.handler
        try:
            handler.shutdown()
            handler._board._connection.close()
        except Exception:  # noqa: BLE001, S110 - the measurement is over; etcd may be gone
            pass


def _phase(name: str, agents: list[ThreadAgent], entering: list[ThreadAgent]) -> dict[str, Any]:
    cpu = CpuUse([os.getpid()])  # every agent is in this process
    try:
        seconds, rounds = _settle(agents, entering)
    except (TimeoutError, RuntimeError) as exc:
        raise type(exc)(f"{name} phase: {exc} ({cpu.summary()})") from None
    record = {"seconds": round(seconds, 3), "rounds": rounds, **_counts(agents), **cpu.figures()}
    record["reads_per_agent_second"] = round(record["reads_per_agent"] / max(seconds, 1e-3), 1)
    return record


def measure(agents_count: int, endpoint: str, poll_s: float = MONITOR_INTERVAL_S) -> dict[str, Any]:
    """The three phases with `agents_count` thread agents on a fresh run id (see
    `rendezvous_scale.measure`); a phase that fails or times out ends the measurement, recorded."""
    run_id = f"threads-{uuid.uuid4().hex[:8]}"
    record: dict[str, Any] = {"backend": BACKEND, "agents": agents_count, "mode": "threads", "poll_s": poll_s}
    built: list[ThreadAgent] = []
    try:
        built = [ThreadAgent(endpoint, run_id, agents_count + 1, poll_s) for _ in range(agents_count + 1)]
        agents, joiner = built[:-1], built[-1]
        record["first"] = _phase("first", agents, entering=agents)
        if agents_count > 1:
            agents[-1].kill()
            agents = agents[:-1]
            record["kill"] = _phase("kill", agents, entering=agents)
        record["join"] = _phase("join", [*agents, joiner], entering=[joiner])
    except (TimeoutError, RuntimeError, RendezvousError) as exc:
        record["error"] = str(exc)
        record["timed_out"] = isinstance(exc, TimeoutError)
    finally:
        _close_all(built)
    return record


def _close_all(agents: list[ThreadAgent]) -> None:
    """Close the run (every waiting agent raises RendezvousClosedError), then end every agent."""
    if agents:
        try:
            agents[0].agent.handler.set_closed()
        except Exception:  # noqa: BLE001, S110 - best effort: the join timeout ends them anyway
            pass
    for agent in agents:
        agent.stop()
    for agent in agents:
        agent.close()


def run(counts: list[int], repeats: int, endpoint: str, poll_s: float = MONITOR_INTERVAL_S) -> list[dict[str, Any]]:
    records = []
    for _ in range(repeats):
        for count in counts:
            record = measure(count, endpoint, poll_s)
            print(_line(record), flush=True)
            records.append(record)
    return records


def _line(record: dict[str, Any]) -> str:
    phases = ", ".join(
        f"{phase} {record[phase]['seconds']:.2f} s / {record[phase]['rounds']} round(s) "
        f"({record[phase]['writes_per_agent']:g} writes, {record[phase]['lost_writes_per_agent']:g} lost, "
        f"{record[phase]['reads_per_agent']:g} reads = {record[phase]['reads_per_agent_second']:g}/s per agent, "
        f"machine {record[phase]['machine_busy']:.0%})"
        for phase in PHASES if phase in record)
    failure = f"{', ' if phases else ''}{'TIMED OUT' if record.get('timed_out') else 'FAILED'}: {record['error']}" \
        if "error" in record else ""
    return f"{record['backend']:>13} x{record['agents']:<3} (threads, poll {record['poll_s']:g} s) {phases}{failure}"


def print_table(records: list[dict[str, Any]]) -> None:
    print("\n| backend | agents (threads) | first / kill / join s | writes per agent | lost | reads per agent | "
          "reads per agent per s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for record in records:
        cells = [record.get(phase) for phase in PHASES]

        def column(key: str, form: str, cells: list = cells) -> str:
            return ", ".join(format(cell[key], form) if cell else "-" for cell in cells)

        seconds = " / ".join(f"{cell['seconds']:.2f}" if cell else "-" for cell in cells)
        if "error" in record:
            seconds += " (timed out)" if record.get("timed_out") else " (failed)"
        print(f"| {record['backend']} | {record['agents']} | {seconds} | {column('writes_per_agent', 'g')} | "
              f"{column('lost_writes_per_agent', 'g')} | {column('reads_per_agent', 'g')} | "
              f"{column('reads_per_agent_second', 'g')} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--agents", type=int, nargs="+", default=list(AGENT_COUNTS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--poll", type=float, default=MONITOR_INTERVAL_S,
                        help="Seconds between an agent's looks (monitor loop, waiting agent); default %(default)s.")
    parser.add_argument("--json", type=Path, help="Also write the records here.")
    args = parser.parse_args(argv)
    if any(count < 1 for count in args.agents) or args.repeats < 1:
        parser.error("--agents and --repeats: expected positive integers")
    if args.poll <= 0:
        parser.error(f"--poll: got {args.poll:g}; expected a positive number of seconds")
    from elastic_ddp.testbed.etcd_server import single_server

    with tempfile.TemporaryDirectory(prefix="rdzv-threads-") as directory:
        server = single_server(Path(directory))
        try:
            records = run(args.agents, args.repeats, server.endpoint, args.poll)
        finally:
            server.stop()
    print_table(records)
    if args.json:
        args.json.write_text(json.dumps({"records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
