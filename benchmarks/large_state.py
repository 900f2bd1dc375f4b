"""Recovery with a large state: time, memory and the peer watchdog, by the size of the state.

    python benchmarks/large_state.py                         # 16 MB, 512 MB, 1024 MB; one round
    python benchmarks/large_state.py --sizes-mb 16 2048 --repeats 2
    python benchmarks/large_state.py --baseline 8884c7e      # the same against an earlier commit

(run from the repository root; about 3-5 minutes with the defaults on a 2-core machine). Each run
starts a job of two torchrun agents ("nodes", `elastic_ddp.testbed.local_cluster`, the shipped
launcher and settings, memory copies and the watchdog on, a checkpoint directory per node as on
separate machines) whose model holds a frozen parameter of the given size beside a small trained
MLP, so that the state is that size while a step stays cheap. It trains until the first snapshot
is durable, then:

1. SIGKILLs node 1: node 0's worker keeps its last step in memory, a new worker restores it
   alone (the restore reads the memory copy), and trains: "kill -> first step";
2. starts a new node with an empty checkpoint directory: node 0 serves the state to it through
   the snapshot transport, both restore and train: "join -> first step";
3. after HOLD_S more seconds of training, SIGTERMs both agents: the workers drain, and each
   watchdog logs the longest a peer's heartbeat stayed unchanged in its incarnation (the restore
   included: the watchdog runs from before the restore) and any peer it found silent. The kill's
   group has no peer to watch (a world of one); a silent peer reported in any group but the one
   the kill broke is a false eviction.

Per run it records the times above, the peak resident memory (VmHWM) of each worker after its
restore, the longest heartbeat gap and the watchdog's evictions from the workers' logs, and the
snapshots' `blocked_seconds` (rank 0's training thread blocked by a snapshot; the first snapshot
of the kill's and of the join's group, right after their restore, apart; the drain's final
snapshot, which waits for the write in flight by design, apart too). Memory is given
against the smallest size's run of the same setting (interpreter, torch, data): what the state
adds, in units of the state (1 is the state itself, so the goal "at most 2x the state beside it
during a restore" is a figure of at most 3).

With `--baseline REV` the nodes of a second setting run the code of commit REV (a git worktree;
the benchmark's harness is this tree's), interleaved with this tree's in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.reader import EventFollower, WorkerGroup
from elastic_ddp.testbed.local_cluster import AGENT_ENV, LocalJob, LocalNode, wait_for

REPO = Path(__file__).resolve().parent.parent
MODEL_MODULE = "large_state_model"  # written into each run's directory, the nodes' working directory
MODEL_SOURCE = '''
import os
import torch
from torch import nn


class LargeStateModel(nn.Module):
    """A small MLP that trains, and a frozen parameter of LARGE_STATE_MB that is only carried."""

    def __init__(self, state_mb: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(768, 64), nn.ReLU(), nn.Linear(64, 10))
        self.carried = nn.Parameter(torch.full((state_mb * 2**20 // 4,), 0.5), requires_grad=False)

    def forward(self, x):
        return self.net(x)


def build():
    return LargeStateModel(int(os.environ["LARGE_STATE_MB"]))
'''
TRAINING_ARGS = ["--model", f"{MODEL_MODULE}:build", "--no-augment", "--epochs", "1000", "--dataset_size", "4096",
                 "--global_batch_size", "64", "--micro_batch_size", "32", "--log_interval", "1000"]
GAP_LINE = re.compile(r"peer watchdog: the longest a peer's heartbeat stayed unchanged was ([\d.]+) s")
EVICTION_LINE = re.compile(r"peer watchdog: .*(sent no heartbeat|has not answered)")
TIMEOUT_S = 240.0
SHM = Path("/dev/shm")
HOLD_S = 4.0  # of training after the join, before the drain: the watchdog's gaps span the restore


def _vm_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith(field + ":")), 0)
    except OSError:
        return 0


def worker_peak_mb(node: LocalNode) -> float:
    """The largest VmHWM among the node's processes (its worker: the one that holds the state)."""
    return max((_vm_kib(pid, "VmHWM") for pid in node.worker_pids()), default=0) / 1024


class _Job(LocalJob):
    """A LocalJob whose nodes keep their memory copies in /dev/shm, as the shipped default does
    (a directory on disk would add its writeback to every keep)."""

    def node_memory_dir(self, name: str) -> Path:
        return SHM / f"elastic-ddp-bench-{os.getpid()}-{self.run_id}-{name}"


def _log_since(nodes: list[LocalNode], offsets: dict[str, int]) -> str:
    """What the nodes logged since `offsets` (characters, by node name)."""
    return "\n".join(node.log_text()[offsets.get(node.name, 0):] for node in nodes)


def _first_step_of(events: EventFollower, after: float, predicate, what: str) -> WorkerGroup:
    found: list[WorkerGroup] = []

    def ready() -> bool:
        events.poll()
        found[:] = [g for g in events.groups_since(after) if g.first_step is not None and predicate(g)]
        return bool(found)

    wait_for(ready, TIMEOUT_S, what, interval=0.05)
    return found[0]


def _startup(events: EventFollower, group: WorkerGroup, origin: float) -> dict[str, float]:
    """Seconds from `origin` (the kill, the join) to rank 0's process start and each start-up mark."""
    startup = next((e for e in events.of_kind(schema.STARTUP) if e["incarnation"] == group.incarnation), None)
    if startup is None:
        return {}
    marks = {"process_started": 0.0, **startup["seconds"]}
    return {name: round(startup["process_started"] + seconds - origin, 2) for name, seconds in marks.items()}


def _first_snapshot_blocked(events: EventFollower, group: WorkerGroup) -> float | None:
    """How long the group's first snapshot (right after its restore) blocked rank 0's training."""
    return next((e["blocked_seconds"] for e in events.of_kind(schema.SNAPSHOT_CAPTURED)
                 if e["incarnation"] == group.incarnation), None)


def _restored_seconds(phases: dict[str, float]) -> float | None:
    return round(phases["restored"] - phases["built"], 2) if {"restored", "built"} <= phases.keys() else None


def measure_once(setting: str, size_mb: int, run_dir: Path, pythonpath: str) -> dict[str, Any]:
    """One kill, one join and one drain of a job whose state is `size_mb`, under `setting`."""
    run_dir.mkdir(parents=True)
    (run_dir / f"{MODEL_MODULE}.py").write_text(MODEL_SOURCE)
    env = {"LARGE_STATE_MB": str(size_mb), "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, str(run_dir)]))}
    job = _Job(run_dir, TRAINING_ARGS, nnodes="1:4", run_id=f"large-{setting}-{size_mb}", env=env,
                   agent_env={**AGENT_ENV, "LOGLEVEL": "INFO"}, per_node_checkpoint_dirs=True)
    events = EventFollower(job.event_log)
    try:
        job.add_node("node0")
        job.add_node("node1")
        _first_step_of(events, 0, lambda g: g.start["world_size"] == 2, "world 2")
        job.wait_for_event(lambda e: e["event"] == schema.SNAPSHOT.name, TIMEOUT_S, "a durable snapshot")
        job.wait_for_step(job.last_step() + 5, TIMEOUT_S)

        killed_at = time.time()
        watched = [_log_since(job.nodes, {})]  # before the kill: any eviction is a false one
        job.nodes[1].kill()
        alone = _first_step_of(events, killed_at, lambda g: True, "training after the kill")
        after_kill = {node.name: len(node.log_text()) for node in job.nodes}  # node 1's own silence: a real one
        job.wait_for_step(alone.first_step["global_step"] + 3, TIMEOUT_S)
        kept = [e["seconds"] for e in events.of_kind(schema.MEMORY_COPY) if killed_at <= e["time"] <= alone.started]
        phases = _startup(events, alone, killed_at)
        kill = {"seconds": round(alone.first_step["time"] - killed_at, 2), "keep_s": max(kept, default=None),
                "restore_s": _restored_seconds(phases), "phases": phases,
                "peak_mb": [round(worker_peak_mb(job.nodes[0]))]}

        joined_at = time.time()
        joiner = job.add_node("joiner")
        both = _first_step_of(events, joined_at, lambda g: joiner.pid in g.agent_pids, "training with the joiner")
        # Long enough after the restore for each watchdog to see the other's heartbeat change again.
        wait_for(lambda: job.events(schema.STEP.name)[-1]["time"] >= both.first_step["time"] + HOLD_S, TIMEOUT_S,
                 f"{HOLD_S:g} s of training with the joiner", interval=0.1, still_possible=job.why_ended)
        phases = _startup(events, both, joined_at)
        join = {"seconds": round(both.first_step["time"] - joined_at, 2), "restore_s": _restored_seconds(phases),
                "phases": phases,
                "peak_mb": [round(worker_peak_mb(node)) for node in (job.nodes[0], joiner)]}

        watched.append(_log_since(job.nodes, after_kill))  # the join, its restore, training: until the drain
        for node in (job.nodes[0], joiner):
            node.terminate()
        job.wait(TIMEOUT_S)
    finally:
        job.stop()
        for node in job.nodes:
            shutil.rmtree(job.node_memory_dir(node.name), ignore_errors=True)
    logs = "\n".join(node.log_text() for node in job.nodes)
    events.poll()
    # The drains' final snapshots wait for the write in flight by design (snapshots.md): apart.
    drained = {e["global_step"] for e in events.of_kind(schema.DRAIN)}
    captured = events.of_kind(schema.SNAPSHOT_CAPTURED)
    blocked = [e["blocked_seconds"] for e in captured if e["global_step"] not in drained]
    largest = max((e for e in captured if e["global_step"] not in drained), key=lambda e: e["blocked_seconds"],
                  default=None)
    drain_blocked = [e["blocked_seconds"] for e in captured if e["global_step"] in drained]
    kill["first_snapshot_s"], join["first_snapshot_s"] = (_first_snapshot_blocked(events, group)
                                                          for group in (alone, both))
    return {"setting": setting, "size_mb": size_mb, "kill": kill, "join": join,
            "longest_gap_s": max((float(gap) for gap in GAP_LINE.findall(logs)), default=None),
            "evictions": sum(len(EVICTION_LINE.findall(text)) for text in watched),
            "restarts": len(events.groups) - 3,  # beyond the three groups of the scenario
            "snapshot_blocked_s": {"max": max(blocked, default=None), "n": len(blocked),
                                   "median": statistics.median(blocked) if blocked else None,
                                   "max_at": None if largest is None else _placed(largest, events)},
            "drain_snapshot_blocked_s": max(drain_blocked, default=None)}


def _placed(captured: dict[str, Any], events: EventFollower) -> str:
    """Where a snapshot was taken: its step, which of the run's worker groups, and which of its
    snapshots ("group 2, snapshot 1": the kill's group, its first)."""
    groups = [g for g in events.groups_since(0.0) if g.started <= captured["time"]]
    if not groups:
        return f"step {captured['global_step']}"
    group = groups[-1]
    nth = sum(1 for e in events.of_kind(schema.SNAPSHOT_CAPTURED) if group.started <= e["time"] <= captured["time"])
    return f"step {captured['global_step']}, group {len(groups)}, its snapshot {nth}"


def baseline_tree(revision: str, root: Path) -> Path:
    """A git worktree of `revision` (removed by `remove_tree`)."""
    tree = root / f"baseline-{revision}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), revision], check=True,
                   capture_output=True)
    return tree


def remove_tree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False,
                   capture_output=True)


def memory_bandwidth_gb_s() -> float:
    """One core's copy bandwidth (a 256 MB tensor copied; the best of 3), for the time per GB."""
    source, target = torch.ones(64 * 2**20), torch.empty(64 * 2**20)
    best = min(_timed(lambda: target.copy_(source)) for _ in range(3))
    return round(source.numel() * 4 / best / 1e9, 2)


def _timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def run_benchmark(sizes_mb: list[int], repeats: int = 1, baseline: str | None = None) -> dict[str, Any]:
    """Every (setting, size) `repeats` times, interleaved; the raw records and the summary. A run
    that times out is reported (`failed`) and the others go on."""
    records: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="large-state-") as root:
        trees = {"current": REPO}
        if baseline:
            trees[f"baseline-{baseline}"] = baseline_tree(baseline, Path(root))
        try:
            for repeat in range(repeats):
                for size in sizes_mb:
                    for setting, tree in trees.items():
                        try:
                            record = measure_once(setting, size, Path(root) / f"{setting}-{size}-{repeat}", str(tree))
                        except TimeoutError as exc:
                            failed.append({"setting": setting, "size_mb": size, "repeat": repeat, "error": str(exc)})
                            print(f"{setting} {size} MB #{repeat + 1}: FAILED: {exc}", file=sys.stderr, flush=True)
                            continue
                        records.append({**record, "repeat": repeat})
                        print(f"{setting} {size} MB #{repeat + 1}: kill -> step {record['kill']['seconds']} s, "
                              f"join -> step {record['join']['seconds']} s, peaks {record['join']['peak_mb']} MB, "
                              f"gap {record['longest_gap_s']} s, evictions {record['evictions']}, largest "
                              f"snapshot block {record['snapshot_blocked_s']['max']} s "
                              f"({record['snapshot_blocked_s']['max_at']})",
                              file=sys.stderr, flush=True)
        finally:
            for setting, tree in trees.items():
                if setting != "current":
                    remove_tree(tree)
    others = [setting for setting in trees if setting != "current"]
    return {"records": records, "failed": failed, "summary": summarise(records),
            "memory_bandwidth_gb_s": memory_bandwidth_gb_s(), "ratios": {setting: ratios(records, setting) for setting in others}}


def _stats(values: list[float]) -> dict[str, float] | None:
    values = [value for value in values if value is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values), "n": len(values)}


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per setting and size: the times, the peaks over the smallest size's (in states), the gaps."""
    summary: dict[str, dict[int, dict[str, Any]]] = {}
    for setting in dict.fromkeys(r["setting"] for r in records):
        mine = [r for r in records if r["setting"] == setting]
        smallest = min(r["size_mb"] for r in mine)
        base_peak = statistics.median(max(r["join"]["peak_mb"] + r["kill"]["peak_mb"]) for r in mine
                                      if r["size_mb"] == smallest)
        summary[setting] = {}
        for size in sorted({r["size_mb"] for r in mine}):
            runs = [r for r in mine if r["size_mb"] == size]
            peak = [max(r["join"]["peak_mb"] + r["kill"]["peak_mb"]) for r in runs]
            summary[setting][size] = {
                "kill_s": _stats([r["kill"]["seconds"] for r in runs]),
                "keep_s": _stats([r["kill"]["keep_s"] for r in runs]),
                "join_s": _stats([r["join"]["seconds"] for r in runs]),
                "restore_s": _stats([r["kill"]["restore_s"] for r in runs] + [r["join"]["restore_s"] for r in runs]),
                "peak_mb": _stats(peak),
                "peak_states": (_stats([round((p - base_peak) / size, 2) for p in peak]) if size != smallest else None),
                "longest_gap_s": _stats([r["longest_gap_s"] for r in runs]),
                "evictions": sum(r["evictions"] for r in runs),
                "first_snapshot_s": _stats([r["kill"].get("first_snapshot_s") for r in runs]
                                           + [r["join"].get("first_snapshot_s") for r in runs]),
                "snapshot_blocked_s": _stats([r["snapshot_blocked_s"]["median"] for r in runs]),
                "snapshot_blocked_max_s": _stats([r["snapshot_blocked_s"]["max"] for r in runs]),
                "drain_snapshot_s": _stats([r.get("drain_snapshot_blocked_s") for r in runs]),
            }
    return summary


COLUMNS = {"kill_s": "kill->step s", "keep_s": "keep s", "join_s": "join->step s", "restore_s": "restore s",
           "peak_mb": "peak MB", "peak_states": "(peak-base)/state", "longest_gap_s": "longest gap s",
           "first_snapshot_s": "1st snap after restore s", "snapshot_blocked_s": "snap blocked s",
           "snapshot_blocked_max_s": "snap blocked max s", "drain_snapshot_s": "drain's snap s"}


def print_table(result: dict[str, Any]) -> None:
    print(f"\nmemory copy bandwidth, one core: {result['memory_bandwidth_gb_s']} GB/s; "
          "cells: median [min-max] over the repeats; evictions: false ones, summed")
    for setting, sizes in result["summary"].items():
        print(f"\n{setting}")
        print(f"  {'state':>8}" + "".join(f"{title:>21}" for title in COLUMNS.values()) + f"{'evictions':>10}")
        for size, row in sizes.items():
            print(f"  {size:>6}MB" + "".join(f"{_cell(row[key]):>21}" for key in COLUMNS) + f"{row['evictions']:>10}")
    for run in result.get("failed", []):
        print(f"\n{run['setting']} {run['size_mb']} MB #{run['repeat'] + 1} failed: {run['error']}")
    for baseline, by_size in result.get("ratios", {}).items():
        print(f"\n{baseline} / current (per repeat, paired)")
        for size, row in by_size.items():
            print(f"  {size:>6}MB" + "".join(f"{name + ' ' + _cell(stats):>30}" for name, stats in row.items()))


def _cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "-"
    return f"{_number(stats['median'])} [{_number(stats['min'])}-{_number(stats['max'])}]"


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}"


RATIOS = {"kill->step": lambda r: r["kill"]["seconds"], "join->step": lambda r: r["join"]["seconds"],
          "peak MB": lambda r: max(r["join"]["peak_mb"] + r["kill"]["peak_mb"]),
          "longest gap": lambda r: r["longest_gap_s"]}


def ratios(records: list[dict[str, Any]], baseline: str) -> dict[int, dict[str, dict[str, float] | None]]:
    """Per size: `baseline` / current of each figure, per repeat (paired: run one after the other;
    a repeat that one of them lacks is left out)."""
    result = {}
    for size in sorted({r["size_mb"] for r in records}):
        current = {r.get("repeat"): r for r in records if r["setting"] == "current" and r["size_mb"] == size}
        other = {r.get("repeat"): r for r in records if r["setting"] == baseline and r["size_mb"] == size}
        pairs = [(current[repeat], other[repeat]) for repeat in current.keys() & other.keys()]
        result[size] = {name: _stats([value(b) / value(c) for c, b in pairs if value(c) and value(b)])
                        for name, value in RATIOS.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 512, 1024],
                        help="State sizes in MB; the smallest is the memory reference (default: 16 512 1024).")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline", metavar="REV", help="Also run the nodes on the code of git revision REV.")
    parser.add_argument("--json", type=Path, help="Also write the raw records and the summary here.")
    args = parser.parse_args(argv)
    if min(args.sizes_mb) < 1 or args.repeats < 1:
        parser.error(f"--sizes-mb {args.sizes_mb} / --repeats {args.repeats}: expected positive numbers")
    result = run_benchmark(sorted(set(args.sizes_mb)), args.repeats, args.baseline)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
