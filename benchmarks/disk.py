"""The disk's own sequential write bandwidth, measured with a plain file write.

    python -m benchmarks.disk --dir /path/to/checkpoints --size_mb 1024

What a snapshot write is compared against: `size_mb` of incompressible bytes written in 8 MiB
blocks with `os.write`, then `fsync`, to a new file in `directory` (put it where the snapshots go),
which is removed afterwards. Page cache and device both count, as they do for a snapshot write.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

BLOCK_BYTES = 8 * 2**20


def sequential_write_mb_per_s(directory: str | Path, size_mb: int) -> float:
    """MB (10^6 bytes) per second to write and fsync `size_mb` MiB into a new file in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(BLOCK_BYTES)
    blocks = max(1, size_mb * 2**20 // BLOCK_BYTES)
    path = directory / f".disk-bandwidth-{os.getpid()}"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        for _ in range(blocks):
            os.write(descriptor, block)
        os.fsync(descriptor)
        seconds = time.perf_counter() - started
    finally:
        os.close(descriptor)
        path.unlink(missing_ok=True)
    return blocks * BLOCK_BYTES / 1e6 / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=".", help="directory on the disk to measure (default: here)")
    parser.add_argument("--size_mb", type=int, default=1024)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args(argv)
    for _ in range(args.repetitions):
        print(f"{sequential_write_mb_per_s(args.dir, args.size_mb):.0f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
