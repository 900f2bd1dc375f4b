"""Every system call of the store's write paths, failed in turn with ENOSPC and with EIO: the listed
snapshots stay intact, nothing acknowledged is lost, and the next write cleans up.

The same points with a real crash (the process ends mid-call) are in
tests/cluster/test_snapshot_crash_consistency.py. The points: tests/support/crashpoints.py.
"""

from __future__ import annotations

import pytest

from tests.support.crashpoints import (
    WORKLOAD,
    Injector,
    check_directory,
    count_points,
    leftovers,
    prepare,
    run_workload,
)
from tests.support.snapshots import snapshot_bytes

pytestmark = pytest.mark.timeout(300)


def test_the_workload_makes_every_kind_of_call(tmp_path):
    calls = count_points(tmp_path)
    assert {"create", "write", "fsync", "rename", "unlink", "mkdir", "open-dir"} <= set(calls), sorted(set(calls))
    assert len(calls) >= 40, len(calls)


@pytest.mark.parametrize("failure", ["ENOSPC", "EIO"])
def test_an_error_at_any_point_loses_nothing_listed_and_nothing_acknowledged(tmp_path, failure):
    calls = count_points(tmp_path / "count")
    points = len(calls)
    failed_operations = 0
    for point in range(1, points + 1):
        directory = tmp_path / f"{failure}-{point}"
        store = prepare(directory)
        acknowledged: list[int] = []
        with Injector(point, failure).installed():
            errors = run_workload(store, acknowledged.append)
        failed_operations += len(errors)
        newest = check_directory(directory, acknowledged)
        store.write(6, 0, 6, snapshot_bytes(6))
        assert check_directory(directory, [*acknowledged, 6]) == 6 >= newest
        assert not [name for name in leftovers(directory) if name.startswith(".")], "temporary files outlived a write"
    print(f"{failure}: {points} injection points, {failed_operations} operations failed, {len(WORKLOAD)} per run")
    # Every point fails its operation, except the unlinks of pruning (a prune that fails is retried
    # by the next write; the snapshot it followed is durable).
    assert failed_operations >= points - calls.count("unlink")
