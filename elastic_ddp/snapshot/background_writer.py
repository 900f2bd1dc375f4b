"""Background snapshot writing on rank 0: training waits for a memory copy, not for the disk.

At a snapshot point the training thread calls `SnapshotWriter.submit(capture)`: `capture` copies
the state into the writer's reusable `StagingBuffers` (CPU memory; pinned, non-blocking copies for
CUDA tensors), and one background thread then serialises the copy through the `SnapshotStore`,
which hashes it on its way to storage and makes it durable (retrying transient I/O errors, bounded).
On a local disk the serialised bytes go straight into the file: no second copy of the state is
held in memory, and the GIL is released while each chunk is hashed and written.

When the next snapshot point arrives while a write is still in flight, `submit` WAITS for that
write to finish before copying: the bound on lost work (one snapshot interval) holds, the staging
buffers are free again, and the time waited is part of what `submit` returns as blocked. A run
whose writes take longer than its snapshot interval therefore slows down to the disk's pace
instead of silently losing snapshots; the `blocked_seconds` of the `snapshot_captured` events show
it. That wait is bounded (next paragraph but one). One exception: a write of bytes already
serialised (`submit_serialized`: the state a restore took from memory or a peer, written here so
that it is durable) is stopped by the next snapshot point, whose state is newer: it waits for
that write to stop (between two chunks), not to end. So does a writer closed for an in-process
re-form (`close(superseded=True)`): the next group snapshots its state at once, and the re-form
does not wait for the whole write of an older step.

A write that still fails after the store's retries is logged as an error (`SNAPSHOT NOT SAVED`),
counted in `failed_writes` and passed to `on_failed`; training goes on, the previous snapshots stay
as they were, and the next snapshot point tries again. So does a snapshot whose state holds a NaN
or an infinity (a diverged run): it is refused, checked on the writer thread, never written as the
newest "valid" one.

Hung storage (a hard NFS mount, an object store without timeouts) cannot stall training for
minutes: a snapshot point waits for the write in flight at most POINT_WAIT_S (30 s), or
POINT_WAIT_FACTOR times as long as the last write that completed took if that is longer (a disk
known to be slow keeps setting the pace), and never once the write has run `write_timeout_s`.
A write that outlasts the wait is taken as hung: this snapshot point is skipped (reported, as a
failed write is), and so is every later one at once, without waiting, until that write ends. So
hung storage costs training one wait of at most 30 s, not `write_timeout_s` at every snapshot
point. The final snapshot (a drain) waits longer: until the write in flight has run
`write_timeout_s`. `wait` and `close` take a timeout too. The hung write's thread is a daemon: it
does not keep the process alive.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic_ddp.snapshot.files.errors import SnapshotError, SnapshotWriteError, WriteCancelled
from elastic_ddp.snapshot.files.manifest import ManifestEntry
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.snapshot.serialization import write_snapshot
from elastic_ddp.snapshot.staging import StagingBuffers
from elastic_ddp.snapshot.training_state import Snapshot, non_finite_tensors

logger = logging.getLogger(__name__)

WrittenCallback = Callable[[ManifestEntry, float], None]  # entry, seconds the background write took
FailedCallback = Callable[[int, str], None]  # global step, reason
Capture = Callable[[StagingBuffers], Snapshot]
# The longest a write may take before it is hung whoever waits for it (--snapshot_timeout_s).
DEFAULT_WRITE_TIMEOUT_S = 600.0
# How long a snapshot point waits for the write in flight: this, or this factor times the last
# write that completed when that is longer (see the module docstring).
POINT_WAIT_S = 30.0
POINT_WAIT_FACTOR = 4.0


@dataclass(frozen=True)
class _Write:
    """A write on the writer's thread."""

    global_step: int
    done: threading.Event
    started: float  # time.monotonic()
    stop: threading.Event  # asks it to end early, between two chunks (the listed snapshots unchanged)
    of_restored_state: bool  # bytes a restore took (`submit_serialized`), which the next snapshot supersedes


class SnapshotWriter:
    """One background thread at a time that writes snapshots to `store`.

    With `asynchronous=False`, `submit` returns only once the write is done (a synchronous save,
    for debugging and for measuring what the background writing saves).
    """

    def __init__(self, store: SnapshotStore, on_written: WrittenCallback | None = None,
                 on_failed: FailedCallback | None = None, asynchronous: bool = True,
                 write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S, staging: StagingBuffers | None = None):
        self.store = store
        self.on_written = on_written
        self.on_failed = on_failed
        self.asynchronous = asynchronous
        self.write_timeout_s = write_timeout_s
        self.staging = staging if staging is not None else StagingBuffers()  # (one of an earlier writer: warm)
        self.failed_writes = 0
        self.last_written: ManifestEntry | None = None
        self._in_flight: _Write | None = None  # the last write started (done or not)
        self._hung_step: int | None = None  # the write in flight that a snapshot point gave up on
        self._last_write_seconds = 0.0  # how long the last write that completed took
        self.last_write_cpu_seconds = 0.0  # CPU time of the last write on its thread (serialise, hash, write)

    def submit(self, capture: Capture, *, final: bool = False, global_step: int | None = None) -> float:
        """Wait for the write in flight, copy the state with `capture(staging)`, queue its write.

        Returns the seconds the caller was blocked: the wait plus the copy (plus the whole write
        when not asynchronous). If the write in flight does not end within the bound (the module
        docstring; `final`: until it has run `write_timeout_s`), this snapshot (of `global_step`,
        for the report) is skipped and reported: its staging buffers are still the hung write's.
        """
        started = time.monotonic()
        self._supersede_restored_write()
        if not self._wait_for_room(final, global_step):
            return time.monotonic() - started
        snapshot = capture(self.staging)
        self._start(snapshot.global_step, self._write_snapshot, snapshot)
        return time.monotonic() - started

    def submit_serialized(self, global_step: int, epoch: int, samples_consumed: int, data: bytes) -> float:
        """Queue the write of an already serialised snapshot (a restored state, from memory or a
        peer). The next `submit` supersedes it: see `_supersede_restored_write`."""
        started = time.monotonic()
        if self._wait_for_room(False, global_step):
            self._start(global_step, self._write_bytes, global_step, epoch, samples_consumed, data, started,
                        of_restored_state=True)
        return time.monotonic() - started

    def _supersede_restored_write(self) -> None:
        """Stop the write of a restored state still in flight: the snapshot about to be taken is of
        a newer step. The first snapshot after a restore from memory or a peer waited for all of
        that write (3-4.7 s at 1 GB, 7.9 s at 2 GB: hash, write, fsync), and copying while it ran
        instead was slow on a busy machine and left two writes of the whole state for a stopping
        worker to wait for. A write stops between two chunks; its temporary file is removed, and the
        listed snapshots stay as they were (`SnapshotStore.write`, `cancelled`)."""
        in_flight = self._in_flight
        if in_flight is not None and in_flight.of_restored_state:
            in_flight.stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write in flight (if any) is done, at most `timeout` seconds; whether it
        is. It never raises the write's error (that goes to `on_failed`)."""
        in_flight = self._in_flight
        return in_flight is None or in_flight.done.wait(timeout)

    def writing(self) -> bool:
        """Whether a write is in flight that has run less than POINT_WAIT_S (one running longer is
        slow or hung: a snapshot point then waits for it, bounded, as the module docstring says)."""
        in_flight = self._in_flight
        return in_flight is not None and not in_flight.done.is_set() \
            and time.monotonic() - in_flight.started < POINT_WAIT_S

    def staging_to_reuse(self) -> StagingBuffers | None:
        """This writer's staging buffers when no write reads them (none in flight): a later writer
        in this process copies into pages already faulted in. None while a write still runs."""
        return self.staging if self.wait(0) else None

    def close(self, timeout: float | None = None, *, superseded: bool = False) -> bool:
        """Let the write in flight finish (so a clean exit keeps its last snapshot), at most
        `timeout` seconds (default `write_timeout_s`); whether it did. `superseded`: a newer
        snapshot of the same run is taken at once by the next writer (an in-process re-form): the
        write in flight stops at its next chunk instead (`serialization.STOP_CHECK_BYTES`), and the
        listed snapshots stay as they were."""
        if superseded and self._in_flight is not None:
            self._in_flight.stop.set()
        finished = self.wait(self.write_timeout_s if timeout is None else timeout)
        if not finished:
            logger.error("the snapshot write of step %d is still running after %.0f s (storage hung?); "
                         "leaving it behind", self._in_flight.global_step,
                         self.write_timeout_s if timeout is None else timeout)
        return finished

    def _wait_for_room(self, final: bool, skipped_step: int | None) -> bool:
        """Whether the write in flight ended within the bound (the module docstring); else report."""
        if self._in_flight is None:
            return True
        step, done, write_started = self._in_flight.global_step, self._in_flight.done, self._in_flight.started
        left = max(0.0, self.write_timeout_s - (time.monotonic() - write_started))
        if final:
            bound = left
        elif self._hung_step == step:
            bound = 0.0
        else:
            bound = min(left, max(POINT_WAIT_S, POINT_WAIT_FACTOR * self._last_write_seconds))
        if done.wait(bound):
            return True
        self._hung_step = step
        this = f"the snapshot of step {skipped_step}" if skipped_step is not None else "this snapshot point"
        self._report_failure(skipped_step if skipped_step is not None else step,
                             f"the write of step {step} is still running after "
                             f"{time.monotonic() - write_started:.1f} s (storage hung?); {this} is skipped")
        return False

    def _start(self, global_step: int, function, *args, of_restored_state: bool = False) -> None:
        """Run `function(*args, stop)` on a thread of its own; `stop`: the event that asks it to end
        early. `of_restored_state`: the next snapshot point supersedes it (`submit_serialized`)."""
        done, stop = threading.Event(), threading.Event()

        def run() -> None:
            cpu_started = time.thread_time()
            try:
                function(*args, stop)
            finally:
                self.last_write_cpu_seconds = time.thread_time() - cpu_started
                done.set()

        self._in_flight = _Write(global_step, done, time.monotonic(), stop, of_restored_state)
        threading.Thread(target=run, name="snapshot-writer", daemon=True).start()
        if not self.asynchronous:
            self.wait()

    def _write_snapshot(self, snapshot: Snapshot, stop: threading.Event) -> None:
        def produce(file):
            self.staging.wait_until_copied()  # device-to-host copies still landing (CUDA)
            bad = non_finite_tensors(snapshot.states)
            if bad:
                raise SnapshotError(f"non-finite values (NaN or infinity) in {', '.join(bad[:5])}"
                                    f"{' and more' if len(bad) > 5 else ''}: the run has diverged; this state "
                                    "is not saved, the previous snapshots are kept")
            return write_snapshot(snapshot, file, stopped=stop.is_set)

        try:
            self._write(snapshot.global_step, time.monotonic(), self.store.write_stream, snapshot.global_step,
                        snapshot.epoch, snapshot.samples_consumed, produce)
        except WriteCancelled:
            logger.info("the write of the snapshot of step %d stopped: the next group snapshots a newer state "
                        "at once", snapshot.global_step)

    def _write_bytes(self, global_step: int, epoch: int, samples_consumed: int, data: bytes,
                     started: float, stop: threading.Event) -> None:
        try:
            self._write(global_step, started, functools.partial(self.store.write, cancelled=stop.is_set),
                        global_step, epoch, samples_consumed, data)
        except WriteCancelled:
            logger.info("the write of the restored state of step %d stopped: a newer snapshot is being taken",
                        global_step)

    def _write(self, global_step: int, started: float, write: Callable[..., ManifestEntry], *args) -> None:
        try:
            entry = write(*args)
        except WriteCancelled:
            raise
        except (SnapshotWriteError, SnapshotError) as exc:
            self._report_failure(global_step, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bug must not end the writer silently
            self._report_failure(global_step, f"unexpected error: {exc!r}", exc_info=True)
            return
        self.last_written = entry
        self._last_write_seconds = time.monotonic() - started
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
