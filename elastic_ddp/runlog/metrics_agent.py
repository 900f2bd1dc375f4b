"""The node's torchrun agent's rendezvous rounds, as the node's metrics server shows them.

The agent (elastic_ddp/agent/rendezvous_metrics.py, which this module never imports: the agent
side and the worker side live apart) writes its figures to the file of `elastic_ddp.handoff.rendezvous_figures`,
the one contract of the two; the node's metrics server knows the agent's pid (it watches the agent)
and serves the file through `AgentRendezvousCollector`, read at each scrape. These series are every node's own (one per
endpoint), unlike the run's, which come from rank 0's node:

    elastic_ddp_agent_rendezvous_rounds_total            rounds the agent completed
    elastic_ddp_agent_rendezvous_failures_total          rounds that raised (closed, timed out)
    elastic_ddp_agent_rendezvous_seconds_total           seconds in rendezvous, the round in progress included
    elastic_ddp_agent_rendezvous_last_round_seconds      how long the newest completed round took
    elastic_ddp_agent_rendezvous_in_progress             1 while the agent is in a round, else 0

Not guaranteed: nothing is shown before the agent has written the file (torch's own c10d under
plain torchrun never does: docs/operations.md), and a file that is not this user's, or not the
watched agent's, is ignored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from elastic_ddp.handoff.rendezvous_figures import read_figures, remove_file_and_empty_directory, rendezvous_file

NAME = "elastic_ddp_agent_rendezvous"

# name: (help, type)
SERIES = {
    "rounds": ("Rendezvous rounds this node's torchrun agent completed (a worker group formed).", "counter"),
    "failures": ("Rendezvous rounds of this node's agent that raised (closed, timed out, store lost).", "counter"),
    "seconds": ("Seconds this node's agent spent in rendezvous rounds, the round in progress included.", "counter"),
    "last_round_seconds": ("How long the newest completed rendezvous round of this node's agent took.", "gauge"),
    "in_progress": (("1 while this node's agent is in a rendezvous round (its worker group is being formed), "
                     "else 0."), "gauge"),
}


def series_values(figures: dict, now: float) -> dict[str, float]:
    """The value of every series in SERIES, from the agent's figures at Unix time `now`."""
    started = figures.get("round_started")
    ongoing = max(0.0, now - float(started)) if started is not None else 0.0
    return {"rounds": float(figures.get("rounds", 0)), "failures": float(figures.get("failures", 0)),
            "seconds": float(figures.get("seconds", 0.0)) + ongoing,
            "last_round_seconds": float(figures.get("last_round_seconds", 0.0)),
            "in_progress": 1.0 if started is not None else 0.0}


class AgentRendezvousCollector:
    """Collects the SERIES of the agent `pid` at each scrape (none before its file exists)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._served_seconds = 0.0

    def collect(self) -> Iterator[Metric]:
        figures = read_figures(self.pid)
        if figures is None:
            return
        try:
            values = series_values(figures, time.time())
        except (TypeError, ValueError):
            return
        # A scrape just after a round ended, before the agent wrote its end, adds the round's time up
        # to the scrape: a little more than the agent then records (1.7063 s served, then 1.7048 s
        # written, in a CI run). A counter never goes down: serve the larger until the total passes it.
        values["seconds"] = self._served_seconds = max(self._served_seconds, values["seconds"])
        for name, (text, kind) in SERIES.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"{NAME}_{name}", text)
            family.add_metric([], values[name])
            yield family


def remove_agent_file(pid: int) -> None:
    """The agent of `pid` has ended (perhaps SIGKILLed, so it could not remove its file itself)."""
    remove_file_and_empty_directory(rendezvous_file(pid))


def exposed_names() -> set[str]:
    """The sample names the collector exposes (counters with `_total`)."""
    return {f"{NAME}_{name}_total" if kind == "counter" else f"{NAME}_{name}" for name, (_, kind) in SERIES.items()}
