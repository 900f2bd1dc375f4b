"""What the recovery benchmarks share: the settings they compare, the training they run, and how
they read a job's recovery off its event log and its agents' logs (phases, pauses, lost steps,
the summary table). `benchmarks/recovery.py` (kill, join, freeze) and
`benchmarks/recovery_network.py` (partition, heal, freeze) both build on it; the settings are
described in `benchmarks/recovery.py`'s docstring.
"""

from __future__ import annotations

import re
import statistics
import time
from datetime import datetime
from typing import Any

from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.agent.rendezvous.rounds import IN_PROCESS_KEY
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.reader import EventFollower, WorkerGroup
from elastic_ddp.testbed.local_cluster import (
    LAUNCHER,
    MONITOR_INTERVAL_S,
    RDZV_CONF,
    STOCK_LAUNCHER,
    LocalJob,
    LocalNode,
)

PLAIN = {"rdzv_backend": BACKEND_NAME, "rdzv_conf": None, "monitor_interval": None, "launcher": STOCK_LAUNCHER}
SETTINGS: dict[str, dict[str, Any]] = {
    "ours": {"rdzv_conf": RDZV_CONF, "monitor_interval": MONITOR_INTERVAL_S, "launcher": LAUNCHER},
    "plain": PLAIN,
    # `plain` with in-process re-forms off: torchrun restarts the survivors' workers (issue 44).
    "restart": {**PLAIN, "rdzv_conf": f"{IN_PROCESS_KEY}=0"},
    "ours-cold": {"rdzv_conf": RDZV_CONF, "monitor_interval": MONITOR_INTERVAL_S, "launcher": STOCK_LAUNCHER},
    "stock": {"rdzv_conf": None, "monitor_interval": None, "launcher": STOCK_LAUNCHER},
    "tutorial": {"rdzv_conf": None, "monitor_interval": None, "launcher": STOCK_LAUNCHER},
    "fsdp": {"rdzv_conf": RDZV_CONF, "monitor_interval": MONITOR_INTERVAL_S, "launcher": LAUNCHER},
    # `fsdp` with in-process re-forms off: torchrun restarts the survivors' workers.
    "fsdp-restart": {"rdzv_conf": f"{RDZV_CONF},{IN_PROCESS_KEY}=0", "monitor_interval": MONITOR_INTERVAL_S,
                     "launcher": LAUNCHER},
}
DEFAULT_SETTINGS = [name for name in SETTINGS if not name.startswith("fsdp")]  # fsdp only when asked for
# Training flags of a setting beyond TRAINING_ARGS (benchmarks/recovery.py's docstring).
WITHOUT_OURS = ["--no-memory_copies", "--watchdog_timeout_s", "0"]
SNAPSHOT_FLAGS: dict[str, list[str]] = {
    "stock": WITHOUT_OURS,
    "tutorial": [*WITHOUT_OURS, "--snapshot_every_steps", "0"],
    "fsdp": ["--sharding", "fsdp"],
    "fsdp-restart": ["--sharding", "fsdp"],
}
TRAINING_ARGS = ["--model", "mlp", "--no-augment", "--epochs", "1000", "--dataset_size", "4096",
                 "--global_batch_size", "64", "--micro_batch_size", "32", "--snapshot_every_steps", "20",
                 "--log_interval", "100"]
NODES = 3
STEPS_PER_EPOCH = 4096 // 64
# glog-style lines of torchrun's loggers: "I1121 19:27:26.876000 15122 path.py:123] message"
AGENT_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) \d+ \S+\] (.*)$")
PHASES = ("imports", "process_group", "built", "restored", "first_step")
EVENTS = {"kill": "SIGKILL of 1 of 3 nodes -> first step without it",
          "join": "new node started -> first step with it (world 2 -> 3)",
          "freeze": "SIGSTOP of 1 of 3 nodes -> first step without it"}


def agent_log(node: LocalNode) -> list[tuple[float, str]]:
    """(Unix time, message) of each torchrun log line of `node` (local time, this year)."""
    year = datetime.now().year
    lines = []
    for line in node.log_text().splitlines():
        match = AGENT_LINE.match(line)
        if match:
            month, day, hour, minute, second, message = match.groups()
            moment = datetime(year, int(month), int(day), int(hour), int(minute)).timestamp() + float(second)
            lines.append((moment, message))
    return lines


def first_after(lines: list[tuple[float, str]], moment: float, needle: str) -> float | None:
    return next((when for when, message in lines if when >= moment and needle in message), None)


def wait_for_group(events: EventFollower, after: float, predicate, timeout: float, what: str) -> WorkerGroup:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events.poll()
        for group in events.groups_since(after):
            if group.first_step is not None and predicate(group):
                return group
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def group_phases(group: WorkerGroup, events: EventFollower, origin: float) -> dict[str, float]:
    """Seconds from `origin` to the new worker process's start and to each start-up mark."""
    startup = next((e for e in events.of_kind(schema.STARTUP) if e["incarnation"] == group.incarnation), None)
    if startup is None:
        return {}
    phases = {"worker_process_started": round(startup["process_started"] - origin, 2)}
    for name in PHASES:
        if name in startup["seconds"]:
            phases[name] = round(startup["process_started"] + startup["seconds"][name] - origin, 2)
    return phases


def with_node_logs(setting: str, error: TimeoutError, job: LocalJob) -> TimeoutError:
    """`error` with the end of every node's log: without the nodes' own words a time-out says
    nothing (seen on a 16-core GPU machine)."""
    logs = "\n".join(f"===== {node.name}\n{node.log_text()[-3000:]}" for node in job.nodes)
    return TimeoutError(f"{setting}: {error}\n{logs}")


def pause_of(group: WorkerGroup, events: EventFollower) -> float | None:
    """Seconds without training before `group`'s first step: since the newest step of the groups
    that started before it (for a join, how long the running nodes waited for the new one)."""
    before = [g.newest_step["time"] for g in events.groups.values()
              if g.started < group.started and g.newest_step is not None]
    return round(group.first_step["time"] - max(before), 2) if before else None


def lost_steps_of(group: WorkerGroup, events: EventFollower) -> int | None:
    """The `lost_steps` of the restore that started `group`; without one (a start from scratch),
    every step the run had committed: the step `group` began with, less one."""
    restore = next((e for e in events.of_kind(schema.RESTORE) if e["incarnation"] == group.incarnation), None)
    if restore is not None:
        return restore["lost_steps"]
    previous = [g for g in events.groups.values() if g.started < group.started and g.newest_step is not None]
    return max(g.newest_step["global_step"] for g in previous) if previous else None


def regroup_of(group: WorkerGroup, events: EventFollower, before: float) -> dict[str, bool]:
    """How `group` formed: `in_process`, its `start` event's flag (the survivors' workers re-formed
    it in their own processes, issue 44), and `kept_worker_pids`: whether the workers of the group
    that trained at `before` whose agents are in `group` kept their process ids (left out when no
    group trained then or none of its agents is in `group`)."""
    regroup = {"in_process": bool(group.start.get("in_process"))}
    trained = [g for g in events.groups.values() if g.started < before and g.newest_step is not None]
    if trained:
        previous = max(trained, key=lambda g: g.started)
        pids = {rank["pid"] for rank in group.start.get("ranks") or []}
        survivors = [rank["pid"] for rank in previous.start.get("ranks") or [] if rank["agent_pid"] in group.agent_pids]
        if survivors:
            regroup["kept_worker_pids"] = all(pid in pids for pid in survivors)
    return regroup


def seconds_since(moment: float | None, origin: float) -> float | None:
    return None if moment is None else round(moment - origin, 2)


def summarise(records: list[dict[str, Any]],
              events: dict[str, str] = EVENTS) -> dict[str, dict[str, dict[str, float]]]:
    """Per setting and event (kill, join, freeze: `events`): median, min and max of the seconds and of
    each phase; of a yes/no field (`regroup_of`), how many runs said yes."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for setting in dict.fromkeys(r["setting"] for r in records):
        summary[setting] = {}
        for event in events:
            keys = dict.fromkeys(key for r in records if r["setting"] == setting for key in r[event])
            summary[setting][event] = {}
            for key in keys:
                values = [r[event][key] for r in records if r["setting"] == setting and r[event].get(key) is not None]
                if values and all(isinstance(value, bool) for value in values):
                    summary[setting][event][key] = {"yes": sum(values), "n": len(values)}
                elif values:
                    summary[setting][event][key] = {"median": round(statistics.median(values), 2),
                                                    "min": min(values), "max": max(values), "n": len(values)}
    return summary


def print_table(summary: dict[str, dict[str, dict[str, float]]], events: dict[str, str] = EVENTS) -> None:
    for event, title in events.items():
        print(f"\n{title} (seconds after the event; median [min-max] over n runs)")
        settings = list(summary)
        keys = list(dict.fromkeys(key for s in settings for key in summary[s][event]))
        print(f"  {'':24}" + "".join(f"{s:>22}" for s in settings))
        for key in keys:
            cells = []
            for setting in settings:
                cell = summary[setting][event].get(key)
                cells.append("-" if not cell else f"yes in {cell['yes']} of {cell['n']}" if "yes" in cell else
                             f"{cell['median']:6.2f} [{cell['min']:.2f}-{cell['max']:.2f}] n={cell['n']}")
            print(f"  {key:24}" + "".join(f"{c:>22}" for c in cells))
        if "ours" in summary:
            ours = summary["ours"][event]["seconds"]["median"]
            for other in (s for s in summary if s != "ours"):
                print(f"  {other} / ours: {summary[other][event]['seconds']['median'] / ours:.1f}x")
