"""The manifest: the index of a snapshot directory, and the names of the files it may list.

    manifest.json   {"format": 2, "snapshots": [{file, global_step, epoch, samples_consumed,
                                                 checksum, size_bytes, created_unix}, ...]}

The manifest is file content, so untrusted input: it is read no further than MAX_MANIFEST_BYTES,
and each entry is checked field by field (`ManifestEntry.from_document`): its file is a snapshot
file name (SNAPSHOT_PATTERN, never a path), its numbers are non-negative integers, its checksum an
"algorithm:hex". An entry that fails is ignored with a warning; a manifest that fails as a whole
raises ValueError. It is only an index: format-2 files describe themselves, and `SnapshotStore`
rebuilds the index from them when the manifest is missing or unusable (`Index.rebuilt`). A
manifest is written all or nothing; writing it after the files it lists, and only then pruning,
is the store's part. Nothing here imports torch.

Not guaranteed: that a listed file exists or holds what its entry says (the store verifies each
file against its entry when it reads it).
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Any

from elastic_ddp.snapshot.files.backends import StorageBackend
from elastic_ddp.snapshot.files.checksum import parse_checksum
from elastic_ddp.snapshot.files.file_layout import Seal

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 2
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists --keep_last entries: a few hundred bytes each
# Format 1: snapshot-000000120.pt. Format 2: snapshot-000000120-3f9a0c1e.pt (a fresh suffix per write).
SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d{9})(?:-([0-9a-f]{8}))?\.pt$")


def snapshot_file_name(global_step: int) -> str:
    """A fresh name for a snapshot of `global_step` (random suffix: never an existing file's)."""
    return f"snapshot-{global_step:09d}-{secrets.token_hex(4)}.pt"


@dataclass(frozen=True)
class ManifestEntry:
    """One listed snapshot: its file and what the file must prove when read."""

    file: str
    global_step: int
    epoch: int
    samples_consumed: int
    checksum: str  # "algorithm:hex" (format-1 files: sha256 of the whole file)
    size_bytes: int
    created_unix: float

    @classmethod
    def from_document(cls, item: Any) -> ManifestEntry:
        """An entry of a manifest (format 1 or 2), checked field by field; ValueError says which."""
        if not isinstance(item, dict):
            raise ValueError("an entry is not an object")
        file = item.get("file")
        if not isinstance(file, str) or not SNAPSHOT_PATTERN.match(file):
            raise ValueError(f"file {str(file)[:80]!r} is not a snapshot file name")
        numbers = {name: item.get(name) for name in ("global_step", "epoch", "samples_consumed", "size_bytes")}
        for name, value in numbers.items():
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} of {file} is not a non-negative integer")
        if numbers["global_step"] != int(SNAPSHOT_PATTERN.match(file).group(1)):
            raise ValueError(f"{file} is listed with global_step {numbers['global_step']}")
        checksum = item.get("checksum", f"sha256:{item['sha256']}" if isinstance(item.get("sha256"), str) else None)
        parse_checksum(checksum)  # ValueError for anything but algorithm:hex
        created = item.get("created_unix")
        if type(created) not in (int, float) or not math.isfinite(created):
            raise ValueError(f"created_unix of {file} is not a number")
        return cls(file=file, checksum=checksum, created_unix=float(created), **numbers)

    @classmethod
    def from_seal(cls, file: str, seal: Seal) -> ManifestEntry:
        """The entry that lists the format-2 file `file`, from what the file says about itself."""
        header = seal.header
        return cls(file, header.global_step, header.epoch, header.samples_consumed, seal.checksum, seal.size_bytes,
                   header.wall_time)


@dataclass(frozen=True)
class Index:
    """The snapshots a store knows of, oldest first, and where that knowledge came from."""

    entries: list[ManifestEntry]
    manifest_readable: bool  # False: the manifest exists but could not be used at all
    rebuilt: bool  # the entries come from the files themselves


def read_manifest(storage: StorageBackend) -> Index:
    """The manifest's usable entries in `storage`; none, and readable, when there is no manifest.
    An unusable one (an I/O error, or `parse_manifest` refused it) is logged and reads as none."""
    where = storage.describe(MANIFEST_NAME)
    try:
        raw = storage.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return Index([], manifest_readable=True, rebuilt=False)
    except OSError as exc:
        logger.error("%s cannot be read (%s)", where, exc)
        return Index([], manifest_readable=False, rebuilt=False)
    try:
        entries = parse_manifest(raw, where)
    except ValueError as exc:
        logger.error("%s is unreadable (%s)", where, exc)
        return Index([], manifest_readable=False, rebuilt=False)
    return Index(entries, manifest_readable=True, rebuilt=False)


def parse_manifest(raw: bytes, source: str) -> list[ManifestEntry]:
    """The usable entries of the manifest `raw` (read from `source`), oldest first.

    Raises ValueError, saying why, when the manifest cannot be used at all; logs a warning for each
    entry it ignores.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"more than {MAX_MANIFEST_BYTES} bytes")
    try:
        document = json.loads(raw)
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc
    if not isinstance(document, dict) or not isinstance(document.get("snapshots"), list):
        raise ValueError('not an object with a "snapshots" list')
    entries = []
    for item in document["snapshots"]:
        try:
            entries.append(ManifestEntry.from_document(item))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("%s: ignoring an entry (%s)", source, exc)
    return sorted(entries, key=lambda entry: entry.global_step)


def write_manifest(storage: StorageBackend, entries: list[ManifestEntry]) -> None:
    """Make the manifest in `storage` list `entries`, all or nothing (`write_atomically`)."""
    document = {"format": MANIFEST_FORMAT, "snapshots": [asdict(entry) for entry in entries]}
    storage.write_atomically(MANIFEST_NAME, json.dumps(document, indent=1).encode())
