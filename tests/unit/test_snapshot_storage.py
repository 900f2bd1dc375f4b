"""Snapshots beyond a local disk: the store on fsspec URLs (memory:// and the local filesystem through
fsspec), written with one put per file, verified and pruned like on a local directory."""

from __future__ import annotations

import errno
import importlib.util
import os
import uuid

import fsspec
import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.config import TrainingConfig
from elastic_ddp.snapshot.files.backends import FsspecStorage, LocalDirectoryStorage, open_storage
from elastic_ddp.snapshot.files.errors import SnapshotWriteError
from elastic_ddp.snapshot.files.manifest import MANIFEST_NAME, SNAPSHOT_PATTERN
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.snapshots import snapshot_bytes
from tests.support.training import Crash, crash_at, make_trainer, small_config


@pytest.fixture
def memory_url():
    url = f"memory://elastic-ddp-test-{uuid.uuid4().hex}"
    yield url
    memory = fsspec.filesystem("memory")
    root = url.split("://", 1)[1]
    if memory.exists(root):
        memory.rm(root, recursive=True)


@pytest.fixture(params=["memory", "local-through-fsspec"])
def fsspec_storage(request, memory_url, tmp_path) -> FsspecStorage:
    url = memory_url if request.param == "memory" else f"file://{tmp_path / 'store'}"
    return FsspecStorage(url)


def write(store: SnapshotStore, step: int) -> bytes:
    data = snapshot_bytes(step)
    store.write(step, epoch=0, samples_consumed=step, data=data)
    return data


def test_urls_choose_the_storage_and_its_atomic_primitive(tmp_path, memory_url):
    assert isinstance(open_storage(tmp_path), LocalDirectoryStorage)
    local = open_storage(f"file://{tmp_path}")  # rename is the local filesystem's atomic primitive
    assert isinstance(local, LocalDirectoryStorage) and local.directory == tmp_path
    assert isinstance(open_storage(memory_url), FsspecStorage)


def test_a_url_that_cannot_be_used_fails_at_configuration_time():
    with pytest.raises(ValueError, match=r"--checkpoint_dir: got 'nosuch://bucket/run'; expected .*Protocol not known"):
        TrainingConfig(checkpoint_dir="nosuch://bucket/run")


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed here")
def test_an_object_store_without_its_driver_names_the_package():
    with pytest.raises(ValueError, match="s3fs"):
        TrainingConfig(checkpoint_dir="s3://bucket/run")


def test_snapshots_are_written_with_one_put_each_and_no_temporary_objects(fsspec_storage, monkeypatch):
    puts: list[str] = []
    original = fsspec_storage.fs.pipe_file

    def pipe_file(path, data, **kwargs):
        puts.append(path.rsplit("/", 1)[-1])
        return original(path, data, **kwargs)

    monkeypatch.setattr(fsspec_storage.fs, "pipe_file", pipe_file)
    store = SnapshotStore(fsspec_storage, keep_last=2)
    for step in (1, 2, 3):
        newest = write(store, step)
    assert [SNAPSHOT_PATTERN.sub(r"snapshot-\1", name) for name in puts] == [
        "snapshot-000000001", MANIFEST_NAME, "snapshot-000000002", MANIFEST_NAME, "snapshot-000000003", MANIFEST_NAME]
    listed = [entry.file for entry in store.manifest_entries()]
    assert sorted(fsspec_storage.list_names()) == sorted([MANIFEST_NAME, *listed]) and listed == puts[2::2]
    entry, data = store.latest_valid()
    assert (entry.global_step, data) == (3, newest)


def test_a_corrupt_object_is_skipped_for_the_previous_one(fsspec_storage, caplog):
    store = SnapshotStore(fsspec_storage, keep_last=3)
    previous = write(store, 1)
    write(store, 2)
    damaged = store.manifest_entries()[-1].file
    fsspec_storage.fs.pipe_file(fsspec_storage._path(damaged), b"bit rot")
    assert store.latest_valid() == (store.manifest_entries()[0], previous)
    assert f"{fsspec_storage.describe(damaged)}: 7 bytes, the index says" in caplog.text


def test_a_failed_manifest_put_leaves_the_previous_state_and_no_orphan(fsspec_storage, monkeypatch):
    store = SnapshotStore(fsspec_storage, keep_last=3)
    good = write(store, 1)
    original = fsspec_storage.fs.pipe_file

    def pipe_file(path, data, **kwargs):
        if path.endswith(MANIFEST_NAME):
            raise PermissionError(errno.EACCES, "Access Denied")
        return original(path, data, **kwargs)

    monkeypatch.setattr(fsspec_storage.fs, "pipe_file", pipe_file)
    with pytest.raises(SnapshotWriteError, match="Access Denied.*listed snapshots are intact"):
        write(store, 2)
    monkeypatch.undo()
    assert store.latest_valid()[1] == good
    assert not [name for name in fsspec_storage.list_names() if name.startswith("snapshot-000000002")]


def test_training_resumes_from_an_object_store_url(tmp_path, memory_url):
    """A crash, a rebuild from nothing, a restore from memory://: the run finishes where it should."""
    config = small_config(tmp_path, checkpoint_dir=memory_url, event_log=str(tmp_path / "events.jsonl"))
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(7)).fit()
    assert load_snapshot(memory_url)["global_step"] == 6
    resumed = make_trainer(config)
    resumed.fit()
    assert resumed.global_step == load_snapshot(memory_url)["global_step"] == config.epochs * config.steps_per_epoch
    assert os.path.exists(tmp_path / "events.jsonl")
