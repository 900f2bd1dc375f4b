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
        self._unwritable = False
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"time": round(time.time(), 4), "event": event, "incarnation": self.incarnation, **fields}
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write(json.dumps(record) + "\n")
                    self._unwritable = False
                except OSError as exc:  # a full disk must not stop training (the snapshot path reports it)
                    if not self._unwritable:
                        logger.warning("event log %s cannot be written (%s): events are dropped until it can",
                                       self.path, exc)
                    self._unwritable = True

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as exc:
                    logger.warning("event log %s: last events lost (%s)", self.path, exc)
                self._file = None


def process_start_unix(pid: int | str = "self") -> float | None:
    """When process `pid` started, in Unix seconds (to the kernel's clock tick, 10 ms), from /proc.

    None where /proc is missing (not Linux) or the process is gone.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    now = time.time()
    # Fields after the command name (which may hold spaces); starttime (ticks after boot) is field 22.
    started_after_boot = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return now - (uptime - started_after_boot)


class StartupTimeline:
    """Seconds from this process's start to each named moment of a worker's start-up.

    The trainer reports them in the `startup` event after its first optimizer step, so that the
    seconds of a restart can be attributed: interpreter and `import torch`, process group,
    building the model and data, restoring the snapshot, the first step.
    """

    def __init__(self) -> None:
        self.process_started = process_start_unix() or time.time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Record that `name` is done now (the first call for a name wins)."""
        self.marks.setdefault(name, round(time.time() - self.process_started, 3))


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


def next_round(path: str | Path) -> int:
    """The `round` for a new `start` event: 1 + the newest one in the log (1 for a new log).

    It numbers the worker groups that started training in this run, relaunches included: one per
    rendezvous round that reached training. (torchrun does not tell workers its own round number.)
    """
    path = Path(path)
    starts = [e for e in read_events(path, TAIL_BYTES) if e.get("event") == "start"]
    if not starts and path.exists() and path.stat().st_size > TAIL_BYTES:
        with open(path, "rb") as handle:  # a long incarnation pushed its start out of the tail
            for line in handle:
                if b'"event": "start"' in line:
                    try:
                        starts.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
    if not starts:
        return 1
    return int(starts[-1].get("round") or len(starts)) + 1


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
