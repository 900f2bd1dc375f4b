"""The snapshot store on a local (or shared) directory: atomic, durable, verified, pruned.

On-disk format (docs/design.md, "Snapshot format"):

    CHECKPOINT_DIR/
      snapshot-000000120.pt     torch.save of a Snapshot as a plain dict
      manifest.json             {"format": 1, "snapshots": [{file, global_step, epoch,
                                 samples_consumed, sha256, size_bytes, created_unix}, ...]}

A write goes to a temporary file in the same directory, is flushed and fsynced, renamed over its
final name, and the directory is fsynced; only then is the manifest (itself written the same way)
replaced by one that lists it. A snapshot counts only once the manifest lists it and its size and
sha256 match, so a writer killed at any moment leaves at worst a temporary file, which the next
writer removes. Older snapshots beyond `keep_last` are dropped from the manifest and deleted only
after a newer one is durable; a failed write never touches existing snapshots.

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
from pathlib import Path

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d{9})\.pt$")
TEMPORARY_PATTERN = re.compile(r"^\.(snapshot-\d{9}\.pt|manifest\.json)\.tmp-\d+$")
# I/O errors worth retrying: a full disk, a read-only mount or missing permission will not heal.
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE}


class CheckpointError(Exception):
    """The store could not do what was asked."""


class SnapshotWriteError(CheckpointError):
    """A snapshot could not be made durable; the previous snapshots are untouched."""


@dataclass(frozen=True)
class ManifestEntry:
    file: str
    global_step: int
    epoch: int
    samples_consumed: int
    sha256: str
    size_bytes: int
    created_unix: float


def snapshot_file_name(global_step: int) -> str:
    return f"snapshot-{global_step:09d}.pt"


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


_retry_transient_io = retry(
    retry=retry_if_exception(_is_transient),
    stop=stop_after_attempt(4),
    wait=wait_random_exponential(multiplier=0.1, max=2.0),
    reraise=True,
)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@_retry_transient_io
def write_file_atomically(path: Path, data: bytes) -> None:
    """Make `data` the content of `path` durably, or leave `path` as it was.

    Writes a temporary sibling, fsyncs it, renames it over `path`, fsyncs the directory. On any
    error the temporary file is removed and the error propagates.
    """
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


class CheckpointStore:
    """Snapshots in one directory. Any rank may read; only one process (rank 0) may write."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3):
        if keep_last < 2:
            raise ValueError(f"keep_last: got {keep_last}; expected at least 2")
        self.directory = Path(directory)
        self.keep_last = keep_last

    # ----------------------------------------------------------------------------------- reading

    def manifest_entries(self) -> list[ManifestEntry]:
        """The manifest's entries, oldest first; [] when there is no (readable) manifest."""
        return self._read_manifest()[0]

    def _read_manifest(self) -> tuple[list[ManifestEntry], bool]:
        """(entries oldest first, whether the manifest is missing or readable).

        An unreadable manifest is reported and treated as empty: no snapshot is then trusted, and
        no file is deleted on its account (pruning only removes files a readable manifest dropped).
        """
        path = self.directory / MANIFEST_NAME
        try:
            document = json.loads(path.read_text())
            entries = [ManifestEntry(**entry) for entry in document["snapshots"]]
        except FileNotFoundError:
            return [], True
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error("%s is unreadable (%s): no snapshot in %s is trusted until the next write",
                         path, exc, self.directory)
            return [], False
        return sorted(entries, key=lambda entry: entry.global_step), True

    def read_verified(self, entry: ManifestEntry) -> bytes:
        """The bytes of `entry`'s file; raises CheckpointError if missing, short or corrupt."""
        path = self.directory / entry.file
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        if len(data) != entry.size_bytes:
            raise CheckpointError(f"{path}: {len(data)} bytes, the manifest says {entry.size_bytes} (torn write?)")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise CheckpointError(f"{path}: sha256 {digest[:12]}... does not match the manifest's "
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
                    accept(data, str(self.directory / entry.file))
                return entry, data
            except Exception as exc:  # noqa: BLE001 - any reason to reject means: try the previous one
                logger.warning("skipping snapshot: %s; trying the previous one", exc)
        return None

    # ----------------------------------------------------------------------------------- writing

    def write(self, global_step: int, epoch: int, samples_consumed: int, data: bytes) -> ManifestEntry:
        """Durably add a snapshot, then prune the oldest ones beyond `keep_last`.

        Raises SnapshotWriteError when the snapshot could not be made durable (after bounded
        retries of transient I/O errors); existing snapshots and the manifest are then unchanged.
        """
        started = time.monotonic()
        entry = ManifestEntry(
            file=snapshot_file_name(global_step), global_step=global_step, epoch=epoch,
            samples_consumed=samples_consumed, sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data), created_unix=time.time(),
        )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()
            write_file_atomically(self.directory / entry.file, data)
            previous, manifest_readable = self._read_manifest()
            # Entries at or past this step belong to a trajectory the run rolled back from.
            previous = [e for e in previous if e.global_step < global_step]
            kept = (previous + [entry])[-self.keep_last:]
            self._write_manifest(kept)
        except OSError as exc:
            raise SnapshotWriteError(
                f"snapshot of step {global_step} could not be written to {self.directory} "
                f"({exc.strerror or exc}); the previous snapshots are intact") from exc
        if manifest_readable:
            self._delete_unlisted_snapshots(keep={e.file for e in kept}, below_step=global_step)
        logger.debug("snapshot %s durable in %.3f s", entry.file, time.monotonic() - started)
        return entry

    def _write_manifest(self, entries: list[ManifestEntry]) -> None:
        document = {"format": MANIFEST_FORMAT, "snapshots": [asdict(entry) for entry in entries]}
        write_file_atomically(self.directory / MANIFEST_NAME, json.dumps(document, indent=1).encode())

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of writers that were killed mid-write (never a snapshot that counts)."""
        for path in self.directory.iterdir():
            if TEMPORARY_PATTERN.match(path.name):
                logger.info("removing %s, left by an interrupted write", path)
                path.unlink(missing_ok=True)

    def _delete_unlisted_snapshots(self, keep: set[str], below_step: int) -> None:
        """Delete snapshot files older than `below_step` that the (durable) manifest no longer lists."""
        for path in self.directory.iterdir():
            match = SNAPSHOT_PATTERN.match(path.name)
            if match and path.name not in keep and int(match.group(1)) < below_step:
                try:
                    path.unlink()
                except OSError as exc:
                    logger.warning("could not delete old snapshot %s: %s", path, exc)
