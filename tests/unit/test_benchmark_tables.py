"""The benchmark suite's arithmetic and its baseline's equal work (no benchmark is run here)."""

from __future__ import annotations

import os
import statistics

import pytest
import torch

from benchmarks import baseline_schedule, run_all, snapshot_sweep
from benchmarks.measure import emit_result, parse_results, steady_state_cpu_ms_per_step, steady_state_samples_per_second
from benchmarks.table import Row, format_cell, parse_cell, render_markdown
from elastic_ddp.training.state_builder import warmup_cosine_schedule


def test_steady_state_rate_leaves_out_the_first_steps():
    # A slow first epoch (start-up) of 4 steps, then one step every 0.5 s.
    step_times = [10.0, 20.0, 30.0, 40.0] + [40.0 + 0.5 * k for k in range(1, 9)]
    assert steady_state_samples_per_second(step_times, samples_per_step=64, skip_steps=4) == pytest.approx(128)
    cpu_times = [1.0, 2.0, 3.0, 4.0] + [4.0 + 0.01 * k for k in range(1, 9)]
    assert steady_state_cpu_ms_per_step(cpu_times, skip_steps=4) == pytest.approx(10)
    with pytest.raises(ValueError, match="need more than"):
        steady_state_samples_per_second(step_times[:5], samples_per_step=64, skip_steps=4)


def test_result_lines_survive_other_output(capsys):
    emit_result({"rank": 1, "peak_rss_mb": 312.5})
    text = "[rank1]: warning: something\n" + capsys.readouterr().out + "trailing log line\n"
    assert parse_results(text) == [{"rank": 1, "peak_rss_mb": 312.5}]


def test_cells_show_median_and_spread_and_parse_back():
    cell = format_cell([1234.4, 1100.0, 1300.2])
    assert cell == "1234 [1100..1300]"
    assert parse_cell(cell) == (1234, 1100, 1300)
    assert parse_cell(format_cell([0.0123, 0.0101])) == (pytest.approx(0.0112), 0.0101, 0.0123)


def test_ratio_is_paired_per_repetition_and_targets_are_judged():
    row = Row("throughput", "samples/s", elastic=[97, 99, 200], baseline=[100, 100, 100], baseline_name="bare DDP",
              target=">= 0.97")
    assert row.ratios == [0.97, 0.99, 2.0] and row.ratio == 0.99 and row.target_met() is True
    unpaired = Row("recovery", "seconds", elastic=[4.0, 4.5, 6.0], baseline=[40.0], baseline_name="stock",
                   target="< 5", target_on="elastic")
    assert not unpaired.paired and unpaired.ratio == pytest.approx(4.5 / 40) and unpaired.target_met() is True
    table = render_markdown([row, unpaired], [("recovery", "left out of --quick")])
    assert "| >= 0.97 met |" in table and "elastic_ddp < 5 met" in table
    assert "| recovery | left out of --quick |" in table


def test_the_baselines_use_the_same_learning_rate_schedule():
    def rates(schedule_factory):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
        schedule = schedule_factory(optimizer, 5, 40)
        rates = []
        for _ in range(45):
            rates.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
        return rates

    assert rates(baseline_schedule.warmup_cosine_schedule) == rates(warmup_cosine_schedule)


def test_wide_mlp_widths_give_the_snapshot_sizes_asked_for():
    from benchmarks.snapshot_cost import WideMLP

    for size in (10e6, 100e6):
        hidden = snapshot_sweep.hidden_for_snapshot_bytes(size)
        parameters = sum(p.numel() for p in WideMLP(hidden).parameters())
        assert 8 * parameters == pytest.approx(size, rel=0.01)
    assert snapshot_sweep.hidden_for_snapshot_bytes(1e9) == pytest.approx(10797, abs=2)


def test_recovery_records_become_paired_rows():
    records = [{"setting": setting, "kill": {"seconds": kill}, "join": {"seconds": join}}
               for setting, kill, join in (("ours", 4.0, 7.0), ("stock", 45.0, 40.0),
                                           ("stock", 46.0, 41.0), ("ours", 4.4, 7.4))]
    kill, join = run_all.recovery_rows(records)
    assert kill.elastic == [4.0, 4.4] and kill.baseline == [45.0, 46.0] and kill.target_met() is True
    assert join.ratio == pytest.approx(statistics.median([7.0 / 40.0, 7.4 / 41.0]))


def test_recovery_records_give_lost_step_rows_against_both_baselines():
    records = [{"setting": setting, "kill": {"seconds": 5.0, "lost_steps": kill}, "join": {"seconds": 8.0, "lost_steps": 0}}
               for setting, kill in (("ours", 0), ("stock", 12), ("tutorial", 40), ("ours", 0), ("stock", 7),
                                     ("tutorial", 55))]
    rows = run_all.recovery_rows(records)
    lost = {(row.figure, row.baseline_name): row for row in rows if row.figure.startswith("committed steps")}
    kill_vs_tutorial = lost[("committed steps redone after a SIGKILL of 1 of 3 nodes",
                             "stock torchrun, a snapshot per epoch (tutorial)")]
    assert kill_vs_tutorial.elastic == [0, 0] and kill_vs_tutorial.baseline == [40, 55]
    assert kill_vs_tutorial.target_met() is True
    assert len(lost) == 4


def test_thread_cpu_splits_a_window_per_thread_group_and_per_step():
    from benchmarks import thread_cpu

    pid = 100
    before = {100: ("python", 1.0), 101: ("gloo_tcp_loop", 0.5), 102: ("pt_gloo_runloop", 0.0), 103: ("python", 2.0)}
    after = {100: ("python", 3.0), 101: ("gloo_tcp_loop", 1.0), 102: ("pt_gloo_runloop", 0.5), 103: ("python", 2.5),
             104: ("python", 0.25)}  # a thread started within the window counts from zero
    groups = thread_cpu.cpu_ms_per_step_by_group(pid, before, after, steps=250)
    assert groups == pytest.approx({"main": 8.0, "gloo": 4.0, "other": 3.0})
    # The reading of a real process: this one has a main thread that has used some CPU.
    own = thread_cpu.thread_cpu_seconds(os.getpid())
    assert own[os.getpid()][1] > 0


def test_rendezvous_rows_count_a_failed_phase_and_the_ones_after_it_as_not_settled():
    from benchmarks import rendezvous_scale

    def phase(seconds):
        return {"seconds": seconds, "rounds": 1, "reads_per_agent": 1, "writes_per_agent": 1,
                "lost_writes_per_agent": 0, "machine_busy": 0.5, "agent_cores": 1.0}

    records = [
        {"backend": "etcd-v3", "agents": 8, "first": phase(1.5), "kill": phase(0.5), "join": phase(0.5)},
        {"backend": "etcd-v3", "agents": 64, "first": phase(3.0), "error": "kill phase: did not settle"},
    ]
    rows = {row.figure: row for row in rendezvous_scale.rows(records, baseline_agents=8)}
    first = rows["etcd-v3, 64 agents, first: s to one complete round"]
    assert first.ratio == 2.0 and not first.note
    for later in ("kill", "join"):
        row = rows[f"etcd-v3, 64 agents, {later}: s to one complete round"]
        assert row.elastic == [float("inf")] and "1 of 1 did not settle" in row.note
    assert "FAILED: kill phase" in rendezvous_scale._line(records[1]) and "first 3.00 s" in rendezvous_scale._line(records[1])
