"""GradScaler's skipped updates are counted without a device sync of their own
(`ScalerState.step`): the optimizer step post-hook tells whether the update ran.

    .venv/bin/python -m pytest -q tests/unit/test_amp_skipped_steps.py

Runs on the CPU (torch's GradScaler works there too); tests/cuda repeats it with fp16 on a GPU.
"""

from __future__ import annotations

import torch

from elastic_ddp.snapshot.training_state import ScalerState


def _scaled_step(state: ScalerState, weights: torch.nn.Parameter, optimizer, gradient: list[float]) -> bool:
    optimizer.zero_grad()
    state.scaler.scale((weights * torch.tensor(gradient)).sum()).backward()
    return state.step(optimizer)


def test_an_overflowing_step_is_counted_as_skipped_and_lowers_the_scale():
    weights = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weights], lr=0.1)
    state = ScalerState(torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1))

    assert _scaled_step(state, weights, optimizer, [1.0, float("inf"), 0.0]) is True
    assert torch.equal(weights.detach(), torch.ones(3))  # the update did not run
    assert state.scaler.get_scale() == 4.0

    assert _scaled_step(state, weights, optimizer, [1.0, 1.0, 0.0]) is False
    assert torch.allclose(weights.detach(), torch.tensor([0.9, 0.9, 1.0]))
    assert state.scaler.get_scale() == 8.0  # grown again after one good step (growth_interval=1)
    assert state.skipped_steps == 1


def test_a_disabled_scaler_never_reports_a_skip():
    weights = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weights], lr=0.1)
    state = ScalerState(torch.amp.GradScaler("cpu", enabled=False))
    assert _scaled_step(state, weights, optimizer, [float("nan"), 1.0]) is False
    assert state.skipped_steps == 0
