"""A crash at every system call of the store's write paths: the process ends mid-call (os._exit in a
forked child: no `finally`, no cleanup), then the directory is checked as a restart would read it.

After a crash at any point: every listed snapshot verifies and loads; the newest is at least the
newest step the crashed process had been told was durable, and never older than what the
directory held before; and the next write succeeds and leaves no temporary file. The points and
the checks: tests/support/crashpoints.py (the same points fail with errors in
tests/unit/test_snapshot_crash_points.py).
"""

from __future__ import annotations

import os

import pytest

from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.crashpoints import (
    KEEP_LAST,
    NO_RETRY,
    Injector,
    check_directory,
    count_points,
    leftovers,
    prepare,
    run_workload,
)
from tests.support.snapshots import snapshot_bytes

pytestmark = pytest.mark.timeout(300)


def crash_at(directory, point: int) -> list[int]:
    """Run the workload in a child that dies at `point`; the steps it had acknowledged."""
    prepare(directory)
    acknowledged_log = directory.parent / f"{directory.name}.acknowledged"
    pid = os.fork()
    if pid == 0:  # the child: dies at the point (or after the workload), never returns to pytest
        try:
            log = os.open(acknowledged_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            store = SnapshotStore(directory, keep_last=KEEP_LAST, retry=NO_RETRY)
            with Injector(point, "crash").installed():
                run_workload(store, lambda step: os.write(log, f"{step}\n".encode()))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    text = acknowledged_log.read_text() if acknowledged_log.exists() else ""
    return [int(line) for line in text.split()]


def test_a_crash_at_any_point_loses_nothing_listed_and_nothing_acknowledged(tmp_path):
    points = len(count_points(tmp_path / "count"))
    crashed_before_the_end = 0
    for point in range(1, points + 1):
        directory = tmp_path / f"crash-{point}"
        acknowledged = crash_at(directory, point)
        crashed_before_the_end += len(acknowledged) < 4
        newest = check_directory(directory, acknowledged)
        store = SnapshotStore(directory, keep_last=KEEP_LAST)
        store.write(6, 0, 6, snapshot_bytes(6))  # the restarted writer
        assert check_directory(directory, [*acknowledged, 6]) == 6 >= newest
        assert not [name for name in leftovers(directory) if name.startswith(".")], (point, leftovers(directory))
    print(f"{points} crash points, {crashed_before_the_end} of them before the last operation returned")
    assert crashed_before_the_end >= points - 3
