"""Straggler detection (elastic_ddp/training/stragglers.py): each rank's own work per sample, carried by
the peer watchdog's heartbeats (runtime/watchdog.py) on a real TCPStore, scored and judged by rank 0;
the events, the metrics and the report that say who and when."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.metrics import PREFIX, RunMetrics
from elastic_ddp.runlog.run_history import load_history
from elastic_ddp.runtime.watchdog import PeerWatchdog, node_rank_of, pace_of
from elastic_ddp.tools.report import format_summary, summarise
from elastic_ddp.training.stragglers import StepPace, StragglerJudge

PATIENCE_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def judge_with(clock: Clock, threshold: float = 0.6):
    named, recovered, scores = [], [], []
    judge = StragglerJudge(threshold, PATIENCE_S, named.append, recovered.append, scores.append, clock=clock)
    return judge, named, recovered, scores


def play(judge: StragglerJudge, clock: Clock, paces: dict[int, float], seconds: float, every_s: float = 0.5) -> None:
    """`paces` read every `every_s` for `seconds`, rank r on node r."""
    for _ in range(int(seconds / every_s)):
        judge.read({rank: (pace, rank) for rank, pace in paces.items()})
        clock.now += every_s


def test_a_rank_at_half_speed_is_named_after_the_patience_and_recovers_after_it_again():
    clock = Clock()
    judge, named, recovered, scores = judge_with(clock)
    play(judge, clock, {0: 1e-3, 1: 1.05e-3, 2: 0.98e-3}, 30)
    assert named == [] and min(scores[-1].values()) > 0.9
    play(judge, clock, {0: 1e-3, 1: 1.05e-3, 2: 2e-3}, PATIENCE_S - 1)
    assert named == []  # not before the patience
    play(judge, clock, {0: 1e-3, 1: 1.05e-3, 2: 2e-3}, 2)
    assert [(report.rank, report.node) for report in named] == [(2, 2)]
    assert named[0].score == pytest.approx(0.5) and named[0].own_score == pytest.approx(0.49, abs=0.01)
    play(judge, clock, {0: 1e-3, 1: 1.05e-3, 2: 2e-3}, 20)
    assert len(named) == 1 and judge.named() == [2]  # named once
    play(judge, clock, {0: 1e-3, 1: 1.05e-3, 2: 1e-3}, PATIENCE_S + 1)
    assert [report.rank for report in recovered] == [2] and judge.named() == []


def test_a_slow_spell_shorter_than_the_patience_names_nobody():
    clock = Clock()
    judge, named, _, _ = judge_with(clock)
    for _ in range(5):
        play(judge, clock, {0: 1e-3, 1: 3e-3}, PATIENCE_S / 2)
        play(judge, clock, {0: 1e-3, 1: 1e-3}, 1)
    assert named == []


def test_a_slowdown_of_every_rank_names_nobody_and_a_lone_rank_is_not_scored():
    clock = Clock()
    judge, named, _, scores = judge_with(clock)
    play(judge, clock, {0: 5e-3, 1: 5.1e-3}, 3 * PATIENCE_S)
    play(judge, clock, {0: 1e-3}, 3 * PATIENCE_S)
    assert named == [] and all(min(s.values()) > 0.9 for s in scores)


@pytest.mark.parametrize("threshold", [0, 1, 1.5, float("nan")])
def test_a_threshold_outside_0_1_is_refused(threshold):
    with pytest.raises(ValueError, match="straggler threshold"):
        StragglerJudge(threshold, 1.0, print, print)


def test_the_pace_is_the_time_outside_the_runs_collectives_per_sample_over_a_full_window():
    clock = Clock()
    pace = StepPace(window=4, clock=clock)

    def step(samples: int, own_s: float, waited_s: float) -> None:
        pace.step_started(samples)
        clock.now += own_s / 2
        with pace.waiting():
            clock.now += waited_s
        clock.now += own_s / 2

    for samples in (4, 0, 4, 4):  # the empty share is not measured
        step(samples, own_s=0.04, waited_s=1.0)
    assert pace.pace() is None  # three measured steps so far: the window is not full
    step(4, own_s=0.04, waited_s=0.0)
    step(4, own_s=0.36, waited_s=0.5)  # one long step among short ones counts: a stop/continue cycle's
    assert pace.pace() == pytest.approx(0.01)  # 0.04 s over 4 samples, whatever the waits
    step(4, own_s=0.04, waited_s=0.0)
    assert pace.pace() == pytest.approx((0.04 * 3 + 0.36) / 16)
    pace.reset()  # a new group: the step in progress is not measured
    step(4, own_s=10.0, waited_s=0.0)
    assert pace.pace() == pytest.approx((0.04 * 3 + 0.36) / 16)


@pytest.mark.parametrize("heartbeat, node, pace", [
    (b"5@2 0.00125", 2, 0.00125), (b"5@2", 2, None), (b"5", None, None), (b"left", None, None),
    (b"5@2 nan", 2, None), (b"5@2 inf", 2, None), (b"5@2 -1", 2, None), (b"5@2 0", 2, None),
    (b"5@2 " + b"1" * 40, 2, None), (b"5@2 x", 2, None), (b"switched after 7", None, None),
])
def test_a_heartbeat_carries_its_node_and_pace_and_garbage_carries_none(heartbeat, node, pace):
    assert node_rank_of(heartbeat) == node and pace_of(heartbeat) == pace


def test_the_heartbeats_carry_every_ranks_pace_to_rank_0(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    got, seen = [], threading.Event()

    def on_paces(paces):
        got.append(paces)
        if len(paces) == 2:
            seen.set()

    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
               for _ in range(2)]
    dogs = [PeerWatchdog(0, 2, 1, 3.0, lambda *_: None, 0.05, store=clients[0], node_rank=0, pace=lambda: 0.001,
                         on_paces=on_paces),
            PeerWatchdog(1, 2, 1, 3.0, lambda *_: None, 0.05, store=clients[1], node_rank=4, pace=lambda: 0.002)]
    for dog in dogs:
        dog.start()
    try:
        assert seen.wait(10), got[-3:]
        assert got[-1] == {0: (0.001, 0), 1: (0.002, 4)}
    finally:
        for dog in dogs:
            dog.stop()


def test_a_straggler_is_an_event_a_metric_and_a_line_of_the_report(tmp_path):
    registry = CollectorRegistry()
    metrics = RunMetrics(None, registry=registry)
    log = EventLog(tmp_path / schema.EVENT_LOG_NAME, incarnation=1, enabled=True, sink=metrics.record)
    log.emit(schema.START, round=1, world_size=3, local_world_size=1, nodes=3, ranks=[], restart_count=0, run_id="r",
             in_process=False)
    fields = {"rank": 2, "node": 2, "score": 0.5, "own_score": 0.49, "pace_seconds": 0.002, "best_pace_seconds": 0.001}
    log.emit(schema.STRAGGLER, state="named", **fields)
    assert registry.get_sample_value(f"{PREFIX}_stragglers") == 1
    log.emit(schema.STRAGGLER, state="recovered", **{**fields, "score": 0.97})
    assert registry.get_sample_value(f"{PREFIX}_stragglers") == 0
    metrics.rank_speeds(0.5)
    assert registry.get_sample_value(f"{PREFIX}_slowest_rank_speed_ratio") == 0.5
    log.close()
    text = format_summary(summarise(load_history(tmp_path)))
    assert "rank 2 (node 2) named slow: 0.50 of the fastest rank's speed" in text
    assert "rank 2 (node 2) back to speed: 0.97" in text
