"""Resume: crash after N steps, rebuild everything from nothing, restore, continue; the result
must equal an uninterrupted run bit for bit (same world size, so the same summation order)."""

from __future__ import annotations

import pytest
import torch

from elastic_ddp import load_snapshot
from tests.support.training import Crash, assert_same_parameters, crash_at, make_trainer, small_config


@pytest.mark.parametrize("crash_step", [5, 6, 12])  # mid-epoch after a snapshot, epoch boundary, later
@pytest.mark.parametrize("model", ["mlp", "mini_resnet"])
def test_resumed_run_equals_an_uninterrupted_run(tmp_path, crash_step, model):
    reference = small_config(tmp_path / "reference", model=model)
    make_trainer(reference).fit()
    expected = load_snapshot(reference.checkpoint_dir)

    interrupted = small_config(tmp_path / "interrupted", model=model)
    with pytest.raises(Crash):
        make_trainer(interrupted, after_step=crash_at(crash_step)).fit()
    crashed_at = load_snapshot(interrupted.checkpoint_dir)["global_step"]
    assert crashed_at <= crash_step
    resumed = make_trainer(interrupted)  # everything rebuilt from nothing
    resumed.fit()
    result = load_snapshot(interrupted.checkpoint_dir)

    assert result["global_step"] == expected["global_step"] == reference.epochs * reference.steps_per_epoch
    assert_same_parameters(result["model"], expected["model"])
    assert result["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for key, state in expected["optimizer"]["state"].items():
        assert torch.equal(result["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"])


def test_a_finished_run_relaunched_does_no_more_work(tmp_path):
    config = small_config(tmp_path)
    make_trainer(config).fit()
    before = load_snapshot(config.checkpoint_dir)
    trainer = make_trainer(config)
    trainer.fit()
    assert trainer.global_step == before["global_step"]
    assert load_snapshot(config.checkpoint_dir)["wall_time"] == before["wall_time"]
