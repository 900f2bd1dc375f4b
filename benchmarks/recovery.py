"""Recovery: from a lost node, a new node and a frozen node to training again; in seconds, and in
committed steps redone.

    python benchmarks/recovery.py --quick            # one round per setting (about 6 min)
    python benchmarks/recovery.py --repeats 3        # medians and spread (about 20 min)
    python -m benchmarks.recovery --settings plain restart --repeats 3   # in-process re-form against restart
    python benchmarks/recovery.py --settings ours plain   # only some settings
    python -m benchmarks.recovery --partition     # a network partition against a freeze (root: benchmarks/recovery_network.py)
    python -m benchmarks.recovery --settings ours ours-cold --device cuda   # on a GPU machine: warm and cold CUDA workers
    python -m benchmarks.recovery --settings fsdp --keep-logs /tmp/runs     # each run's logs kept

(run from the repository root). Each repetition starts a job of three torchrun agents ("nodes")
on 127.0.0.1 with one worker each, lets it train, SIGKILLs one node (agent and workers), waits
for the first optimizer step of the group that continues without it, then starts a new node and
waits for the first step of the group that includes it (world 2 -> 3, below --nnodes' maximum of
4, so torchrun's last-call wait applies, as it does on a real cluster that is not full), then
SIGSTOPs that new node and waits for the first step of the group that goes on without it.

Six settings are measured in the same run, interleaved, on the same machine:
- `ours`: `python -m elastic_ddp.agent.launcher` (`LAUNCHER=` of launch/node.sh; torchrun with workers forked
  by a warm-worker server, `--rdzv_backend=c10d` run as `elastic-c10d`) with `RDZV_CONF` and
  `MONITOR_INTERVAL_S` of elastic_ddp.agent.rendezvous.defaults; memory copies and the watchdog on (the
  defaults);
- `plain`: plain torchrun (`python -m torch.distributed.run`) with `--rdzv_backend=elastic-c10d`
  and nothing else: the README's main command, and what launch/node.sh runs; on a kill the
  survivors' workers re-form the group in their own processes (`in_process=1`, the default; so
  does `ours`);
- `restart`: `plain` with `--rdzv_conf in_process=0`: torchrun restarts the survivors' workers on
  a kill, the path that joins, freezes and fallbacks take (issue 44);
- `ours-cold`: plain torchrun with torch's `c10d` and `RDZV_CONF`, the way to run before
  elastic-c10d existed;
- `stock`: plain torchrun with torch's `c10d` and its defaults (no --rdzv_conf, --monitor_interval
  0.1), and the trainer with snapshot files alone (`--no-memory_copies --watchdog_timeout_s 0`):
  periodic checkpoints every 20 steps, a frozen peer left to the collective timeout (60 s);
- `tutorial`: the same, with a snapshot at each epoch end only (`--snapshot_every_steps 0`), as the
  PyTorch fault-tolerance tutorial saves (its script itself also loses the optimizer state and
  tears its snapshot when killed mid-write; findings.md).
- `fsdp` (not in the default list: `--settings ours fsdp`): `ours` with `--sharding fsdp`, the
  zero loss coming from the memory copies of shards (docs/sharding.md); `fsdp-restart`, the same
  with `in_process=0` (the survivors' workers restart; `--settings fsdp fsdp-restart`).
All use the same training (`elastic_ddp.train`, 64 steps per epoch) and environment (`AGENT_ENV`:
one thread per worker, the agent-shared store off), so the differences are the launch settings
and the snapshot flags above.

Lost steps are the `restore` event's `lost_steps`: committed steps of the group before that the
resumed group redoes. `in_process` (yes/no) is the new group's `start` event's flag: its survivors'
workers re-formed it in their own processes; a kill of `plain` or `ours` that says no fell back to
a restart. `kept_worker_pids` (yes/no): the workers of the nodes that go on kept their process ids
(the `start` events' `ranks`).

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
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.recovery_events import (
    DEFAULT_SETTINGS,
    EVENTS,
    NODES,
    SETTINGS,
    SNAPSHOT_FLAGS,
    STEPS_PER_EPOCH,
    TRAINING_ARGS,
    agent_log,
    first_after,
    group_phases,
    lost_steps_of,
    pause_of,
    print_table,
    regroup_of,
    seconds_since,
    summarise,
    wait_for_group,
    with_node_logs,
)
from elastic_ddp.runlog.reader import EventFollower
from elastic_ddp.testbed.local_cluster import (
    AGENT_ENV,
    RDZV_CONF,
    LocalJob,
)

# The kill lands mid-epoch, after the first epoch's snapshot: no setting restarts from scratch.
KILL_AFTER_STEP = STEPS_PER_EPOCH + 30


def with_keep_alive_max_attempt(attempts: int) -> dict[str, Any]:
    """`ours` with another heartbeat budget (expiry = attempts x 1 s); see docs on the margin."""
    conf = re.sub(r"keep_alive_max_attempt=\d+", f"keep_alive_max_attempt={attempts}", RDZV_CONF)
    return {**SETTINGS["ours"], "rdzv_conf": conf}


# The workers' flags for a device: on CUDA every node's worker shares the machine's GPUs over gloo
# (NCCL refuses two ranks on one GPU), as tests/run_cuda.sh runs the cluster tests.
DEVICE_ARGS = {"cpu": [], "cuda": ["--device", "cuda", "--dist_backend", "gloo"]}


def measure_once(setting: str, run_dir: Path, timeout: float = 180, device: str = "cpu") -> dict[str, Any]:
    """One kill, one join and one freeze under `setting`; seconds, lost steps and their phases."""
    job = LocalJob(run_dir, [*TRAINING_ARGS, *SNAPSHOT_FLAGS.get(setting, []), *DEVICE_ARGS[device]], nnodes="1:4",
                   run_id=f"recovery-{setting}", agent_env={**AGENT_ENV, "LOGLEVEL": "INFO"}, **SETTINGS[setting])
    events = EventFollower(job.event_log)
    try:
        for index in range(NODES):
            job.add_node(f"node{index}")
        wait_for_group(events, 0, lambda g: g.start["world_size"] == NODES, timeout, f"world {NODES}")
        job.wait_for_step(max(events.newest_step() + 30, KILL_AFTER_STEP), timeout)

        killed_at = time.time()
        job.nodes[-1].kill()
        resumed = wait_for_group(events, killed_at, lambda g: True, timeout, "training after the kill")
        survivor = agent_log(job.nodes[0])
        kill = {"seconds": round(resumed.first_step["time"] - killed_at, 2),
                "lost_steps": lost_steps_of(resumed, events), "without_training": pause_of(resumed, events),
                "agent_noticed": seconds_since(first_after(survivor, killed_at, "Worker group FAILED"), killed_at),
                "rendezvous_complete": seconds_since(first_after(survivor, killed_at, "Rendezvous complete"), killed_at),
                **regroup_of(resumed, events, killed_at), **group_phases(resumed, events, killed_at)}

        job.wait_for_step(resumed.first_step["global_step"] + 30, timeout)
        joined_at = time.time()
        joiner = job.add_node("joiner")
        grown = wait_for_group(events, joined_at, lambda g: joiner.pid in g.agent_pids, timeout,
                                "training with the new node")
        joiner_log = agent_log(joiner)
        join = {"seconds": round(grown.first_step["time"] - joined_at, 2),
                "lost_steps": lost_steps_of(grown, events), "without_training": pause_of(grown, events),
                "joiner_waiting": seconds_since(first_after(joiner_log, joined_at, "Rendezvous'ing worker group"), joined_at),
                "rendezvous_complete": seconds_since(first_after(joiner_log, joined_at, "Rendezvous complete"), joined_at),
                **regroup_of(grown, events, joined_at), **group_phases(grown, events, joined_at)}

        job.wait_for_step(grown.first_step["global_step"] + 30, timeout)
        frozen_at = time.time()
        joiner.freeze()
        unfrozen = wait_for_group(events, frozen_at, lambda g: joiner.pid not in g.agent_pids, timeout,
                                   "training without the frozen node")
        survivor = agent_log(job.nodes[0])
        freeze = {"seconds": round(unfrozen.first_step["time"] - frozen_at, 2),
                  "lost_steps": lost_steps_of(unfrozen, events), "without_training": pause_of(unfrozen, events),
                  "agent_noticed": seconds_since(first_after(survivor, frozen_at, "Worker group FAILED"), frozen_at),
                  "rendezvous_complete": seconds_since(first_after(survivor, frozen_at, "Rendezvous complete"), frozen_at),
                  **regroup_of(unfrozen, events, frozen_at), **group_phases(unfrozen, events, frozen_at)}
        return {"setting": setting, "kill": kill, "join": join, "freeze": freeze}
    except TimeoutError as error:
        raise with_node_logs(setting, error, job) from None
    finally:
        job.stop()


def measure(settings: list[str], repeats: int, run_root: Path, device: str = "cpu") -> list[dict[str, Any]]:
    """`repeats` rounds; each round measures every setting once (interleaved, so that a busy
    machine affects all settings alike). Returns one record per measurement."""
    records = []
    for repeat in range(repeats):
        for setting in settings:
            record = measure_once(setting, run_root / f"{setting}-{repeat}", device=device)
            records.append(record)
            print(f"{setting} #{repeat + 1}: " + ", ".join(
                f"{event} -> training {record[event]['seconds']:.1f} s ({record[event]['lost_steps']} steps lost, "
                f"in process: {'yes' if record[event]['in_process'] else 'no'})"
                for event in EVENTS), file=sys.stderr, flush=True)
    return records


def run_benchmark(repeats: int = 1, settings: list[str] | None = None,
                  keep_alive_max_attempts: Sequence[int] = (), device: str = "cpu",
                  keep_logs: Path | None = None) -> dict[str, Any]:
    """For benchmark runners: {"records": [...], "summary": {setting: {kill|join: {phase: stats}}}}.
    `keep_logs`: the runs' directories (every node's log, the event log) go there and stay."""
    names = list(settings or DEFAULT_SETTINGS)
    for attempts in keep_alive_max_attempts:
        SETTINGS[f"ours-ka{attempts}"] = with_keep_alive_max_attempt(attempts)
        names.append(f"ours-ka{attempts}")
    if keep_logs is not None:
        keep_logs.mkdir(parents=True, exist_ok=True)
        records = measure(names, repeats, keep_logs, device)
    else:
        with tempfile.TemporaryDirectory(prefix="recovery-") as root:
            records = measure(names, repeats, Path(root), device)
    return {"records": records, "summary": summarise(records)}


def _cuda_available() -> bool:
    import torch  # (only asked for --device cuda: the benchmark itself runs no torch)
    return torch.cuda.is_available()


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
                        help="Keep every run's directory (each node's log, the event log) under DIR (else a "
                             "temporary directory, removed).")
    parser.add_argument("--device", choices=list(DEVICE_ARGS), default="cpu",
                        help="Where the workers train: cuda puts every node's worker on this machine's GPUs, over "
                             "gloo (not with --partition).")
    parser.add_argument("--partition-seconds", type=float, default=0,
                        help="With --partition: keep the link down at least this long before the heal.")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not _cuda_available():
        parser.error("--device cuda: torch sees no CUDA GPU on this machine; use --device cpu")
    if args.device == "cuda" and args.partition:
        parser.error("--device cuda: --partition runs its workers on the CPU only")
    if args.partition:
        from benchmarks.recovery_network import main_partition  # (it builds on this module)
        return main_partition(args, default_settings=args.settings is parser.get_default("settings"))
    result = run_benchmark(1 if args.quick else args.repeats, args.settings, args.keep_alive_max_attempts,
                           args.device, args.keep_logs)
    print_table(result["summary"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
