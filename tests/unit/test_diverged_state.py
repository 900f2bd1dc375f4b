"""A diverged run (NaN or infinity in the state) never wins: no memory copy keeps it, no restore
takes it, nothing writes it durable or prunes a finite snapshot for it (promise 12 of the design;
docs/failure-semantics.md, docs/snapshots.md "A diverged run"). The writer's own refusal of such a
snapshot: tests/unit/test_snapshot_faults.py.

    .venv/bin/python -m pytest -q tests/unit/test_diverged_state.py
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.exchange.restore_agreement import newest_usable_snapshot
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.snapshot.memory_copies import MemoryTier
from elastic_ddp.snapshot.serialization import snapshot_from_bytes, snapshot_to_bytes
from elastic_ddp.snapshot.training_state import Snapshot, non_finite_tensors
from tests.support.training import Crash, crash_at, make_trainer, small_config

FINGERPRINT = {"model": "m", "dataset_size": 10}


def snapshot_of(step: int, value: float) -> Snapshot:
    return Snapshot(states={"progress": {"global_step": step}, "sampler": {"epoch": 0, "samples_consumed": step},
                            "model": {"w": torch.full((4,), value), "b": torch.zeros(2)}},
                    rng_per_rank=[], fingerprint=FINGERPRINT, world_size=1, incarnation=0, wall_time=0.0)


def diverged(snapshot: Snapshot, step: int) -> Snapshot:
    """`snapshot` moved to `step`, its first model tensor NaN: what a diverged run would hold."""
    states = copy.deepcopy(snapshot.states)
    states["progress"]["global_step"] = step
    next(iter(states["model"].values())).fill_(float("nan"))
    return Snapshot(states=states, rng_per_rank=snapshot.rng_per_rank, fingerprint=snapshot.fingerprint,
                    world_size=snapshot.world_size, incarnation=snapshot.incarnation, wall_time=snapshot.wall_time)


def events_of(config, kind: str) -> list[dict]:
    return [e for e in read_events(os.path.join(config.checkpoint_dir, "events.jsonl")) if e["event"] == kind]


def memory_copy_steps(config) -> list[int]:
    return sorted(int(path.name[7:16]) for path in Path(config.memory_dir).glob("*/memory-*"))


def listed_snapshots(config) -> dict[int, Snapshot]:
    store = SnapshotStore(config.checkpoint_dir)
    return {entry.global_step: snapshot_from_bytes(store.read_verified(entry), entry.file)
            for entry in store.manifest_entries()}


# ------------------------------------------------------------------------------- the memory tier

def test_the_memory_tier_refuses_to_keep_a_non_finite_state_and_says_so_once(tmp_path, caplog):
    memory = MemoryTier(tmp_path / "memory", "run", str(tmp_path / "ck"), FINGERPRINT, "a" * 32)
    assert memory.keep(snapshot_of(4, 1.0)) is not None
    with caplog.at_level(logging.ERROR):
        assert memory.keep(snapshot_of(5, float("nan"))) is None
        assert memory.keep(snapshot_of(5, float("inf"))) is None  # a sibling rank, or the same stop again
    refusals = [r.getMessage() for r in caplog.records if "not kept in memory" in r.getMessage()]
    assert len(refusals) == 1 and "model.w" in refusals[0] and "non-finite" in refusals[0], refusals
    assert memory.refusal is not None and "model.w" in memory.refusal
    assert [step for _, step, _ in memory._files()] == [4]
    assert memory.newest().global_step == 4


def test_a_non_finite_memory_copy_is_refused_at_restore_and_the_one_before_is_used(tmp_path, caplog):
    memory = MemoryTier(tmp_path / "memory", "run", str(tmp_path / "ck"), FINGERPRINT, "a" * 32)
    memory.keep(snapshot_of(4, 1.0))
    # As a version that did not check would have kept it (with the tier's fingerprint, as keep does):
    memory._write(dataclasses.replace(diverged(snapshot_of(5, 1.0), 5), fingerprint=memory.fingerprint))
    refused: list[tuple[int, Exception]] = []
    with caplog.at_level(logging.WARNING):
        newest = memory.newest(on_refused=lambda step, exc: refused.append((step, exc)))
    assert newest.global_step == 4
    assert [(step, "model.w" in str(exc)) for step, exc in refused] == [(5, True)]
    assert "memory copy refused" in caplog.text and "non-finite" in caplog.text


# ------------------------------------------------------------------------------- in the trainer

def test_a_run_that_diverged_and_crashed_resumes_from_its_last_finite_state(tmp_path, caplog):
    """NaN from step 7 on, a crash after step 9: the copy of step 9 is refused, no file newer than
    6 is written, the finite snapshots (4 and 6, --keep_last 2) stay, and the restart resumes from 6."""
    config = small_config(tmp_path, keep_last=2)  # snapshots at 4, 6 (epoch end), 8, 12

    def diverge_then_crash(trainer):
        if trainer.global_step == 7:
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))
        crash_at(9)(trainer)

    with caplog.at_level(logging.ERROR), pytest.raises(Crash):
        make_trainer(config, after_step=diverge_then_crash).fit()
    assert memory_copy_steps(config) == [], "the diverged state of step 9 was kept in memory"
    assert "non-finite" in caplog.text and "model.net.1.weight" in caplog.text
    [failed_copy] = events_of(config, "memory_copy_failed")
    assert failed_copy["global_step"] == 9 and "non-finite" in failed_copy["error"]
    assert sorted(listed_snapshots(config)) == [4, 6]

    resumed = make_trainer(config)
    resumed.fit()
    [restore] = events_of(config, "restore")
    assert (restore["global_step"], restore["source"], restore["refused"]) == (6, "file", [])
    snapshots = listed_snapshots(config)
    assert max(snapshots) == 12
    assert all(non_finite_tensors(snapshot.states) == [] for snapshot in snapshots.values())


def test_newer_non_finite_copies_from_any_tier_are_refused_and_the_restore_event_says_why(tmp_path):
    """A file of step 10 and a memory copy of step 9 that hold NaN (left by a version that did not
    check): the restart takes the finite step 8 (the memory copy wins the tie with the file), names
    both refusals, and by the end of the run no file or copy holds NaN."""
    config = small_config(tmp_path, keep_last=3)
    crashed = make_trainer(config, after_step=crash_at(8))
    with pytest.raises(Crash):
        crashed.fit()
    store = SnapshotStore(config.checkpoint_dir, config.keep_last)
    _, _, finite = newest_usable_snapshot(store, crashed.run.fingerprint)
    assert finite.global_step == 8
    store.write(10, 0, 160, snapshot_to_bytes(diverged(finite, 10)))
    crashed.run.snapshots.memory._write(diverged(crashed.run.snapshots.memory.newest().snapshot, 9))
    assert sorted(listed_snapshots(config)) == [6, 8, 10] and memory_copy_steps(config) == [8, 9]

    make_trainer(config).fit()
    [restore] = events_of(config, "restore")
    assert (restore["global_step"], restore["source"]) == (8, "memory")
    assert [(r["source"], r["global_step"]) for r in restore["refused"]] == [("file", 10), ("memory", 9)]
    assert all(r["reason"] == "non-finite: model.net.1.weight" for r in restore["refused"]), restore["refused"]
    snapshots = listed_snapshots(config)
    assert max(snapshots) == 12 and 10 not in snapshots
    assert all(non_finite_tensors(snapshot.states) == [] for snapshot in snapshots.values())
