"""The event log: what happened to a run, as JSON lines that tools and people can read.

Only rank 0 writes. Every line has `time` (Unix seconds), `event` and `incarnation`; the kinds are
listed in docs/operations.md ("Event log"). Lines are appended with one write each, so incarnations
that follow each other share one file per checkpoint directory.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TAIL_BYTES = 1 << 20


class EventLog:
    """Appends events to `path`; a disabled log (on ranks other than 0) drops them."""

    def __init__(self, path: str | Path, incarnation: int, enabled: bool):
        self.path = Path(path)
        self.incarnation = incarnation
        self._file = None
        self._lock = threading.Lock()  # the snapshot writer thread emits too
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"time": round(time.time(), 4), "event": event, "incarnation": self.incarnation, **fields}
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The events in `path` (only those in its last `tail_bytes` if given); torn lines are skipped."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, "rb") as handle:
        if tail_bytes is not None:
            handle.seek(max(0, os.path.getsize(path) - tail_bytes))
        lines = handle.read().decode(errors="replace").splitlines()
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def work_lost(path: str | Path, restored_step: int) -> tuple[int, float] | None:
    """(steps, seconds) trained after `restored_step` by earlier incarnations and now rolled back.

    Read from the `step` events at the end of the log; None when the log does not tell.
    """
    steps = [e for e in read_events(path, TAIL_BYTES) if e.get("event") == "step"]
    if not steps:
        return None
    last = steps[-1]
    restored_at = next((e["time"] for e in reversed(steps) if e["global_step"] <= restored_step), None)
    lost_steps = max(0, last["global_step"] - restored_step)
    lost_seconds = max(0.0, last["time"] - restored_at) if restored_at is not None and lost_steps else 0.0
    return lost_steps, round(lost_seconds, 3)
