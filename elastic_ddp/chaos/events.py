"""Following a run's event log while it grows: what the harness triggers on and measures with.

The trainer appends JSON lines (elastic_ddp/events.py); `EventFollower.poll()` reads only what
was appended since the last call, keeps complete lines, and indexes what the harness asks about
often: each worker group's `start` event, its first and newest `step`, and every other event in
order. A poll costs one `stat` when nothing is new, so the harness can poll every few
milliseconds and fire a fault within milliseconds of the event that triggers it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class WorkerGroup:
    """One incarnation: a worker group that a rendezvous round started."""

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
    """Incremental reader of one event log (see module docs)."""

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
        fresh = []
        for line in lines:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line from a writer that was killed mid-line
            self._index(event)
            fresh.append(event)
        return fresh

    def _index(self, event: dict[str, Any]) -> None:
        kind, incarnation = event.get("event"), event.get("incarnation")
        if kind == "step":
            group = self.groups.get(incarnation)
            if group is not None:
                if group.first_step is None:
                    group.first_step = event
                group.newest_step = event
            return
        if kind == "start":
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

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event.get("event") == kind]
