"""Recovery: from a lost node, a new node and a frozen node to training again; in seconds, and in
committed steps redone.

    python benchmarks/recovery.py --quick            # one round per setting (about 6 min)
    python benchmarks/recovery.py --repeats 3        # medians and spread (about 18 min)
    python benchmarks/recovery.py --settings ours plain   # only some settings
    python -m benchmarks.recovery --partition     # a network partition against a freeze (root: benchmarks/recovery_network.py)

(run from the repository root). Each repetition starts a job of three torchrun agents ("nodes")
on 127.0.0.1 with one worker each, lets it train, SIGKILLs one node (agent and workers), waits
for the first optimizer step of the group that continues without it, then starts a new node and
waits for the first step of the group that includes it (world 2 -> 3, below --nnodes' maximum of
4, so torchrun's last-call wait applies, as it does on a real cluster that is not full), then
SIGSTOPs that new node and waits for the first step of the group that goes on without it.

Five settings are measured in the same run, interleaved, on the same machine:
- `ours`: what launch/node.sh ships: `python -m elastic_ddp.agent.launcher` (torchrun with workers forked
  from a warm fork server, `--rdzv_backend=c10d` run as `elastic-c10d`) with `RDZV_CONF` and
  `MONITOR_INTERVAL_S` of elastic_ddp.agent.rendezvous.defaults; memory copies and the watchdog on (the
  defaults);
- `plain`: plain torchrun (`python -m torch.distributed.run`) with `--rdzv_backend=elastic-c10d`
  and nothing else: the README's main command;
- `ours-cold`: plain torchrun with torch's `c10d` and `RDZV_CONF`, the way to run before
  elastic-c10d existed;
- `stock`: plain torchrun with torch's `c10d` and its defaults (no --rdzv_conf, --monitor_interval
  0.1), and the trainer with snapshot files alone (`--no-memory_copies --watchdog_timeout_s 0`):
  periodic checkpoints every 20 steps, a frozen peer left to the collective timeout (60 s);
- `tutorial`: the same, with a snapshot at each epoch end only (`--snapshot_every_steps 0`), as the
  PyTorch fault-tolerance tutorial saves (its script itself also loses the optimizer state and
  tears its snapshot when killed mid-write; findings.md).
- `fsdp` (not in the default list: `--settings ours fsdp`): `ours` with `--sharding fsdp`, the
  zero loss coming from the memory copies of shards (docs/sharding.md).
All use the same training (`elastic_ddp.train`, 64 steps per epoch) and environment (`AGENT_ENV`:
one thread per worker, the agent-shared store off), so the differences are the launch settings
and the snapshot flags above.

Lost steps are the `restore` event's `lost_steps`: committed steps of the group before that the
resumed group redoes.

Times are taken from the event log (`step` and `startup` events: wall-clock seconds) and the
agents' logs (LOGLEVEL=INFO), and split into phases: the agents notice the failure, the
rendezvous completes, the worker processes start and import, the process group forms, the model
and data are built, the snapshot is restored, the first step is done.

`run_benchmark(repeats, settings)` returns the raw records and the summary, for benchmark runners.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from elastic_ddp.agent.rendezvous.c10d import BACKEND_NAME
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.reader import EventFollower, WorkerGroup
from elastic_ddp.testbed.local_cluster import (
    AGENT_ENV,
    LAUNCHER,
    MONITOR_INTERVAL_S,
    RDZV_CONF,
    STOCK_LAUNCHER,
    LocalJob,
    LocalNode,
)

SETTINGS: dict[str, dict[str, Any]] = {
    "ours": {"rdzv_conf": RDZV_CONF, "monitor_interval": MONITOR_INTERVAL_S, "launcher": LAUNCHER},
    "plain": {"rdzv_backend": BACKEND_NAME, "rdzv_conf": None, "monitor_interval": None,
              "launcher": STOCK_LAUNCHER},
    "ours-cold": {"rdzv_conf": RDZV_CONF, "monitor_interval": MONITOR_INTERVAL_S, "launcher": STOCK_LAUNCHER},
    "stock": {"rdzv_conf": None, "monitor_interval": None, "launcher": STOCK_LAUNCHER},
    "tutorial": {"rdzv_conf": None, "monitor_interval": None, "launcher": STOCK_LAUNCHER},
    "fsdp": {"rdzv_conf": RDZV_CONF, "monitor_interval": MONITOR_INTERVAL_S, "launcher": LAUNCHER},
}
DEFAULT_SETTINGS = [name for name in SETTINGS if name != "fsdp"]  # fsdp only when asked for
# Training flags of a setting beyond TRAINING_ARGS (see the module docstring).
WITHOUT_OURS = ["--no-memory_copies", "--watchdog_timeout_s", "0"]
SNAPSHOT_FLAGS: dict[str, list[str]] = {
    "stock": WITHOUT_OURS,
    "tutorial": [*WITHOUT_OURS, "--snapshot_every_steps", "0"],
    "fsdp": ["--sharding", "fsdp"],
}
TRAINING_ARGS = ["--model", "mlp", "--no-augment", "--epochs", "1000", "--dataset_size", "4096",
                 "--global_batch_size", "64", "--micro_batch_size", "32", "--snapshot_every_steps", "20",
                 "--log_interval", "100"]
NODES = 3
STEPS_PER_EPOCH = 4096 // 64
# The kill lands mid-epoch, after the first epoch's snapshot: no setting restarts from scratch.
KILL_AFTER_STEP = STEPS_PER_EPOCH + 30
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


def _wait_for_group(events: EventFollower, after: float, predicate, timeout: float, what: str) -> WorkerGroup:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events.poll()
        for group in events.groups_since(after):
            if group.first_step is not None and predicate(group):
                return group
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _phases(group: WorkerGroup, events: EventFollower, origin: float) -> dict[str, float]:
    """Seconds from `origin` to the new worker process's start and to each start-up mark."""
    startup = next((e for e in events.of_kind(schema.STARTUP) if e["incarnation"] == group.incarnation), None)
    if startup is None:
        return {}
    phases = {"worker_process_started": round(startup["process_started"] - origin, 2)}
    for name in PHASES:
        if name in startup["seconds"]:
            phases[name] = round(startup["process_started"] + startup["seconds"][name] - origin, 2)
    return phases


def with_keep_alive_max_attempt(attempts: int) -> dict[str, Any]:
    """`ours` with another heartbeat budget (expiry = attempts x 1 s); see docs on the margin."""
    conf = re.sub(r"keep_alive_max_attempt=\d+", f"keep_alive_max_attempt={attempts}", RDZV_CONF)
    return {**SETTINGS["ours"], "rdzv_conf": conf}


def measure_once(setting: str, run_dir: Path, timeout: float = 180) -> dict[str, Any]:
    """One kill, one join and one freeze under `setting`; seconds, lost steps and their phases."""
    job = LocalJob(run_dir, [*TRAINING_ARGS, *SNAPSHOT_FLAGS.get(setting, [])], nnodes="1:4",
                   run_id=f"recovery-{setting}", agent_env={**AGENT_ENV, "LOGLEVEL": "INFO"}, **SETTINGS[setting])
    events = EventFollower(job.event_log)
    try:
        for index in range(NODES):
            job.add_node(f"node{index}")
        _wait_for_group(events, 0, lambda g: g.start["world_size"] == NODES, timeout, f"world {NODES}")
        job.wait_for_step(max(events.newest_step() + 30, KILL_AFTER_STEP), timeout)

        killed_at = time.time()
        job.nodes[-1].kill()
        resumed = _wait_for_group(events, killed_at, lambda g: True, timeout, "training after the kill")
        survivor = agent_log(job.nodes[0])
        kill = {"seconds": round(resumed.first_step["time"] - killed_at, 2),
                "lost_steps": _lost_steps(resumed, events), "without_training": _paused(resumed, events),
                "agent_noticed": _since(first_after(survivor, killed_at, "Worker group FAILED"), killed_at),
                "rendezvous_complete": _since(first_after(survivor, killed_at, "Rendezvous complete"), killed_at),
                **_phases(resumed, events, killed_at)}

        job.wait_for_step(resumed.first_step["global_step"] + 30, timeout)
        joined_at = time.time()
        joiner = job.add_node("joiner")
        grown = _wait_for_group(events, joined_at, lambda g: joiner.pid in g.agent_pids, timeout,
                                "training with the new node")
        joiner_log = agent_log(joiner)
        join = {"seconds": round(grown.first_step["time"] - joined_at, 2),
                "lost_steps": _lost_steps(grown, events), "without_training": _paused(grown, events),
                "joiner_waiting": _since(first_after(joiner_log, joined_at, "Rendezvous'ing worker group"), joined_at),
                "rendezvous_complete": _since(first_after(joiner_log, joined_at, "Rendezvous complete"), joined_at),
                **_phases(grown, events, joined_at)}

        job.wait_for_step(grown.first_step["global_step"] + 30, timeout)
        frozen_at = time.time()
        joiner.freeze()
        unfrozen = _wait_for_group(events, frozen_at, lambda g: joiner.pid not in g.agent_pids, timeout,
                                   "training without the frozen node")
        survivor = agent_log(job.nodes[0])
        freeze = {"seconds": round(unfrozen.first_step["time"] - frozen_at, 2),
                  "lost_steps": _lost_steps(unfrozen, events), "without_training": _paused(unfrozen, events),
                  "agent_noticed": _since(first_after(survivor, frozen_at, "Worker group FAILED"), frozen_at),
                  "rendezvous_complete": _since(first_after(survivor, frozen_at, "Rendezvous complete"), frozen_at),
                  **_phases(unfrozen, events, frozen_at)}
        return {"setting": setting, "kill": kill, "join": join, "freeze": freeze}
    except TimeoutError as error:
        raise with_node_logs(setting, error, job) from None
    finally:
        job.stop()


def with_node_logs(setting: str, error: TimeoutError, job: LocalJob) -> TimeoutError:
    """`error` with the end of every node's log: without the nodes' own words a time-out says
    nothing (seen on a 16-core GPU machine)."""
    logs = "\n".join(f"===== {node.name}\n{node.log_text()[-3000:]}" for node in job.nodes)
    return TimeoutError(f"{setting}: {error}\n{logs}")


def _paused(group: WorkerGroup, events: EventFollower) -> float | None:
    """Seconds without training before `group`'s first step: since the newest step of the groups
    that started before it (for a join, how long the running nodes waited for the new one)."""
    before = [g.newest_step["time"] for g in events.groups.values()
              if g.started < group.started and g.newest_step is not None]
    return round(group.first_step["time"] - max(before), 2) if before else None


def _lost_steps(group: WorkerGroup, events: EventFollower) -> int | None:
    """The `lost_steps` of the restore that started `group`; without one (a start from scratch),
    every step the run had committed: the step `group` began with, less one."""
    restore = next((e for e in events.of_kind(schema.RESTORE) if e["incarnation"] == group.incarnation), None)
    if restore is not None:
        return restore["lost_steps"]
    previous = [g for g in events.groups.values() if g.started < group.started and g.newest_step is not None]
    return max(g.newest_step["global_step"] for g in previous) if previous else None


def _since(moment: float | None, origin: float) -> float | None:
    return None if moment is None else round(moment - origin, 2)


def measure(settings: list[str], repeats: int, run_root: Path) -> list[dict[str, Any]]:
    """`repeats` rounds; each round measures every setting once (interleaved, so that a busy
    machine affects all settings alike). Returns one record per measurement."""
    records = []
    for repeat in range(repeats):
        for setting in settings:
            record = measure_once(setting, run_root / f"{setting}-{repeat}")
            records.append(record)
            print(f"{setting} #{repeat + 1}: " + ", ".join(
                f"{event} -> training {record[event]['seconds']:.1f} s ({record[event]['lost_steps']} steps lost)"
                for event in EVENTS), file=sys.stderr, flush=True)
    return records


def summarise(records: list[dict[str, Any]],
              events: dict[str, str] = EVENTS) -> dict[str, dict[str, dict[str, float]]]:
    """Per setting and event (kill, join, freeze: `events`): median, min and max of the seconds and of each phase."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for setting in dict.fromkeys(r["setting"] for r in records):
        summary[setting] = {}
        for event in events:
            keys = dict.fromkeys(key for r in records if r["setting"] == setting for key in r[event])
            summary[setting][event] = {}
            for key in keys:
                values = [r[event][key] for r in records if r["setting"] == setting and r[event].get(key) is not None]
                if values:
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
                cells.append(f"{cell['median']:6.2f} [{cell['min']:.2f}-{cell['max']:.2f}] n={cell['n']}"
                             if cell else "-")
            print(f"  {key:24}" + "".join(f"{c:>22}" for c in cells))
        if "ours" in summary:
            ours = summary["ours"][event]["seconds"]["median"]
            for other in (s for s in summary if s != "ours"):
                print(f"  {other} / ours: {summary[other][event]['seconds']['median'] / ours:.1f}x")


def run_benchmark(repeats: int = 1, settings: list[str] | None = None,
                  keep_alive_max_attempts: Sequence[int] = ()) -> dict[str, Any]:
    """For benchmark runners: {"records": [...], "summary": {setting: {kill|join: {phase: stats}}}}."""
    names = list(settings or DEFAULT_SETTINGS)
    for attempts in keep_alive_max_attempts:
        SETTINGS[f"ours-ka{attempts}"] = with_keep_alive_max_attempt(attempts)
        names.append(f"ours-ka{attempts}")
    with tempfile.TemporaryDirectory(prefix="recovery-") as root:
        records = measure(names, repeats, Path(root))
    return {"records": records, "summary": summarise(records)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="One repetition (same as --repeats 1).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=DEFAULT_SETTINGS)
    parser.add_argument("--keep-alive-max-attempts", type=int, nargs="+", default=[], metavar="N",
                        help="Also measure `ours` with keep_alive_max_attempt=N (setting ours-kaN).")
    parser.add_argument("--json", type=Path, help="Also write the raw records and the summary here.")
    parser.add_argument("--partition", action="store_true",
                        help="Instead: a network partition, its heal and a freeze of 1 of 3 nodes, each node a "
                             "host of its own (root; settings ours and plain: benchmarks/recovery_network.py).")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="With --partition: keep every node's logs and event log under DIR (else a temporary "
                             "directory, removed).")
    parser.add_argument("--partition-seconds", type=float, default=0,
                        help="With --partition: keep the link down at least this long before the heal.")
    args = parser.parse_args(argv)
    if args.partition:
        from benchmarks.recovery_network import main_partition  # (it builds on this module)
        return main_partition(args, default_settings=args.settings is parser.get_default("settings"))
    result = run_benchmark(1 if args.quick else args.repeats, args.settings, args.keep_alive_max_attempts)
    print_table(result["summary"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
