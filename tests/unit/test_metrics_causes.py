"""The restart cause label (runlog/metrics_causes.py), read from a real event log, and the peer
watchdog's figures in the live metrics (runlog/metrics.py: `heartbeat_gap`, `peer_evicted`), also
as an in-process trainer feeds them (the stop guard and RunLog wire them)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.metrics import PREFIX, RunMetrics
from elastic_ddp.runlog.metrics_causes import RESTART_CAUSES, GroupEnd, how_it_ended, restart_cause
from elastic_ddp.runlog.metrics_node import metrics_directory
from elastic_ddp.runlog.reader import PreviousIncarnation, previous_incarnation
from elastic_ddp.training import stop_guard
from tests.support.training import Crash, make_trainer, silent_peer_at, small_config

pytestmark = pytest.mark.timeout(60)


def write_group(path, incarnation: int, world_size: int, stop_reason: str | None = None, drained: bool = False,
                finished: bool = False) -> None:
    """One incarnation's events as rank 0 writes them, ending the way the stop guard does."""
    log = EventLog(path, incarnation, enabled=True)
    log.emit(schema.START, round=incarnation, world_size=world_size, local_world_size=1, nodes=world_size,
             ranks=[], restart_count=0, run_id="job", in_process=False)
    log.emit(schema.STEP, global_step=incarnation * 10, epoch=0)
    if stop_reason is not None:
        log.emit(schema.MEMORY_COPY, global_step=incarnation * 10, reason=stop_reason, size_bytes=10, seconds=0.01,
                 written=True)
    if drained:
        log.emit(schema.DRAIN, global_step=incarnation * 10, snapshot_durable=True, seconds_since_signal=0.2)
    if finished:
        log.emit(schema.FINISHED, global_step=incarnation * 10, seconds=1.0)
    log.close()


@pytest.mark.parametrize("before, after, reason, drained, finished, cause", [
    (3, 3, "RuntimeError: Connection reset by peer", False, False, "worker_crash"),
    (3, 2, "RuntimeError: Connection reset by peer", False, False, "node_lost"),
    (3, 2, None, False, False, "node_lost"),  # rank 0 itself was killed: no reason written
    (2, 3, "drain", True, False, "node_joined"),  # the running group drained for the newcomer
    (3, 2, "peer watchdog: rank(s) [2] sent no heartbeat for over 3 s", False, False, "peer_evicted"),
    (3, 2, "drain", True, False, "drain"),
    (3, 3, None, False, True, "relaunched"),
])
def test_the_cause_comes_from_the_world_sizes_and_how_the_group_before_stopped(
        tmp_path, before, after, reason, drained, finished, cause):
    path = tmp_path / "events.jsonl"
    write_group(path, 1, 3)
    write_group(path, 2, before, reason, drained, finished)
    write_group(path, 3, after)  # the new group has started: its own events do not count
    previous, end = previous_incarnation(path, 3), how_it_ended(path, 3)
    assert restart_cause(previous, end, after) == cause

    registry = CollectorRegistry()
    metrics = RunMetrics(24, previous, registry=registry, previous_end=end)
    metrics.record(schema.START, {"round": 3, "world_size": after, "local_world_size": 1, "nodes": after,
                                  "ranks": [], "restart_count": 0, "run_id": "job"}, 1000.0)
    counts = {c: registry.get_sample_value(f"{PREFIX}_restarts_total", {"cause": c}) for c in RESTART_CAUSES}
    assert counts == {c: float(c == cause) for c in RESTART_CAUSES}


def test_a_first_group_has_no_group_before_it(tmp_path):
    path = tmp_path / "events.jsonl"
    assert how_it_ended(path, 1) is None
    write_group(path, 1, 2, "peer watchdog: x")
    assert how_it_ended(path, 1) is None, "its own stop is not a group before it"
    assert how_it_ended(path, 2) == GroupEnd(watchdog=True, drained=False)


def test_an_unknown_world_before_counts_as_the_same():
    assert restart_cause(PreviousIncarnation(None, 1.0, False), None, 4) == "worker_crash"


def test_the_watchdog_figures_reset_with_each_group_and_evictions_count():
    registry = CollectorRegistry()
    metrics = RunMetrics(24, registry=registry, watchdog_bound_s=3.0)

    def value(name):
        return registry.get_sample_value(f"{PREFIX}_{name}")

    assert value("watchdog_bound_seconds") == 3.0 and value("watchdog_longest_heartbeat_gap_seconds") == 0
    metrics.heartbeat_gap(0.4)
    metrics.heartbeat_gap(1.1)
    metrics.peer_evicted()
    assert value("watchdog_longest_heartbeat_gap_seconds") == 1.1 and value("watchdog_evictions_total") == 1
    RunMetrics(24, registry=(after := CollectorRegistry()), watchdog_bound_s=0)
    assert after.get_sample_value(f"{PREFIX}_watchdog_longest_heartbeat_gap_seconds") == 0
    assert after.get_sample_value(f"{PREFIX}_watchdog_bound_seconds") == 0, "0: the watchdog is off"


def test_a_trainer_whose_watchdog_stopped_it_counts_an_eviction_and_the_next_group_a_peer_evicted_restart(
        tmp_path, monkeypatch):
    """The wiring, in one process standing for rank 0 of two worker groups: the stop guard tells the
    live metrics of the eviction, and the next group reads the cause from the event log."""
    config = small_config(tmp_path, snapshot_every_steps=0, metrics_port=0)
    monkeypatch.setattr(stop_guard, "end_worker_now", lambda code: None)  # instead of os._exit
    with pytest.raises(Crash):
        make_trainer(config, after_step=silent_peer_at(3)).fit()
    make_trainer(config).fit()
    directory = metrics_directory(config.memory_dir, "local", config.checkpoint_dir)
    samples = {(s.name, tuple(s.labels.items())): s.value
               for family in MultiProcessCollector.merge([str(p) for p in directory.glob("*.db")])
               for s in family.samples}
    assert samples[(f"{PREFIX}_watchdog_evictions_total", ())] == 1
    assert samples[(f"{PREFIX}_restarts_total", (("cause", "peer_evicted"),))] == 1
    assert samples[(f"{PREFIX}_incarnations_total", ())] == 2
