"""The event log's writer: what happened to a run, as JSON lines that tools and people can read.

Only rank 0 writes. Every line has `time` (Unix seconds), `event` and `incarnation`, plus the
fields its kind declares in `runlog.schema` (docs/operations.md, "Event log", lists them).
Lines are appended with one write each, so incarnations that follow each other share one file per
checkpoint directory; `runlog.reader` reads them back. A sink, when given, sees every event too
(the live metrics, runlog/metrics.py), also while the file cannot be written.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_ddp.locations import local_path
from elastic_ddp.runlog.schema import EVENT_KINDS, EVENT_LOG_NAME, EventKind

logger = logging.getLogger(__name__)

# Told each event: its kind, its fields and its time (Unix seconds).
EventSink = Callable[[EventKind, dict[str, Any], float], None]


def default_event_log(checkpoint_dir: str) -> Path:
    """CHECKPOINT_DIR/events.jsonl; ./events.jsonl when snapshots go to an object store."""
    directory = local_path(checkpoint_dir)
    return (directory if directory is not None else Path.cwd()) / EVENT_LOG_NAME


class EventLog:
    """Appends events to `path` and tells `sink`; a disabled log (on ranks other than 0) drops them."""

    def __init__(self, path: str | Path, incarnation: int, enabled: bool, sink: EventSink | None = None):
        self.path = Path(path)
        self.incarnation = incarnation
        self._file = None
        self._lock = threading.Lock()  # the snapshot writer thread emits too
        self._unwritable = False
        self._sink = sink if enabled else None
        self._sink_failed = False
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def emit(self, kind: EventKind, **fields: Any) -> None:
        """Append one event of `kind`; `fields` must be exactly the ones the kind declares."""
        # An undeclared kind or field is a bug of the writer: every reader relies on the schema.
        assert EVENT_KINDS.get(kind.name) is kind and fields.keys() == kind.field_set, (kind, sorted(fields))
        if self._file is None and self._sink is None:
            return
        record = {"time": round(time.time(), 4), "event": kind.name, "incarnation": self.incarnation, **fields}
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._sink is not None:
                self._tell_sink(kind, fields, record["time"])
            if self._file is not None:
                try:
                    self._file.write(line)
                    self._unwritable = False
                except OSError as exc:  # a full disk must not stop training (the snapshot path reports it)
                    if not self._unwritable:
                        logger.warning("event log %s cannot be written (%s): events are dropped until it can",
                                       self.path, exc)
                    self._unwritable = True

    def _tell_sink(self, kind: EventKind, fields: dict[str, Any], now: float) -> None:
        try:
            self._sink(kind, fields, now)
        except Exception as exc:  # noqa: BLE001 - the metrics must not stop training; the log has the event
            if not self._sink_failed:
                logger.warning("live metrics missed a %s event (%s: %s); training goes on", kind.name,
                               type(exc).__name__, exc)
            self._sink_failed = True

    def close(self) -> None:
        with self._lock:
            self._sink = None
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as exc:
                    logger.warning("event log %s: last events lost (%s)", self.path, exc)
                self._file = None
