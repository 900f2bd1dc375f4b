"""Recovery from a network partition, against a freeze in the same job: `benchmarks/recovery.py --partition`.

    sudo .venv/bin/python -m benchmarks.recovery --partition --repeats 3 --settings ours plain

(root: every node is a host of its own, a network namespace with its own address on a bridge,
elastic_ddp/testbed/netns.py; elsewhere it refuses in one line). Each repetition starts a job of
three torchrun agents ("nodes"), one worker each, the rendezvous endpoint on node0's address and
every node started with `--local_addr=<its address>` (the README's flags for several hosts), lets
it train, then:

1. `partition`: node2's link goes down (its packets vanish, nothing is refused or reset); the time
   until the first optimizer step of the group that goes on without it, and the steps lost;
2. the link comes back (30 steps later, or `--partition-seconds` after the partition if that is
   later): the time until node2 is in a group again by itself (`rejoin`; `down_s`: how long the
   link was down);
3. `freeze`: node2 is SIGSTOPped (the freeze event of `benchmarks/recovery.py`, here on the same
   bed and job, so that the two are compared in one run); the time until the others train again.

Settings: `ours` (the launcher) and `plain` (plain torchrun with `--rdzv_backend=elastic-c10d`) of
`benchmarks/recovery.py`; the others need the store's host and gloo's interface named by hand
(docs/failure-semantics.md, "The network fails"). Phases as in `benchmarks/recovery.py`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.recovery_events import (
    NODES,
    SETTINGS,
    TRAINING_ARGS,
    agent_log,
    first_after,
    group_phases,
    lost_steps_of,
    pause_of,
    print_table,
    seconds_since,
    summarise,
    wait_for_group,
    with_node_logs,
)
from elastic_ddp.runlog.reader import EventFollower
from elastic_ddp.testbed.local_cluster import AGENT_ENV, LocalJob, wait_for
from elastic_ddp.testbed.netns import NetworkBed, why_unavailable

NETWORK_SETTINGS = ("ours", "plain")
NETWORK_EVENTS = {"partition": "link of 1 of 3 nodes down -> first step without it",
                  "rejoin": "link back -> first step with the node again (by itself)",
                  "freeze": "SIGSTOP of the same node, same job -> first step without it"}
RDZV_PORT = 29400
# After the first epoch's snapshot, mid-epoch (as recovery.py's kill).
PARTITION_AFTER_STEP = 64 + 30


def refusal(settings: list[str]) -> str | None:
    """Why the partition event cannot be measured here (one line), or None."""
    others = [setting for setting in settings if setting not in NETWORK_SETTINGS]
    if others:
        return f"--partition measures the settings {', '.join(NETWORK_SETTINGS)} only (got {', '.join(others)})"
    reason = why_unavailable()
    return None if reason is None else f"--partition runs every node in a network namespace of its own: {reason}"


def _departure(group, events: EventFollower, origin: float, survivor) -> dict[str, Any]:
    """What it cost until `group`, which goes on without a node, trained: seconds, steps, phases."""
    log = agent_log(survivor)
    return {"seconds": round(group.first_step["time"] - origin, 2), "lost_steps": lost_steps_of(group, events),
            "without_training": pause_of(group, events),
            "agent_noticed": seconds_since(first_after(log, origin, "Worker group FAILED"), origin),
            "rendezvous_complete": seconds_since(first_after(log, origin, "Rendezvous complete"), origin),
            **group_phases(group, events, origin)}


def measure_partition_once(setting: str, run_dir: Path, down_s: float = 0, timeout: float = 180) -> dict[str, Any]:
    """One partition (the link down for at least `down_s`), its heal and one freeze of the same
    node under `setting` (module docstring)."""
    names = [f"node{index}" for index in range(NODES)]
    bed = NetworkBed(names).open()
    endpoint = f"{bed.address(names[0])}:{RDZV_PORT}"
    options = {**SETTINGS[setting], "rdzv_backend": "elastic-c10d" if setting == "plain" else "c10d"}
    job = LocalJob(run_dir, TRAINING_ARGS, nnodes="1:4", run_id=f"partition-{setting}", rdzv_endpoint=endpoint,
                   agent_env={**AGENT_ENV, "LOGLEVEL": "INFO"}, **options)
    events = EventFollower(job.event_log)
    try:
        for name in names:
            job.add_node(name, hosts_store=False, local_addr=bed.address(name), command_prefix=bed.prefix(name))
            if name == names[0]:
                wait_for(lambda: bed.connects(names[-1], bed.address(names[0]), RDZV_PORT), timeout,
                         f"the c10d store on {endpoint}")
        wait_for_group(events, 0, lambda g: g.start["world_size"] == NODES, timeout, f"world {NODES}")
        job.wait_for_step(max(events.newest_step() + 30, PARTITION_AFTER_STEP), timeout)
        node = job.nodes[-1]

        partitioned_at = time.time()
        bed.partition(node.name)
        resumed = wait_for_group(events, partitioned_at, lambda g: node.pid not in g.agent_pids, timeout,
                                  "training after the partition")
        partition = _departure(resumed, events, partitioned_at, job.nodes[0])

        job.wait_for_step(resumed.first_step["global_step"] + 30, timeout)
        time.sleep(max(0.0, partitioned_at + down_s - time.time()))  # the length asked for, not a wait for a condition
        healed_at = time.time()
        bed.heal(node.name)
        back = wait_for_group(events, healed_at, lambda g: node.pid in g.agent_pids, timeout,
                               "training with the healed node")
        rejoin = {"seconds": round(back.first_step["time"] - healed_at, 2), "lost_steps": lost_steps_of(back, events),
                  "without_training": pause_of(back, events), **group_phases(back, events, healed_at)}

        job.wait_for_step(back.first_step["global_step"] + 30, timeout)
        frozen_at = time.time()
        node.freeze()
        unfrozen = wait_for_group(events, frozen_at, lambda g: node.pid not in g.agent_pids, timeout,
                                   "training without the frozen node")
        freeze = _departure(unfrozen, events, frozen_at, job.nodes[0])
        rejoin["down_s"] = round(healed_at - partitioned_at, 2)
        return {"setting": setting, "partition": partition, "rejoin": rejoin, "freeze": freeze}
    except TimeoutError as error:
        raise with_node_logs(setting, error, job) from None
    finally:
        job.stop()
        bed.close()


def measure_partitions(settings: list[str], repeats: int, run_root: Path, down_s: float = 0) -> list[dict[str, Any]]:
    """`repeats` rounds of every setting, interleaved (as `benchmarks.recovery.measure`)."""
    records = []
    for repeat in range(repeats):
        for setting in settings:
            record = measure_partition_once(setting, run_root / f"partition-{setting}-{repeat}", down_s)
            records.append(record)
            print(f"{setting} #{repeat + 1}: " + ", ".join(
                f"{event} -> training {record[event]['seconds']:.1f} s ({record[event]['lost_steps']} steps lost)"
                for event in NETWORK_EVENTS), file=sys.stderr, flush=True)
    return records


def main_partition(args, default_settings: bool) -> int:
    """`python -m benchmarks.recovery --partition`: measure, print the table (and --json); 2 with
    one line where it cannot run."""
    settings = list(NETWORK_SETTINGS) if default_settings else args.settings
    problem = refusal(settings)
    if problem is not None:
        print(f"benchmarks.recovery: {problem}", file=sys.stderr)
        return 2
    repeats = 1 if args.quick else args.repeats
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        records = measure_partitions(settings, repeats, args.keep_logs, args.partition_seconds)
    else:
        with tempfile.TemporaryDirectory(prefix="recovery-") as root:
            records = measure_partitions(settings, repeats, Path(root), args.partition_seconds)
    summary = summarise(records, NETWORK_EVENTS)
    print_table(summary, NETWORK_EVENTS)
    if args.json:
        args.json.write_text(json.dumps({"records": records, "summary": summary}, indent=1) + "\n")
    return 0
