"""Memory copies and a writer that is gone: the partial copy a dead process left is removed, a live
writer's is kept (elastic_ddp/snapshot/memory_copies.py). Here rather than in
tests/unit/test_memory_copies.py because it needs a real process that has ended.

    .venv/bin/python -m pytest -q tests/cluster/test_memory_copies_killed_writer.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.test_memory_copies import snapshot_of, tier


@pytest.mark.timeout(90)
def test_the_partial_copy_of_a_killed_writer_is_removed(tmp_path):
    memory = tier(tmp_path)
    memory.keep(snapshot_of(1))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60)
    partial = memory.directory / f".memory-000000002-0badc0de.pt.tmp-{dead.stdout.strip()}"
    partial.write_bytes(b"half a copy")
    ours = memory.directory / f".memory-000000002-0badc0de.pt.tmp-{os.getpid()}"  # a live writer's
    ours.write_bytes(b"being written")
    assert memory.newest().global_step == 1
    assert not partial.exists() and ours.exists()
