"""The worker's side of an in-process re-form, piece by piece (elastic_ddp/training/in_process.py):
what counts as a lost peer, the environment a round gives a worker, the alarm that fails a
collective left waiting in a replaced group, and the comm hook that routes the loop's own.
The whole, with real processes: tests/cluster/test_in_process.py."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.round_handoff import RoundAnnouncement
from elastic_ddp.training.in_process import (
    REPLACED_GROUP,
    BrokenGroupAlarm,
    InterruptibleCommHook,
    apply_round,
    lost_peer,
    what_broke,
)

pytestmark = pytest.mark.timeout(60)

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:48849: Connection reset by peer. This is typically caused by a remote worker hanging")


def test_a_lost_peer_is_told_by_gloos_words_not_by_the_type():
    assert lost_peer(RuntimeError(GLOO_RESET))
    assert lost_peer(RuntimeError(f"Unable to cast Got the following error when running the callback: "
                                  f"RuntimeError: {GLOO_RESET}"))
    assert lost_peer(RuntimeError(REPLACED_GROUP))
    assert lost_peer(dist.DistError("anything a distributed call raised"))
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"))
    assert not lost_peer(ValueError(GLOO_RESET))  # not what a collective raises


def test_what_broke_is_gloos_own_words_without_the_wrapping_or_the_advice():
    wrapped = RuntimeError(f"Unable to cast Got the following error when running the callback: RuntimeError: "
                           f"{GLOO_RESET}")
    assert what_broke(wrapped) == ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                                   "error [127.0.0.1]:48849: Connection reset by peer")
    assert what_broke(RuntimeError("")) == "RuntimeError"


def test_a_round_gives_the_worker_torchruns_variables_for_its_new_place(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "stale")
    # Nodes of 1, 2 and 3 workers: this one, group rank 1, holds ranks 1 and 2 of 6.
    round_seven = RoundAnnouncement(7, group_rank=1, group_world_size=3, master_addr="10.0.0.2", master_port=29511,
                                    in_process=True, first_rank=1, world_size=6)
    apply_round(round_seven, local_rank=1, local_world_size=2)
    assert {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "2", "WORLD_SIZE": "6", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "2",
        "ROLE_WORLD_SIZE": "6", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29511"}
    with pytest.raises(ValueError, match="round 7: 6 worker"):  # more workers here than the round has room for
        apply_round(round_seven, local_rank=0, local_world_size=6)


class _Rounds:
    """A stand-in for `Regroup.replaced`: whether the agent announced a round after the group's."""

    def __init__(self):
        self.newer = threading.Event()

    def replaced(self) -> bool:
        return self.newer.is_set()


def test_the_alarm_hands_a_collectives_result_on_while_the_group_stands():
    alarm = BrokenGroupAlarm(_Rounds())
    collective: torch.futures.Future = torch.futures.Future()
    guarded = alarm.guard(collective)
    assert not guarded.done()
    collective.set_result(torch.ones(2))
    assert torch.equal(guarded.wait(), torch.ones(2))
    failing: torch.futures.Future = torch.futures.Future()
    guarded = alarm.guard(failing)
    failing.set_exception(RuntimeError(GLOO_RESET))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        guarded.wait()


def test_the_alarm_fails_a_collective_left_waiting_once_the_agent_announces_a_newer_round():
    rounds = _Rounds()
    alarm = BrokenGroupAlarm(rounds)
    never: torch.futures.Future = torch.futures.Future()  # a neighbour that left: no error, no result
    guarded = alarm.guard(never)
    rounds.newer.set()
    with pytest.raises(RuntimeError, match=REPLACED_GROUP):
        guarded.wait()  # within ALARM_POLL_S (the test's timeout bounds it)
    never.set_result(torch.zeros(1))  # the abandoned collective ending later changes nothing
    assert guarded.done()


def test_the_loops_own_comm_hook_runs_in_place_of_the_default_once():
    hook = InterruptibleCommHook(BrokenGroupAlarm(_Rounds()))
    calls = []

    def loops_hook(state, bucket):
        calls.append((state, bucket))
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket)
        return done

    hook.register("my state", loops_hook)
    assert hook(bucket="a bucket").wait() == "a bucket" and calls == [("my state", "a bucket")]
    with pytest.raises(RuntimeError, match="DDP takes one"):
        hook.register(None, loops_hook)
