"""Sharded snapshots on disk: one directory per step, committed atomically, verified before use.

Layout in the checkpoint directory (one every node reads; on node-local disks each node's
directory holds a part of the files its manifest lists: node_local.py):

    sharded-000000120/          a committed step: never changed after its rename
        __0_0.distcp ...        DCP's files, one or more per rank (tensors only)
        .metadata               DCP's index of them (pickled by torch: read through safe_reader)
        trainer.snap            everything that is not sharded, as a format-2 snapshot file
        checksums.json          written last: every file above with its size and BLAKE3 checksum
    .sharded-000000125.tmp-INC  a step being written by incarnation INC (or abandoned by it)

The commit is the rename of the temporary directory to its final name, after every file and the
directory are fsynced; `checksums.json` is written just before it, so a committed directory lists
every file it holds. A reader trusts nothing it finds: the manifest is strict JSON with a fixed
shape, every listed name is a plain file name, and each file's size and checksum must match before
any byte of it is loaded. Pruning removes only committed steps beyond `keep_last`, oldest first,
and only after a newer one was committed, so the newest valid step is never removed.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from elastic_ddp.snapshot.files.backends import fsync_path
from elastic_ddp.snapshot.files.checksum import DEFAULT_ALGORITHM, checksum_of, checksum_text, new_hasher
from elastic_ddp.snapshot.files.strict_json import StrictJSONError, encode_object, parse_object

MANIFEST = "checksums.json"
TRAINER_FILE = "trainer.snap"
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 20
_COMMITTED = re.compile(r"^sharded-(\d{9})$")
_TEMPORARY = re.compile(r"^\.sharded-(\d{9})\.tmp-(\d+)(?:-replaced)?$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_CHUNK = 8 << 20


class ShardedSnapshotError(Exception):
    """A sharded snapshot directory that must not be loaded; the message says which and why."""


def committed_directory(root: Path, step: int) -> Path:
    return root / f"sharded-{step:09d}"


def temporary_directory(root: Path, step: int, incarnation: int) -> Path:
    return root / f".sharded-{step:09d}.tmp-{incarnation}"


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every committed sharded snapshot under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in root.iterdir()
             if (match := _COMMITTED.match(entry.name)) and entry.is_dir()]
    return sorted(found, reverse=True)


def file_checksum(path: Path) -> str:
    """The BLAKE3 checksum of the file at `path`, read in 8 MB pieces (the hash releases the GIL)."""
    hasher = new_hasher(DEFAULT_ALGORITHM)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return checksum_text(DEFAULT_ALGORITHM, hasher.hexdigest())


def commit(temporary: Path, step: int) -> tuple[Path, str, int]:
    """List every file of `temporary` in its manifest, make it durable and rename it to the step's
    committed name. Returns (committed directory, the manifest's checksum, bytes in all files).
    A step committed already (by an earlier incarnation) is kept as it is, and `temporary` removed."""
    files = {}
    for path in sorted(temporary.iterdir()):
        if path.name == MANIFEST or not path.is_file():
            continue
        files[path.name] = {"size": path.stat().st_size, "checksum": file_checksum(path)}
    return seal(temporary, step, files)


def seal(temporary: Path, step: int, files: dict[str, dict[str, object]],
         replace: bool = False) -> tuple[Path, str, int]:
    """`commit` with the manifest's `files` given: on node-local disks (node_local.py) a directory
    lists every file of the step and holds those of its node and the copies it received. With
    `replace`, a committed directory of the step with another manifest (an abandoned trajectory's,
    which no restore chose) is replaced rather than kept."""
    for name in files:
        if (temporary / name).is_file():
            fsync_path(temporary / name)
    manifest = encode_object({"format": MANIFEST_FORMAT, "global_step": step, "files": files})
    with open(temporary / MANIFEST, "wb") as handle:
        handle.write(manifest)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_path(temporary)
    final = committed_directory(temporary.parent, step)
    if final.exists() and not (replace and _manifest_of(final) != manifest):
        shutil.rmtree(temporary, ignore_errors=True)
    else:
        install(temporary, final)
    return final, checksum_of(manifest), sum(int(entry["size"]) for entry in files.values()) + len(manifest)


def install(temporary: Path, final: Path) -> None:
    """Rename `temporary` to `final`; a directory already there is renamed aside first and removed after."""
    aside = temporary.with_name(f"{temporary.name}-replaced")
    if final.exists():
        os.rename(final, aside)
    os.rename(temporary, final)
    fsync_path(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _manifest_of(directory: Path) -> bytes:
    try:
        return (directory / MANIFEST).read_bytes()[:MAX_MANIFEST_BYTES + 1]
    except OSError:
        return b""


def verify(directory: Path) -> str:
    """Check every file `directory`'s manifest lists (name, size, checksum); returns the manifest's
    checksum. Raises ShardedSnapshotError naming the directory and the first problem found."""
    raw, files = read_manifest(directory)
    for name, entry in files.items():
        problem = file_problem(directory / name, entry)
        if problem:
            raise ShardedSnapshotError(problem)
    return checksum_of(raw)


def read_manifest(directory: Path) -> tuple[bytes, dict[str, dict]]:
    """The raw manifest of the committed `directory` and the files it lists, checked for shape (not
    the files themselves). Raises ShardedSnapshotError naming what is wrong."""
    manifest_path = directory / MANIFEST
    try:
        if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            raise ShardedSnapshotError(f"{manifest_path}: larger than {MAX_MANIFEST_BYTES} bytes")
        raw = manifest_path.read_bytes()
        document = parse_object(raw)
    except (OSError, StrictJSONError) as exc:
        raise ShardedSnapshotError(f"{manifest_path}: unreadable ({exc})") from exc
    files = document.get("files")
    step = committed_step_of(directory)
    if (document.get("format") != MANIFEST_FORMAT or document.get("global_step") != step
            or not isinstance(files, dict) or TRAINER_FILE not in files or ".metadata" not in files):
        raise ShardedSnapshotError(f"{manifest_path}: not a manifest of step {step} listing {TRAINER_FILE} and "
                                   ".metadata")
    for name, entry in files.items():
        if (not _FILE_NAME.match(name) or name == MANIFEST or not isinstance(entry, dict)
                or type(entry.get("size")) is not int or not isinstance(entry.get("checksum"), str)):
            raise ShardedSnapshotError(f"{manifest_path}: lists {name[:80]!r}, which is no file name of a snapshot")
    return raw, files


def size_problem(path: Path, entry: dict) -> str:
    """Why the file at `path` does not have the size its manifest `entry` lists ("" when it does)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        return f"{path}: listed but unreadable ({exc})"
    if size != entry.get("size"):
        return f"{path}: {size} bytes; the manifest says {entry.get('size')}"
    return ""


def file_problem(path: Path, entry: dict) -> str:
    """Why the file at `path` is not the one its manifest `entry` lists ("" when it is): its size,
    then its checksum (the whole file is read)."""
    problem = size_problem(path, entry)
    if problem:
        return problem
    if file_checksum(path) != entry.get("checksum"):
        return f"{path}: its checksum does not match the manifest's (torn or changed)"
    return ""


def committed_step_of(directory: Path) -> int:
    match = _COMMITTED.match(directory.name)
    if match is None:
        raise ShardedSnapshotError(f"{directory}: not a committed sharded snapshot directory")
    return int(match.group(1))


def prune(root: Path, keep_last: int, incarnation: int, keep: tuple[int, ...] = ()) -> list[Path]:
    """Remove committed steps beyond the newest `keep_last` (but not the steps in `keep`), and the
    temporary directories of other incarnations (abandoned writes). Returns what was removed."""
    removed = [directory for step, directory in committed_steps(root)[keep_last:] if step not in keep]
    removed += [entry for entry in root.iterdir()
                if (match := _TEMPORARY.match(entry.name)) and int(match.group(2)) != incarnation]
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)
    return removed
