"""`CpuUse`: how busy the machine, a set of processes and a server process were during a phase
(the rendezvous benchmarks' profile, `benchmarks.rendezvous_scale` and `benchmarks.rendezvous_threads`)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path


class CpuUse:
    """How busy the machine and the agent processes were since this was made (Linux /proc; the
    figures are NaN elsewhere): the profile that tells an algorithm's cost from a saturated machine."""

    def __init__(self, pids: list[int], server_pid: int | None = None):
        self._pids = pids
        self._server = [server_pid] if server_pid is not None else []
        self._started = time.monotonic()
        self._machine, self._agents = self._machine_ticks(), self._agent_ticks()
        self._server_ticks = self._agent_ticks(self._server)

    def _agent_ticks(self, pids: list[int] | None = None) -> float:
        total = 0
        for pid in self._pids if pids is None else pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total

    @staticmethod
    def _machine_ticks() -> tuple[int, int]:
        """(busy, all) jiffies of every CPU since boot."""
        try:
            values = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return 0, 0
        idle = values[3] + values[4]  # idle, iowait
        return sum(values) - idle, sum(values)

    def figures(self) -> dict[str, float]:
        """machine_busy: the fraction of all CPUs busy; agent_cores: CPUs' worth the agents used;
        agent_cpu_s and (with a `server_pid`, the local etcd's) server_cpu_s: CPU seconds used."""
        ticks = os.sysconf("SC_CLK_TCK")
        elapsed = max(time.monotonic() - self._started, 1e-9)
        busy, total = self._machine_ticks()
        machine = (busy - self._machine[0]) / (total - self._machine[1]) if total > self._machine[1] else math.nan
        agent_s = (self._agent_ticks() - self._agents) / ticks if self._pids else math.nan
        figures = {"machine_busy": round(machine, 3), "agent_cores": round(agent_s / elapsed, 2),
                   "agent_cpu_s": round(agent_s, 2)}
        if self._server:
            figures["server_cpu_s"] = round((self._agent_ticks(self._server) - self._server_ticks) / ticks, 2)
        return figures

    def summary(self) -> str:
        figures = self.figures()
        server = f", etcd {figures['server_cpu_s']:.2f} CPU s" if "server_cpu_s" in figures else ""
        return f"machine {figures['machine_busy']:.0%} busy, agents using {figures['agent_cores']:.2f} CPUs{server}"
