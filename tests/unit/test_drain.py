"""The drain vote: SIGTERM on any rank is agreed by all ranks, without a collective per step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.runtime import drain


@pytest.mark.timeout(60)
def test_the_drain_vote_runs_about_every_quarter_second_not_every_step(monkeypatch):
    """The throughput fix in elastic_ddp/runtime/drain.py: a collective per step cost several percent of a
    small model's step, so the ranks vote about every VOTE_INTERVAL_S seconds and still agree."""
    assert drain.steps_between_votes(0) == 1 and drain.steps_between_votes(1.0) == 1
    assert drain.steps_between_votes(0.01) == 25 and drain.steps_between_votes(1e-6) == drain.MAX_STEPS_BETWEEN_VOTES
    clock = [100.0]
    monkeypatch.setattr(drain.time, "monotonic", lambda: clock[0])
    votes = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(drain.dist, "all_reduce", lambda *a, **k: votes.append(clock[0]) or all_reduce(*a, **k))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        drain_signal = drain.DrainSignal(torch.device("cpu"))
        answers = []
        for step in range(1, 201):
            clock[0] += 0.01  # a 10 ms step
            if step == 120:
                drain_signal._on_sigterm(15, None)
            answers.append(drain_signal.agreed())
        drain_signal.finish()
    finally:
        dist.destroy_process_group()
    assert 8 <= len(votes) <= 12  # 2 s of steps: the first steps, then one vote per 25 steps
    first_true = answers.index(True) + 1  # the trainer drains at the first True
    assert 120 < first_true <= 120 + 2 * 25


