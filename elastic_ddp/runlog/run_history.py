"""The whole run as incarnations and the transitions between them: the model of `elastic-ddp report`.

`load_history(path)` reads the event log through the one reader (`runlog.reader`) in one pass and
groups it by incarnation (one start of the worker group); each is paired with the next one as a
`Transition`: a node lost, drained or joined, a restart in the same world, or a relaunch after the
run had finished. What the log can and cannot tell: see `runlog.reader`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.reader import iter_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME


class HistoryError(Exception):
    """The path given is not an elastic_ddp run, or its event log holds nothing to read."""


TRANSITION_KINDS = ("node lost", "node drained", "restart", "node joined", "relaunch after finish")


@dataclass
class Incarnation:
    """One start of the worker group, from its `start` event to its last event."""

    incarnation: int
    start_time: float
    last_time: float
    world_size: int | None = None
    nodes: int | None = None
    run_id: str | None = None
    in_process: bool = False  # re-formed by the survivors' workers in their own processes (no restart)
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
    incarnations: list[Incarnation] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)  # in log order, rolled-back steps included
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    snapshot_failures: list[dict[str, Any]] = field(default_factory=list)
    blocked_seconds: list[float] = field(default_factory=list)
    snapshot_cadences: list[dict[str, Any]] = field(default_factory=list)  # on the budget
    replication_plans: list[dict[str, Any]] = field(default_factory=list)
    replications: list[dict[str, Any]] = field(default_factory=list)
    replication_failures: list[dict[str, Any]] = field(default_factory=list)
    memory_copies: list[dict[str, Any]] = field(default_factory=list)
    memory_copy_failures: list[dict[str, Any]] = field(default_factory=list)
    amp_skipped_steps: list[dict[str, Any]] = field(default_factory=list)  # fp16 updates GradScaler skipped
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # ranks named slow, and back
    epochs_completed: int = 0
    other_events: dict[str, int] = field(default_factory=dict)

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


def _record_start(history: RunHistory, incarnation: Incarnation, event: dict[str, Any]) -> None:
    incarnation.start_time = float(event["time"])
    incarnation.world_size = event.get("world_size")
    incarnation.nodes = event.get("nodes")
    incarnation.run_id = event.get("run_id")
    incarnation.in_process = event.get("in_process") is True


def _record_step(history: RunHistory, incarnation: Incarnation, event: dict[str, Any]) -> None:
    point = (float(event["time"]), int(event["global_step"]))
    incarnation.first_step = incarnation.first_step or point
    incarnation.last_step = point


def _record_startup(history: RunHistory, incarnation: Incarnation, event: dict[str, Any]) -> None:
    if isinstance(event.get("seconds"), dict):
        incarnation.startup_seconds = event["seconds"]


def _record_epoch_end(history: RunHistory, incarnation: Incarnation, event: dict[str, Any]) -> None:
    history.epochs_completed = max(history.epochs_completed, int(event["epoch"]) + 1)


def _appending_to(attribute: str) -> Callable[[RunHistory, Incarnation, dict[str, Any]], None]:
    return lambda history, incarnation, event: getattr(history, attribute).append(event)


def _marking(attribute: str) -> Callable[[RunHistory, Incarnation, dict[str, Any]], None]:
    return lambda history, incarnation, event: setattr(incarnation, attribute, True)


# What `load_history` does with each declared kind; tests/unit/test_runlog.py checks that every
# kind of the schema has an entry, so that no event the trainer writes is left out of the report.
RECORDERS: dict[str, Callable[[RunHistory, Incarnation, dict[str, Any]], None]] = {
    schema.START.name: _record_start,
    schema.RESTORE.name: lambda history, incarnation, event: setattr(incarnation, "restore", event),
    schema.STARTUP.name: _record_startup,
    schema.STEP.name: _record_step,
    schema.PROGRESS.name: _appending_to("progress"),
    schema.EPOCH_END.name: _record_epoch_end,
    schema.EVAL.name: _appending_to("evaluations"),
    schema.SNAPSHOT_CAPTURED.name: lambda history, incarnation, event: history.blocked_seconds.append(
        float(event.get("blocked_seconds", 0.0))),
    schema.SNAPSHOT_CADENCE.name: _appending_to("snapshot_cadences"),
    schema.SNAPSHOT.name: _appending_to("snapshots"),
    schema.SNAPSHOT_FAILED.name: _appending_to("snapshot_failures"),
    schema.REPLICATION.name: _appending_to("replication_plans"),
    schema.SNAPSHOT_REPLICATED.name: _appending_to("replications"),
    schema.REPLICATION_FAILED.name: _appending_to("replication_failures"),
    schema.MEMORY_COPY.name: _appending_to("memory_copies"),
    schema.MEMORY_COPY_FAILED.name: _appending_to("memory_copy_failures"),
    schema.AMP_STEP_SKIPPED.name: _appending_to("amp_skipped_steps"),
    schema.DRAIN.name: _marking("drained"),
    schema.FINISHED.name: _marking("finished"),
    schema.STRAGGLER.name: _appending_to("stragglers"),
}


def find_event_log(path: str | Path) -> Path:
    """The event log of the run at `path`: the file itself, DIR/events.jsonl, or DIR/*/events.jsonl.

    Raises HistoryError naming what was looked for when there is none, or several to choose from.
    """
    path = Path(path)
    if not path.exists():
        raise HistoryError(f"{path}: no such file or directory")
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
        raise HistoryError(f"{path}: several event logs ({listed}); name one of them")
    raise HistoryError(f"{path}: not an elastic_ddp run directory (no {EVENT_LOG_NAME} in it or one level "
                       f"below); give the run's --checkpoint_dir, or the file named by --event_log")


def load_history(path: str | Path) -> RunHistory:
    """Read the event log at (or under) `path`. Raises HistoryError when it holds no run."""
    history = RunHistory(find_event_log(path))
    by_id: dict[int, Incarnation] = {}
    other: Counter[str] = Counter()
    for event in iter_events(history.event_log):
        moment = float(event["time"])
        incarnation = by_id.get(event["incarnation"])
        if incarnation is None:
            incarnation = by_id[event["incarnation"]] = Incarnation(event["incarnation"], moment, moment)
        incarnation.last_time = max(incarnation.last_time, moment)
        recorder = RECORDERS.get(event["event"])
        if recorder is None:
            other[event["event"]] += 1
        else:
            recorder(history, incarnation, event)
    if not by_id:
        raise HistoryError(f"{history.event_log}: holds no elastic_ddp events (is it the event log of a run?)")
    history.incarnations = sorted(by_id.values(), key=lambda incarnation: incarnation.start_time)
    history.other_events = dict(other)
    return history
