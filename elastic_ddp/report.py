"""What happened to a run, read back from its event log: a summary for people and for scripts.

    elastic-ddp report runs/job1                # text summary + runs/job1/report.png
    elastic-ddp report runs/job1 --json         # the same numbers as JSON

`load_history(path)` groups the event log (docs/operations.md, "Event log") by incarnation (one
start of the worker group) and pairs each incarnation with the next one: a membership change
(a node lost or joined), a restart in the same world, or a relaunch after the run had finished.
`summarise(history)` turns that into the numbers of the report; `format_summary` into text. The
plot lives in `elastic_ddp.report_plot` (it needs matplotlib).

What the report can and cannot tell:
- A failure is dated by the last event of the incarnation that died (its last step or snapshot),
  so the real moment of the crash lies between that and the next event; the downtime it shows
  (last event before the failure to the first step after it) is therefore an upper bound.
- It reads the event log of rank 0, which lives on rank 0's node: when rank 0 moved to a node with
  another local log, give the report that node's log (or keep event logs on a shared filesystem).
- Lines torn by a crash are skipped; events of unknown kinds are counted, never an error.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EVENT_LOG_NAME = "events.jsonl"
KNOWN_EVENTS = {"start", "restore", "step", "progress", "epoch_end", "snapshot_captured", "snapshot",
                "snapshot_failed", "startup", "drain", "finished"}
TRANSITION_KINDS = ("node lost", "node drained", "restart", "node joined", "relaunch after finish")


class ReportError(Exception):
    """The path given is not an elastic_ddp run (or its event log holds nothing to report)."""


# --------------------------------------------------------------------------------------- reading

def find_event_log(path: str | Path) -> Path:
    """The event log of the run at `path`: the file itself, DIR/events.jsonl, or DIR/*/events.jsonl.

    Raises ReportError naming what was looked for when there is none, or several to choose from.
    """
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such file or directory")
    if path.is_file():
        return path
    direct = path / EVENT_LOG_NAME
    if direct.is_file():
        return direct
    nested = sorted(candidate for candidate in path.glob(f"*/{EVENT_LOG_NAME}") if candidate.is_file())
    if len(nested) == 1:
        return nested[0]
    if nested:
        listed = ", ".join(str(candidate) for candidate in nested)
        raise ReportError(f"{path}: several event logs ({listed}); name one of them")
    raise ReportError(f"{path}: not an elastic_ddp run directory (no {EVENT_LOG_NAME} in it or one level "
                      f"below); give the run's --checkpoint_dir, or the file named by --event_log")


def iter_events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of the log one by one (a long run's log need not fit in memory twice)."""
    with open(path, "rb") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a line torn by a crash
            if isinstance(record, dict) and "event" in record and "time" in record and "incarnation" in record:
                yield record


# ------------------------------------------------------------------------------------- the model

@dataclass
class Incarnation:
    """One start of the worker group, from its `start` event to its last event."""

    incarnation: int
    start_time: float
    last_time: float
    world_size: int | None = None
    nodes: int | None = None
    run_id: str | None = None
    restore: dict[str, Any] | None = None
    startup_seconds: dict[str, float] | None = None  # process start to each start-up stage
    drained: bool = False
    first_step: tuple[float, int] | None = None  # (time, global_step) of its first committed step
    last_step: tuple[float, int] | None = None
    finished: bool = False

    @property
    def resumed_from_step(self) -> int:
        """The step it continued from: the restored snapshot's, or 0 when it started from scratch."""
        return self.restore["global_step"] if self.restore else 0

    @property
    def final_step(self) -> int:
        return self.last_step[1] if self.last_step else self.resumed_from_step


@dataclass
class Transition:
    """What separates two consecutive incarnations."""

    kind: str  # one of TRANSITION_KINDS
    failed_at: float  # the last event of the earlier incarnation
    resumed_at: float  # the first step of the later one (its last event if it made no step)
    before: Incarnation
    after: Incarnation

    @property
    def lost_steps(self) -> int:
        logged = (self.after.restore or {}).get("lost_steps")
        if logged is not None:
            return int(logged)
        return max(0, self.before.final_step - self.after.resumed_from_step)

    @property
    def lost_seconds(self) -> float:
        return float((self.after.restore or {}).get("lost_seconds") or 0.0)

    @property
    def downtime(self) -> float:
        return max(0.0, self.resumed_at - self.failed_at)


@dataclass
class RunHistory:
    """Everything the report needs, gathered in one pass over the event log."""

    event_log: Path
    incarnations: list[Incarnation]
    progress: list[dict[str, Any]]
    snapshots: list[dict[str, Any]]
    snapshot_failures: list[dict[str, Any]]
    blocked_seconds: list[float]
    epochs_completed: int
    other_events: dict[str, int]

    @property
    def started(self) -> float:
        return self.incarnations[0].start_time

    @property
    def ended(self) -> float:
        return max(incarnation.last_time for incarnation in self.incarnations)

    @property
    def transitions(self) -> list[Transition]:
        return [_transition(before, after) for before, after in zip(self.incarnations, self.incarnations[1:])]


def _transition(before: Incarnation, after: Incarnation) -> Transition:
    if before.finished:
        kind = "relaunch after finish"
    elif before.world_size and after.world_size and after.world_size < before.world_size:
        # A drained worker group stopped on SIGTERM after a final snapshot; torchrun also sends
        # SIGTERM to re-form the group when a node joins, hence the world-size test first.
        kind = "node drained" if before.drained else "node lost"
    elif before.world_size and after.world_size and after.world_size > before.world_size:
        kind = "node joined"
    else:
        kind = "restart"
    resumed_at = after.first_step[0] if after.first_step else after.last_time
    return Transition(kind=kind, failed_at=before.last_time, resumed_at=resumed_at, before=before, after=after)


def load_history(path: str | Path) -> RunHistory:
    """Read the event log at (or under) `path`. Raises ReportError when it holds no run."""
    event_log = find_event_log(path)
    by_id: dict[int, Incarnation] = {}
    progress, snapshots, snapshot_failures, blocked = [], [], [], []
    epochs_completed = 0
    other: Counter[str] = Counter()
    for event in iter_events(event_log):
        kind, moment = event["event"], float(event["time"])
        incarnation = by_id.get(event["incarnation"])
        if incarnation is None:
            incarnation = by_id[event["incarnation"]] = Incarnation(event["incarnation"], moment, moment)
        incarnation.last_time = max(incarnation.last_time, moment)
        if kind == "start":
            incarnation.start_time = moment
            incarnation.world_size = event.get("world_size")
            incarnation.nodes = event.get("nodes")
            incarnation.run_id = event.get("run_id")
        elif kind == "restore":
            incarnation.restore = event
        elif kind == "step":
            point = (moment, int(event["global_step"]))
            incarnation.first_step = incarnation.first_step or point
            incarnation.last_step = point
        elif kind == "progress":
            progress.append(event)
        elif kind == "snapshot":
            snapshots.append(event)
        elif kind == "snapshot_failed":
            snapshot_failures.append(event)
        elif kind == "startup" and isinstance(event.get("seconds"), dict):
            incarnation.startup_seconds = event["seconds"]
        elif kind == "drain":
            incarnation.drained = True
        elif kind == "snapshot_captured":
            blocked.append(float(event.get("blocked_seconds", 0.0)))
        elif kind == "epoch_end":
            epochs_completed = max(epochs_completed, int(event["epoch"]) + 1)
        elif kind == "finished":
            incarnation.finished = True
        if kind not in KNOWN_EVENTS:
            other[kind] += 1
    if not by_id:
        raise ReportError(f"{event_log}: holds no elastic_ddp events (is it the event log of a run?)")
    incarnations = sorted(by_id.values(), key=lambda incarnation: incarnation.start_time)
    return RunHistory(event_log, incarnations, progress, snapshots, snapshot_failures, blocked, epochs_completed,
                      dict(other))


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
    restart_seconds: dict[str, Any]
    throughput: dict[str, Any]
    loss: dict[str, Any]
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
        restart_seconds=_restart_numbers(history),
        throughput=_throughput_numbers(history.progress),
        loss=_loss_numbers(history.progress),
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
        "lost_steps": transition.lost_steps,
        "lost_seconds": transition.lost_seconds,
        "downtime_seconds": round(transition.downtime, 3),
    }


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


# ------------------------------------------------------------------------------------- the text

def format_duration(seconds: float) -> str:
    """`42.1 s`, `3 min 05 s`, `2 h 04 min`, `3 d 02 h`: exact enough for a person."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"


def format_clock(seconds: float) -> str:
    """Elapsed time as `m:ss` or `h:mm:ss`, for positions within a run."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def plural(count: int, noun: str) -> str:
    """`1 failure`, `2 failures`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _nodes_text(nodes: int | None) -> str:
    return f" on {plural(nodes, 'node')}" if nodes else ""


def _format_loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def describe_transition(transition: dict[str, Any]) -> str:
    """One line per membership change, as the progress output announces it."""
    line = (f"{transition['kind']}: world {transition['from_world_size']} -> {transition['to_world_size']}, "
            f"resumed from step {transition['resumed_from_step']}")
    if transition["kind"] == "relaunch after finish":
        return line + " (no work to redo)"
    return (line + f", lost {plural(transition['lost_steps'], 'step')} ({transition['lost_seconds']:.1f} s), "
            f"{transition['downtime_seconds']:.1f} s without training")


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
        "World size   " + " -> ".join(
            f"{w['world_size']}{_nodes_text(w['nodes'])} ({format_clock(w['from_seconds'])}-"
            f"{format_clock(w['to_seconds'])})" for w in summary.world_sizes),
        "Incidents    " + ", ".join(
            [plural(summary.failures, "failure")] + ([plural(summary.drains, "drain")] if summary.drains else [])
            + [plural(summary.joins, "join"), plural(summary.restores, "restore")])
        + f" over {plural(summary.incarnations, 'incarnation')}",
    ]
    lines += [f"  at {format_clock(t['at_seconds'])}  {describe_transition(t)}" for t in summary.transitions]
    lines.append(f"Work lost    {plural(summary.lost_steps_total, 'step')} "
                 f"({summary.lost_seconds_total:.1f} s of training "
                 f"redone); {summary.downtime_seconds_total:.1f} s without training between failure and resume")
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
    if snapshots["failed"]:
        lines.append(f"             {plural(snapshots['failed'], 'snapshot write')} FAILED "
                     "(the previous ones were kept; "
                     "see the snapshot_failed events)")
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
