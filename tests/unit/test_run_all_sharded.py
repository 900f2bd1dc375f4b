"""benchmarks/run_all.py's sharded section: its rows from the records of the benchmarks it runs, and
its absence from --quick (no benchmark is run here; the section runs with `run_all.py --only sharded`)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from benchmarks import run_all
from benchmarks.table import Row


def test_sharded_recovery_records_become_rows_against_ddp_with_the_steps_redone():
    records = [{"setting": setting, "kill": {"seconds": kill, "lost_steps": 0}, "join": {"seconds": 4.0, "lost_steps": 0},
                "freeze": {"seconds": 5.0, "lost_steps": lost}}
               for setting, kill, lost in (("fsdp", 0.6, 0), ("ours", 0.4, 0), ("ours", 0.5, 0), ("fsdp", 0.5, 1))]
    rows = {row.figure: row for row in run_all.sharded_recovery_rows(records)}
    kill = rows["SIGKILL of 1 of 3 nodes -> first step without it, s"]
    assert (kill.benchmark, kill.elastic, kill.baseline, kill.baseline_name) == ("sharded", [0.6, 0.5], [0.4, 0.5], "DDP")
    assert kill.ratio == pytest.approx((0.6 / 0.4 + 1.0) / 2)
    assert {"new node started -> first step with it (world 2 -> 3), s",
            "SIGSTOP of a node -> first step without it, s"} < rows.keys()
    assert rows["committed steps redone after a SIGKILL"].target_met() is True
    assert rows["committed steps redone after a SIGSTOP"].target_met() is False  # a median of 0.5 steps lost
    assert len(rows) == 5


def test_rows_of_a_sharded_run_go_under_their_own_heading_against_a_bare_fsdp2_loop():
    throughput = run_all.sharded_row(Row("throughput", "mlp, default snapshots, on the budget: samples/s", [9.0], [10.0],
                                         "bare DDP", target=">= 0.98"))
    memory = run_all.sharded_row(Row("memory", "world 2: peak RSS per worker (largest rank), MiB", [1443.0], [844.0],
                                     "DDP"))
    assert (throughput.benchmark, throughput.baseline_name, throughput.ratio, throughput.target_met()) == (
        "sharded", "bare FSDP2", 0.9, False)
    assert (memory.benchmark, memory.baseline_name) == ("sharded", "DDP")


def test_the_sharded_section_is_left_out_of_quick_with_its_reason(tmp_path: Path):
    rows, missing, ok = run_all.run(["sharded"], quick=True, repetitions=None, work_dir=tmp_path, progress=print)
    assert (rows, ok) == ([], True)
    assert [(section, reason.startswith("left out of --quick")) for section, reason in missing] == [("sharded", True)]


def test_the_full_sharded_section_calls_its_three_benchmarks_as_they_are_defined(monkeypatch, tmp_path: Path):
    """Each benchmark replaced by a stand-in that checks the call against the real function's signature
    and returns records of the real shape: the section's rows, without minutes of torchrun jobs."""
    from benchmarks import recovery, sharded_memory, throughput

    calls = []

    def stand_in(real, result):
        def fake(*args, **kwargs):
            inspect.signature(real).bind(*args, **kwargs)  # raises TypeError on a call the real one refuses
            calls.append((real.__name__, args, kwargs))
            return result(*args, **kwargs)
        return fake

    throughput_rows = lambda workloads, *_, **__: [
        Row("throughput", f"{w.model}, default snapshots, on the budget: samples/s", [1500.0], [2800.0], "bare DDP")
        for w in workloads]
    memory_records = [{"mode": mode, "world_size": world, "peak_rss_mb": [800.0, 900.0], "state_mb": 81.2}
                      for world in (2, 4) for mode in ("fsdp", "none")]
    recovery_records = [{"setting": setting, **{event: {"seconds": 1.0, "lost_steps": 0}
                                                for event in ("kill", "join", "freeze")}} for setting in ("fsdp", "ours")]
    monkeypatch.setattr(throughput, "measure", stand_in(throughput.measure, throughput_rows))
    monkeypatch.setattr(sharded_memory, "measure", stand_in(sharded_memory.measure, lambda *_, **__: memory_records))
    monkeypatch.setattr(recovery, "measure", stand_in(recovery.measure, lambda *_, **__: recovery_records))

    rows, missing, ok = run_all.run(["sharded"], quick=False, repetitions=None, work_dir=tmp_path, progress=print)
    assert (missing, ok) == ([], True)
    assert [name for name, _, _ in calls] == ["measure"] * 3
    (_, (workloads, repetitions, _), _), (_, (worlds, *_), _), (_, (settings, *_), _) = calls
    assert [(w.model, w.sharding) for w in workloads] == [("mlp", "fsdp")] and repetitions == 3
    assert (worlds, settings) == ([2, 4], ["fsdp", "ours"])
    assert {row.benchmark for row in rows} == {"sharded"}
    figures = [(row.figure, row.baseline_name) for row in rows]
    assert ("mlp, default snapshots, on the budget: samples/s", "bare FSDP2") in figures
    assert ("world 4: peak RSS per worker (largest rank), MiB", "DDP") in figures
    assert ("SIGKILL of 1 of 3 nodes -> first step without it, s", "DDP") in figures
