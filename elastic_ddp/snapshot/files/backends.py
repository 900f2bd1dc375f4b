"""Where snapshot files live: a local directory (the default) or any fsspec URL.

`StorageBackend` is the small surface the `SnapshotStore` needs: read a named file, make a named
file's content durable all-or-nothing with the storage's own atomic primitive, list names, delete.
The manifest, checksums, retries and pruning live in the store, above this line.

- `LocalDirectoryStorage` (a path, or a `file://` URL): temporary sibling, fsync, rename over the
  final name, fsync of the directory. A writer killed at any moment leaves at worst a temporary
  file, which `prepare_for_writing` removes before the next write.
- `FsspecStorage` (`s3://`, `gs://`, `az://`, `memory://`, ...): one `pipe_file` per file, which
  object stores turn into a single PUT (or a multipart upload that becomes visible only when it is
  completed). There is no rename and no temporary object: readers see the old object or the new
  one, never a part. Needs `pip install fsspec` plus the protocol's package (s3fs, gcsfs, adlfs).

Not guaranteed: atomicity on filesystems whose rename is not atomic (some FUSE mounts), and
durability on object stores beyond what the store acknowledges for a completed PUT.
"""

from __future__ import annotations

import io
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# is_url is re-exported: elastic_ddp/tools/inspection.py imports it from here (until it imports elastic_ddp.run_files.locations).
from elastic_ddp.run_files.locations import (
    is_url,  # noqa: F401
    local_path,
    url_filesystem,
)
from elastic_ddp.snapshot.files.writeback import WritebackTracker

logger = logging.getLogger(__name__)

# A temporary file of LocalDirectoryStorage: ".<final name>.tmp-<pid>".
TEMPORARY_PATTERN = re.compile(r"^\..+\.tmp-\d+$")


def open_storage(location: str | os.PathLike) -> StorageBackend:
    """The storage for a `--checkpoint_dir` value: a local path, `file://` URL or fsspec URL.

    The one way the checkpoint directory is opened: the DDP session's `SnapshotStore`, the sharded
    session (its step directories, node-local probe, memory scope token) and `load_snapshot` all
    hold what this returns. It touches nothing; `make_location` creates a local directory with the
    process's umask. Not guaranteed: a private directory (its mode and owner are not checked; the
    memory directory's are, `memory_copies.open_memory_tier`). Raises ValueError when the URL's
    protocol cannot be used here (fsspec or its driver missing).
    """
    # A file:// URL too: fsspec's local pipe_file writes in place; rename is the local atomic primitive.
    directory = local_path(location)
    if directory is not None:
        return LocalDirectoryStorage(directory)
    return FsspecStorage(str(location))


class StorageBackend(ABC):
    """Named files in one place, written all-or-nothing. Any process may read; one may write."""

    @abstractmethod
    def describe(self, name: str) -> str:
        """The path or URL of `name`, for messages."""

    @abstractmethod
    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The content of `name`; FileNotFoundError when it does not exist, OSError on I/O errors.

        With `limit`, at most `limit + 1` bytes are read: a longer file shows as longer than the
        limit without being read whole (a manifest must not make a reader swallow /dev/zero).
        """

    @abstractmethod
    def size(self, name: str) -> int:
        """The size of `name` in bytes (FileNotFoundError when it does not exist)."""

    @abstractmethod
    def read_range(self, name: str, start: int, length: int) -> bytes:
        """At most `length` bytes of `name` from offset `start`."""

    @abstractmethod
    def write_atomically(self, name: str, data: bytes) -> None:
        """Make `data` the durable content of `name`, or raise and leave `name` as it was."""

    def create_if_absent(self, name: str, data: bytes, limit: int) -> bytes:
        """Give `name` the content `data` unless it exists; return its content either way (at most
        `limit + 1` bytes of it, as `read_bytes`). Of two writers racing, the first wins on a local
        directory; an object store has no such primitive (the last PUT wins, and a reader may have
        seen the other)."""
        try:
            return self.read_bytes(name, limit)
        except FileNotFoundError:
            self.make_location()
            self.write_atomically(name, data)
            return self.read_bytes(name, limit)

    def write_stream_atomically(self, name: str, produce: Callable[[BinaryIO], None]) -> None:
        """Like `write_atomically`, the content being what `produce(file)` writes into `file`.

        This default gathers it in memory first; a local directory streams it to disk.
        """
        buffer = io.BytesIO()
        produce(buffer)
        self.write_atomically(name, buffer.getvalue())

    @abstractmethod
    def list_names(self) -> list[str]:
        """Names of the files present ([] when the location does not exist yet)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove `name`; a missing file is not an error."""

    def make_location(self) -> None:
        """Create the location if it does not exist yet."""

    def prepare_for_writing(self) -> None:
        """Create the location if needed and clear what interrupted writes left; see subclasses."""
        self.make_location()

    @property
    def local_directory(self) -> Path | None:
        """The local directory behind this storage, or None for remote storage."""
        return None


class LocalDirectoryStorage(StorageBackend):
    """Files in a local directory (or one on a POSIX shared filesystem), written by rename."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def describe(self, name: str) -> str:
        return str(self.directory / name)

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """See base class."""
        if limit is None:
            return (self.directory / name).read_bytes()
        return self.read_range(name, 0, limit + 1)

    def size(self, name: str) -> int:
        """See base class."""
        return (self.directory / name).stat().st_size

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """See base class."""
        with open(self.directory / name, "rb") as handle:
            handle.seek(start)
            return handle.read(length)

    def write_atomically(self, name: str, data: bytes) -> None:
        """See base class. Temporary sibling, fsync, rename, fsync of the directory."""
        self.write_stream_atomically(name, lambda file: file.write(data))

    def write_stream_atomically(self, name: str, produce: Callable[[BinaryIO], None]) -> None:
        """See base class. `produce` writes straight into the temporary file, unbuffered (each
        write is one system call that releases the GIL, and no copy of the content is kept); the
        device starts writing while `produce` goes on (elastic_ddp/snapshot/files/writeback.py)."""
        path = self.directory / name
        temporary = path.with_name(f".{name}.tmp-{os.getpid()}")
        try:
            with open(temporary, "wb", buffering=0) as handle:
                produce(_WriteAll(handle, WritebackTracker(handle.fileno())))
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        fsync_path(self.directory)

    def create_if_absent(self, name: str, data: bytes, limit: int) -> bytes:
        """See base class. A hard link of a complete temporary file: the first writer wins."""
        path = self.directory / name
        if not path.exists():
            self.make_location()
            temporary = path.with_name(f".{name}.tmp-{os.getpid()}")
            temporary.write_bytes(data)
            try:
                os.link(temporary, path)  # fails if `name` exists: someone else was first
            except FileExistsError:
                pass
            finally:
                temporary.unlink(missing_ok=True)
        return self.read_bytes(name, limit)

    def list_names(self) -> list[str]:
        try:
            return os.listdir(self.directory)
        except FileNotFoundError:
            return []

    def delete(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)

    def make_location(self) -> None:
        """See base class."""
        self.directory.mkdir(parents=True, exist_ok=True)

    def prepare_for_writing(self) -> None:
        """See base class. Removes temporary files of writers that were killed mid-write."""
        self.make_location()
        for name in self.list_names():
            if TEMPORARY_PATTERN.match(name):
                logger.info("removing %s, left by an interrupted write", self.directory / name)
                (self.directory / name).unlink(missing_ok=True)

    @property
    def local_directory(self) -> Path:
        return self.directory


class FsspecStorage(StorageBackend):
    """Files under an fsspec URL; each write is one `pipe_file` (a single PUT on object stores)."""

    def __init__(self, url: str):
        self.fs, root = url_filesystem(url, "--checkpoint_dir")
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def describe(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """See base class."""
        if limit is None:
            return self.fs.cat_file(self._path(name))
        return self.read_range(name, 0, limit + 1)

    def size(self, name: str) -> int:
        """See base class."""
        return int(self.fs.size(self._path(name)))

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """See base class."""
        return self.fs.cat_file(self._path(name), start=start, end=start + length)

    def write_atomically(self, name: str, data: bytes) -> None:
        """See base class. One `pipe_file`: object stores make the object visible only once complete."""
        self.fs.pipe_file(self._path(name), data)

    def list_names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)  # listings may be cached; pruning needs the truth
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [path.rstrip("/").rsplit("/", 1)[-1] for path in paths]

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass

    def make_location(self) -> None:
        """See base class. Object stores have no directories and no temporary objects to clear."""
        self.fs.makedirs(self.root, exist_ok=True)

    def prepare_for_writing(self) -> None:
        """See base class."""
        self.make_location()


class _WriteAll:
    """An unbuffered file whose `write` returns only once all of its argument is written (a raw
    file may write less, for instance just before a disk fills up)."""

    def __init__(self, raw: BinaryIO, writeback: WritebackTracker | None = None):
        self._raw = raw
        self._writeback = writeback

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += self._raw.write(view[written:])
        if self._writeback is not None:
            self._writeback.wrote(written)
        return written

    def flush(self) -> None:
        """Nothing is buffered here."""


def fsync_path(path: Path) -> None:
    """fsync the file or directory at `path` (a directory's fsync makes its renames durable)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
