"""The snapshot store: atomic writes, verified loads, pruning, and failures that lose nothing."""

from __future__ import annotations

import errno
import json
import os

import pytest

from elastic_ddp.snapshot.storage import LocalDirectoryStorage
from elastic_ddp.snapshot.store import (
    MANIFEST_NAME,
    CheckpointStore,
    RetryPolicy,
    SnapshotWriteError,
    snapshot_file_name,
)


def write(store: CheckpointStore, step: int) -> bytes:
    data = f"snapshot of step {step}".encode() * 100
    store.write(step, epoch=0, samples_consumed=step, data=data)
    return data


def test_the_newest_snapshot_is_found_and_verified(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    write(store, 1)
    newest = write(store, 2)
    entry, data = store.latest_valid()
    assert (entry.global_step, data) == (2, newest)


def test_a_truncated_newest_file_is_skipped_for_the_previous_one(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=3)
    previous = write(store, 1)
    write(store, 2)
    path = tmp_path / snapshot_file_name(2)
    path.write_bytes(path.read_bytes()[:100])
    entry, data = store.latest_valid()
    assert (entry.global_step, data) == (1, previous)
    assert f"{path}: 100 bytes" in caplog.text


def test_a_checksum_failure_is_skipped_for_the_previous_one(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=3)
    write(store, 1)
    write(store, 2)
    path = tmp_path / snapshot_file_name(2)
    corrupted = bytearray(path.read_bytes())
    corrupted[10] ^= 0xFF
    path.write_bytes(bytes(corrupted))
    assert store.latest_valid()[0].global_step == 1
    assert f"{path}: sha256" in caplog.text and "does not match the manifest" in caplog.text


def test_a_manifest_pointing_at_a_missing_file_falls_back_and_nothing_valid_means_none(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=2)
    previous = write(store, 1)
    write(store, 2)
    (tmp_path / snapshot_file_name(2)).unlink()
    assert store.latest_valid() == (store.manifest_entries()[0], previous)
    assert f"{tmp_path / snapshot_file_name(2)}: cannot be read (No such file or directory)" in caplog.text
    (tmp_path / snapshot_file_name(1)).unlink()
    assert store.latest_valid() is None


def test_a_file_the_manifest_does_not_list_is_not_trusted(tmp_path):
    store = CheckpointStore(tmp_path)
    (tmp_path / snapshot_file_name(5)).write_bytes(b"complete-looking but unverified")
    assert store.latest_valid() is None


def test_keep_last_prunes_only_after_the_new_snapshot_is_durable(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        write(store, step)
    assert sorted(p.name for p in tmp_path.glob("snapshot-*")) == [snapshot_file_name(2), snapshot_file_name(3)]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [e["global_step"] for e in manifest["snapshots"]] == [2, 3]


def test_temporary_files_of_a_killed_writer_are_removed_by_the_next_write(tmp_path):
    store = CheckpointStore(tmp_path)
    write(store, 1)
    leftover = tmp_path / f".{snapshot_file_name(2)}.tmp-12345"
    leftover.write_bytes(b"half a snapshot")
    assert store.latest_valid()[0].global_step == 1, "readers never look at temporary files"
    write(store, 3)
    assert not leftover.exists()
    assert store.latest_valid()[0].global_step == 3


def test_a_failed_write_raises_and_leaves_the_previous_snapshot_and_manifest(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last=2)
    good = write(store, 1)
    manifest_before = (tmp_path / "manifest.json").read_bytes()

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(SnapshotWriteError, match="No space left on device.*previous snapshots are intact"):
        write(store, 2)
    monkeypatch.undo()
    assert (tmp_path / "manifest.json").read_bytes() == manifest_before
    assert store.latest_valid()[1] == good
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "partial files must be cleaned up"


def test_a_failed_manifest_write_removes_the_snapshot_file_it_was_to_list(tmp_path, monkeypatch):
    """On a full disk the orphan's space is what the next write needs; unlisted, it was never trusted."""
    store = CheckpointStore(tmp_path, keep_last=2)
    good = write(store, 1)
    original = LocalDirectoryStorage.write_atomically

    def write_atomically(self, name, data):
        if name == MANIFEST_NAME:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, name, data)

    monkeypatch.setattr(LocalDirectoryStorage, "write_atomically", write_atomically)
    with pytest.raises(SnapshotWriteError, match="No space left on device"):
        write(store, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        [MANIFEST_NAME, snapshot_file_name(1)]
    assert store.latest_valid()[1] == good


def test_transient_errors_are_retried_a_bounded_number_of_times(tmp_path, monkeypatch, caplog):
    store = CheckpointStore(tmp_path, retry=RetryPolicy(attempts=3, first_wait_s=0.01, max_wait_s=0.05))
    attempts = []

    def flaky(self, name, data):
        attempts.append(name)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(LocalDirectoryStorage, "write_atomically", flaky)
    with pytest.raises(SnapshotWriteError, match="Input/output error"):
        write(store, 1)
    assert attempts == [snapshot_file_name(1)] * 3
    assert "retrying in" in caplog.text and "(attempt 3 of 3)" in caplog.text


def test_an_unreadable_manifest_trusts_nothing_and_deletes_nothing(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    write(store, 1)
    write(store, 2)
    (tmp_path / "manifest.json").write_text("{not json")
    assert store.latest_valid() is None
    write(store, 3)
    assert (tmp_path / snapshot_file_name(1)).exists() and (tmp_path / snapshot_file_name(2)).exists()
    assert store.latest_valid()[0].global_step == 3


def test_keep_last_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_last: got 1; expected at least 2"):
        CheckpointStore(tmp_path, keep_last=1)
