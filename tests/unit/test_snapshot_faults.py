"""Snapshot writes under pressure, with real training: a slow disk, transient I/O errors, errors that
do not heal, and a full disk (injected). Training must go on, the failure must be loud, the last
good snapshot must stay intact and nothing half-written may be left behind.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot import background_writer
from elastic_ddp.snapshot.background_writer import SnapshotWriter
from elastic_ddp.snapshot.files.backends import LocalDirectoryStorage
from elastic_ddp.snapshot.files.manifest import SNAPSHOT_PATTERN
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.disk import run_through_a_full_disk
from tests.support.snapshots import make_snapshot, snapshot_bytes
from tests.support.training import make_trainer, small_config

# ------------------------------------------------------------------ the next snapshot point arrives


class GatedStorage(LocalDirectoryStorage):
    """A local directory whose snapshot-file writes wait until `gate` opens (a slow disk)."""

    def __init__(self, directory):
        super().__init__(directory)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def write_stream_atomically(self, name, produce):
        if SNAPSHOT_PATTERN.match(name):
            self.writing.set()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        super().write_stream_atomically(name, produce)


def tiny_snapshot(step: int, staging):
    weights = staging.copy({"w": torch.full((256,), float(step))}, "model")
    return make_snapshot(step, model=weights)


def test_a_snapshot_point_during_a_write_waits_for_it_and_skips_nothing(tmp_path):
    storage = GatedStorage(tmp_path)
    writer = SnapshotWriter(SnapshotStore(storage))
    captured: list[int] = []

    def capture(step):
        def build(staging):
            captured.append(step)
            return tiny_snapshot(step, staging)
        return build

    first = threading.Thread(target=writer.submit, args=(capture(1),))
    first.start()
    first.join(timeout=30)
    assert not first.is_alive(), "submit must return while the disk is still busy"
    assert storage.writing.wait(timeout=30)

    blocked: list[float] = []
    second = threading.Thread(target=lambda: blocked.append(writer.submit(capture(2))))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive(), "the second snapshot point must wait for the write in flight"
    assert captured == [1], "and must not overwrite the staging buffers the first write still reads"

    storage.gate.set()
    second.join(timeout=30)
    writer.close()
    assert captured == [1, 2] and blocked and blocked[0] >= 0.5
    assert [e.global_step for e in writer.store.manifest_entries()] == [1, 2]
    assert writer.failed_writes == 0
    assert load_snapshot(tmp_path)["model"]["w"][0].item() == 2.0  # step 2's copy, not step 1's


def test_a_later_writer_copies_into_the_staging_of_one_no_write_reads(tmp_path):
    """`staging_to_reuse`: an in-process re-form's next writer copies into the last one's buffers
    (warm pages), but never while a write still reads them."""
    storage = GatedStorage(tmp_path)
    writer = SnapshotWriter(SnapshotStore(storage))
    writer.submit(lambda staging: tiny_snapshot(1, staging))
    assert storage.writing.wait(timeout=30)
    assert writer.staging_to_reuse() is None  # the write in flight reads them
    storage.gate.set()
    assert writer.close() is True
    staging = writer.staging_to_reuse()
    first_buffer = staging._buffers[("model", "w")]
    later = SnapshotWriter(SnapshotStore(storage), staging=staging)
    later.submit(lambda staging: tiny_snapshot(2, staging))
    assert later.close() is True
    assert staging._buffers[("model", "w")] is first_buffer  # the same pages, step 2's copy in them
    assert load_snapshot(tmp_path)["model"]["w"][0].item() == 2.0


def test_hung_storage_skips_a_snapshot_point_instead_of_blocking_training_and_close_is_bounded(tmp_path, caplog):
    storage = GatedStorage(tmp_path)  # a hard NFS mount that stopped answering: the gate never opens
    failures: list[tuple[int, str]] = []
    writer = SnapshotWriter(SnapshotStore(storage), on_failed=lambda step, why: failures.append((step, why)),
                            write_timeout_s=0.5)
    writer.submit(lambda staging: tiny_snapshot(1, staging))
    assert storage.writing.wait(timeout=30)
    captured: list[int] = []
    blocked = writer.submit(lambda staging: captured.append(2) or tiny_snapshot(2, staging))
    assert 0.3 <= blocked < 10 and captured == []  # until the write has run 0.5 s
    [(step, why)] = failures
    assert step == 1 and why.startswith("the write of step 1 is still running after ")
    assert why.endswith(" s (storage hung?); this snapshot point is skipped")
    assert writer.close(timeout=0.2) is False and "still running after 0 s (storage hung?)" in caplog.text
    storage.gate.set()  # (lets the daemon thread end)


def test_with_hung_storage_a_snapshot_point_waits_a_short_bound_once_then_not_at_all(tmp_path, monkeypatch):
    """--snapshot_timeout_s at its default (600 s): a snapshot point gives up on a hung write after
    POINT_WAIT_S, and the next ones skip at once while that write hangs: training never stalls for
    minutes. Before, every snapshot point waited the full 600 s."""
    monkeypatch.setattr(background_writer, "POINT_WAIT_S", 0.3, raising=False)
    storage = GatedStorage(tmp_path)  # the gate never opens while the test looks
    failures: list[tuple[int, str]] = []
    writer = SnapshotWriter(SnapshotStore(storage), on_failed=lambda step, why: failures.append((step, why)))
    writer.submit(lambda staging: tiny_snapshot(1, staging))
    assert storage.writing.wait(timeout=30)
    blocked: list[float] = []
    second = threading.Thread(target=lambda: blocked.append(writer.submit(lambda staging: tiny_snapshot(2, staging))),
                              daemon=True)
    second.start()
    second.join(timeout=10)
    assert not second.is_alive(), "a snapshot point waited for a hung write for longer than 10 s"
    assert 0.3 <= blocked[0] < 5
    assert writer.submit(lambda staging: tiny_snapshot(3, staging)) < 0.1, "and the next one waits no more"
    assert [step for step, _ in failures] == [1, 1] and writer.failed_writes == 2
    assert all("(storage hung?)" in why and "this snapshot point is skipped" in why for _, why in failures)
    storage.gate.set()
    assert writer.close(timeout=30)
    assert writer.submit(lambda staging: tiny_snapshot(4, staging)) < 5 and writer.close(timeout=30)
    assert [e.global_step for e in writer.store.manifest_entries()] == [1, 4]


def test_the_final_snapshot_still_waits_for_a_slow_write_up_to_the_write_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(background_writer, "POINT_WAIT_S", 0.2, raising=False)
    storage = GatedStorage(tmp_path)
    writer = SnapshotWriter(SnapshotStore(storage), write_timeout_s=30)
    writer.submit(lambda staging: tiny_snapshot(1, staging))
    assert storage.writing.wait(timeout=30)
    writer.submit(lambda staging: tiny_snapshot(2, staging))  # skipped after 0.2 s
    threading.Timer(1.0, storage.gate.set).start()  # the disk was only slow
    blocked = writer.submit(lambda staging: tiny_snapshot(3, staging), final=True)
    assert 0.5 < blocked < 20 and writer.close(timeout=30)
    assert [e.global_step for e in writer.store.manifest_entries()] == [1, 3]


def test_training_on_hung_storage_goes_on_at_full_speed_and_says_which_snapshots_it_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(background_writer, "POINT_WAIT_S", 0.3)
    config = small_config(tmp_path, epochs=1, snapshot_every_steps=1, snapshot_timeout_s=1)  # 6 steps
    hung = threading.Event()
    original = LocalDirectoryStorage.write_stream_atomically

    def write_stream_atomically(self, name, produce):
        match = SNAPSHOT_PATTERN.match(name)
        if match and int(match.group(1)) >= 2:
            hung.wait(timeout=60)  # the mount stopped answering
        original(self, name, produce)

    monkeypatch.setattr(LocalDirectoryStorage, "write_stream_atomically", write_stream_atomically)
    try:
        make_trainer(config).fit()
    finally:
        hung.set()
    blocked = [e["blocked_seconds"] for e in snapshot_events(config, "snapshot_captured")]
    assert len(blocked) == 6 and sum(blocked) < 2, blocked  # one wait of 0.3 s in all (step 3's)
    failed = snapshot_events(config, "snapshot_failed")
    assert [e["global_step"] for e in failed] == [3, 4, 5, 6]
    assert all("the write of step 2 is still running" in e["error"] for e in failed)


def test_a_diverged_state_is_never_saved_and_the_last_finite_snapshot_stays(tmp_path, caplog):
    config = small_config(tmp_path, epochs=2, keep_last=2)  # snapshots at 4, 6 (epoch end), 8, 12

    def diverge(trainer):
        if trainer.global_step == 7:
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))

    trainer = make_trainer(config, after_step=diverge)
    trainer.fit()
    failed = snapshot_events(config, "snapshot_failed")
    assert [e["global_step"] for e in failed] == [8, 12]
    assert "non-finite values (NaN or infinity) in model.net.1.weight" in failed[0]["error"]
    assert "the run has diverged" in caplog.text
    assert [e.global_step for e in SnapshotStore(config.checkpoint_dir).manifest_entries()] == [4, 6]
    assert load_snapshot(config.checkpoint_dir)["global_step"] == 6


def test_a_synchronous_writer_returns_only_when_the_snapshot_is_durable(tmp_path):
    writer = SnapshotWriter(SnapshotStore(tmp_path), asynchronous=False)
    writer.submit(lambda staging: tiny_snapshot(7, staging))
    assert writer.last_written is not None and writer.last_written.global_step == 7
    writer.close()


# ------------------------------------------------------------------------------ I/O errors


def fail_snapshot_writes(monkeypatch, steps: set[int], error: int, times: int | None):
    """Make the writes of these steps' snapshot files fail `times` times (None: always)."""
    original = LocalDirectoryStorage.write_stream_atomically
    failures: dict[int, int] = {}

    def write_stream_atomically(self, name, produce):
        match = SNAPSHOT_PATTERN.match(name)
        step = int(match.group(1)) if match else None
        if step in steps and (times is None or failures.get(step, 0) < times):
            failures[step] = failures.get(step, 0) + 1
            raise OSError(error, os.strerror(error), str(self.directory / name))
        original(self, name, produce)

    monkeypatch.setattr(LocalDirectoryStorage, "write_stream_atomically", write_stream_atomically)
    return failures


def snapshot_events(config, kind: str) -> list[dict]:
    return [e for e in read_events(os.path.join(config.checkpoint_dir, "events.jsonl")) if e["event"] == kind]


def test_transient_write_errors_are_retried_and_the_snapshot_lands(tmp_path, monkeypatch, caplog):
    config = small_config(tmp_path, epochs=1)
    failures = fail_snapshot_writes(monkeypatch, {4}, errno.EIO, times=2)
    trainer = make_trainer(config)
    trainer.fit()
    assert failures == {4: 2}
    assert caplog.text.count("retrying in") == 2
    assert 4 in [e["global_step"] for e in snapshot_events(config, "snapshot")]
    assert trainer.run.snapshots.writer.failed_writes == 0 and not snapshot_events(config, "snapshot_failed")


def test_a_write_that_keeps_failing_is_reported_and_training_goes_on(tmp_path, monkeypatch, caplog):
    config = small_config(tmp_path, epochs=2)  # 12 steps, snapshots at 4, 6 (epoch end), 8, 12
    failures = fail_snapshot_writes(monkeypatch, {8}, errno.EIO, times=None)
    trainer = make_trainer(config)
    trainer.fit()
    assert failures == {8: 4}, "bounded retries: 4 attempts in all"
    assert trainer.global_step == 12 and trainer.run.snapshots.writer.failed_writes == 1
    [failed] = snapshot_events(config, "snapshot_failed")
    assert failed["global_step"] == 8 and "Input/output error" in failed["error"]
    assert "SNAPSHOT NOT SAVED (step 8)" in caplog.text and "listed snapshots are intact" in caplog.text
    assert [e.global_step for e in SnapshotStore(config.checkpoint_dir).manifest_entries()] == [4, 6, 12]
    assert load_snapshot(config.checkpoint_dir)["global_step"] == 12


# ------------------------------------------------------------------------------ a full disk (injected)


@pytest.mark.timeout(120)
def test_a_full_disk_injected(tmp_path, monkeypatch, caplog):
    """ENOSPC from fsync, after the data was written: the temporary file exists and must go."""
    config = small_config(tmp_path, epochs=3, dataset_size=160, snapshot_every_steps=3, keep_last=2)
    full = threading.Event()
    real_fsync = os.fsync

    def fsync(descriptor):
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    run_through_a_full_disk(config, full.set, full.clear, caplog)
    newest = SnapshotStore(tmp_path / "ck").manifest_entries()[-1]
    assert newest.global_step == 30 and (tmp_path / "ck" / newest.file).exists()



class ChunkGatedStorage(LocalDirectoryStorage):
    """A local directory whose snapshot-file writes pause in their first chunk until `gate` opens."""

    def __init__(self, directory):
        super().__init__(directory)
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.bytes_written = 0  # into snapshot files

    def write_stream_atomically(self, name, produce):
        if not SNAPSHOT_PATTERN.match(name):
            return super().write_stream_atomically(name, produce)

        def slow(file):
            class Paused:
                def __init__(self):
                    self.chunks = 0

                def write(inner, data):
                    inner.chunks += 1
                    if inner.chunks == 1:
                        self.writing.set()
                        assert self.gate.wait(timeout=60), "the test never opened the gate"
                    self.bytes_written += memoryview(data).nbytes
                    return file.write(data)

                def flush(inner):
                    file.flush()

            return produce(Paused())

        return super().write_stream_atomically(name, slow)


@pytest.mark.timeout(120)
def test_a_snapshot_point_stops_the_write_of_a_restored_state_and_writes_its_newer_one(tmp_path, caplog):
    """The first snapshot after a restore from memory or a peer waited for the whole write of the
    restored state (3-4.7 s at 1 GB): its newer state supersedes that write, which stops between
    two chunks, lists nothing and leaves no file behind."""
    storage = ChunkGatedStorage(tmp_path)
    failures: list = []
    writer = SnapshotWriter(SnapshotStore(storage), on_failed=lambda step, why: failures.append((step, why)))
    restored = snapshot_bytes(1, model={"w": torch.zeros(6 * 2**20)})  # 24 MB: two chunks
    writer.submit_serialized(1, 0, 1, restored)
    assert storage.writing.wait(timeout=30)

    threading.Timer(0.3, storage.gate.set).start()  # the chunk in flight ends; the next is not written
    with caplog.at_level(logging.INFO):
        blocked = writer.submit(lambda staging: tiny_snapshot(2, staging))
    assert writer.close(timeout=30) and failures == [] and writer.failed_writes == 0
    assert blocked < 10
    assert [e.global_step for e in writer.store.manifest_entries()] == [2]
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []
    assert "the write of the restored state of step 1 stopped: a newer snapshot is being taken" in caplog.text


@pytest.mark.timeout(120)
def test_a_writer_closed_for_a_re_form_stops_its_write_and_keeps_the_listed_snapshot(tmp_path, caplog):
    """`close(superseded=True)` (an in-process re-form, whose next group snapshots at once) does not
    wait for the whole write in flight (0.5-3.4 s at 1 GB): the write stops at its next chunk, lists
    nothing and leaves no file behind; the snapshot listed before stays, and the staging is free for
    the next writer."""
    storage = ChunkGatedStorage(tmp_path)
    storage.gate.set()
    failures: list = []
    writer = SnapshotWriter(SnapshotStore(storage), on_failed=lambda step, why: failures.append((step, why)))
    writer.submit(lambda staging: tiny_snapshot(1, staging))
    assert writer.wait(timeout=30)
    storage.gate.clear()
    storage.writing.clear()
    storage.bytes_written = 0
    large = torch.ones(12 * 2**20)  # 48 MB: three of serialization.STOP_CHECK_BYTES
    writer.submit(lambda staging: make_snapshot(2, model=staging.copy({"w": large}, "model")))
    assert storage.writing.wait(timeout=30)

    closed: list[bool] = []
    closing = threading.Thread(target=lambda: closed.append(writer.close(timeout=30, superseded=True)))
    with caplog.at_level(logging.INFO):
        closing.start()
        deadline = time.monotonic() + 30
        while not writer._in_flight.stop.is_set():  # the stop is asked before the paused chunk ends
            assert time.monotonic() < deadline, "close(superseded=True) never asked the write to stop"
            time.sleep(0.01)
        storage.gate.set()
        closing.join(timeout=60)
    assert closed == [True] and failures == [] and writer.failed_writes == 0
    assert storage.bytes_written < large.nbytes / 2  # stopped, not written to its end
    assert [e.global_step for e in writer.store.manifest_entries()] == [1]
    assert load_snapshot(tmp_path)["model"]["w"][0].item() == 1.0
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []
    assert "the write of the snapshot of step 2 stopped: the next group snapshots a newer state at once" \
        in caplog.text
    assert writer.staging_to_reuse() is not None
