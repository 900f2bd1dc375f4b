"""Background snapshot writing on rank 0: training waits for a memory copy, not for the disk.

At a snapshot point the training thread calls `SnapshotWriter.submit(capture)`: `capture` copies
the state into the writer's reusable `StagingBuffers` (CPU memory; pinned, non-blocking copies for
CUDA tensors), and one background thread then serialises the copy through the `CheckpointStore`,
which hashes it on its way to storage and makes it durable (retrying transient I/O errors, bounded).
On a local disk the serialised bytes go straight into the file: no second copy of the state is
held in memory, and the GIL is released while each chunk is hashed and written.

When the next snapshot point arrives while a write is still in flight, `submit` WAITS for that
write to finish before copying (it never skips): the bound on lost work (one snapshot interval)
holds, the staging buffers are free again, and the time waited is part of what `submit` returns
as blocked. A run whose writes take longer than its snapshot interval therefore slows down to the
disk's pace instead of silently losing snapshots; the `blocked_seconds` of the `snapshot_captured`
events show it.

A write that still fails after the store's retries is logged as an error (`SNAPSHOT NOT SAVED`),
counted in `failed_writes` and passed to `on_failed`; training goes on, the previous snapshots stay
as they were, and the next snapshot point tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from elastic_ddp.snapshot.errors import SnapshotWriteError
from elastic_ddp.snapshot.format import write_snapshot
from elastic_ddp.snapshot.staging import StagingBuffers
from elastic_ddp.snapshot.state import Snapshot
from elastic_ddp.snapshot.store import CheckpointStore, ManifestEntry

logger = logging.getLogger(__name__)

WrittenCallback = Callable[[ManifestEntry, float], None]  # entry, seconds the background write took
FailedCallback = Callable[[int, str], None]  # global step, reason
Capture = Callable[[StagingBuffers], Snapshot]


class SnapshotWriter:
    """One background thread that writes snapshots to `store`, one at a time.

    With `asynchronous=False`, `submit` returns only once the write is done (a synchronous save,
    for debugging and for measuring what the background writing saves).
    """

    def __init__(self, store: CheckpointStore, on_written: WrittenCallback | None = None,
                 on_failed: FailedCallback | None = None, asynchronous: bool = True):
        self.store = store
        self.on_written = on_written
        self.on_failed = on_failed
        self.asynchronous = asynchronous
        self.staging = StagingBuffers()
        self.failed_writes = 0
        self.last_written: ManifestEntry | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._in_flight: Future | None = None
        self._lock = threading.Lock()

    def submit(self, capture: Capture) -> float:
        """Wait for the write in flight, copy the state with `capture(staging)`, queue its write.

        Returns the seconds the caller was blocked: the wait plus the copy (plus the whole write
        when not asynchronous).
        """
        started = time.monotonic()
        self.wait()  # the staging buffers belong to the write in flight until it ends
        snapshot = capture(self.staging)
        self._start(self._write_snapshot, snapshot)
        return time.monotonic() - started

    def submit_serialized(self, global_step: int, epoch: int, samples_consumed: int, data: bytes) -> float:
        """Queue the write of an already serialised snapshot (one restored from a peer)."""
        started = time.monotonic()
        self.wait()
        self._start(self._write_bytes, global_step, epoch, samples_consumed, data, time.monotonic())
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

    def _start(self, function, *args) -> None:
        with self._lock:
            self._in_flight = self._executor.submit(function, *args)
        if not self.asynchronous:
            self.wait()

    def _write_snapshot(self, snapshot: Snapshot) -> None:
        def serialize(file) -> None:
            self.staging.wait_until_copied()  # device-to-host copies still landing (CUDA)
            write_snapshot(snapshot, file)

        self._write(snapshot.global_step, time.monotonic(), self.store.write_serialized, snapshot.global_step,
                    snapshot.epoch, snapshot.samples_consumed, serialize)

    def _write_bytes(self, global_step: int, epoch: int, samples_consumed: int, data: bytes,
                     started: float) -> None:
        self._write(global_step, started, self.store.write, global_step, epoch, samples_consumed, data)

    def _write(self, global_step: int, started: float, write: Callable[..., ManifestEntry], *args) -> None:
        try:
            entry = write(*args)
        except SnapshotWriteError as exc:
            self._report_failure(global_step, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the writer thread silently
            self._report_failure(global_step, f"unexpected error: {exc!r}", exc_info=True)
            return
        self.last_written = entry
        if self.on_written is not None:
            _call_safely(self.on_written, entry, time.monotonic() - started)

    def _report_failure(self, global_step: int, reason: str, exc_info: bool = False) -> None:
        self.failed_writes += 1
        logger.error("SNAPSHOT NOT SAVED (step %d): %s. Training continues; the work since the last good "
                     "snapshot is at risk until a write succeeds (%d failed so far).",
                     global_step, reason, self.failed_writes, exc_info=exc_info)
        if self.on_failed is not None:
            _call_safely(self.on_failed, global_step, reason)


def _call_safely(callback, *args) -> None:
    """Run a caller's callback on the writer thread; its bug is logged, not left to end the thread."""
    try:
        callback(*args)
    except Exception:  # the snapshot itself is fine; keep writing the next ones
        logger.exception("snapshot writer callback %r failed", callback)
