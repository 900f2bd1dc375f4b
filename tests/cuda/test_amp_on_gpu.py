"""fp16 autocast with GradScaler on one GPU (and bf16 without one, --amp_dtype bf16): the scale moves, skipped updates are counted, and a run
interrupted and resumed from its snapshot equals an uninterrupted one bit for bit (model, optimizer,
scaler, CUDA RNG), as tests/unit/test_resume.py checks on the CPU.

    bash tests/run_cuda.sh tests/cuda/test_amp_on_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_ddp import load_snapshot
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.training.trainer import Trainer
from elastic_ddp.workload.data import SyntheticImageDataset
from elastic_ddp.workload.models import build_model
from tests.support.training import Crash, assert_same_parameters, crash_at, small_config


def _amp_config(tmp_path, **overrides):
    return small_config(tmp_path, model="mini_resnet", device="cuda", use_amp=True, **overrides)


def _trainer(config, dropout: bool = False, **kwargs) -> Trainer:
    model = build_model(config.model, config.seed)
    if dropout:  # draws from the CUDA generator every step: a resume must restore it
        model = nn.Sequential(model, nn.Dropout(0.3))
    return Trainer(model=model, dataset=SyntheticImageDataset(config.dataset_size, config.seed), config=config,
                   **kwargs)


def test_fp16_scale_moves_and_skipped_updates_are_counted(tmp_path):
    config = _amp_config(tmp_path, epochs=3)
    trainer = _trainer(config)
    assert trainer.state.grad_scaler.scaler.is_enabled(), "fp16 autocast on CUDA uses a GradScaler"
    # A start scale far above fp16's range: the first updates overflow and are skipped, the scale
    # halves each time, then grows again every 3 good steps.
    trainer.state.grad_scaler.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40, growth_interval=3)
    trainer.fit()

    skipped = [e for e in read_events(tmp_path / "ck" / EVENT_LOG_NAME) if e["event"] == "amp_step_skipped"]
    assert len(skipped) == trainer.state.grad_scaler.skipped_steps >= 10
    scales = [e["scale"] for e in skipped]
    assert scales == sorted(scales, reverse=True) and scales[0] == 2.0**39
    final = load_snapshot(config.checkpoint_dir)
    assert final["global_step"] == config.epochs * config.steps_per_epoch, "skipped steps still count"
    assert final["grad_scaler"]["scale"] == trainer.state.grad_scaler.scaler.get_scale() != 2.0**40
    assert all(torch.isfinite(value).all() for value in final["model"].values())


@pytest.mark.parametrize("crash_step", [5, 6, 9])  # mid-epoch after a snapshot, epoch boundary, later
def test_resumed_amp_run_equals_an_uninterrupted_run(tmp_path, crash_step, deterministic_cuda):
    # From the file snapshot: memory copies carry no RNG state, and dropout draws from it.
    reference = _amp_config(tmp_path / "reference", memory_copies=False)
    _trainer(reference, dropout=True).fit()
    expected = load_snapshot(reference.checkpoint_dir)

    interrupted = _amp_config(tmp_path / "interrupted", memory_copies=False)
    with pytest.raises(Crash):
        _trainer(interrupted, dropout=True, after_step=crash_at(crash_step)).fit()
    resumed = _trainer(interrupted, dropout=True)  # everything rebuilt from nothing
    resumed.fit()
    result = load_snapshot(interrupted.checkpoint_dir)

    assert result["global_step"] == expected["global_step"] == reference.epochs * reference.steps_per_epoch
    assert_same_parameters(result["model"], expected["model"])
    assert result["grad_scaler"] == expected["grad_scaler"] is not None
    for key, state in expected["optimizer"]["state"].items():
        assert torch.equal(result["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"])


def test_bf16_on_cuda_needs_no_scaler_and_resumes_exactly(tmp_path, deterministic_cuda):
    """--amp_dtype bf16: autocast to bf16 on the GPU, no GradScaler, a resume bit-equal."""
    reference = _amp_config(tmp_path / "reference", amp_dtype="bf16", memory_copies=False)
    trainer = _trainer(reference)
    assert trainer.run.autocast_dtype is torch.bfloat16 and not trainer.state.grad_scaler.scaler.is_enabled()
    trainer.fit()
    interrupted = _amp_config(tmp_path / "interrupted", amp_dtype="bf16", memory_copies=False)
    with pytest.raises(Crash):
        _trainer(interrupted, after_step=crash_at(5)).fit()
    _trainer(interrupted).fit()
    expected, result = load_snapshot(reference.checkpoint_dir), load_snapshot(interrupted.checkpoint_dir)
    assert result["grad_scaler"] is None and result["global_step"] == expected["global_step"]
    assert_same_parameters(result["model"], expected["model"])


def test_the_cuda_rng_state_is_part_of_the_snapshot_and_restored(tmp_path):
    # Memory copies carry no RNG state (docs/snapshots.md): restore from the file snapshot here.
    reference = _amp_config(tmp_path / "reference", memory_copies=False)
    expected: dict[int, torch.Tensor] = {}
    _trainer(reference, dropout=True, after_step=lambda t: expected.setdefault(t.global_step,
                                                                               torch.cuda.get_rng_state())).fit()

    config = _amp_config(tmp_path / "interrupted", memory_copies=False)
    with pytest.raises(Crash):
        _trainer(config, dropout=True, after_step=crash_at(5)).fit()
    snapshot = load_snapshot(config.checkpoint_dir)
    assert snapshot["global_step"] == 4
    assert torch.equal(snapshot["rng_per_rank"][0]["cuda"][0], expected[4])

    torch.cuda.manual_seed_all(12345)  # another stream, as a fresh process could have
    seen: dict[int, torch.Tensor] = {}
    _trainer(config, dropout=True, after_step=lambda t: seen.setdefault(t.global_step, torch.cuda.get_rng_state())).fit()
    assert min(seen) == 5
    assert torch.equal(seen[5], expected[5]), "step 5 drew from the restored CUDA generator"
    assert not torch.equal(expected[5], expected[4]), "dropout draws advance the generator every step"
