"""benchmarks/in_process_cost.py's pairing and its input check (the runs themselves are the benchmark's)."""

from __future__ import annotations

import pytest

from benchmarks.in_process_cost import SIDES, main, paired_ratios
from benchmarks.throughput import RunResult


def _result(samples_per_second: float, cpu_ms_per_step: float) -> RunResult:
    return RunResult(samples_per_second, cpu_ms_per_step, peak_rss_mb=1.0, peak_cuda_mb=None, seconds=1.0)


def test_the_ratios_are_paired_on_over_off_run_by_run():
    on = [_result(110, 9.0), _result(90, 12.0)]
    off = [_result(100, 10.0), _result(100, 10.0)]
    assert paired_ratios(on, off) == {"samples_per_second": [1.1, 0.9], "cpu_ms_per_step": [0.9, 1.2]}
    with pytest.raises(ValueError):  # unpaired runs are a bug of the caller
        paired_ratios(on, off[:1])


def test_the_two_sides_differ_only_in_in_process():
    assert SIDES["on"].replace("in_process=1", "in_process=0") == SIDES["off"]


def test_no_pair_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--pairs", "0"])
    assert "--pairs: got 0; expected at least 1" in capsys.readouterr().err
