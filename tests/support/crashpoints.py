"""Crash consistency of the snapshot store, after the ALICE / CrashMonkey idea.

`Injector` counts the system calls the store's write paths make on a local directory (every
file creation, `write`, `fsync`, `rename`, `unlink`, `mkdir`, directory open) and, at the n-th one,
either raises an OSError (ENOSPC or EIO: the process goes on) or ends the process at once with
`os._exit` (a crash: no `finally`, no cleanup). `WORKLOAD` is the sequence of store operations
played against a directory that already holds two snapshots: a snapshot streamed by the writer
(the trainer's path), a replica received as bytes, a rewrite of that step with other bytes, and a
write that prunes. `check_directory` states what must hold after any of them failed or crashed
at any point.
"""

from __future__ import annotations

import builtins
import errno
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from elastic_ddp.snapshot.files import backends as storage_module
from elastic_ddp.snapshot.files.backends import TEMPORARY_PATTERN
from elastic_ddp.snapshot.files.manifest import SNAPSHOT_PATTERN
from elastic_ddp.snapshot.files.snapshot_store import RetryPolicy, SnapshotStore
from elastic_ddp.snapshot.serialization import snapshot_from_bytes, write_snapshot
from tests.support.snapshots import make_snapshot, snapshot_bytes

KEEP_LAST = 2
NO_RETRY = RetryPolicy(attempts=1)


class Injector:
    """Fails the `fail_at`-th counted system call (1-based) with `failure`; None: count only."""

    def __init__(self, fail_at: int | None = None, failure: str = "ENOSPC"):
        self.fail_at = fail_at
        self.failure = failure  # "ENOSPC", "EIO" or "crash"
        self.calls: list[str] = []

    def point(self, kind: str) -> None:
        self.calls.append(kind)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            if self.failure == "crash":
                os._exit(0)
            code = errno.ENOSPC if self.failure == "ENOSPC" else errno.EIO
            raise OSError(code, f"{os.strerror(code)} (injected at {kind} #{self.fail_at})")

    @contextmanager
    def installed(self):
        """Wrap the calls `elastic_ddp.snapshot.files.backends` makes, for the duration of the block."""
        originals = {name: getattr(os, name) for name in ("fsync", "replace", "open")}
        original_unlink, original_mkdir = Path.unlink, Path.mkdir
        original_write = storage_module._WriteAll.write

        def counted(kind: str, function: Callable) -> Callable:
            def call(*args, **kwargs):
                self.point(kind)
                return function(*args, **kwargs)
            return call

        def open_counted(file, mode="r", *args, **kwargs):
            if "w" in mode or "a" in mode:
                self.point("create")
            return builtins.open(file, mode, *args, **kwargs)

        os.fsync, os.replace = counted("fsync", originals["fsync"]), counted("rename", originals["replace"])
        os.open = counted("open-dir", originals["open"])
        Path.unlink, Path.mkdir = counted("unlink", original_unlink), counted("mkdir", original_mkdir)
        storage_module._WriteAll.write = counted("write", original_write)
        storage_module.open = open_counted
        try:
            yield self
        finally:
            os.fsync, os.replace, os.open = originals["fsync"], originals["replace"], originals["open"]
            Path.unlink, Path.mkdir = original_unlink, original_mkdir
            storage_module._WriteAll.write = original_write
            del storage_module.open


def prepare(directory: Path) -> SnapshotStore:
    """A directory holding the snapshots of steps 1 and 2."""
    store = SnapshotStore(directory, keep_last=KEEP_LAST, retry=NO_RETRY)
    for step in (1, 2):
        store.write(step, 0, step, snapshot_bytes(step))
    return store


def _streamed(store: SnapshotStore) -> None:
    snapshot = make_snapshot(3)
    store.write_stream(3, 0, 3, lambda file: write_snapshot(snapshot, file))


WORKLOAD: list[tuple[int, Callable[[SnapshotStore], object]]] = [
    (3, _streamed),  # the writer's path: streamed, hashed on the way
    (4, lambda store: store.write(4, 0, 4, snapshot_bytes(4))),  # a replica or a peer's snapshot
    (4, lambda store: store.write(4, 0, 4, snapshot_bytes(4, incarnation=2))),  # a rewrite of a listed step
    (5, lambda store: store.write(5, 0, 5, snapshot_bytes(5))),  # prunes beyond keep_last
]


def run_workload(store: SnapshotStore, acknowledged: Callable[[int], None]) -> list[str]:
    """Play WORKLOAD; `acknowledged(step)` after each operation that returned (durable); the errors."""
    errors = []
    for step, operation in WORKLOAD:
        try:
            operation(store)
        except Exception as exc:  # noqa: BLE001 - the injected failure, reported by the store
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        acknowledged(step)
    return errors


def check_directory(directory: Path, acknowledged: list[int]) -> int:
    """What must hold after any failure: every listed snapshot verifies and loads, the newest one
    is at least the newest acknowledged step (nothing acknowledged was lost), and it is never
    older than the newest snapshot the directory held before (step 2). Returns the newest step."""
    store = SnapshotStore(directory, keep_last=KEEP_LAST)
    for entry in store.manifest_entries():
        snapshot_from_bytes(store.read_verified(entry), entry.file)  # raises if a listed file was lost
    found = store.latest_valid()
    assert found is not None, "no snapshot left"
    entry, data = found
    assert snapshot_from_bytes(data, entry.file).global_step == entry.global_step
    assert entry.global_step >= max([2, *acknowledged]), (entry.global_step, acknowledged)
    return entry.global_step


def leftovers(directory: Path) -> list[str]:
    """Temporary files, and snapshot files that no index lists."""
    listed = {e.file for e in SnapshotStore(directory).index().entries}
    return sorted(name for name in os.listdir(directory)
                  if TEMPORARY_PATTERN.match(name) or (SNAPSHOT_PATTERN.match(name) and name not in listed))


def count_points(directory: Path) -> list[str]:
    """The counted calls of one clean run of WORKLOAD on a fresh directory."""
    store = prepare(directory)
    with Injector().installed() as injector:
        run_workload(store, lambda step: None)
    return injector.calls
