"""Reading a run's event log back: the one reader every tool goes through.

One parser (`parse_event`) turns a line into an event or drops it (a line torn by a crash, or one
that is not an event); on top of it:

- `iter_events` / `read_events`: a whole log, or its tail, at once;
- `EventFollower`: a log that is still growing, read incrementally (the chaos harness and the
  recovery benchmark poll it every few milliseconds; a poll costs one `stat` when nothing is new);
- `next_round`, `work_lost`, `previous_incarnation`: what a restarting trainer needs to say
  about the incarnation before it.

`runlog.run_history` builds the whole run out of it (the model behind `elastic-ddp report`).

What the log can and cannot tell:
- A failure is dated by the last event of the incarnation that died (its last step or snapshot),
  so the real moment of the crash lies between that and the next event; downtimes derived from
  it are upper bounds.
- The log is rank 0's, on rank 0's node: when rank 0 moved to a node with another local log, read
  that node's log (or keep event logs on a shared filesystem).
- Events of kinds this version does not declare (a newer writer) are counted, never an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ddp.runlog import schema

# How much of the end of a log the trainer reads at a restart (a run's last incarnation fits).
TAIL_BYTES = 1 << 20


# ------------------------------------------------------------------------------------- parsing

def parse_event(line: bytes | str) -> dict[str, Any] | None:
    """The event on one line of the log, or None for a torn line or one that is not an event."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(record, dict) and "event" in record and "time" in record and "incarnation" in record:
        return record
    return None


def iter_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """The events of the log one by one (a long run's log need not fit in memory twice)."""
    with open(path, "rb") as handle:
        for line in handle:
            event = parse_event(line)
            if event is not None:
                yield event


def read_events(path: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The events in `path` (only those in its last `tail_bytes` if given); [] when it is missing."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            if tail_bytes is not None:
                handle.seek(max(0, os.path.getsize(path) - tail_bytes))
            data = handle.read()
    except FileNotFoundError:
        return []
    return [event for line in data.splitlines() if (event := parse_event(line)) is not None]


@dataclass
class WorkerGroup:
    """One incarnation as a follower sees it: its `start` event, its first and newest `step`."""

    incarnation: int
    start: dict[str, Any]
    first_step: dict[str, Any] | None = None
    newest_step: dict[str, Any] | None = None

    @property
    def started(self) -> float:
        return self.start["time"]

    @property
    def agent_pids(self) -> set[int]:
        return {rank["agent_pid"] for rank in self.start.get("ranks") or []}


@dataclass
class EventFollower:
    """Incremental reader of one growing event log (see the module docstring)."""

    path: Path
    groups: dict[int, WorkerGroup] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # every event but `step`, in order
    _offset: int = 0
    _partial: bytes = b""

    def poll(self) -> list[dict[str, Any]]:
        """The events appended since the last poll (all kinds), after indexing them."""
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            return []
        if size <= self._offset:
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            data = handle.read(size - self._offset)
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the rest
        fresh = [event for line in lines if (event := parse_event(line)) is not None]
        for event in fresh:
            self._index(event)
        return fresh

    def _index(self, event: dict[str, Any]) -> None:
        kind, incarnation = event["event"], event["incarnation"]
        if kind == schema.STEP.name:
            group = self.groups.get(incarnation)
            if group is not None:
                if group.first_step is None:
                    group.first_step = event
                group.newest_step = event
            return
        if kind == schema.START.name:
            self.groups[incarnation] = WorkerGroup(incarnation, event)
        self.events.append(event)

    def groups_since(self, moment: float) -> list[WorkerGroup]:
        """Worker groups that started at or after `moment` (Unix seconds), oldest first."""
        return sorted((g for g in self.groups.values() if g.started >= moment), key=lambda g: g.started)

    def newest_group(self) -> WorkerGroup | None:
        return max(self.groups.values(), key=lambda g: g.started, default=None)

    def newest_step(self) -> int:
        """The highest global step of the newest group that has trained (0 before any)."""
        trained = [g for g in self.groups.values() if g.newest_step is not None]
        if not trained:
            return 0
        return max(trained, key=lambda g: g.started).newest_step["global_step"]

    def of_kind(self, kind: schema.EventKind) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == kind.name]


# ----------------------------------------------------------------------- what a restart needs

def next_round(path: str | Path) -> int:
    """The `round` for a new `start` event: 1 + the newest one in the log (1 for a new log).

    It numbers the worker groups that started training in this run, relaunches included: one per
    rendezvous round that reached training. (torchrun does not tell workers its own round number.)
    """
    starts = [e for e in read_events(path, TAIL_BYTES) if e["event"] == schema.START.name]
    if not starts and Path(path).exists() and Path(path).stat().st_size > TAIL_BYTES:
        # A long incarnation pushed its start out of the tail.
        starts = [e for e in iter_events(path) if e["event"] == schema.START.name]
    if not starts:
        return 1
    return int(starts[-1].get("round") or len(starts)) + 1


def work_lost(path: str | Path, restored_step: int) -> tuple[int, float] | None:
    """(steps, seconds) trained after `restored_step` by earlier incarnations and now rolled back.

    Read from the `step` events at the end of the log; None when the log does not tell.
    """
    steps = [e for e in read_events(path, TAIL_BYTES) if e["event"] == schema.STEP.name]
    if not steps:
        return None
    last = steps[-1]
    restored_at = next((e["time"] for e in reversed(steps) if e["global_step"] <= restored_step), None)
    lost_steps = max(0, last["global_step"] - restored_step)
    lost_seconds = max(0.0, last["time"] - restored_at) if restored_at is not None and lost_steps else 0.0
    return lost_steps, round(lost_seconds, 3)


@dataclass
class PreviousIncarnation:
    """What the event log says about the incarnation before this one."""

    world_size: int | None
    last_event_time: float
    finished: bool


def previous_incarnation(path: str | Path, current: int) -> PreviousIncarnation | None:
    """The newest incarnation other than `current` in the tail of the log at `path`, or None."""
    found: PreviousIncarnation | None = None
    previous_id = None
    for event in reversed(read_events(path, TAIL_BYTES)):
        if event["incarnation"] == current:
            continue
        if found is None:
            previous_id = event["incarnation"]
            found = PreviousIncarnation(None, float(event["time"]), event["event"] == schema.FINISHED.name)
        if event["incarnation"] != previous_id:
            break
        if "world_size" in event:  # progress and start events carry it
            found.world_size = int(event["world_size"])
            break
    return found
