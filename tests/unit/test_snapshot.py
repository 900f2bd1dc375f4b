"""Snapshots load only as plain data, refuse foreign runs, and restore exactly."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.files.file_layout import TRAILER_BYTES, verify
from elastic_ddp.snapshot.files.errors import IncompatibleSnapshotError, SnapshotError
from elastic_ddp.snapshot.serialization import check_compatible, snapshot_from_bytes
from elastic_ddp.snapshot.staging import StagingBuffers
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.snapshots import make_snapshot
from tests.support.training import make_trainer, small_config


def test_a_trained_snapshot_loads_with_weights_only(tmp_path):
    config = small_config(tmp_path)
    make_trainer(config).fit()
    entry, data = SnapshotStore(config.checkpoint_dir).latest_valid()
    seal = verify(data, entry.file)  # a self-describing file: its own checksum matches
    payload = torch.load(io.BytesIO(data[seal.payload_start:-TRAILER_BYTES]), weights_only=True)
    assert payload["states"]["progress"]["global_step"] == config.epochs * config.steps_per_epoch
    assert seal.header.global_step == entry.global_step == config.epochs * config.steps_per_epoch
    public = load_snapshot(config.checkpoint_dir)
    assert {"model", "epoch", "global_step", "samples_consumed"} <= public.keys()
    assert public["epoch"] == config.epochs and public["samples_consumed"] == 0


class RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    buffer = io.BytesIO()
    torch.save({"format_version": 1, "payload": RunsCodeWhenUnpickled()}, buffer, pickle_module=pickle)
    with pytest.raises(SnapshotError, match="cannot be loaded safely with weights_only=True"):
        snapshot_from_bytes(buffer.getvalue(), "evil.pt")


def test_a_checksummed_but_unsafe_snapshot_is_skipped_for_the_previous_one(tmp_path):
    config = small_config(tmp_path, epochs=1)
    make_trainer(config).fit()
    store = SnapshotStore(config.checkpoint_dir, keep_last=3)
    good_step = store.latest_valid()[0].global_step
    buffer = io.BytesIO()
    torch.save({"format_version": 1, "payload": RunsCodeWhenUnpickled()}, buffer)
    store.write(good_step + 1, epoch=1, samples_consumed=0, data=buffer.getvalue())
    assert load_snapshot(config.checkpoint_dir)["global_step"] == good_step


def test_a_snapshot_from_another_model_is_refused_with_the_file_and_the_difference(tmp_path):
    make_trainer(small_config(tmp_path, model="mlp", epochs=1)).fit()
    other = make_trainer(small_config(tmp_path, model="mini_resnet", epochs=2))
    newest = rf"{tmp_path / 'ck'}/snapshot-000000006-[0-9a-f]{{8}}\.pt"
    with pytest.raises(IncompatibleSnapshotError, match=rf"{newest} was written by an incompatible run \(model: "):
        other.fit()
    assert load_snapshot(tmp_path / "ck")["epoch"] == 1, "the refused snapshot must stay"


def test_a_foreign_snapshot_newer_than_ours_is_skipped_for_our_previous_one(tmp_path, caplog):
    config = small_config(tmp_path, epochs=2, memory_copies=False)  # about the files alone
    with pytest.raises(Exception, match="stop"):
        make_trainer(config, after_step=stop_at(6)).fit()
    foreign = small_config(tmp_path / "other", epochs=2, seed=1)
    make_trainer(foreign).fit()
    _, foreign_bytes = SnapshotStore(foreign.checkpoint_dir).latest_valid()
    foreign_entry = SnapshotStore(config.checkpoint_dir).write(12, epoch=2, samples_consumed=0, data=foreign_bytes)

    trainer = make_trainer(config)
    trainer.fit()
    foreign_file = tmp_path / "ck" / foreign_entry.file
    assert f"skipping snapshot: {foreign_file} was written by an incompatible run (seed: snapshot has 1, " \
           "this run has 0)" in caplog.text
    restores = [e for e in read_events(tmp_path / "ck" / "events.jsonl") if e["event"] == "restore"]
    assert restores[-1]["global_step"] == 6 and restores[-1]["file"].startswith("snapshot-000000006-")
    assert trainer.global_step == config.epochs * config.steps_per_epoch


def stop_at(step: int):
    def after_step(trainer):
        if trainer.global_step == step:
            raise RuntimeError(f"stop at {step}")
    return after_step


def test_fingerprint_differences_are_all_named():
    snapshot = make_snapshot(1, fingerprint={"seed": 1, "dataset_size": 10})
    with pytest.raises(IncompatibleSnapshotError) as excinfo:
        check_compatible(snapshot, {"seed": 2, "dataset_size": 11}, "x.pt")
    assert "seed: snapshot has 1, this run has 2" in str(excinfo.value)
    assert "dataset_size: snapshot has 10, this run has 11" in str(excinfo.value)


def test_load_snapshot_on_a_directory_without_snapshots_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no valid elastic_ddp snapshot"):
        load_snapshot(tmp_path)


def test_staging_copies_are_independent_of_training_and_reuse_their_buffers():
    staging = StagingBuffers()
    state = {"w": torch.zeros(4), "groups": [{"lr": 0.1, "step": torch.tensor(3)}]}
    first = staging.copy(state, "model")
    state["w"].add_(1.0)
    state["groups"][0]["step"].add_(1)
    assert first["w"].tolist() == [0.0] * 4 and first["groups"][0]["step"].item() == 3, "a copy, not a view"
    second = staging.copy(state, "model")
    assert second["w"].data_ptr() == first["w"].data_ptr(), "the next snapshot reuses the buffer"
    assert second["w"].tolist() == [1.0] * 4 and second["groups"][0] == {"lr": 0.1, "step": torch.tensor(4)}
    state["w"] = torch.zeros(8)
    assert staging.copy(state, "model")["w"].shape == (8,), "a new shape gets a new buffer"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_copies_from_cuda_land_in_pinned_buffers():
    staging = StagingBuffers()
    weights = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    copy = staging.copy({"w": weights}, "model")["w"]
    weights.zero_()  # ordered after the copy on the same stream
    staging.wait_until_copied()
    assert copy.device.type == "cpu" and copy.is_pinned()
    assert torch.equal(copy, torch.arange(1 << 20, dtype=torch.float32))
