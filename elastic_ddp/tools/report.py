"""What happened to a run, read back from its event log: a summary for people and for scripts.

    elastic-ddp report runs/job1                # text summary + runs/job1/report.png
    elastic-ddp report runs/job1 --json         # the same numbers as JSON

`runlog.run_history.load_history(path)` reads the event log (docs/operations.md, "Event log") into
incarnations (starts of the worker group), each paired with the next one: a membership change (a
node lost or joined), a restart in the same world, or a relaunch after the run had finished.
`summarise(history)` turns that into the numbers of the report; `format_summary` into text. The
plot lives in `elastic_ddp.tools.plot` (it needs matplotlib). What the log can and cannot tell
(downtimes are upper bounds; the log is rank 0's): see `runlog.reader`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_ddp.runlog.progress import source_text
from elastic_ddp.runlog.run_history import RunHistory, Transition
from elastic_ddp.tools.text import format_bytes, format_clock, format_duration, plural

# ----------------------------------------------------------------------------------- the numbers

@dataclass
class RunSummary:
    """The numbers of a report; `to_dict()` is what `elastic-ddp report --json` prints."""

    event_log: str
    run_id: str | None
    started_unix: float
    duration_seconds: float
    finished: bool
    final_step: int
    epochs_completed: int
    incarnations: int
    world_sizes: list[dict[str, Any]]
    transitions: list[dict[str, Any]]
    failures: int
    drains: int
    joins: int
    restores: int
    lost_steps_total: int
    lost_seconds_total: float
    downtime_seconds_total: float
    snapshots: dict[str, Any]
    replication: dict[str, Any]
    restart_seconds: dict[str, Any]
    throughput: dict[str, Any]
    loss: dict[str, Any]
    evaluation: dict[str, Any]
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # each naming and recovery, in order
    other_events: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(history: RunHistory) -> RunSummary:
    started = history.started
    transitions = history.transitions
    last = history.incarnations[-1]
    return RunSummary(
        event_log=str(history.event_log),
        run_id=next((i.run_id for i in reversed(history.incarnations) if i.run_id), None),
        started_unix=started,
        duration_seconds=round(history.ended - started, 3),
        finished=last.finished,
        final_step=last.final_step,
        epochs_completed=history.epochs_completed,
        incarnations=len(history.incarnations),
        world_sizes=[{"world_size": i.world_size, "nodes": i.nodes, "from_seconds": round(i.start_time - started, 3),
                      "to_seconds": round(i.last_time - started, 3)} for i in history.incarnations],
        transitions=[_transition_dict(t, started) for t in transitions],
        failures=sum(1 for t in transitions if t.kind in ("node lost", "restart")),
        drains=sum(1 for t in transitions if t.kind == "node drained"),
        joins=sum(1 for t in transitions if t.kind == "node joined"),
        restores=sum(1 for i in history.incarnations if i.restore),
        lost_steps_total=sum(t.lost_steps for t in transitions),
        lost_seconds_total=round(sum(t.lost_seconds for t in transitions), 3),
        downtime_seconds_total=round(sum(t.downtime for t in transitions if t.kind != "relaunch after finish"), 3),
        snapshots=_snapshot_numbers(history),
        replication=_replication_numbers(history),
        restart_seconds=_restart_numbers(history),
        throughput=_throughput_numbers(history.progress),
        loss=_loss_numbers(history.progress),
        evaluation=_evaluation_numbers(history.evaluations),
        stragglers=[{"at_seconds": round(float(event["time"]) - started, 3),
                     **{key: event[key] for key in ("state", "rank", "node", "score", "pace_seconds")}}
                    for event in history.stragglers],
        other_events=history.other_events,
    )


def _transition_dict(transition: Transition, started: float) -> dict[str, Any]:
    return {
        "kind": transition.kind,
        "at_seconds": round(transition.failed_at - started, 3),
        "from_world_size": transition.before.world_size,
        "to_world_size": transition.after.world_size,
        "last_step_before": transition.before.final_step,
        "resumed_from_step": transition.after.resumed_from_step,
        "resumed_from": _restore_source(transition.after.restore),
        "refused": (transition.after.restore or {}).get("refused") or [],
        "lost_steps": transition.lost_steps,
        "lost_seconds": transition.lost_seconds,
        "downtime_seconds": round(transition.downtime, 3),
        "in_process": transition.after.in_process,
    }


def _restore_source(restore: dict[str, Any] | None) -> str | None:
    """`memory of rank 1 on node-b`, `a snapshot file`, or None (from scratch, or an older log)."""
    if not restore or not restore.get("source"):
        return None
    return source_text(restore["source"], restore.get("source_rank"), restore.get("source_host"))


def _stats(values: list[float], digits: int = 4) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "max": None}
    return {"mean": round(statistics.fmean(values), digits), "max": round(max(values), digits)}


def _snapshot_numbers(history: RunHistory) -> dict[str, Any]:
    sizes = [int(s["size_bytes"]) for s in history.snapshots if "size_bytes" in s]
    writes = [float(s["write_seconds"]) for s in history.snapshots if "write_seconds" in s]
    write_stats, blocked_stats = _stats(writes), _stats(history.blocked_seconds)
    return {
        "count": len(history.snapshots),
        "size_bytes_min": min(sizes) if sizes else None,
        "size_bytes_max": max(sizes) if sizes else None,
        "write_seconds_mean": write_stats["mean"], "write_seconds_max": write_stats["max"],
        "blocked_seconds_mean": blocked_stats["mean"], "blocked_seconds_max": blocked_stats["max"],
        "last_step": history.snapshots[-1]["global_step"] if history.snapshots else None,
        "failed": len(history.snapshot_failures),
        # The last spacing chosen on the overhead budget (None: --snapshot_every_steps, or an older log).
        "cadence": ({key: history.snapshot_cadences[-1][key] for key in ("every_steps", "interval_s", "budget")}
                    if history.snapshot_cadences else None),
    }


def _replication_numbers(history: RunHistory) -> dict[str, Any]:
    """Replicas asked for and delivered, and the failed deliveries, with their last reason."""
    plans = history.replication_plans
    delivered = [r for r in history.replications if r.get("nodes")]
    failures = history.replication_failures
    return {
        "replicas_asked": plans[-1].get("replicas") if plans else None,
        "target_nodes": plans[-1].get("target_nodes") if plans else None,
        "replicated": len(delivered),
        "last_replicated_step": delivered[-1]["global_step"] if delivered else None,
        "failed": len(failures),
        "last_failure": failures[-1].get("error") if failures else None,
    }


def _restart_numbers(history: RunHistory) -> dict[str, Any]:
    """Median seconds from a restarted worker's process start to each start-up stage (from the
    `startup` events of every incarnation but the first): where a restart's time goes."""
    restarts = [i.startup_seconds for i in history.incarnations[1:] if i.startup_seconds]
    stages = sorted({stage for seconds in restarts for stage in seconds},
                    key=lambda stage: statistics.median(s[stage] for s in restarts if stage in s))
    return {stage: round(statistics.median(s[stage] for s in restarts if stage in s), 3) for stage in stages}


def _throughput_numbers(progress: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [float(p["samples_per_second"]) for p in progress if "samples_per_second" in p]
    by_world: dict[int, list[float]] = {}
    for point in progress:
        if "samples_per_second" in point and "world_size" in point:
            by_world.setdefault(int(point["world_size"]), []).append(float(point["samples_per_second"]))
    return {
        "samples_per_second_median": round(statistics.median(rates), 1) if rates else None,
        "by_world_size": {str(world): round(statistics.median(values), 1)
                          for world, values in sorted(by_world.items())},
    }


def _loss_numbers(progress: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [float(p["loss"]) for p in progress if "loss" in p]
    if not losses:
        return {"first": None, "last": None, "min": None}
    return {"first": losses[0], "last": losses[-1], "min": min(losses)}


def _evaluation_numbers(evaluations: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out evaluations: `count` (those of rolled-back steps included: each was run), the
    `last_*` by time, the highest accuracy and the lowest loss with their steps (the earliest by time
    on a tie; `best_accuracy*` None when no evaluation had an accuracy). All but `count` are None
    when there was no evaluation."""
    # After a rollback a later evaluation can be of an earlier step: order by time, not by step.
    ordered = sorted(evaluations, key=lambda event: float(event["time"]))
    last = ordered[-1] if ordered else {}
    scored = [event for event in ordered if event.get("accuracy") is not None]
    best_accuracy = max(scored, key=lambda event: event["accuracy"], default={})
    best_loss = min(ordered, key=lambda event: event["loss"], default={})
    return {
        "count": len(ordered),
        "last_step": last.get("global_step"), "last_loss": last.get("loss"), "last_accuracy": last.get("accuracy"),
        "best_accuracy": best_accuracy.get("accuracy"), "best_accuracy_step": best_accuracy.get("global_step"),
        "best_loss": best_loss.get("loss"), "best_loss_step": best_loss.get("global_step"),
    }


# ------------------------------------------------------------------------------------- the text

def _nodes_text(nodes: int | None) -> str:
    return f" on {plural(nodes, 'node')}" if nodes else ""


def _format_loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def describe_transition(transition: dict[str, Any]) -> str:
    """One line per membership change, as the progress output announces it."""
    line = (f"{transition['kind']}: world {transition['from_world_size']} -> {transition['to_world_size']}, "
            f"resumed from step {transition['resumed_from_step']}")
    if transition.get("resumed_from"):
        line += f" from {transition['resumed_from']}"
    if transition.get("refused"):
        line += " (refused newer: " + "; ".join(f"{item['source']} of step {item['global_step']}, {item['reason']}"
                                               for item in transition["refused"]) + ")"
    if transition["kind"] == "relaunch after finish":
        return line + " (no work to redo)"
    return (line + f", lost {plural(transition['lost_steps'], 'step')} ({transition['lost_seconds']:.1f} s), "
            f"{transition['downtime_seconds']:.1f} s without training"
            + (", in process (no worker restarted)" if transition.get("in_process") else ""))


def _evaluation_line(evaluation: dict[str, Any]) -> str:
    """The last held-out evaluation and the best one: by accuracy, or by loss when none had one."""
    last = f"last at step {evaluation['last_step']}: loss {_format_loss(evaluation['last_loss'])}"
    if evaluation["last_accuracy"] is not None:
        last += f", accuracy {evaluation['last_accuracy']:.1%}"
    if evaluation["best_accuracy"] is not None:
        best = f"best accuracy {evaluation['best_accuracy']:.1%} at step {evaluation['best_accuracy_step']}"
    else:
        best = f"lowest loss {_format_loss(evaluation['best_loss'])} at step {evaluation['best_loss_step']}"
    return f"Evaluation   {plural(evaluation['count'], 'held-out evaluation')}; {last}; {best}"


def format_summary(summary: RunSummary, plot_path: str | None = None) -> str:
    """The text of `elastic-ddp report`."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary.started_unix))
    state = "finished" if summary.finished else "did not finish (still running, or its last incarnation died)"
    lines = [
        f"Run report: {summary.event_log}",
        f"  run id {summary.run_id or 'unknown'}; started {started}; lasted "
        f"{format_duration(summary.duration_seconds)}; {state}",
        f"Progress     step {summary.final_step}; {summary.epochs_completed} epochs completed; loss "
        f"{_format_loss(summary.loss['first'])} -> {_format_loss(summary.loss['last'])} "
        f"(min {_format_loss(summary.loss['min'])})",
        *([_evaluation_line(summary.evaluation)] if summary.evaluation["count"] else []),
        "World size   " + " -> ".join(
            f"{w['world_size']}{_nodes_text(w['nodes'])} ({format_clock(w['from_seconds'])}-"
            f"{format_clock(w['to_seconds'])})" for w in summary.world_sizes),
        "Incidents    " + ", ".join(
            [plural(summary.failures, "failure")] + ([plural(summary.drains, "drain")] if summary.drains else [])
            + [plural(summary.joins, "join"), plural(summary.restores, "restore")])
        + f" over {plural(summary.incarnations, 'incarnation')}",
    ]
    lines += [f"  at {format_clock(t['at_seconds'])}  {describe_transition(t)}" for t in summary.transitions]
    lines.append(f"Work lost    {plural(summary.lost_steps_total, 'step')} redone "
                 f"({summary.lost_seconds_total:.1f} s of training); "
                 f"{summary.downtime_seconds_total:.1f} s without training between failure and resume")
    snapshots = summary.snapshots
    if snapshots["count"]:
        size = format_bytes(snapshots["size_bytes_max"])
        if format_bytes(snapshots["size_bytes_min"]) != size:
            size = f"{format_bytes(snapshots['size_bytes_min'])}-{size}"
        lines.append(f"Snapshots    {snapshots['count']} written, {size} each; "
                     f"write {snapshots['write_seconds_mean']:.3f} s "
                     f"mean, {snapshots['write_seconds_max']:.3f} s max; training blocked "
                     f"{1000 * (snapshots['blocked_seconds_mean'] or 0):.1f} ms mean, "
                     f"{1000 * (snapshots['blocked_seconds_max'] or 0):.1f} ms max")
    else:
        lines.append("Snapshots    none written")
    if snapshots["cadence"]:
        cadence = snapshots["cadence"]
        lines.append(f"             on a {100 * cadence['budget']:g} % overhead budget: the last interval chosen was "
                     f"{plural(cadence['every_steps'], 'step')} ({format_duration(cadence['interval_s'])})")
    if snapshots["failed"]:
        lines.append(f"             {plural(snapshots['failed'], 'snapshot write')} FAILED "
                     "(the previous ones were kept; "
                     "see the snapshot_failed events)")
    replication = summary.replication
    if replication["replicated"] or replication["failed"] or replication["target_nodes"]:
        line = (f"Replication  {plural(replication['replicated'], 'snapshot')} copied to other nodes "
                f"(newest: step {replication['last_replicated_step']})" if replication["replicated"]
                else "Replication  no snapshot copied to another node")
        if replication["failed"]:
            line += (f"; {plural(replication['failed'], 'delivery', 'deliveries')} FAILED (last: {replication['last_failure']}; "
                     "see the replication_failed events)")
        lines.append(line)
    for straggler in summary.stragglers:
        node = "" if straggler["node"] is None else f" (node {straggler['node']})"
        lines.append(f"Straggler    at {format_clock(straggler['at_seconds'])}  rank {straggler['rank']}{node} "
                     f"{'named slow' if straggler['state'] == 'named' else 'back to speed'}: "
                     f"{straggler['score']:.2f} of the fastest rank's speed")
    if summary.restart_seconds:
        stages = ", ".join(f"{stage.replace('_', ' ')} {seconds:.1f} s"
                           for stage, seconds in summary.restart_seconds.items())
        lines.append(f"Restarts     median seconds from a restarted worker's process start: {stages}")
    throughput = summary.throughput
    if throughput["samples_per_second_median"] is not None:
        per_world = ", ".join(f"world {world}: {rate:,.0f}" for world, rate in throughput["by_world_size"].items())
        lines.append(f"Throughput   {throughput['samples_per_second_median']:,.0f} samples/s median ({per_world})")
    if summary.other_events:
        lines.append("Other events " + ", ".join(f"{kind} x{count}"
                                                 for kind, count in sorted(summary.other_events.items())))
    if plot_path:
        lines.append(f"Plot         {plot_path}")
    return "\n".join(lines)
