"""The worker's side of an in-process re-form, piece by piece (elastic_ddp/training/in_process.py):
what counts as a lost peer, the environment a round gives a worker, the alarm that fails a
collective left waiting in a replaced group, and the comm hook that routes the loop's own.
The whole, with real processes: tests/cluster/test_in_process.py."""

from __future__ import annotations

import os
import tempfile
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.handoff import rounds as round_handoff
from elastic_ddp.handoff.rounds import RoundAnnouncement
from elastic_ddp.training.in_process import (
    REPLACED_GROUP,
    BrokenGroupAlarm,
    InterruptibleCommHook,
    Regroup,
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
    """A stand-in for `Regroup.abandons_the_group`: whether the agent announced a round that ends the group."""

    def __init__(self):
        self.newer = threading.Event()

    def abandons_the_group(self) -> bool:
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


def test_the_alarm_fails_a_collective_of_a_step_a_peer_left_before():
    """A join announced to this node later than to a peer's: the peer left after step N, this rank
    began step N + 1 and waits in its collective. The run's word (`also_when`) fails it, though the
    round only adds nodes."""
    rounds = _Rounds()  # this node's agent has announced nothing yet
    alarm = BrokenGroupAlarm(rounds)
    peer_left_before_this_step = threading.Event()
    alarm.also_when(peer_left_before_this_step.is_set)
    never: torch.futures.Future = torch.futures.Future()
    guarded = alarm.guard(never)
    assert not guarded.done()
    peer_left_before_this_step.set()
    with pytest.raises(RuntimeError, match=REPLACED_GROUP):
        guarded.wait()  # within ALARM_POLL_S (the test's timeout bounds it)


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


def test_only_a_round_that_leaves_the_group_fails_its_collectives(tmp_path, monkeypatch):
    """The alarm's question (`Regroup.abandons_the_group`): a round without some of the group's
    nodes, or a restart, ends the group where it stands; a round that only adds nodes (a join)
    does not, so that every rank finishes the step (and commits it) before switching."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    agent = 4_000_321  # above Linux's pid_max: nothing signals it
    round_handoff.open_handoff(agent)
    regroup = Regroup(SimpleNamespace(), timedelta(seconds=1))
    regroup.enabled, regroup.round, regroup.nodes, regroup._agent = True, 3, 2, agent  # a group of two nodes

    def announce(group_world_size: int, joined: int, in_process: bool = True) -> tuple[bool, bool]:
        round_handoff.publish_round(agent, RoundAnnouncement(
            4, 0, group_world_size, "127.0.0.1", 29500, in_process, "" if in_process else "a restart", joined,
            first_rank=0 if in_process else None, world_size=group_world_size if in_process else None))
        return regroup.replaced(), regroup.abandons_the_group()

    assert announce(3, joined=1) == (True, False)  # both nodes and a newcomer: the step finishes
    assert announce(2, joined=1) == (True, True)  # a node lost and one joining
    assert announce(1, joined=0) == (True, True)  # a node lost
    assert announce(3, joined=1, in_process=False) == (True, True)  # torchrun restarts the workers
    round_handoff.close_handoff(agent)
