"""A real full disk (an 8 MiB tmpfs) under a training run: training goes on, the failure is loud, the
last good snapshot stays intact and nothing half-written is left behind.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from tests.support.disk import run_through_a_full_disk
from tests.support.training import small_config


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 8 MiB tmpfs mounted for this test; skipped where this process may not mount one."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                            check=False, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); "
                    "test_a_full_disk_injected covers the same path with an injected ENOSPC")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


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
