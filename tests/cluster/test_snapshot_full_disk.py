"""A real full disk (an 8 MiB tmpfs) under a training run: training goes on, the failure is loud, the
last good snapshot stays intact and nothing half-written is left behind. And a memory directory
too small for the state: no memory copy, a warning, and the restart falls back to the files.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest

from elastic_ddp.runlog.reader import read_events
from tests.support.disk import run_through_a_full_disk
from tests.support.training import Crash, crash_at, make_trainer, small_config


@pytest.fixture
def tmpfs(tmp_path):
    """Mounts real tmpfs of a given size for this test (`tmpfs("8m")`); skips the test where this
    process may not mount one (test_a_full_disk_injected covers the disk path with an injected
    ENOSPC). Every mount is removed at the end."""
    mounted = []

    def mount(size: str):
        mount_point = tmp_path / f"tmpfs-{len(mounted)}"
        mount_point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                                check=False, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()})")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "-l", str(mount_point)], check=False, timeout=30)


@pytest.fixture
def small_tmpfs(tmpfs):
    """A real 8 MiB tmpfs."""
    return tmpfs("8m")


def fill(directory) -> None:
    """Write a ballast file until the filesystem holding `directory` is full."""
    with open(directory / "ballast", "wb") as ballast:
        chunk = b"\0" * (1 << 20)
        try:
            while True:
                ballast.write(chunk)
                ballast.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


@pytest.mark.timeout(120)
def test_a_full_disk_on_a_real_tmpfs(small_tmpfs, tmp_path, caplog):
    config = small_config(tmp_path, epochs=3, dataset_size=160, snapshot_every_steps=3, keep_last=2,
                          checkpoint_dir=str(small_tmpfs / "ck"))
    run_through_a_full_disk(config, lambda: fill(small_tmpfs), lambda: os.remove(small_tmpfs / "ballast"), caplog)


@pytest.mark.timeout(120)
def test_a_state_too_large_for_the_memory_directory_falls_back_to_the_files(tmpfs, tmp_path, caplog):
    memory = tmpfs("1m")  # the MLP and its momentum take 2.1 MB
    config = small_config(tmp_path, snapshot_every_steps=0, memory_dir=str(memory))
    with caplog.at_level(logging.WARNING), pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(9)).fit()
    assert f"does not fit in {memory}" in caplog.text and "a restart falls back to the snapshot files" in caplog.text
    assert not list(memory.glob("*/memory-*")) and not list(memory.glob("*/.memory-*"))
    make_trainer(config).fit()
    restores = [e for e in read_events(tmp_path / "ck" / "events.jsonl") if e["event"] == "restore"]
    assert [(r["global_step"], r["source"], r["lost_steps"]) for r in restores] == [(6, "file", 3)]
