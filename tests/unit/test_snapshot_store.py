"""The snapshot store: atomic writes, verified loads, pruning, failures that lose nothing, and a
manifest that is only an index (untrusted input, rebuilt from the self-describing files)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from elastic_ddp.snapshot.files.backends import LocalDirectoryStorage
from elastic_ddp.snapshot.files.checksum import checksum_of
from elastic_ddp.snapshot.files.errors import SnapshotWriteError
from elastic_ddp.snapshot.files.manifest import MANIFEST_NAME
from elastic_ddp.snapshot.files.snapshot_store import RetryPolicy, SnapshotStore
from tests.support.snapshots import snapshot_bytes, v1_snapshot_bytes


def write(store: SnapshotStore, step: int) -> bytes:
    data = snapshot_bytes(step)
    store.write(step, epoch=0, samples_consumed=step, data=data)
    return data


def file_of(store: SnapshotStore, step: int):
    [entry] = [e for e in store.manifest_entries() if e.global_step == step]
    return store.storage.local_directory / entry.file


def snapshot_files(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("snapshot-*"))


def test_the_newest_snapshot_is_found_and_verified(tmp_path):
    store = SnapshotStore(tmp_path, keep_last=3)
    write(store, 1)
    newest = write(store, 2)
    entry, data = store.latest_valid()
    assert (entry.global_step, data) == (2, newest)
    assert entry.checksum.startswith("blake3:") and entry.size_bytes == len(newest)


def test_a_truncated_newest_file_is_skipped_for_the_previous_one(tmp_path, caplog):
    store = SnapshotStore(tmp_path, keep_last=3)
    previous = write(store, 1)
    write(store, 2)
    path = file_of(store, 2)
    path.write_bytes(path.read_bytes()[:100])
    entry, data = store.latest_valid()
    assert (entry.global_step, data) == (1, previous)
    assert f"{path}: 100 bytes" in caplog.text


def test_a_checksum_failure_is_skipped_for_the_previous_one(tmp_path, caplog):
    store = SnapshotStore(tmp_path, keep_last=3)
    write(store, 1)
    write(store, 2)
    path = file_of(store, 2)
    corrupted = bytearray(path.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0xFF
    path.write_bytes(bytes(corrupted))
    assert store.latest_valid()[0].global_step == 1
    assert f"{path}: blake3" in caplog.text and "(corrupt)" in caplog.text


def test_a_manifest_pointing_at_a_missing_file_falls_back_and_nothing_valid_means_none(tmp_path, caplog):
    store = SnapshotStore(tmp_path, keep_last=2)
    previous = write(store, 1)
    write(store, 2)
    missing = file_of(store, 2)
    missing.unlink()
    assert store.latest_valid() == (store.manifest_entries()[0], previous)
    assert f"{missing}: cannot be read (No such file or directory)" in caplog.text
    file_of(store, 1).unlink()
    assert store.latest_valid() is None


def test_keep_last_prunes_only_after_the_new_snapshot_is_durable(tmp_path):
    store = SnapshotStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        write(store, step)
    assert [e.global_step for e in store.manifest_entries()] == [2, 3]
    assert snapshot_files(tmp_path) == sorted(e.file for e in store.manifest_entries())


def test_temporary_files_of_a_killed_writer_are_removed_by_the_next_write(tmp_path):
    store = SnapshotStore(tmp_path)
    write(store, 1)
    leftover = tmp_path / ".snapshot-000000002-0badc0de.pt.tmp-12345"
    leftover.write_bytes(b"half a snapshot")
    assert store.latest_valid()[0].global_step == 1, "readers never look at temporary files"
    write(store, 3)
    assert not leftover.exists()
    assert store.latest_valid()[0].global_step == 3


def test_a_failed_write_raises_and_leaves_the_previous_snapshot_and_manifest(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path, keep_last=2)
    good = write(store, 1)
    manifest_before = (tmp_path / MANIFEST_NAME).read_bytes()

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(SnapshotWriteError, match="No space left on device.*listed snapshots are intact"):
        write(store, 2)
    monkeypatch.undo()
    assert (tmp_path / MANIFEST_NAME).read_bytes() == manifest_before
    assert store.latest_valid()[1] == good
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "partial files must be cleaned up"


def fail_manifest_writes(monkeypatch) -> None:
    original = LocalDirectoryStorage.write_atomically

    def write_atomically(self, name, data):
        if name == MANIFEST_NAME:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, name, data)

    monkeypatch.setattr(LocalDirectoryStorage, "write_atomically", write_atomically)


def test_a_failed_manifest_write_removes_the_snapshot_file_it_was_to_list(tmp_path, monkeypatch):
    """On a full disk the orphan's space is what the next write needs; unlisted, it was never trusted."""
    store = SnapshotStore(tmp_path, keep_last=2)
    good = write(store, 1)
    listed = snapshot_files(tmp_path)
    fail_manifest_writes(monkeypatch)
    with pytest.raises(SnapshotWriteError, match="No space left on device"):
        write(store, 2)
    assert snapshot_files(tmp_path) == listed
    assert store.latest_valid()[1] == good


def test_rewriting_a_listed_step_whose_manifest_write_fails_keeps_the_listed_file(tmp_path, monkeypatch):
    # The defect: the rewrite replaced the listed file of step 150, the manifest write failed, and
    # the cleanup deleted the only copy; restore fell to 100.
    store = SnapshotStore(tmp_path, keep_last=3)
    write(store, 100)
    good_150 = write(store, 150)
    fail_manifest_writes(monkeypatch)
    with pytest.raises(SnapshotWriteError):
        store.write(150, 0, 150, snapshot_bytes(150, incarnation=2))  # another copy of step 150
    monkeypatch.undo()
    assert store.latest_valid() == (store.manifest_entries()[-1], good_150)


def test_rewriting_a_listed_step_with_the_same_bytes_writes_nothing(tmp_path):
    store = SnapshotStore(tmp_path, keep_last=3)
    data = write(store, 7)
    before = snapshot_files(tmp_path), (tmp_path / MANIFEST_NAME).read_bytes()
    assert store.write(7, 0, 7, data).file == before[0][0]
    assert (snapshot_files(tmp_path), (tmp_path / MANIFEST_NAME).read_bytes()) == before


def test_rewriting_a_listed_step_with_other_bytes_replaces_it_after_the_manifest(tmp_path):
    store = SnapshotStore(tmp_path, keep_last=3)
    write(store, 7)
    newer = snapshot_bytes(7, incarnation=2)
    store.write(7, 0, 7, newer)
    assert store.latest_valid()[1] == newer and len(snapshot_files(tmp_path)) == 1


def test_transient_errors_are_retried_a_bounded_number_of_times(tmp_path, monkeypatch, caplog):
    store = SnapshotStore(tmp_path, retry=RetryPolicy(attempts=3, first_wait_s=0.01, max_wait_s=0.05))
    attempts = []

    def flaky(self, name, produce):
        attempts.append(name)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    # Every local write goes through it: a snapshot's bytes are hashed as they are written.
    monkeypatch.setattr(LocalDirectoryStorage, "write_stream_atomically", flaky)
    with pytest.raises(SnapshotWriteError, match="Input/output error"):
        write(store, 1)
    assert len(attempts) == 3 and all(name.startswith("snapshot-000000001-") for name in attempts)
    assert "retrying in" in caplog.text and "(attempt 3 of 3)" in caplog.text


def test_keep_last_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_last: got 1; expected at least 2"):
        SnapshotStore(tmp_path, keep_last=1)


# ------------------------------------------------------------------ the manifest is only an index

def test_a_torn_manifest_is_rebuilt_from_the_files_and_no_valid_file_is_lost(tmp_path, caplog):
    store = SnapshotStore(tmp_path, keep_last=2)
    write(store, 1)
    newest = write(store, 2)
    (tmp_path / MANIFEST_NAME).write_text('{"format": 2, "snapshots": [{"fi')  # a crash mid-PUT
    assert store.latest_valid()[1] == newest
    assert "the manifest is unusable; trying the 2 self-describing snapshot file(s) found instead" in caplog.text
    write(store, 3)  # the next write lists what the files say, then its own
    assert [e.global_step for e in store.manifest_entries()] == [2, 3]
    assert store.latest_valid()[0].global_step == 3


def test_a_manifest_that_lists_nothing_that_verifies_falls_back_to_the_files(tmp_path):
    store = SnapshotStore(tmp_path, keep_last=2)
    newest = write(store, 2)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": 2, "snapshots": [
        {"file": "snapshot-000000009-00000000.pt", "global_step": 9, "epoch": 0, "samples_consumed": 9,
         "checksum": checksum_of(b"x"), "size_bytes": 1, "created_unix": 0.0}]}))
    assert store.latest_valid()[1] == newest


@pytest.mark.parametrize("bad_entry, reason", [
    ({"file": "../../../../etc/hostname", "global_step": 99, "epoch": 0, "samples_consumed": 0,
      "checksum": "sha256:" + "0" * 64, "size_bytes": 10, "created_unix": 0.0}, "not a snapshot file name"),
    ({"file": "/dev/zero", "global_step": 99, "epoch": 0, "samples_consumed": 0,
      "checksum": "sha256:" + "0" * 64, "size_bytes": 10, "created_unix": 0.0}, "not a snapshot file name"),
    ({"file": "snapshot-000000099.pt", "global_step": "99", "epoch": 0, "samples_consumed": 0,
      "checksum": "sha256:" + "0" * 64, "size_bytes": 10, "created_unix": 0.0}, "global_step"),
    ({"file": "snapshot-000000099.pt", "global_step": 99.5, "epoch": 0, "samples_consumed": 0,
      "checksum": "sha256:" + "0" * 64, "size_bytes": 10, "created_unix": 0.0}, "global_step"),
    ({"file": "snapshot-000000099.pt", "global_step": 98, "epoch": 0, "samples_consumed": 0,
      "checksum": "sha256:" + "0" * 64, "size_bytes": 10, "created_unix": 0.0}, "listed with global_step 98"),
    ({"file": "snapshot-000000099.pt", "global_step": 99, "epoch": 0, "samples_consumed": 0,
      "checksum": "md5:abc", "size_bytes": 10, "created_unix": 0.0}, "not a checksum"),
    ("snapshot-000000099.pt", "not an object"),
])
def test_a_bad_manifest_entry_is_ignored_and_the_good_ones_count(tmp_path, caplog, bad_entry, reason):
    store = SnapshotStore(tmp_path, keep_last=3)
    good = write(store, 5)
    document = json.loads((tmp_path / MANIFEST_NAME).read_text())
    document["snapshots"].append(bad_entry)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(document))
    assert store.latest_valid()[1] == good
    assert reason in caplog.text


def test_a_listed_file_is_read_no_further_than_its_announced_size(tmp_path, caplog):
    store = SnapshotStore(tmp_path, keep_last=3)
    good = write(store, 1)
    endless = tmp_path / "snapshot-000000002-0000beef.pt"
    endless.symlink_to("/dev/zero")
    document = json.loads((tmp_path / MANIFEST_NAME).read_text())
    document["snapshots"].append({"file": endless.name, "global_step": 2, "epoch": 0, "samples_consumed": 2,
                                  "checksum": "sha256:" + "0" * 64, "size_bytes": 1000, "created_unix": 0.0})
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(document))
    assert store.latest_valid()[1] == good
    assert "more than bytes, the index says 1000" in caplog.text


def test_format_1_files_still_load_with_their_manifest_and_are_skipped_without_it(tmp_path, caplog):
    data = v1_snapshot_bytes(4)
    (tmp_path / "snapshot-000000004.pt").write_bytes(data)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": 1, "snapshots": [
        {"file": "snapshot-000000004.pt", "global_step": 4, "epoch": 0, "samples_consumed": 4,
         "sha256": checksum_of(data, "sha256").split(":")[1], "size_bytes": len(data), "created_unix": 0.0}]}))
    store = SnapshotStore(tmp_path)
    assert store.latest_valid()[1] == data
    (tmp_path / MANIFEST_NAME).unlink()
    assert store.latest_valid() is None
    assert "not a self-describing (format 2) snapshot" in caplog.text
    assert (tmp_path / "snapshot-000000004.pt").exists()


@pytest.mark.parametrize("manifest", ["torn", "missing"])
def test_a_format_1_file_that_no_index_lists_is_never_pruned(tmp_path, manifest):
    old = tmp_path / "snapshot-000000004.pt"
    old.write_bytes(v1_snapshot_bytes(4))
    store = SnapshotStore(tmp_path, keep_last=2)
    write(store, 5)
    if manifest == "torn":
        (tmp_path / MANIFEST_NAME).write_text('{"format": 2, "snapshots": [{"fi')
    else:
        (tmp_path / MANIFEST_NAME).unlink()
    for step in (6, 7, 8):  # past a rebuilt index, then readable manifests that never listed it
        write(store, step)
    assert old.exists()
    assert [e.global_step for e in store.manifest_entries()] == [7, 8]


def test_a_format_1_file_that_keep_last_drops_from_a_readable_manifest_is_pruned(tmp_path):
    data = v1_snapshot_bytes(4)
    (tmp_path / "snapshot-000000004.pt").write_bytes(data)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": 1, "snapshots": [
        {"file": "snapshot-000000004.pt", "global_step": 4, "epoch": 0, "samples_consumed": 4,
         "sha256": checksum_of(data, "sha256").split(":")[1], "size_bytes": len(data), "created_unix": 0.0}]}))
    store = SnapshotStore(tmp_path, keep_last=2)
    write(store, 5)
    write(store, 6)
    assert not (tmp_path / "snapshot-000000004.pt").exists()


@pytest.mark.timeout(60)
def test_bytes_that_do_not_match_their_checksum_are_refused_as_they_are_written_and_nothing_is_lost(tmp_path):
    """A restored state's bytes are hashed while they go to disk (one pass, no check before): a
    damaged one is refused, its temporary file removed, and the listed snapshots stay as they were."""
    store = SnapshotStore(tmp_path, keep_last=2)
    good = write(store, 1)
    manifest_before = (tmp_path / MANIFEST_NAME).read_bytes()
    damaged = bytearray(snapshot_bytes(2))
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(SnapshotWriteError, match="refused to store it: .*does not match its own"):
        store.write(2, epoch=0, samples_consumed=2, data=bytes(damaged))
    assert (tmp_path / MANIFEST_NAME).read_bytes() == manifest_before
    assert store.latest_valid()[1] == good and len(snapshot_files(tmp_path)) == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "the damaged bytes must not stay behind"


def test_bytes_are_hashed_once_on_their_way_to_a_local_disk(tmp_path, monkeypatch):
    from elastic_ddp.snapshot.files import file_layout

    data = snapshot_bytes(3)
    hashed: list[int] = []
    real = file_layout.new_hasher

    class CountingHasher:
        def __init__(self, *args, **kwargs):
            self.hasher = real(*args, **kwargs)

        def update(self, chunk):
            hashed.append(memoryview(chunk).nbytes)
            self.hasher.update(chunk)

        def digest(self):
            return self.hasher.digest()

        def hexdigest(self):
            return self.hasher.hexdigest()

    monkeypatch.setattr(file_layout, "new_hasher", CountingHasher)
    store = SnapshotStore(tmp_path)
    store.write(3, epoch=0, samples_consumed=3, data=data)
    assert sum(hashed) == len(data) - file_layout.TRAILER_BYTES, "every byte before the trailer, once"
    assert store.latest_valid()[1] == data


def test_a_write_stopped_by_its_caller_lists_nothing_and_leaves_nothing(tmp_path):
    from elastic_ddp.snapshot.files.errors import WriteCancelled

    store = SnapshotStore(tmp_path)
    good = write(store, 1)
    manifest_before = (tmp_path / MANIFEST_NAME).read_bytes()
    with pytest.raises(WriteCancelled):
        store.write(2, epoch=0, samples_consumed=2, data=snapshot_bytes(2), cancelled=lambda: True)
    assert (tmp_path / MANIFEST_NAME).read_bytes() == manifest_before
    assert store.latest_valid()[1] == good and len(snapshot_files(tmp_path)) == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
