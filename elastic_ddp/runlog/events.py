"""The event log's writer: what happened to a run, as JSON lines that tools and people can read.

Only rank 0 writes. Every line has `time` (Unix seconds), `event` and `incarnation`, plus the
fields its kind declares in `runlog.schema` (docs/operations.md, "Event log", lists them).
Lines are appended with whole-line writes, so incarnations that follow each other share one file
per checkpoint directory; `runlog.reader` reads them back. A sink, when given, sees every event too
(the live metrics, runlog/metrics.py), at once, also while the file cannot be written.

`step` events, one per optimizer step, are written in batches: every FLUSH_INTERVAL_S by a thread
of the log (so also while training is blocked), and once FLUSH_LINES wait. Any other event is written at once, after the steps waiting before it, and so
are they all on `flush()` and `close()`: the trainer closes the log on every way out of `fit` (an
exception, a drain), and the stop guard flushes it before the peer watchdog ends the worker.

Not guaranteed: a SIGKILL of rank 0 (or a crash of the interpreter) loses the `step` events of
its last FLUSH_INTERVAL_S at most; the audit log, written by every rank, still has those steps.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_ddp.run_files.locations import local_path
from elastic_ddp.runlog.schema import EVENT_KINDS, EVENT_LOG_NAME, STEP, EventKind

logger = logging.getLogger(__name__)

# Only the kind written every step is worth batching; the rest is rare and read live by the tools.
BATCHED_KINDS = frozenset({STEP.name})
FLUSH_INTERVAL_S = 0.5
FLUSH_LINES = 256

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
        self._lock = threading.Lock()  # the snapshot writer thread emits too, and the flusher writes
        self._due = threading.Condition(self._lock)  # the flusher's clock, or the log closes
        self._waiting: list[bytes] = []  # batched lines not yet written, oldest first
        self._flusher: threading.Thread | None = None
        self._unwritable = False
        self._sink = sink if enabled else None
        self._sink_failed = False
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: nothing of ours sits in a buffer that a forked child (a DataLoader worker)
            # could write again when it exits; the batching is `_waiting`, written on purpose.
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - open until close()

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
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            if self._sink is not None:
                self._tell_sink(kind, fields, record["time"])
            if self._file is None:
                return
            self._waiting.append(line)
            if kind.name not in BATCHED_KINDS or len(self._waiting) >= FLUSH_LINES:
                self._write_waiting()
            elif self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_periodically, name="event-log-flusher",
                                                 daemon=True)
                self._flusher.start()

    def flush(self, timeout_s: float = -1) -> None:
        """Write every event waiting now. `timeout_s` bounds the wait for another thread's write
        (for a thread that must end the process in bounded time); -1: no bound."""
        if not self._lock.acquire(timeout=timeout_s):
            logger.warning("event log %s: not flushed, another thread has been writing it for %.1f s",
                           self.path, timeout_s)
            return
        try:
            if self._file is not None:
                self._write_waiting()
        finally:
            self._lock.release()

    def _flush_periodically(self) -> None:
        """The flusher thread: writes what waits every FLUSH_INTERVAL_S until the log is closed.
        It keeps its own time: waking it at each new batch costs the training thread a thread
        switch (about 1 ms under a profiler, on a machine whose cores all train)."""
        with self._lock:
            while self._file is not None:
                self._due.wait(FLUSH_INTERVAL_S)
                if self._file is not None:
                    self._write_waiting()

    def _write_waiting(self) -> None:
        """(holding the lock) Append the waiting lines, whole, in one write where the kernel allows."""
        if not self._waiting:
            return
        data = memoryview(b"".join(self._waiting))
        self._waiting.clear()
        try:
            while data:
                data = data[self._file.write(data):]
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
        """Write what waits and close the file (the flusher thread ends with it)."""
        with self._lock:
            self._sink = None
            if self._file is not None:
                self._write_waiting()
                try:
                    self._file.close()
                except OSError as exc:
                    logger.warning("event log %s: last events lost (%s)", self.path, exc)
                self._file = None
                self._due.notify()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join(timeout=5)
