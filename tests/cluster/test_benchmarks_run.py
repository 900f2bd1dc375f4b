"""`benchmarks/run_all.py --quick` end to end.

No timing is asserted (the machine is shared); the smoke test checks that the table has every row
the quick run promises and that every figure in it parses.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.table import parse_cell

REPO_ROOT = Path(__file__).resolve().parents[2]


QUICK_ROWS = [
    ("throughput", "mlp, default snapshots, on the budget: samples/s"),
    ("throughput", "mlp, snapshots every 50 steps: samples/s"),
    ("throughput", "mlp, default snapshots, on the budget: CPU ms per step, rank 0"),
    ("throughput", "mlp, snapshots every 50 steps: CPU ms per step, rank 0"),
    ("throughput", "mlp, default snapshots, on the budget: share of training time snapshots blocked"),
    ("memory", "mlp: peak RSS per worker, MiB"),
    ("data path", "input pipeline alone: samples/s per worker"),
    ("data path", "mini_resnet: loader samples/s ÷ model step samples/s"),
    ("data path", "mlp: loader samples/s ÷ model step samples/s"),
    ("snapshot", "10 MB: training blocked per snapshot, s"),
    ("snapshot", "10 MB: write bandwidth, MB/s"),
    ("snapshot", "wide MLP: run time with a snapshot every 20 steps, s"),
    ("snapshot", "wide MLP: run time with a synchronous snapshot every 20 steps, s"),
    ("snapshot writer", "10 MB snapshot with blake3, the default: MB/s"),
    ("snapshot writer", "10 MB snapshot with sha256, format 1: MB/s"),
]
# Rows compared with a median of the baseline (not paired): the ratio is one number.
QUICK_UNPAIRED_ROWS = [
    ("checksum", "blake3, 1 thread: MB/s hashing alone"),
    ("checksum", "blake3, all cores: MB/s hashing alone"),
    *(("rendezvous", f"elastic-c10d, 4 agents, {phase}: s to one complete round") for phase in ("first", "kill", "join")),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_all_quick_prints_every_row_with_figures_that_parse(tmp_path):
    output = tmp_path / "report.md"
    completed = subprocess.run(
        [sys.executable, "benchmarks/run_all.py", "--quick", "--work_dir", str(tmp_path / "work"),
         "--output", str(output)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=540, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    assert output.read_text() == completed.stdout
    assert completed.stdout.startswith("Machine: ")

    table = [line for line in completed.stdout.splitlines() if line.startswith("| ")]
    header, body = table[0], table[1:]
    assert header == "| benchmark | figure | elastic_ddp | baseline | vs | ratio | target | n |"
    rows = {}
    for line in body:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[(cells[0], cells[1].split(" (")[0])] = cells
    assert set(QUICK_ROWS) <= set(rows), sorted(rows)
    for key in QUICK_ROWS:
        _, _, elastic, baseline, _, ratio, _, count = rows[key]
        for cell in (elastic, baseline, ratio):
            median, low, high = parse_cell(cell)
            assert low <= median <= high and not math.isnan(median), (key, cell)
        assert count == "1"
    assert set(QUICK_UNPAIRED_ROWS) <= set(rows), sorted(rows)
    for key in QUICK_UNPAIRED_ROWS:
        _, _, elastic, baseline, _, ratio, _, _ = rows[key]
        for cell in (elastic, baseline):
            median, low, high = parse_cell(cell)
            assert 0 < low <= median <= high, (key, cell)
        assert float(ratio) > 0, (key, ratio)
    for section in ("recovery", "sharded"):  # too long for --quick: a line that says so, no figures
        left_out = [cells for key, cells in rows.items() if key[0] == section]
        assert len(left_out) == 1 and left_out[0][1].startswith("left out of --quick"), left_out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rendezvous_scale_benchmark_runs_every_phase_for_both_backends(tmp_path, shared_etcd_server):
    """benchmarks/rendezvous_scale.py with 3 agents, each of our backends: a complete round after the
    first rendezvous, a kill and a join (no timing asserted)."""
    from benchmarks import rendezvous_scale

    backends = ["elastic-c10d", "etcd-v3"]
    records = rendezvous_scale.run(backends, [3], repeats=1, etcd_endpoint=shared_etcd_server.endpoint)
    assert [(r["backend"], r["agents"]) for r in records] == [(backend, 3) for backend in backends]
    for record in records:
        assert "error" not in record, record
        for phase in rendezvous_scale.PHASES:
            counts = record[phase]
            assert counts["seconds"] > 0 and counts["reads_per_agent"] + counts["writes_per_agent"] > 0, record
