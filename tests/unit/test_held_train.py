"""The hold file of elastic_ddp/chaos/held_train.py, and how the chaos harness steers it through a plan."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from elastic_ddp.chaos import held_train
from elastic_ddp.chaos.harness import ChaosHarness
from elastic_ddp.chaos.plan import Fault, FaultPlan

pytestmark = pytest.mark.timeout(60)


def trainer_at(step: int, counted: list[int] | None = None) -> SimpleNamespace:
    """A trainer at `step`; its run's `wait_until_counted` appends the step to `counted`."""
    counted = [] if counted is None else counted
    return SimpleNamespace(global_step=step, run=SimpleNamespace(drain=SimpleNamespace(requested=False),
                                                                 regroup=SimpleNamespace(replaced=lambda: False),
                                                                 wait_until_counted=lambda: counted.append(step)))


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The sleeps of the hook, recorded; the pause's polls still wait a little. Only held_train's
    own: patching `time.sleep` itself also recorded a thread of an earlier test (a 0.32 s sleep)."""
    recorded: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        recorded.append(seconds)
        real_sleep(min(seconds, 0.001))

    monkeypatch.setattr(held_train, "time", SimpleNamespace(sleep=sleep))
    return recorded


def test_the_file_says_the_pace_and_the_stop(tmp_path):
    hold = tmp_path / "hold"
    assert held_train.read_hold(hold) == (False, float("inf"))
    held_train.pace(hold)
    assert held_train.read_hold(hold) == (True, float("inf"))
    held_train.pause_at(hold, 7)
    assert held_train.read_hold(hold) == (True, 7)
    held_train.run_to(hold, 9)
    assert held_train.read_hold(hold) == (False, 9)
    held_train.release(hold)
    held_train.release(hold)  # (twice: nothing to do)
    assert held_train.read_hold(hold) == (False, float("inf")) and not hold.exists()


def test_run_to_trains_at_full_speed_and_stops_until_the_file_changes(tmp_path, sleeps):
    hold = tmp_path / "hold"
    held_train.run_to(hold, 5)
    hook = held_train.held(hold=str(hold))
    counted: list[int] = []
    hook(trainer_at(4, counted))
    assert sleeps == [] and counted == [], "no step before the stop sleeps or waits"

    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (hook(trainer_at(5, counted)), returned.set()))
    waiter.start()
    assert not returned.wait(0.3), "step 5 is where it stops"
    assert counted == [5], "the step stopped after counts (is reported) while the job waits"
    held_train.run_to(hold, 9)
    assert returned.wait(10), "a stop further on lets it go"
    waiter.join(10)
    assert held_train.HELD_STEP_S not in sleeps


def test_the_pace_sleeps_every_step_and_a_drain_or_an_in_process_round_ends_a_stop(tmp_path, sleeps):
    hold = tmp_path / "hold"
    held_train.pause_at(hold, 3)
    hook = held_train.held(hold=str(hold))
    hook(trainer_at(2))
    assert sleeps == [held_train.HELD_STEP_S]
    draining = trainer_at(3)
    draining.run.drain.requested = True  # torchrun stops the group for a join: it must not wait
    hook(draining)
    joining = trainer_at(3)
    joining.run.regroup.replaced = lambda: True  # the agent took a join in process: nor must it wait
    hook(joining)
    held_train.release(hold)
    hook(trainer_at(4))
    assert sleeps == [held_train.HELD_STEP_S] * 3


def test_the_harness_stops_the_job_at_each_faults_step_and_releases_it_after_the_last(tmp_path):
    plan = FaultPlan((
        Fault("kill_node", "random", at_step=25),
        Fault("add_node", settle=False),  # no trigger: fires right after the kill, the next fault decides
        Fault("kill_node", "rank0", at_step=60),
        Fault("kill_node", "rank0", at_step=80, on_event="snapshot_captured"),
        Fault("kill_worker", "random", at_step=90),
    ), initial_nodes=3, min_nodes=1, max_nodes=4)
    hold = tmp_path / "hold"
    harness = ChaosHarness(tmp_path / "run", ["--model", "mlp"], plan, hold=hold)
    said = []
    for next_fault in range(len(plan.faults) + 1):
        harness._steer_hold(next_fault)
        said.append(hold.read_text() if hold.exists() else None)
    assert said == ["run_to=25", "run_to=60", "run_to=60", "", "run_to=90", None]
