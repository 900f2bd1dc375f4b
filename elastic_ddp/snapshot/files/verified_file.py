"""Reading a format-2 snapshot in place: its checksum streamed, its payload read through a window.

Reading a snapshot's bytes whole and copying them for torch.load would hold three times the state
at once, and the copy would hold the GIL long enough to starve the worker's other threads, the
watchdog's heartbeat among them (docs/benchmarks-history.md). Here:

- `verify_file(fd, size, source)` checks a file's frame (`file_layout.read_seal`: its header is
  untrusted input) and recomputes its checksum in chunks of CHUNK_BYTES read with `os.preadv` into
  one reused buffer: the read and the hash both release the GIL, and no copy of the file is held.
  The caller keeps the descriptor open and loads through it, so what is loaded is the very file
  that was verified (a file replaced by rename since is not read).
- `FileWindow` and `BufferWindow` are read-only file objects onto a byte range (the payload) of
  an open file or of bytes in memory, for `torch.load`: it reads straight into the storage of the
  tensors it builds, so the loaded state is the only copy. From memory the copy goes in pieces of
  CHUNK_BYTES, so the GIL changes hands between them.

Not guaranteed: a file modified in place (not replaced) between its check and its load is read as
it is then. Snapshot files are never modified in place (writes go to new names, pruning deletes),
and the payload goes through torch.load(weights_only=True) all the same.
"""

from __future__ import annotations

import io
import mmap
import os

from elastic_ddp.snapshot.files.checksum import new_hasher, parse_checksum
from elastic_ddp.snapshot.files.errors import SnapshotError
from elastic_ddp.snapshot.files.file_layout import HEAD_BYTES, TRAILER_BYTES, Seal, read_seal

# Per read and per hash update: large enough to run at memory or disk speed, small enough that a
# piece copied while holding the GIL takes about a millisecond.
CHUNK_BYTES = 8 * 2**20


def read_at(fd: int, size: int, offset: int) -> bytes:
    """`size` bytes of `fd` from `offset` (fewer at its end)."""
    buffer = bytearray(size)
    got = _pread_into(fd, memoryview(buffer), offset)
    return bytes(buffer[:got])


def verify_file(fd: int, size_bytes: int, source: str) -> Seal:
    """The seal of the format-2 file open as `fd` (of `size_bytes`), once its checksum, recomputed
    over the file in chunks on every core (it is called as a worker restores, before it trains),
    matches; SnapshotError naming `source` otherwise."""
    if size_bytes < TRAILER_BYTES:
        raise SnapshotError(f"{source}: {size_bytes} bytes, too short to be a snapshot (torn write?)")
    head = read_at(fd, min(size_bytes, HEAD_BYTES), 0)
    seal = read_seal(head, read_at(fd, TRAILER_BYTES, size_bytes - TRAILER_BYTES), size_bytes, source)
    algorithm, expected = parse_checksum(seal.checksum)
    hasher = new_hasher(algorithm, all_cores=True)  # a restore: nothing trains meanwhile
    buffer = memoryview(bytearray(min(CHUNK_BYTES, size_bytes - TRAILER_BYTES) or 1))
    offset, end = 0, size_bytes - TRAILER_BYTES
    while offset < end:
        got = _pread_into(fd, buffer[:min(len(buffer), end - offset)], offset)
        if got == 0:
            raise SnapshotError(f"{source}: ended after {offset} bytes while being read (truncated?)")
        hasher.update(buffer[:got])
        offset += got
    if hasher.hexdigest() != expected:
        raise SnapshotError(f"{source}: {algorithm} {hasher.hexdigest()[:12]}... does not match its own "
                            f"{expected[:12]}... (corrupt)")
    return seal


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `fd` at `offset` as far as the file goes; the number of bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class _Window(io.RawIOBase):
    """A read-only, seekable file of `length` bytes; subclasses say where they come from."""

    def __init__(self, length: int):
        super().__init__()
        self._length = length
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}: before the start")
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self._length - self._position))
        done = 0
        while done < wanted:
            got = self._read_at(self._position + done, view[done:done + min(CHUNK_BYTES, wanted - done)])
            if got <= 0:
                break
            done += got
        self._position += done
        return done

    def _read_at(self, position: int, view: memoryview) -> int:
        raise NotImplementedError


class FileWindow(_Window):
    """Bytes [start, start + length) of the open file `fd` (which the caller keeps open)."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__(length)
        self._fd, self._start = fd, start

    def _read_at(self, position: int, view: memoryview) -> int:
        return _pread_into(self._fd, view, self._start + position)


class BufferWindow(_Window):
    """The bytes of `data` (bytes, a bytearray, a memoryview, a mapped file), not copied."""

    def __init__(self, data):
        self._data = memoryview(data).cast("B")
        super().__init__(len(self._data))

    def _read_at(self, position: int, view: memoryview) -> int:
        piece = self._data[position:position + len(view)]
        view[:len(piece)] = piece
        return len(piece)


def map_file(path: str | os.PathLike) -> mmap.mmap:
    """The whole file at `path`, mapped read-only: its pages are read when touched (from the page
    cache or tmpfs, no copy), and the mapping stays valid after the file is removed."""
    with open(path, "rb", buffering=0) as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
