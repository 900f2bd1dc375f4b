"""The frame of a format-2 snapshot file: magic, a JSON header, the payload, a checksummed trailer.

    offset 0   MAGIC                  8 bytes, b"EDDPSNAP"
           8   header length          4 bytes, unsigned, big-endian (at most MAX_HEADER_BYTES)
          12   header                 UTF-8 JSON: {"format": 2, "global_step", "epoch",
                                      "samples_consumed", "world_size", "incarnation", "wall_time",
                                      "fingerprint", "components"}
           .   payload                (snapshot.serialization: torch.save of the states)
    end - 64   trailer                payload length (8 bytes, big-endian), checksum algorithm (16
                                      bytes, ASCII, NUL-padded), digest (32 bytes), TRAILER_MAGIC (8)

The checksum covers every byte before the trailer, so a file proves its own integrity: the
manifest is an index that can be rebuilt from the files (`read_seal` needs only the first and last
bytes of a file), and a torn file fails its check whatever the manifest says. Nothing here imports
torch: `elastic-ddp inspect --checksum-only` and the store read frames without it. Every field of
a header is checked before use (it is file content: untrusted input).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

from elastic_ddp.snapshot.files.checksum import DEFAULT_ALGORITHM, checksum_text, matches, new_hasher, parse_checksum
from elastic_ddp.snapshot.files.errors import SnapshotError, WriteCancelled
from elastic_ddp.snapshot.files.strict_json import StrictJSONError, encode_object, parse_object

FORMAT_VERSION = 2
MAGIC = b"EDDPSNAP"
TRAILER_MAGIC = b"EDDPEND\x00"
MAX_HEADER_BYTES = 64 * 1024
_LENGTH = struct.Struct(">I")
_TRAILER = struct.Struct(">Q16s32s8s")  # payload length, algorithm, digest, magic
PREFIX_BYTES = len(MAGIC) + _LENGTH.size  # before the header
TRAILER_BYTES = _TRAILER.size
# The most of a file's start that `read_seal` needs: everything up to the end of a largest header.
HEAD_BYTES = PREFIX_BYTES + MAX_HEADER_BYTES
# Where the payload starts in the files written now (the header padded with spaces; older files put
# it anywhere): torch.save aligns its records on 64 bytes too, so in a mapped file every tensor's
# bytes are aligned for its dtype, and a restore can use them where they lie
# (`serialization.load_model_as_views`).
PAYLOAD_ALIGNMENT = 64
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's container: a format-1 file


@dataclass(frozen=True)
class SnapshotHeader:
    """What a snapshot file says about itself before its payload (plain, checked values)."""

    global_step: int
    epoch: int
    samples_consumed: int
    world_size: int
    incarnation: int
    wall_time: float
    fingerprint: dict[str, Any]
    components: tuple[str, ...]

    def to_bytes(self) -> bytes:
        document = {"format": FORMAT_VERSION, "global_step": self.global_step, "epoch": self.epoch,
                    "samples_consumed": self.samples_consumed, "world_size": self.world_size,
                    "incarnation": self.incarnation, "wall_time": self.wall_time, "fingerprint": self.fingerprint,
                    "components": list(self.components)}
        return encode_object(document)

    @classmethod
    def from_bytes(cls, raw: bytes, source: str) -> SnapshotHeader:
        """Parse an untrusted header; SnapshotError names the file and the first bad field."""
        try:
            document = parse_object(raw)
        except StrictJSONError as exc:
            raise SnapshotError(f"{source}: its header is {exc}") from exc
        if document.get("format") != FORMAT_VERSION:
            raise SnapshotError(f"{source}: its header is not an elastic_ddp snapshot header of format "
                                f"{FORMAT_VERSION}")
        for name in ("global_step", "epoch", "samples_consumed", "world_size", "incarnation"):
            value = document.get(name)
            if type(value) is not int or value < 0:
                raise SnapshotError(f"{source}: header field {name} must be a non-negative integer")
        wall_time = document.get("wall_time")
        if type(wall_time) not in (int, float) or not math.isfinite(wall_time):
            raise SnapshotError(f"{source}: header field wall_time must be a finite number")
        fingerprint, components = document.get("fingerprint"), document.get("components")
        if not isinstance(fingerprint, dict):
            raise SnapshotError(f"{source}: header field fingerprint must be an object")
        if not isinstance(components, list) or not all(isinstance(name, str) for name in components):
            raise SnapshotError(f"{source}: header field components must be a list of names")
        return cls(document["global_step"], document["epoch"], document["samples_consumed"],
                   document["world_size"], document["incarnation"], float(wall_time), fingerprint,
                   tuple(components))


@dataclass(frozen=True)
class Seal:
    """What a format-2 file proves about itself: its header, its checksum and its sizes."""

    header: SnapshotHeader
    checksum: str  # "algorithm:hex" over every byte before the trailer
    header_bytes: int
    payload_bytes: int
    size_bytes: int

    @property
    def payload_start(self) -> int:
        return PREFIX_BYTES + self.header_bytes


# Chunks at least this large are hashed on a helper thread while the same bytes are written.
PARALLEL_HASH_BYTES = 2**20


class _HashingWriter:
    """A write-only binary file that hashes and counts what it passes on to `target`.

    A large chunk is hashed on one helper thread while this thread writes it (both only read the
    buffer, both release the GIL, and both are done before `write` returns, so the caller may
    reuse the buffer): a chunk costs the longer of the two instead of their sum. Call `close`.
    """

    def __init__(self, target: BinaryIO, algorithm: str):
        self._target = target
        self.hasher = new_hasher(algorithm)
        self.size = 0
        self._helper: ThreadPoolExecutor | None = None

    def write(self, data) -> int:
        if memoryview(data).nbytes < PARALLEL_HASH_BYTES:
            self.hasher.update(data)
            written = self._target.write(data)
        else:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-hash")
            hashed = self._helper.submit(self.hasher.update, data)
            try:
                written = self._target.write(data)
            finally:
                hashed.result()  # (its error, if any, wins over the write's)
        self.size += written
        return written

    def flush(self) -> None:
        self._target.flush()

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None


def write_framed(file: BinaryIO, header: SnapshotHeader, write_payload: Callable[[BinaryIO], None],
                 algorithm: str = DEFAULT_ALGORITHM) -> Seal:
    """Write one format-2 file into `file`: the header, then what `write_payload(f)` writes into the
    file-like `f`, then the trailer; hashed on the way (one pass, no copy held in memory)."""
    raw_header = header.to_bytes()
    # JSON allows trailing spaces: they start the payload on a multiple of PAYLOAD_ALIGNMENT.
    raw_header += b" " * (-(PREFIX_BYTES + len(raw_header)) % PAYLOAD_ALIGNMENT)
    if len(raw_header) > MAX_HEADER_BYTES:
        raise SnapshotError(f"snapshot header of {len(raw_header)} bytes (a fingerprint that large?); "
                            f"at most {MAX_HEADER_BYTES}")
    hashing = _HashingWriter(file, algorithm)
    try:
        hashing.write(MAGIC + _LENGTH.pack(len(raw_header)) + raw_header)
        write_payload(hashing)
    finally:
        hashing.close()
    payload_bytes = hashing.size - PREFIX_BYTES - len(raw_header)
    digest = hashing.hasher.digest()
    trailer = _TRAILER.pack(payload_bytes, algorithm.encode().ljust(16, b"\0"), digest, TRAILER_MAGIC)
    file.write(trailer)
    return Seal(header, checksum_text(algorithm, digest.hex()), len(raw_header), payload_bytes,
                hashing.size + len(trailer))


def format_of(head: bytes) -> int | None:
    """1 or 2 from a file's first bytes; None when it is neither."""
    if head.startswith(MAGIC):
        return FORMAT_VERSION
    if head.startswith(_ZIP_MAGIC):
        return 1
    return None


def read_seal(head: bytes, tail: bytes, size_bytes: int, source: str) -> Seal:
    """The seal of a format-2 file from its first `HEAD_BYTES` (or fewer) and last TRAILER_BYTES
    bytes and its size; nothing of the payload is read. SnapshotError when they do not add up."""
    if len(head) < PREFIX_BYTES or not head.startswith(MAGIC):
        raise SnapshotError(f"{source}: not a format-{FORMAT_VERSION} snapshot (no magic)")
    (header_bytes,) = _LENGTH.unpack_from(head, len(MAGIC))
    if header_bytes > MAX_HEADER_BYTES or len(head) < PREFIX_BYTES + header_bytes:
        raise SnapshotError(f"{source}: a header of {header_bytes} bytes; at most {MAX_HEADER_BYTES} fit")
    header = SnapshotHeader.from_bytes(head[PREFIX_BYTES:PREFIX_BYTES + header_bytes], source)
    if len(tail) != TRAILER_BYTES:
        raise SnapshotError(f"{source}: {size_bytes} bytes, too short to be a snapshot (torn write?)")
    payload_bytes, algorithm, digest, magic = _TRAILER.unpack(tail)
    expected = PREFIX_BYTES + header_bytes + payload_bytes + TRAILER_BYTES
    if magic != TRAILER_MAGIC or expected != size_bytes:
        raise SnapshotError(f"{source}: its trailer does not close a complete snapshot (torn write?)")
    try:
        checksum = checksum_text(algorithm.rstrip(b"\0").decode("ascii"), digest.hex())
        parse_checksum(checksum)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SnapshotError(f"{source}: its trailer names no known checksum algorithm") from exc
    return Seal(header, checksum, header_bytes, payload_bytes, size_bytes)


def verify(data: bytes, source: str, *, all_cores: bool = False) -> Seal:
    """The seal of a whole format-2 file, once its checksum is recomputed (on every core with
    `all_cores`: for a restore, which trains nothing meanwhile) and matches."""
    seal = read_seal(data[:HEAD_BYTES], data[-TRAILER_BYTES:], len(data), source)
    algorithm, expected = parse_checksum(seal.checksum)
    hasher = new_hasher(algorithm, all_cores=all_cores)
    hasher.update(memoryview(data)[:len(data) - TRAILER_BYTES])
    _check_digest(hasher.hexdigest(), expected, algorithm, source)
    return seal


WRITE_CHUNK_BYTES = 16 * 2**20  # `write_verified`: the unit of early writeback, and of stopping


def write_verified(data: bytes, file: BinaryIO, source: str, cancelled: Callable[[], bool] = lambda: False) -> Seal:
    """Write the whole format-2 file `data` into `file`, hashing it on the way (one pass over its
    bytes, each chunk hashed on a helper thread beside its write), and return its seal;
    SnapshotError when it does not match its own checksum, WriteCancelled as soon as `cancelled()`
    (asked before each chunk) says so. Either way `file` then holds bytes that must not be used:
    write it under a temporary name and rename it only once this returns."""
    seal = read_seal(data[:HEAD_BYTES], data[-TRAILER_BYTES:], len(data), source)
    algorithm, expected = parse_checksum(seal.checksum)
    hashing = _HashingWriter(file, algorithm)
    view, end = memoryview(data), len(data) - TRAILER_BYTES
    try:
        for start in range(0, end, WRITE_CHUNK_BYTES):
            if cancelled():
                raise WriteCancelled(f"{source}: the write was stopped after {start} of {len(data)} bytes")
            hashing.write(view[start:min(start + WRITE_CHUNK_BYTES, end)])
    finally:
        hashing.close()
    _check_digest(hashing.hasher.hexdigest(), expected, algorithm, source)
    file.write(data[-TRAILER_BYTES:])
    return seal


def _check_digest(actual: str, expected: str, algorithm: str, source: str) -> None:
    if actual != expected:
        raise SnapshotError(f"{source}: {algorithm} {actual[:12]}... does not match its own "
                            f"{expected[:12]}... (corrupt)")


def file_matches(data: bytes, checksum: str) -> bool:
    """Whether the whole snapshot file `data` is the one `checksum` names: a format-2 file by its
    own verified seal, any other file by the checksum of all its bytes (format 1: sha256)."""
    if format_of(data[:8]) == FORMAT_VERSION:
        try:
            return verify(data, "snapshot").checksum == checksum
        except SnapshotError:
            return False
    return matches(data, checksum)
