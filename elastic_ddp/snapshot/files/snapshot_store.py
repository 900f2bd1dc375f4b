"""The snapshot store: atomic, durable, verified, pruned, on a local directory or an fsspec URL.

Layout (docs/snapshots.md has the full description):

    CHECKPOINT_DIR/
      snapshot-000000120-3f9a0c1e.pt  one format-2 snapshot (file_layout.py): self-describing
      snapshot-000000100.pt           a format-1 snapshot (older versions), trusted via the manifest
      manifest.json                   the index: an entry per listed snapshot (manifest.py)

A write makes the snapshot file durable first, under a name no file had before (a fresh suffix per
write: a write never replaces a file), then replaces the manifest, written the same way, by one
that lists it. So a writer that fails or dies at any moment leaves every listed snapshot as it was;
what it leaves at worst is a temporary file or an unlisted snapshot file, which later writes
remove. Rewriting a step that is already listed with the same checksum changes nothing.

Reading trusts nothing it reads: the manifest is checked entry by entry (manifest.py); a file is
read no further than the size its entry announces; a format-2 file must match its own checksum and
its entry's.
When the manifest is missing, unreadable, or lists nothing that verifies, the index is rebuilt
from the format-2 files themselves (their headers and trailers), so a torn manifest never loses a
valid snapshot; pruning then waits for a readable manifest.

Transient I/O errors (EIO, EAGAIN, timeouts, a reset connection) are retried with bounded
exponential back-off; errors that waiting will not heal (a full disk, a read-only mount, missing
permission) fail at once. Either way the caller gets `SnapshotWriteError`.

Not guaranteed: two jobs writing to one directory at once (one run id per directory), and a
format-1 file whose manifest entry is lost (it cannot prove its integrity; it is left in place).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from elastic_ddp.snapshot.files.backends import StorageBackend, open_storage
from elastic_ddp.snapshot.files.checksum import checksum_of, matches
from elastic_ddp.snapshot.files.errors import SnapshotError, SnapshotStoreError, SnapshotWriteError
from elastic_ddp.snapshot.files.file_layout import (
    FORMAT_VERSION,
    HEAD_BYTES,
    TRAILER_BYTES,
    Seal,
    format_of,
    read_seal,
    verify,
    write_verified,
)
from elastic_ddp.snapshot.files.manifest import (
    SNAPSHOT_PATTERN,
    Index,
    ManifestEntry,
    read_manifest,
    snapshot_file_name,
    write_manifest,
)

logger = logging.getLogger(__name__)

# I/O errors worth retrying: a full disk, a read-only mount or missing permission will not heal.
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE,
                    errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE}


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how patiently, a snapshot write is retried after a transient I/O error."""

    attempts: int = 4
    max_wait_s: float = 2.0
    first_wait_s: float = 0.1


def is_transient(exc: BaseException) -> bool:
    """Whether retrying `exc` soon may succeed (timeouts and the errnos in TRANSIENT_ERRNOS)."""
    return isinstance(exc, TimeoutError) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)


class SnapshotStore:
    """Snapshots in one location. Any rank may read; only one process (rank 0) may write."""

    def __init__(self, location: str | os.PathLike | StorageBackend, keep_last: int = 3,
                 retry: RetryPolicy = RetryPolicy()):
        if keep_last < 2:
            raise ValueError(f"keep_last: got {keep_last}; expected at least 2")
        self.storage = location if isinstance(location, StorageBackend) else open_storage(location)
        self.keep_last = keep_last
        self.retry = retry

    def describe(self, name: str = "") -> str:
        """The path or URL of `name` (of the location itself when empty), for messages."""
        return self.storage.describe(name).rstrip("/")

    # ----------------------------------------------------------------------------------- reading

    def manifest_entries(self) -> list[ManifestEntry]:
        """The manifest's usable entries, oldest first; [] without a (readable) manifest."""
        return read_manifest(self.storage).entries

    def index(self) -> Index:
        """The manifest's entries, or, when it is missing, unreadable or lists nothing, the index
        rebuilt from the format-2 files present."""
        listed = read_manifest(self.storage)
        if listed.entries:
            return listed
        rebuilt = self._rebuild_index()
        if rebuilt:
            logger.warning("%s: %s; indexing the %d self-describing snapshot file(s) found instead",
                           self.describe(), "no manifest" if listed.manifest_readable else "the manifest is unusable",
                           len(rebuilt))
            return Index(rebuilt, listed.manifest_readable, rebuilt=True)
        return listed

    def _rebuild_index(self) -> list[ManifestEntry]:
        """Entries for every format-2 file whose header and trailer add up (not yet verified whole)."""
        try:
            names = self.storage.list_names()
        except OSError as exc:
            logger.warning("could not list %s: %s", self.describe(), exc)
            return []
        entries = []
        for name in names:
            if not SNAPSHOT_PATTERN.match(name):
                continue
            try:
                seal = self.read_seal(name)
            except (OSError, SnapshotError) as exc:
                logger.warning("not indexed: %s", exc)
                continue
            entries.append(ManifestEntry.from_seal(name, seal))
        return sorted(entries, key=lambda entry: (entry.global_step, entry.created_unix))

    def read_seal(self, name: str) -> Seal:
        """What the format-2 file `name` says about itself (its first and last bytes only)."""
        size = self.storage.size(name)
        if size < TRAILER_BYTES:
            raise SnapshotError(f"{self.describe(name)}: {size} bytes, too short to be a format-2 snapshot")
        head = self.storage.read_range(name, 0, min(size, HEAD_BYTES))
        if format_of(head) != FORMAT_VERSION:
            raise SnapshotError(f"{self.describe(name)}: not a self-describing (format 2) snapshot")
        tail = self.storage.read_range(name, size - TRAILER_BYTES, TRAILER_BYTES)
        return read_seal(head, tail, size, self.describe(name))

    def read_verified(self, entry: ManifestEntry) -> bytes:
        """The bytes of `entry`'s file; raises SnapshotStoreError if missing, short, long or corrupt."""
        where = self.describe(entry.file)
        try:
            data = self.storage.read_bytes(entry.file, limit=entry.size_bytes)
        except OSError as exc:
            raise SnapshotStoreError(f"{where}: cannot be read ({exc.strerror or exc})") from exc
        if len(data) != entry.size_bytes:
            longer = "more than" if len(data) > entry.size_bytes else f"{len(data)}"
            raise SnapshotStoreError(f"{where}: {longer} bytes, the index says {entry.size_bytes} (torn write?)")
        if format_of(data[:8]) == FORMAT_VERSION:
            try:
                seal = verify(data, where)
            except SnapshotError as exc:
                raise SnapshotStoreError(str(exc)) from exc
            if seal.checksum != entry.checksum:
                raise SnapshotStoreError(f"{where}: its checksum {seal.checksum[:20]}... is not the index's "
                                      f"{entry.checksum[:20]}...")
        elif not matches(data, entry.checksum):
            raise SnapshotStoreError(f"{where}: {entry.checksum.split(':')[0]} does not match the index's "
                                  f"{entry.checksum[:20]}... (corrupt)")
        return data

    def latest_valid(self, accept: Callable[[Any, str], object] | None = None,
                     on_skipped: Callable[[ManifestEntry, Exception], object] | None = None,
                     read: Callable[[ManifestEntry], Any] | None = None) -> tuple[ManifestEntry, Any] | None:
        """The newest snapshot whose file verifies, with its bytes; None if there is none.

        `read(entry)` replaces `read_verified` (the bytes): it must verify the file as that does
        and may return something else than its bytes (the snapshot loaded from the file in place).

        `accept(data, path)` may check the content further and raise to reject it (for instance a
        file that does not load with weights_only=True). Every newer entry that fails is skipped
        with a warning naming the file and the reason, and passed to `on_skipped(entry, error)`.
        When nothing the manifest lists verifies (or there is no usable manifest), the
        self-describing files are tried.
        """
        listed = read_manifest(self.storage)
        found = self._newest_verified(listed.entries, accept, on_skipped, read or self.read_verified)
        if found is not None:
            return found
        tried = {(entry.file, entry.checksum, entry.size_bytes) for entry in listed.entries}
        unlisted = [e for e in self._rebuild_index() if (e.file, e.checksum, e.size_bytes) not in tried]
        if not unlisted:
            return None
        why = ("nothing it lists verifies" if listed.entries else
               "there is no manifest" if listed.manifest_readable else "the manifest is unusable")
        logger.warning("%s: %s; trying the %d self-describing snapshot file(s) found instead", self.describe(),
                       why, len(unlisted))
        return self._newest_verified(unlisted, accept, on_skipped, read or self.read_verified)

    def _newest_verified(self, entries: list[ManifestEntry], accept: Callable[[Any, str], object] | None,
                         on_skipped: Callable[[ManifestEntry, Exception], object] | None,
                         read: Callable[[ManifestEntry], Any]) -> tuple[ManifestEntry, Any] | None:
        for entry in reversed(entries):
            try:
                data = read(entry)
                if accept is not None:
                    accept(data, self.describe(entry.file))
                return entry, data
            except Exception as exc:  # noqa: BLE001 - any reason to reject means: try the previous one
                logger.warning("skipping snapshot: %s; trying the previous one", exc)
                if on_skipped is not None:
                    on_skipped(entry, exc)
        return None

    # ----------------------------------------------------------------------------------- writing

    def write(self, global_step: int, epoch: int, samples_consumed: int, data: bytes,
              checksum: str | None = None, cancelled: Callable[[], bool] = lambda: False) -> ManifestEntry:
        """Durably add the snapshot `data` (bytes received from a peer or rank 0), then prune.

        A format-2 `data` is verified against its own checksum (and against `checksum` if given):
        into a local directory as it is written (one pass; the file is renamed into place only once
        it matched), elsewhere before; a format-1 `data` is listed with `checksum` (default: its
        sha256). Raises SnapshotWriteError when it was refused or could not be made durable (after
        bounded retries of transient I/O errors), and WriteCancelled when `cancelled()` said so
        before the write into a local directory ended; the listed snapshots and the manifest are
        then unchanged.
        """
        where = f"snapshot of step {global_step}"
        if format_of(data[:8]) != FORMAT_VERSION:
            checksum = checksum or checksum_of(data, "sha256")
            return self._write(global_step, epoch, samples_consumed,
                               lambda name: self._write_whole(name, data, checksum), known_checksum=checksum)
        streamed = self.storage.local_directory is not None
        try:
            seal = (read_seal(data[:HEAD_BYTES], data[-TRAILER_BYTES:], len(data), where) if streamed
                    else verify(data, where))
        except SnapshotError as exc:
            raise SnapshotWriteError(f"refused to store it: {exc}") from exc
        if checksum is not None and checksum != seal.checksum:
            raise SnapshotWriteError(f"refused to store it: its checksum is not the announced {checksum[:20]}...")
        if seal.header.global_step != global_step:
            raise SnapshotWriteError(f"refused to store it: the file is a snapshot of step "
                                     f"{seal.header.global_step}, not of step {global_step}")
        if not streamed:
            return self._write(global_step, epoch, samples_consumed,
                               lambda name: self._write_whole(name, data, seal.checksum), known_checksum=seal.checksum)

        def write_file(name: str) -> tuple[str, int]:
            self.storage.write_stream_atomically(name, lambda file: write_verified(data, file, where, cancelled))
            return seal.checksum, len(data)

        try:
            return self._write(global_step, epoch, samples_consumed, write_file, known_checksum=seal.checksum)
        except SnapshotError as exc:  # its bytes did not match its checksum: the temporary file is gone
            raise SnapshotWriteError(f"refused to store it: {exc}") from exc

    def _write_whole(self, name: str, data: bytes, checksum: str) -> tuple[str, int]:
        self.storage.write_atomically(name, data)
        return checksum, len(data)

    def write_stream(self, global_step: int, epoch: int, samples_consumed: int,
                     produce: Callable[[BinaryIO], Seal]) -> ManifestEntry:
        """Like `write`, with the file written by `produce(file)`, which returns its seal.

        On a local directory it goes straight into the temporary file: no copy of the whole
        snapshot is held in memory. `produce` is called again if a transient error makes the write
        start over.
        """
        def write_file(name: str) -> tuple[str, int]:
            seals: list[Seal] = []
            self.storage.write_stream_atomically(name, lambda file: seals.append(produce(file)))
            return seals[-1].checksum, seals[-1].size_bytes

        return self._write(global_step, epoch, samples_consumed, write_file)

    def _write(self, global_step: int, epoch: int, samples_consumed: int,
               write_file: Callable[[str], tuple[str, int]], known_checksum: str | None = None) -> ManifestEntry:
        started = time.monotonic()
        try:
            entry, dropped, prunable = self._retrying(self._write_once, global_step, epoch, samples_consumed,
                                                      write_file, known_checksum)
        except OSError as exc:
            raise SnapshotWriteError(
                f"snapshot of step {global_step} could not be written to {self.describe()} "
                f"({exc.strerror or exc}); the listed snapshots are intact") from exc
        if prunable:
            self._prune(entry, dropped)
        logger.debug("snapshot %s durable in %.3f s", entry.file, time.monotonic() - started)
        return entry

    def _write_once(self, global_step: int, epoch: int, samples_consumed: int,
                    write_file: Callable[[str], tuple[str, int]], known_checksum: str | None,
                    ) -> tuple[ManifestEntry, set[str], bool]:
        self.storage.prepare_for_writing()
        index = self.index()
        same = next((e for e in index.entries if e.global_step == global_step and e.checksum == known_checksum), None)
        if same is not None and not index.rebuilt:
            return same, set(), False  # already listed, the same bytes: nothing to do
        name = snapshot_file_name(global_step)
        checksum, size_bytes = write_file(name)
        entry = ManifestEntry(file=name, global_step=global_step, epoch=epoch, samples_consumed=samples_consumed,
                              checksum=checksum, size_bytes=size_bytes, created_unix=time.time())
        # Entries at or past this step belong to a trajectory the run rolled back from (or are an
        # older copy of this very step).
        kept = ([e for e in index.entries if e.global_step < global_step] + [entry])[-self.keep_last:]
        try:
            write_manifest(self.storage, kept)
        except BaseException:
            # A new file that no manifest lists is never trusted, and on a full disk its space is what
            # the next write needs: delete it. But the manifest may be in place already (its rename
            # done, the directory's fsync failed): then it lists the file, which must stay.
            after = read_manifest(self.storage)
            if after.manifest_readable and name not in {e.file for e in after.entries}:
                self._delete_quietly(name)
            raise
        dropped = {e.file for e in index.entries} - {e.file for e in kept}
        # Prune only against a manifest that was read: files that an unreadable one may have
        # listed are left alone until a readable manifest says what they are.
        return entry, dropped, not index.rebuilt and index.manifest_readable

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

    def _delete_quietly(self, name: str) -> None:
        try:
            self.storage.delete(name)
        except OSError as exc:
            logger.warning("could not delete %s: %s", self.describe(name), exc)

    def _prune(self, written: ManifestEntry, dropped: set[str]) -> None:
        """After `written` is listed in a durable manifest: delete the files the manifest dropped at
        or below its step, and unlisted format-2 files below its step (left by failed writes).

        An unlisted format-1 file (a name without a suffix: this version never writes one) is
        never deleted: it was written before 0.2, and a lost manifest entry is the only way it can
        be unlisted, so deleting it would destroy a snapshot that the user may still recover.
        """
        listed = {e.file for e in self.manifest_entries()}
        try:
            names = self.storage.list_names()
        except OSError as exc:
            logger.warning("could not list %s to prune old snapshots: %s", self.describe(), exc)
            return
        for name in names:
            match = SNAPSHOT_PATTERN.match(name)
            if not match or name in listed or name == written.file:
                continue
            step = int(match.group(1))
            if match.group(2) is None and name not in dropped:
                continue
            if step < written.global_step or (name in dropped and step == written.global_step):
                self._delete_quietly(name)
