"""The snapshot store: atomic, durable, verified, pruned, on a local directory or an fsspec URL.

Layout (docs/snapshots.md has the full description):

    CHECKPOINT_DIR/
      snapshot-000000120.pt     torch.save of a Snapshot as a plain dict
      manifest.json             {"format": 1, "snapshots": [{file, global_step, epoch,
                                 samples_consumed, sha256, size_bytes, created_unix}, ...]}

A write makes the snapshot file durable first (see `storage`: rename on a local disk, one PUT on an
object store), then replaces the manifest, written the same way, by one that lists it. A snapshot
counts only once the manifest lists it and its size and sha256 match, so a writer killed at any
moment leaves at worst a temporary file (removed by the next write) or an unlisted snapshot file
(never trusted, deleted by a later write). Older snapshots beyond `keep_last` are dropped from the
manifest and deleted only after a newer one is durable; a failed write never touches existing
snapshots, and removes what it wrote itself.

Transient I/O errors (EIO, EAGAIN, timeouts, a reset connection) are retried with bounded
exponential back-off; errors that waiting will not heal (a full disk, a read-only mount, missing
permission) fail at once. Either way the caller gets `SnapshotWriteError`.

Not guaranteed: two jobs writing to one directory at once (one run id per directory).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import BinaryIO

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from elastic_ddp.snapshot.errors import CheckpointError, SnapshotWriteError
from elastic_ddp.snapshot.storage import SnapshotStorage, open_storage

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d{9})\.pt$")
# I/O errors worth retrying: a full disk, a read-only mount or missing permission will not heal.
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE,
                    errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE}


@dataclass(frozen=True)
class ManifestEntry:
    file: str
    global_step: int
    epoch: int
    samples_consumed: int
    sha256: str
    size_bytes: int
    created_unix: float


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how patiently, a snapshot write is retried after a transient I/O error."""

    attempts: int = 4
    max_wait_s: float = 2.0
    first_wait_s: float = 0.1


def snapshot_file_name(global_step: int) -> str:
    return f"snapshot-{global_step:09d}.pt"


def is_transient(exc: BaseException) -> bool:
    """Whether retrying `exc` soon may succeed (timeouts and the errnos in TRANSIENT_ERRNOS)."""
    return isinstance(exc, TimeoutError) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)


class CheckpointStore:
    """Snapshots in one location. Any rank may read; only one process (rank 0) may write."""

    def __init__(self, location: str | os.PathLike | SnapshotStorage, keep_last: int = 3,
                 retry: RetryPolicy = RetryPolicy()):
        if keep_last < 2:
            raise ValueError(f"keep_last: got {keep_last}; expected at least 2")
        self.storage = location if isinstance(location, SnapshotStorage) else open_storage(location)
        self.keep_last = keep_last
        self.retry = retry

    def describe(self, name: str = "") -> str:
        """The path or URL of `name` (of the location itself when empty), for messages."""
        return self.storage.describe(name).rstrip("/")

    # ----------------------------------------------------------------------------------- reading

    def manifest_entries(self) -> list[ManifestEntry]:
        """The manifest's entries, oldest first; [] when there is no (readable) manifest."""
        return self._read_manifest()[0]

    def _read_manifest(self) -> tuple[list[ManifestEntry], bool]:
        """(entries oldest first, whether the manifest is missing or readable).

        An unreadable manifest is reported and treated as empty: no snapshot is then trusted, and
        no file is deleted on its account (pruning only removes files a readable manifest dropped).
        """
        try:
            document = json.loads(self.storage.read_bytes(MANIFEST_NAME))
            entries = [ManifestEntry(**entry) for entry in document["snapshots"]]
        except FileNotFoundError:
            return [], True
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error("%s is unreadable (%s): no snapshot in %s is trusted until the next write",
                         self.describe(MANIFEST_NAME), exc, self.describe())
            return [], False
        return sorted(entries, key=lambda entry: entry.global_step), True

    def read_verified(self, entry: ManifestEntry) -> bytes:
        """The bytes of `entry`'s file; raises CheckpointError if missing, short or corrupt."""
        where = self.describe(entry.file)
        try:
            data = self.storage.read_bytes(entry.file)
        except OSError as exc:
            raise CheckpointError(f"{where}: cannot be read ({exc.strerror or exc})") from exc
        if len(data) != entry.size_bytes:
            raise CheckpointError(f"{where}: {len(data)} bytes, the manifest says {entry.size_bytes} (torn write?)")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise CheckpointError(f"{where}: sha256 {digest[:12]}... does not match the manifest's "
                                  f"{entry.sha256[:12]}... (corrupt)")
        return data

    def latest_valid(self, accept: Callable[[bytes, str], object] | None = None,
                     ) -> tuple[ManifestEntry, bytes] | None:
        """The newest snapshot whose file verifies, with its bytes; None if there is none.

        `accept(data, path)` may check the content further and raise to reject it (for instance a
        file that does not load with weights_only=True). Every newer entry that fails is skipped
        with a warning naming the file and the reason.
        """
        for entry in reversed(self.manifest_entries()):
            try:
                data = self.read_verified(entry)
                if accept is not None:
                    accept(data, self.describe(entry.file))
                return entry, data
            except Exception as exc:  # noqa: BLE001 - any reason to reject means: try the previous one
                logger.warning("skipping snapshot: %s; trying the previous one", exc)
        return None

    # ----------------------------------------------------------------------------------- writing

    def write(self, global_step: int, epoch: int, samples_consumed: int, data: bytes,
              sha256: str | None = None) -> ManifestEntry:
        """Durably add a snapshot, then prune the oldest ones beyond `keep_last`.

        `sha256` may be passed when the caller has just computed it (a replica that verified what it
        received). Raises SnapshotWriteError when the snapshot could not be made durable (after
        bounded retries of transient I/O errors); existing snapshots and the manifest are then
        unchanged and nothing this write created is left behind.
        """
        digest = sha256 or hashlib.sha256(data).hexdigest()

        def write_file(name: str) -> tuple[str, int]:
            self.storage.write_atomically(name, data)
            return digest, len(data)

        return self._write(global_step, epoch, samples_consumed, write_file)

    def write_serialized(self, global_step: int, epoch: int, samples_consumed: int,
                         serialize: Callable[[BinaryIO], None]) -> ManifestEntry:
        """Like `write`, with the content written by `serialize(file)` and hashed on its way.

        On a local directory it goes straight into the temporary file: no copy of the whole
        snapshot is held in memory, and the GIL is released for every chunk's hashing and write.
        `serialize` is called again if a transient error makes the write start over.
        """
        def write_file(name: str) -> tuple[str, int]:
            hashing: list[_HashingWriter] = []

            def produce(file: BinaryIO) -> None:
                hashing.append(_HashingWriter(file))
                serialize(hashing[-1])

            self.storage.write_stream_atomically(name, produce)
            return hashing[-1].hexdigest(), hashing[-1].size

        return self._write(global_step, epoch, samples_consumed, write_file)

    def _write(self, global_step: int, epoch: int, samples_consumed: int,
               write_file: Callable[[str], tuple[str, int]]) -> ManifestEntry:
        started = time.monotonic()
        try:
            entry, kept, manifest_readable = self._retrying(
                self._write_once, global_step, epoch, samples_consumed, write_file)
        except OSError as exc:
            raise SnapshotWriteError(
                f"snapshot of step {global_step} could not be written to {self.describe()} "
                f"({exc.strerror or exc}); the previous snapshots are intact") from exc
        if manifest_readable:
            self._delete_unlisted_snapshots(keep={e.file for e in kept}, below_step=global_step)
        logger.debug("snapshot %s durable in %.3f s", entry.file, time.monotonic() - started)
        return entry

    def _write_once(self, global_step: int, epoch: int, samples_consumed: int,
                    write_file: Callable[[str], tuple[str, int]]) -> tuple[ManifestEntry, list[ManifestEntry], bool]:
        self.storage.prepare_for_writing()
        previous, manifest_readable = self._read_manifest()
        name = snapshot_file_name(global_step)
        sha256, size_bytes = write_file(name)
        entry = ManifestEntry(file=name, global_step=global_step, epoch=epoch, samples_consumed=samples_consumed,
                              sha256=sha256, size_bytes=size_bytes, created_unix=time.time())
        # Entries at or past this step belong to a trajectory the run rolled back from.
        previous = [e for e in previous if e.global_step < global_step]
        kept = (previous + [entry])[-self.keep_last:]
        try:
            self._write_manifest(kept)
        except BaseException:
            # Unlisted, so never trusted; but on a full disk its space is what the next write needs.
            self._delete_quietly(name)
            raise
        return entry, kept, manifest_readable

    def _retrying(self, function, *args):
        policy = self.retry
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(policy.attempts),
            wait=wait_random_exponential(multiplier=policy.first_wait_s, max=policy.max_wait_s),
            before_sleep=self._log_retry,
            reraise=True,
        )
        return retrying(function, *args)

    def _log_retry(self, state: RetryCallState) -> None:
        logger.warning("snapshot write to %s failed (%s); retrying in %.2f s (attempt %d of %d)",
                       self.describe(), state.outcome.exception(), state.next_action.sleep,
                       state.attempt_number + 1, self.retry.attempts)

    def _write_manifest(self, entries: list[ManifestEntry]) -> None:
        document = {"format": MANIFEST_FORMAT, "snapshots": [asdict(entry) for entry in entries]}
        self.storage.write_atomically(MANIFEST_NAME, json.dumps(document, indent=1).encode())

    def _delete_quietly(self, name: str) -> None:
        try:
            self.storage.delete(name)
        except OSError as exc:
            logger.warning("could not delete %s: %s", self.describe(name), exc)

    def _delete_unlisted_snapshots(self, keep: set[str], below_step: int) -> None:
        """Delete snapshot files older than `below_step` that the (durable) manifest no longer lists."""
        try:
            names = self.storage.list_names()
        except OSError as exc:
            logger.warning("could not list %s to prune old snapshots: %s", self.describe(), exc)
            return
        for name in names:
            match = SNAPSHOT_PATTERN.match(name)
            if match and name not in keep and int(match.group(1)) < below_step:
                self._delete_quietly(name)


class _HashingWriter:
    """A write-only binary file that hashes and counts what it passes on to `target`."""

    def __init__(self, target: BinaryIO):
        self._target = target
        self._sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self._sha256.update(data)  # releases the GIL for all but tiny chunks
        written = self._target.write(data)
        self.size += written
        return written

    def flush(self) -> None:
        self._target.flush()

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()
