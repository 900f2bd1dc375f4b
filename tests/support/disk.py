"""A full disk under a training run: what both full-disk tests (injected and real tmpfs) check."""

from __future__ import annotations

import os

from elastic_ddp import load_snapshot
from elastic_ddp.snapshot.files.backends import TEMPORARY_PATTERN
from elastic_ddp.snapshot.files.manifest import SNAPSHOT_PATTERN
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.training import make_trainer


def leftovers(directory) -> list[str]:
    """Temporary files and snapshot files that the manifest does not list."""
    listed = {e.file for e in SnapshotStore(directory).manifest_entries()}
    return [name for name in os.listdir(directory)
            if TEMPORARY_PATTERN.match(name) or (SNAPSHOT_PATTERN.match(name) and name not in listed)]


def run_through_a_full_disk(config, make_disk_full, free_disk, caplog):
    """Train 30 steps; the disk is full from step 10 to step 19. Snapshots every 3 steps and at
    epoch ends (10, 20, 30): 12, 15 and 18 must fail cleanly, the others land."""
    directory = config.checkpoint_dir
    seen_while_full = {}

    def after_step(trainer):
        if trainer.global_step == 10:
            trainer.run.snapshots.writer.wait()
            make_disk_full()
        elif trainer.global_step == 19:
            trainer.run.snapshots.writer.wait()
            seen_while_full["leftovers"] = leftovers(directory)
            seen_while_full["newest"] = load_snapshot(directory)["global_step"]
            free_disk()

    trainer = make_trainer(config, after_step=after_step)
    trainer.fit()
    assert trainer.global_step == 30, "training goes on"
    assert trainer.run.snapshots.writer.failed_writes == 3
    for step in (12, 15, 18):
        assert f"SNAPSHOT NOT SAVED (step {step}): snapshot of step {step} could not be written to {directory} " \
               "(No space left on device); the listed snapshots are intact" in caplog.text
    assert seen_while_full == {"leftovers": [], "newest": 10}, "partial files cleaned, last good one intact"
    assert load_snapshot(directory)["global_step"] == 30, "writes succeed again once there is space"
    assert leftovers(directory) == []
