"""SIGTERM as a flag (elastic_ddp/runtime/drain.py), and the drain vote: SIGTERM on any rank is
agreed by all ranks, without a collective per step.

    .venv/bin/python -m pytest -q tests/unit/test_drain.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.runtime import drain


def test_sigterm_becomes_a_flag_and_the_handler_is_put_back():
    drain_signal = drain.DrainSignal(torch.device("cpu"))
    before = signal.getsignal(signal.SIGTERM)
    assert drain_signal.seconds_since_request() is None, "no SIGTERM yet"
    with drain_signal.sigterm_handler_restored():
        drain_signal.catch_sigterm()
        assert not drain_signal.agreed()
        sent_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert drain_signal.agreed()  # without a process group, this process alone decides
        seen_at = time.monotonic()
    assert signal.getsignal(signal.SIGTERM) is before
    assert sent_at <= drain_signal.requested_at <= seen_at
    asked_at = time.monotonic()
    since = drain_signal.seconds_since_request()
    answered_at = time.monotonic()
    # Rounded to the millisecond: at most 0.5 ms outside the intervals measured around the signal and the call.
    assert asked_at - seen_at - 0.0005 <= since <= answered_at - sent_at + 0.0005


def test_seconds_since_request_counts_from_the_first_sigterm(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(drain.time, "monotonic", lambda: clock[0])
    drain_signal = drain.DrainSignal(torch.device("cpu"))
    drain_signal._on_sigterm(signal.SIGTERM, None)
    clock[0] = 101.0
    drain_signal._on_sigterm(signal.SIGTERM, None)  # a second SIGTERM does not restart the count
    clock[0] = 102.4567
    assert drain_signal.seconds_since_request() == 2.457


@pytest.mark.timeout(60)
def test_the_drain_vote_runs_about_every_quarter_second_not_every_step(one_rank_gloo_group, monkeypatch):
    """The throughput fix in elastic_ddp/runtime/drain.py: a collective per step cost several percent of a
    small model's step, so the ranks vote about every VOTE_INTERVAL_S seconds and still agree."""
    assert drain.steps_between_votes(0) == 1 and drain.steps_between_votes(1.0) == 1
    assert drain.steps_between_votes(0.01) == 25 and drain.steps_between_votes(1e-6) == drain.MAX_STEPS_BETWEEN_VOTES
    clock = [100.0]
    monkeypatch.setattr(drain.time, "monotonic", lambda: clock[0])
    votes = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(drain.dist, "all_reduce", lambda *a, **k: votes.append(clock[0]) or all_reduce(*a, **k))
    drain_signal = drain.DrainSignal(torch.device("cpu"))
    answers = []
    for step in range(1, 201):
        clock[0] += 0.01  # a 10 ms step
        if step == 120:
            drain_signal._on_sigterm(15, None)
        answers.append(drain_signal.agreed())
    drain_signal.finish()
    assert 8 <= len(votes) <= 12  # 2 s of steps: the first steps, then one vote per 25 steps
    first_true = answers.index(True) + 1  # the trainer drains at the first True
    assert 120 < first_true <= 120 + 2 * 25


