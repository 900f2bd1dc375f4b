"""When durable snapshots are due (elastic_ddp/snapshot/cadence.py): a fixed cadence as asked, or
the overhead budget, decided the same way on every rank; and the schedule both sessions share
(elastic_ddp/snapshot/exchange/cadence_agreement.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot import cadence as cadence_module
from elastic_ddp.snapshot.cadence import PROBE_STEPS, SnapshotCadence
from elastic_ddp.snapshot.exchange.schedule import SnapshotSchedule
from tests.support.training import make_trainer, small_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(cadence_module.time, "monotonic", fake)
    return fake


def test_a_fixed_cadence_saves_every_n_steps_and_at_epoch_ends():
    cadence = SnapshotCadence(every_steps=4, budget=0.01, max_interval_s=600)
    due = [step for step in range(1, 13) if cadence.due(step, epoch_ended=step == 6, training_done=False)]
    assert due == [4, 6, 8, 12] and not cadence.on_budget
    only_epochs = SnapshotCadence(every_steps=0, budget=0.01, max_interval_s=600)
    assert [s for s in range(1, 13) if only_epochs.due(s, epoch_ended=s % 6 == 0, training_done=False)] == [6, 12]


def test_on_the_budget_the_first_snapshot_measures_and_the_next_keeps_the_cost_under_it(clock):
    cadence = SnapshotCadence(every_steps=None, budget=0.01, max_interval_s=600)
    first = 21  # a worker group restored at step 20
    due = []
    for step in range(first, first + PROBE_STEPS):
        clock.now += 0.125  # the step trains for 0.125 s, then the trainer asks
        due += [step] if cadence.due(step, epoch_ended=step == 25, training_done=False) else []
    probe = first + PROBE_STEPS - 1
    assert due == [probe], "epoch ends follow the budget; the probe comes after PROBE_STEPS"
    clock.now += 0.5  # the snapshot blocked training 0.5 s
    next_due = cadence.next_due(probe, blocked_seconds=0.5)
    # 0.5 s at 1 %: one snapshot per 50 s of training; 0.125 s per step: 400 steps.
    assert next_due == probe + 400
    assert (cadence.interval.every_steps, cadence.interval.seconds, cadence.interval.blocked_seconds) == (400, 50, 0.5)
    cadence.agree(next_due)
    assert not cadence.due(next_due - 1, epoch_ended=True, training_done=False)
    assert cadence.due(next_due, epoch_ended=False, training_done=False)


def test_the_interval_never_exceeds_its_ceiling_and_the_end_of_training_is_always_saved(clock):
    cadence = SnapshotCadence(every_steps=None, budget=0.01, max_interval_s=30)
    for step in range(1, PROBE_STEPS + 1):
        clock.now += 1.0
        assert cadence.due(step, epoch_ended=False, training_done=False) == (step == PROBE_STEPS)
    clock.now += 10.0
    # 10 s at 1 % would be one snapshot per 1000 s; 30 s at most, at 1 s per step: 30 steps.
    assert cadence.next_due(PROBE_STEPS, blocked_seconds=10.0) == PROBE_STEPS + 30
    assert cadence.due(PROBE_STEPS + 1, epoch_ended=False, training_done=True)


def test_a_background_write_that_takes_trainings_cores_counts_in_the_cost(clock):
    blocked_only, with_writer = (SnapshotCadence(every_steps=None, budget=0.01, max_interval_s=600) for _ in range(2))
    for step in range(1, PROBE_STEPS + 1):
        clock.now += 0.1
        for cadence in (blocked_only, with_writer):
            cadence.due(step, epoch_ended=False, training_done=False)
    clock.now += 0.01  # the snapshot blocked training 10 ms; its write took 40 ms of a busy core
    alone = blocked_only.next_due(PROBE_STEPS, blocked_seconds=0.01) - PROBE_STEPS
    counted = with_writer.next_due(PROBE_STEPS, blocked_seconds=0.01, writer_cpu_seconds=0.04) - PROBE_STEPS
    assert alone > 1 and 5 * (alone - 1) <= counted <= 5 * alone  # 50 ms against 10 ms, each rounded up
    assert with_writer.interval.writer_cpu_seconds == 0.04 and blocked_only.interval.writer_cpu_seconds == 0


def committed(global_step: int, epoch: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_step=global_step, sampler=SimpleNamespace(epoch=epoch))


def test_the_schedule_saves_a_drain_once_and_the_end_of_training_always():
    schedule = SnapshotSchedule(SnapshotCadence(every_steps=4, budget=0.01, max_interval_s=600), epochs=2)
    assert not schedule.due(committed(3), epoch_ended=False, final=False) and schedule.last_saved_step is None
    assert schedule.due(committed(4), epoch_ended=False, final=False) and schedule.last_saved_step == 4
    assert not schedule.due(committed(4), epoch_ended=False, final=True)  # a drain right after a save
    assert schedule.due(committed(5), epoch_ended=False, final=True) and schedule.last_saved_step == 5
    assert schedule.due(committed(7, epoch=2), epoch_ended=False, final=False)  # the end of training
    schedule.last_saved_step = 9  # as restored
    assert not schedule.due(committed(9), epoch_ended=False, final=True)


class _Emitted:
    def emit(self, kind, **fields) -> None:
        pass


def test_the_probe_moves_while_a_write_runs_the_same_on_every_rank_and_nothing_else_asks(clock, monkeypatch):
    """After an in-process re-form the group saves before its first step; its probe 10 steps later
    waited for that write. While rank 0 still writes, the probe moves instead. Every rank asks at
    the same steps (the question is a collective: a rank that asked alone hung in it for the
    collective timeout, seen in CI), at the probe only; the end of training never moves."""
    from elastic_ddp.runtime import distributed
    agreed: list[int] = []

    def broadcast(tensor, src):  # rank 0 runs each save first here: the others receive its choice
        if agreed and len(agreed) > broadcast.received:
            tensor.fill_(agreed[broadcast.received])
            broadcast.received += 1
        else:
            agreed.append(int(tensor.item()))
    broadcast.received = 0
    monkeypatch.setattr(distributed.dist, "broadcast", broadcast)
    ranks = [SimpleNamespace(is_main=rank == 0, in_process_group=True, collective_device="cpu") for rank in (0, 1)]
    schedules = [SnapshotSchedule(SnapshotCadence(every_steps=None, budget=0.01, max_interval_s=600), epochs=1)
                 for _ in ranks]
    for context, schedule in zip(ranks, schedules):  # the re-form's snapshot, before any step
        schedule.last_saved_step = 40
        schedule.after_save(40, 0.1, context, _Emitted())
    asked: list[list[int]] = [[], []]
    answers = [True, True, False]
    saved: list[list[int]] = [[], []]
    for step in range(41, 41 + 8 * PROBE_STEPS):  # the probe, then budgeted snapshots every 11 steps
        clock.now += 0.1
        for rank, (context, schedule) in enumerate(zip(ranks, schedules)):
            def write_in_flight(rank=rank, step=step) -> bool:
                asked[rank].append(step)
                return len(asked[rank]) <= len(answers) and answers[len(asked[rank]) - 1]
            if schedule.due(committed(step), epoch_ended=False, final=False, write_in_flight=write_in_flight):
                saved[rank].append(step)
                schedule.after_save(step, 0.01, context, _Emitted())
    probe = 40 + PROBE_STEPS
    assert asked[0] == asked[1] == [probe, probe + PROBE_STEPS, probe + 2 * PROBE_STEPS], asked
    assert saved[0] == saved[1] and saved[0][0] == probe + 2 * PROBE_STEPS and len(saved[0]) >= 3, saved
    last = schedules[0].last_saved_step
    assert last == saved[0][-1] and not schedules[0].due(committed(last), epoch_ended=False, final=True)
    assert schedules[0].due(committed(last + 1, epoch=1), epoch_ended=True, final=False,
                            write_in_flight=lambda: pytest.fail("the end of training was asked to move"))


def test_a_deferred_probe_does_not_count_as_saved_for_a_drain(clock):
    schedule = SnapshotSchedule(SnapshotCadence(every_steps=None, budget=0.01, max_interval_s=600), epochs=1)
    for step in range(1, PROBE_STEPS):
        assert not schedule.due(committed(step), epoch_ended=False, final=False, write_in_flight=lambda: True)
    assert not schedule.due(committed(PROBE_STEPS), epoch_ended=False, final=False, write_in_flight=lambda: True)
    assert schedule.last_saved_step is None
    assert schedule.due(committed(PROBE_STEPS), epoch_ended=False, final=True)  # a drain at that step saves it


def snapshot_events(config, kind: str) -> list[dict]:
    return [e for e in read_events(os.path.join(config.checkpoint_dir, "events.jsonl")) if e["event"] == kind]


def test_a_run_on_the_budget_saves_when_rank_0_chose_and_at_the_end(tmp_path):
    config = small_config(tmp_path, snapshot_every_steps=None, dataset_size=480)  # 2 epochs of 30 steps
    make_trainer(config).fit()
    saved = [e["global_step"] for e in snapshot_events(config, "snapshot")]
    cadences = snapshot_events(config, "snapshot_cadence")
    assert saved[0] == PROBE_STEPS and saved[-1] == 60, saved
    # Every snapshot but the last (the end of training) is the one the cadence before it chose.
    chosen = {e["global_step"]: e["global_step"] + e["every_steps"] for e in cadences}
    assert [chosen[step] for step in saved[:-2]] == saved[1:-1], (saved, cadences)
    assert all(e["budget"] == 0.01 and e["every_steps"] >= 1 for e in cadences)


def test_a_ceiling_below_one_step_saves_every_step_after_the_probe(tmp_path):
    config = small_config(tmp_path, snapshot_every_steps=None, snapshot_max_interval_s=1e-6)
    make_trainer(config).fit()
    saved = [e["global_step"] for e in snapshot_events(config, "snapshot")]
    assert saved == list(range(PROBE_STEPS, config.epochs * config.steps_per_epoch + 1)), saved


def test_a_save_before_the_groups_first_step_probes_the_cost_again_from_there(clock):
    """A group re-formed in process saves the state it kept before it trains a step
    (SnapshotSession.resume_live): the budget has no step time yet, so the next snapshot is a probe."""
    cadence = SnapshotCadence(every_steps=None, budget=0.01, max_interval_s=600)
    assert cadence.next_due(40, blocked_seconds=0.02) == 40 + PROBE_STEPS
    cadence.agree(40 + PROBE_STEPS)
    clock.now += 1.0
    assert [step for step in range(41, 41 + PROBE_STEPS) if cadence.due(step, False, False)] == [40 + PROBE_STEPS]
