"""The snapshot-cost benchmark runs end to end (tiny size; no timing is asserted)."""

from __future__ import annotations

from benchmarks.snapshot_cost import SnapshotCostOptions, measure_snapshot_cost, rows, summary


def test_the_snapshot_cost_benchmark_measures_every_mode(tmp_path):
    options = SnapshotCostOptions(hidden=32, warmup=2, steps=10, every=5, repetitions=1, directory=str(tmp_path))
    result = measure_snapshot_cost(options)
    assert [run.mode for run in result.runs] == ["none", "async", "sync"]
    none, asynchronous, synchronous = result.runs
    assert none.blocked_seconds == [] and len(asynchronous.blocked_seconds) == len(synchronous.blocked_seconds) == 2
    assert all(len(run.step_seconds) == 10 for run in result.runs)
    assert asynchronous.snapshot_bytes > 0 and len(asynchronous.write_seconds) == 2
    assert [row.baseline_name for row in rows(result)] == ["synchronous save", "no snapshots", "no snapshots"]
    assert "blocked per async snapshot" in summary(result)
