"""`--use_amp` with `--amp_dtype`: bf16 autocast without a GradScaler (on the CPU here; the CUDA
cases run in tests/cuda/test_amp_on_gpu.py), a resume equal to an uninterrupted run, and the flag's
bad values refused before anything starts.

    .venv/bin/python -m pytest -q tests/unit/test_precision.py
"""

from __future__ import annotations

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.training.state_builder import autocast_dtype
from tests.support.training import Crash, crash_at, make_trainer, small_config


def test_bf16_autocast_runs_without_a_scaler_and_resumes_exactly(tmp_path):
    reference = small_config(tmp_path / "reference", use_amp=True, amp_dtype="bf16")
    assert autocast_dtype(reference, torch.device("cuda")) is torch.bfloat16  # on CUDA too, unlike auto
    trainer = make_trainer(reference)
    assert trainer.run.autocast_dtype is torch.bfloat16 and not trainer.state.grad_scaler.scaler.is_enabled()
    trainer.fit()
    interrupted = small_config(tmp_path / "interrupted", use_amp=True, amp_dtype="bf16")
    with pytest.raises(Crash):
        make_trainer(interrupted, after_step=crash_at(5)).fit()
    make_trainer(interrupted).fit()
    expected, resumed = load_snapshot(reference.checkpoint_dir), load_snapshot(interrupted.checkpoint_dir)
    assert resumed["global_step"] == expected["global_step"] == 12 and resumed["grad_scaler"] is None
    for name, value in expected["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    fp32 = small_config(tmp_path / "fp32")
    make_trainer(fp32).fit()
    assert any(not torch.equal(load_snapshot(fp32.checkpoint_dir)["model"][name], value)
               for name, value in expected["model"].items()), "bf16 autocast changed nothing"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"use_amp": True, "amp_dtype": "fp8"}, r"^--amp_dtype: got 'fp8'; expected one of auto, bf16, fp16$"),
    ({"amp_dtype": "bf16"}, r"^--amp_dtype: got 'bf16' without --use_amp; expected --use_amp too \(or auto\)$"),
    ({"use_amp": True, "amp_dtype": "fp16", "device": "cpu"},
     r"^--amp_dtype: got 'fp16' with --device cpu \(the CPU here\); expected auto or bf16"),
])
def test_a_bad_amp_dtype_is_one_line_naming_it(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(tmp_path, **overrides)
