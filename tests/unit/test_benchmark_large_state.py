"""benchmarks/large_state.py's arithmetic on made-up records: what the summary and the ratios say.

    .venv/bin/python -m pytest -q tests/unit/test_benchmark_large_state.py
"""

from __future__ import annotations

from benchmarks.large_state import ratios, summarise


def record(setting: str, size_mb: int, kill_s: float, peaks: list[int], gap: float, evictions: int = 0,
           repeat: int = 0) -> dict:
    return {"setting": setting, "size_mb": size_mb, "evictions": evictions, "longest_gap_s": gap, "restarts": 0,
            "repeat": repeat,
            "kill": {"seconds": kill_s, "keep_s": 0.1, "restore_s": 0.2, "peak_mb": [peaks[0]], "first_snapshot_s": 0.4},
            "join": {"seconds": 2 * kill_s, "restore_s": 0.3, "peak_mb": peaks[1:], "first_snapshot_s": None},
            "snapshot_blocked_s": {"max": 0.5, "median": 0.1, "n": 3}}


def test_the_peak_is_counted_in_states_over_the_smallest_sizes_run():
    records = [record("current", 16, 0.3, [300, 340, 310], 0.4),
               record("current", 1024, 4.0, [2300, 3364, 3300], 0.8, evictions=1)]
    summary = summarise(records)["current"]
    assert summary[16]["peak_states"] is None
    assert summary[1024]["peak_states"]["median"] == round((3364 - 340) / 1024, 2)
    assert summary[1024]["kill_s"]["median"] == 4.0 and summary[1024]["join_s"]["median"] == 8.0
    assert summary[1024]["evictions"] == 1
    assert summary[1024]["first_snapshot_s"] == {"median": 0.4, "min": 0.4, "max": 0.4, "n": 1}  # a join without one


def test_ratios_pair_each_repeat_of_the_baseline_with_the_same_repeat_of_this_tree():
    records = [record("current", 1024, 4.0, [1, 2, 3], 0.5), record("old", 1024, 8.0, [1, 4, 3], 2.0),
               record("current", 1024, 5.0, [1, 2, 3], 1.0, repeat=1), record("old", 1024, 15.0, [1, 4, 3], 2.0, repeat=1)]
    by_size = ratios(records, "old")[1024]
    assert by_size["kill->step"] == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 2}
    assert by_size["peak MB"]["median"] == round(4 / 3, 2) and by_size["longest gap"]["max"] == 4.0
    # A run that failed (the baseline's first repeat): its partner is left out, the other pair stays.
    by_size = ratios(records[:1] + records[2:], "old")[1024]
    assert by_size["kill->step"] == {"median": 3.0, "min": 3.0, "max": 3.0, "n": 1}


def test_the_drains_snapshot_is_summarised_apart_and_older_records_lack_it():
    records = [record("current", 1024, 4.0, [1, 2, 3], 0.5), {**record("current", 1024, 5.0, [1, 2, 3], 0.5, repeat=1),
                                                           "drain_snapshot_blocked_s": 2.5}]
    summary = summarise(records)["current"][1024]
    assert summary["drain_snapshot_s"] == {"median": 2.5, "min": 2.5, "max": 2.5, "n": 1}
    assert summary["snapshot_blocked_max_s"]["median"] == 0.5  # the other blocks, as recorded
