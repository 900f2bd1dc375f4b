"""Checksums of snapshot bytes: which algorithms exist, and how a checksum is written down.

A checksum is written `ALGORITHM:HEXDIGEST` (`blake3:9f2c...`) in manifests, events and frame
headers, so that files written with one algorithm stay readable when the default changes. New
snapshots use `DEFAULT_ALGORITHM`; files of format 1 carry `sha256`.

Why BLAKE3 (docs/benchmarks-history.md, "Checksums", has the measurements): it is a cryptographic hash like
sha256 (a checksum that matches proves the bytes are the ones written, not just probably), and it
is 2.4 times faster than sha256 on one core even where sha256 has CPU instructions of its own
(about 6 times without them), so hashing on one thread keeps up with the disk. xxh3 is faster
still but not cryptographic (it detects accidents, not forgeries: a replica's bytes cross a
network), and crc32c (32 bits) was slower than BLAKE3 through its Python binding; the writer is
bound by the disk with BLAKE3 already.
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import blake3

DEFAULT_ALGORITHM = "blake3"
DIGEST_BYTES = 32  # both algorithms' digests
_CHECKSUM = re.compile(r"^(sha256|blake3):([0-9a-f]{64})$")


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str = DEFAULT_ALGORITHM, *, all_cores: bool = False) -> Hasher:
    """A running hash of `algorithm` (ValueError for an unknown one); with `all_cores`, a BLAKE3
    hash spreads each large update over every core (the same digest)."""
    if algorithm == "blake3":
        # One thread by default: it keeps up with the disk, and on a training node the other cores
        # belong to training (docs/benchmarks-history.md, "Checksums"). A restore, which trains
        # nothing yet, asks for all of them: 1 GB in 0.13 s on 2 cores against 0.24 s on one. The
        # GIL is released either way.
        return blake3.blake3(max_threads=blake3.blake3.AUTO) if all_cores else blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; expected blake3 or sha256")


def checksum_text(algorithm: str, digest_hex: str) -> str:
    return f"{algorithm}:{digest_hex}"


def parse_checksum(text: object) -> tuple[str, str]:
    """(algorithm, hex digest) of a checksum string; ValueError for anything else."""
    match = _CHECKSUM.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not a checksum: {str(text)[:80]!r}; expected blake3:<64 hex> or sha256:<64 hex>")
    return match.group(1), match.group(2)


def checksum_of(data: bytes | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return checksum_text(algorithm, hasher.hexdigest())


def matches(data: bytes | memoryview, checksum: str) -> bool:
    """Whether `data` has `checksum` (computed with the checksum's own algorithm)."""
    algorithm, _ = parse_checksum(checksum)
    return checksum_of(data, algorithm) == checksum
