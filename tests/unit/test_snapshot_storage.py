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
from elastic_ddp.snapshot.storage import FsspecStorage, LocalDirectoryStorage, open_storage
from elastic_ddp.snapshot.store import MANIFEST_NAME, CheckpointStore, SnapshotWriteError, snapshot_file_name
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


def write(store: CheckpointStore, step: int) -> bytes:
    data = f"snapshot of step {step}".encode() * 1000
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
    store = CheckpointStore(fsspec_storage, keep_last=2)
    for step in (1, 2, 3):
        newest = write(store, step)
    assert puts == [snapshot_file_name(1), MANIFEST_NAME, snapshot_file_name(2), MANIFEST_NAME,
                    snapshot_file_name(3), MANIFEST_NAME]
    assert sorted(fsspec_storage.list_names()) == [MANIFEST_NAME, snapshot_file_name(2), snapshot_file_name(3)]
    entry, data = store.latest_valid()
    assert (entry.global_step, data) == (3, newest)


def test_a_corrupt_object_is_skipped_for_the_previous_one(fsspec_storage, caplog):
    store = CheckpointStore(fsspec_storage, keep_last=3)
    previous = write(store, 1)
    write(store, 2)
    fsspec_storage.fs.pipe_file(fsspec_storage._path(snapshot_file_name(2)), b"bit rot")
    assert store.latest_valid() == (store.manifest_entries()[0], previous)
    assert f"{fsspec_storage.describe(snapshot_file_name(2))}: 7 bytes, the manifest says" in caplog.text


def test_a_failed_manifest_put_leaves_the_previous_state_and_no_orphan(fsspec_storage, monkeypatch):
    store = CheckpointStore(fsspec_storage, keep_last=3)
    good = write(store, 1)
    original = fsspec_storage.fs.pipe_file

    def pipe_file(path, data, **kwargs):
        if path.endswith(MANIFEST_NAME):
            raise PermissionError(errno.EACCES, "Access Denied")
        return original(path, data, **kwargs)

    monkeypatch.setattr(fsspec_storage.fs, "pipe_file", pipe_file)
    with pytest.raises(SnapshotWriteError, match="Access Denied.*previous snapshots are intact"):
        write(store, 2)
    monkeypatch.undo()
    assert store.latest_valid()[1] == good
    assert snapshot_file_name(2) not in fsspec_storage.list_names()


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
