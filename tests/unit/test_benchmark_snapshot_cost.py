"""The snapshot-cost benchmark runs end to end (tiny size; no timing is asserted)."""

from __future__ import annotations

from benchmarks.snapshot_cost import SnapshotCostOptions, measure_snapshot_cost, rows, summary


def test_the_snapshot_cost_benchmark_measures_every_mode(tmp_path):
    options = SnapshotCostOptions(hidden=32, warmup=2, steps=10, every=5, repetitions=1, pairs=2,
                                  directory=str(tmp_path))
    result = measure_snapshot_cost(options)
    assert [run.mode for run in result.runs] == ["none", "async", "sync", "alternating"]
    none, asynchronous, synchronous, alternating = result.runs
    assert none.blocked_seconds == [] and len(asynchronous.blocked_seconds) == len(synchronous.blocked_seconds) == 2
    assert [len(run.step_seconds) for run in result.runs] == [10, 10, 10, 20]
    assert asynchronous.snapshot_bytes > 0 and len(asynchronous.write_seconds) == 2
    # Snapshots at steps 10 and 20 open the two 10-step cycles: 5 steps with one, 5 without.
    assert len(alternating.blocked_seconds) == len(result.segment_pairs) == 2
    assert [row.baseline_name for row in rows(result)] == ["synchronous save", "the next 5 steps", "no snapshots",
                                                           "no snapshots"]
    assert "blocked per async snapshot" in summary(result) and "paired 5-step segments" in summary(result)
    assert set(result.cpu_accounting()) == {"training_cpu_ratio", "writer_cpu_per_snapshot", "interval_cpu",
                                            "with_idle_core", "without_idle_core"}
