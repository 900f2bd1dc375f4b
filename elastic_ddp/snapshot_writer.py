"""Background snapshot writing on rank 0: training waits for a memory copy, not for the disk.

`SnapshotWriter.submit` takes a `Snapshot` whose tensors are already copies (see
`snapshot.copy_to_cpu`), and a single background thread serialises it, checksums it and hands it to
the `CheckpointStore`. At most one write is in flight: a `submit` that arrives while the previous
write is still running waits for it (training slows down rather than skipping a snapshot, so the
promised bound on lost work holds). A write that fails after the store's bounded retries is logged
as an error and counted in `failed_writes`; training goes on and the previous snapshots stay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from elastic_ddp.checkpoint import CheckpointStore, ManifestEntry, SnapshotWriteError
from elastic_ddp.snapshot import Snapshot

logger = logging.getLogger(__name__)

WriteCallback = Callable[[ManifestEntry, float], None]


class SnapshotWriter:
    """One background thread that writes snapshots to `store`, one at a time."""

    def __init__(self, store: CheckpointStore, on_written: WriteCallback | None = None,
                 asynchronous: bool = True):
        self.store = store
        self.on_written = on_written
        self.asynchronous = asynchronous
        self.failed_writes = 0
        self.last_written: ManifestEntry | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._in_flight: Future | None = None
        self._lock = threading.Lock()

    def submit(self, snapshot: Snapshot) -> float:
        """Queue `snapshot` for writing; return the seconds the caller was blocked waiting."""
        started = time.monotonic()
        self.wait()
        with self._lock:
            self._in_flight = self._executor.submit(self._write, snapshot)
        if not self.asynchronous:
            self.wait()
        return time.monotonic() - started

    def wait(self, timeout: float | None = None) -> None:
        """Block until the write in flight (if any) is done; it never raises the write's error."""
        with self._lock:
            in_flight = self._in_flight
        if in_flight is not None:
            in_flight.result(timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the write in flight (so a clean exit keeps its last snapshot) and stop the thread."""
        try:
            self.wait(timeout)
        finally:
            self._executor.shutdown(wait=False)

    def _write(self, snapshot: Snapshot) -> None:
        started = time.monotonic()
        try:
            entry = self.store.write(snapshot.global_step, snapshot.epoch, snapshot.samples_consumed,
                                     snapshot.to_bytes())
        except SnapshotWriteError as exc:
            self.failed_writes += 1
            logger.error("SNAPSHOT NOT SAVED: %s. Training continues; the work since the last good "
                         "snapshot is at risk until a write succeeds.", exc)
            return
        except Exception:  # a bug must not kill the writer thread silently
            self.failed_writes += 1
            logger.exception("SNAPSHOT NOT SAVED: unexpected error while writing step %d", snapshot.global_step)
            return
        self.last_written = entry
        if self.on_written is not None:
            self.on_written(entry, time.monotonic() - started)
