"""benchmarks/rendezvous_threads.py (agents as threads, for 256 of them on 2 cores) with 3 agents:
every phase settles on etcd-v3, and the operations it reports are counted (no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks import rendezvous_scale, rendezvous_threads

pytestmark = pytest.mark.timeout(120)


def test_the_threads_benchmark_runs_every_phase(shared_etcd_server) -> None:
    records = rendezvous_threads.run([3], repeats=1, endpoint=shared_etcd_server.endpoint)
    assert [(r["backend"], r["agents"]) for r in records] == [("etcd-v3", 3)]
    [record] = records
    assert "error" not in record, record
    for phase in rendezvous_scale.PHASES:
        assert record[phase]["rounds"] >= (phase != "first"), record  # the first round is round 0
        assert record[phase]["reads_per_agent"] > 0 and record[phase]["writes_per_agent"] > 0, record
    assert record["kill"]["writes_per_agent"] <= 2 and record["kill"]["lost_writes_per_agent"] == 0, record
