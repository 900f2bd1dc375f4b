"""The event log batches `step` lines with a bounded delay and loses none on the way out
(elastic_ddp/runlog/events.py): every other event, close, the watchdog's exit, a crash out of fit,
a drain.

    .venv/bin/python -m pytest -q tests/unit/test_event_batching.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic_ddp.runlog import events as event_log_module
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import FLUSH_INTERVAL_S, EventLog
from elastic_ddp.runlog.reader import EventFollower, read_events
from elastic_ddp.runtime.drain import DrainRequested
from elastic_ddp.training import stop_guard
from tests.support.training import Crash, crash_at, make_trainer, silent_peer_at, small_config

SLACK_S = 2.0  # what a busy 2-core machine may add to the flusher's bound


@pytest.fixture
def no_timed_flush(monkeypatch):
    """Only the other triggers write: no flush comes from the clock during the test."""
    monkeypatch.setattr(event_log_module, "FLUSH_INTERVAL_S", 600.0)


def kinds_and_steps(path) -> list[tuple[str, int | None]]:
    return [(e["event"], e.get("global_step")) for e in read_events(path)]


@pytest.mark.timeout(60)
def test_step_lines_wait_and_any_other_event_writes_them_first_in_order(tmp_path, no_timed_flush):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, incarnation=1, enabled=True)
    for step in range(1, 6):
        log.emit(schema.STEP, global_step=step, epoch=0)
    assert read_events(path) == [], "a step line was written at once"
    log.emit(schema.EPOCH_END, epoch=0, global_step=5)
    assert kinds_and_steps(path) == [("step", 1), ("step", 2), ("step", 3), ("step", 4), ("step", 5), ("epoch_end", 5)]
    times = [e["time"] for e in read_events(path)]
    assert times == sorted(times)
    log.close()


@pytest.mark.timeout(60)
def test_a_follower_sees_a_step_within_the_bound_while_nothing_else_is_emitted(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, incarnation=1, enabled=True)
    follower = EventFollower(path)
    for round_number in range(3):  # the flusher waits again after each write
        step = round_number + 1
        emitted = time.monotonic()
        log.emit(schema.STEP, global_step=step, epoch=0)
        while not any(e["event"] == "step" and e["global_step"] == step for e in follower.poll()):
            assert time.monotonic() - emitted < FLUSH_INTERVAL_S + SLACK_S, f"step {step} not seen in time"
            time.sleep(0.01)
    log.close()


@pytest.mark.timeout(60)
def test_a_full_batch_is_written_without_waiting_for_the_clock(tmp_path, no_timed_flush, monkeypatch):
    monkeypatch.setattr(event_log_module, "FLUSH_LINES", 4)
    path = tmp_path / "events.jsonl"
    log = EventLog(path, incarnation=1, enabled=True)
    for step in range(1, 6):
        log.emit(schema.STEP, global_step=step, epoch=0)
    assert kinds_and_steps(path) == [("step", 1), ("step", 2), ("step", 3), ("step", 4)]
    log.close()
    assert kinds_and_steps(path)[-1] == ("step", 5)


@pytest.mark.timeout(60)
def test_close_and_flush_write_what_waits_and_the_sink_hears_each_event_at_once(tmp_path, no_timed_flush):
    path = tmp_path / "events.jsonl"
    heard: list[tuple[str, dict]] = []
    log = EventLog(path, incarnation=1, enabled=True, sink=lambda kind, fields, now: heard.append((kind.name, fields)))
    log.emit(schema.STEP, global_step=1, epoch=0)
    assert heard == [("step", {"global_step": 1, "epoch": 0})] and read_events(path) == []
    log.flush()
    assert kinds_and_steps(path) == [("step", 1)]
    log.emit(schema.STEP, global_step=2, epoch=0)
    log.close()
    assert kinds_and_steps(path) == [("step", 1), ("step", 2)]
    log.emit(schema.STEP, global_step=3, epoch=0)  # after close: dropped, as before
    assert kinds_and_steps(path) == [("step", 1), ("step", 2)]


@pytest.mark.timeout(120)
def test_a_trainer_that_crashes_mid_run_has_logged_every_committed_step(tmp_path, no_timed_flush):
    config = small_config(tmp_path, snapshot_every_steps=0)
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(5)).fit()
    steps = [step for kind, step in kinds_and_steps(os.path.join(config.checkpoint_dir, "events.jsonl"))
             if kind == "step"]
    assert steps == [1, 2, 3, 4, 5]


@pytest.mark.timeout(120)
def test_the_watchdogs_exit_comes_after_every_committed_step_is_written(tmp_path, no_timed_flush, monkeypatch):
    # No memory copies: keeping the step then emits no event that would write the steps anyway.
    config = small_config(tmp_path, snapshot_every_steps=0, memory_copies=False)
    path = os.path.join(config.checkpoint_dir, "events.jsonl")
    written_at_exit: list[list[int]] = []

    def end_worker_now(exit_code: int) -> None:  # what os._exit would leave behind
        written_at_exit.append([step for kind, step in kinds_and_steps(path) if kind == "step"])

    monkeypatch.setattr(stop_guard, "end_worker_now", end_worker_now)

    with pytest.raises(Crash):
        make_trainer(config, after_step=silent_peer_at(5)).fit()
    assert written_at_exit == [[1, 2, 3, 4, 5]]


@pytest.mark.timeout(120)
def test_a_drained_trainer_has_logged_every_committed_step_before_its_drain(tmp_path, no_timed_flush):
    config = small_config(tmp_path, snapshot_every_steps=0, min_step_time_s=0.1)  # the vote runs every 0.25 s

    def sigterm_after_step_3(trainer):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(DrainRequested):
        make_trainer(config, after_step=sigterm_after_step_3).fit()
    logged = kinds_and_steps(os.path.join(config.checkpoint_dir, "events.jsonl"))
    [drained_at] = [step for kind, step in logged if kind == "drain"]
    assert [step for kind, step in logged if kind == "step"] == list(range(1, drained_at + 1))
