"""Early writeback: ask the kernel to start writing a file's dirty pages while we keep producing.

A snapshot write is `write()` into the page cache, then one `fsync()` that waits for the device.
Done that way, serialising and hashing (CPU) and the device's write never overlap: the device
idles until the fsync, then the CPU idles. `start_writeback` is called after every
`WRITEBACK_BYTES` written, so the device works on the first megabytes while the next ones are
produced, and the final fsync finds little left (docs/benchmarks-history.md, "Checksums and the writer":
alone it took the writer from 0.6 to 0.9 (100 MB) and 0.74 (1 GB) of a plain write + fsync; with
the hashing alongside the write, 0.97 and 1.19).

Linux only, through `sync_file_range(SYNC_FILE_RANGE_WRITE)` from the C library: it starts the
writeback of a range and returns without waiting. It is a hint, never a durability step: the fsync
still makes the file durable. Elsewhere, or where the call is missing or fails, nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

WRITEBACK_BYTES = 16 * 2**20  # measured: 8 to 32 MiB all help; smaller ranges cost more calls
_SYNC_FILE_RANGE_WRITE = 2  # from <fcntl.h>


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


def available() -> bool:
    """Whether `start_writeback` does anything on this platform."""
    return _sync_file_range is not None


def start_writeback(descriptor: int, offset: int, length: int) -> None:
    """Start writing bytes [offset, offset + length) of the open file `descriptor` to the device;
    returns at once. A failure is ignored (the caller's fsync reports real I/O errors)."""
    if _sync_file_range is None or length <= 0:
        return
    _sync_file_range(descriptor, offset, length, _SYNC_FILE_RANGE_WRITE)


class WritebackTracker:
    """Calls `start_writeback` for each further `every` bytes written to `descriptor`."""

    def __init__(self, descriptor: int, every: int = WRITEBACK_BYTES):
        self._descriptor = descriptor
        self._every = every
        self._written = 0
        self._started_up_to = 0

    def wrote(self, count: int) -> None:
        self._written += count
        if self._written - self._started_up_to >= self._every:
            start_writeback(self._descriptor, self._started_up_to, self._written - self._started_up_to)
            self._started_up_to = self._written
