"""The epoch boundary: a failure between an epoch's last commit and the next step must not leave a
state that no restore can train from (issue 25: such a state used to hang the whole job)."""

from __future__ import annotations

import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.training.loss_window import LossWindow
from elastic_ddp.workload.sampler import ElasticSampler
from tests.support.training import Crash, assert_same_parameters, make_trainer, small_config
from tests.unit.test_memory_copies import restore_events


@pytest.mark.timeout(120)  # before the fix the resumed run looped for ever
def test_a_failure_after_an_epochs_last_commit_resumes_in_the_next_epoch(tmp_path, monkeypatch):
    reference = small_config(tmp_path / "reference", snapshot_every_steps=0, log_interval=2)
    make_trainer(reference).fit()
    config = small_config(tmp_path / "run", snapshot_every_steps=0, log_interval=2)
    trainer = make_trainer(config)
    finish = LossWindow.finish
    fired = []

    def finish_fails_at_the_end_of_epoch_0(window):
        if trainer.global_step == config.steps_per_epoch and not fired:
            fired.append(trainer.state.sampler.state_dict())
            raise Crash("the epoch's last progress reduce failed (a peer died)")
        return finish(window)

    monkeypatch.setattr(LossWindow, "finish", finish_fails_at_the_end_of_epoch_0)
    with pytest.raises(Crash):
        trainer.fit()
    assert fired, "the injected failure did not fire"
    assert trainer.state.sampler.state_dict() == {"epoch": 1, "samples_consumed": 0}, \
        "the epoch's last commit leaves the cursor at the start of the next epoch"
    monkeypatch.setattr(LossWindow, "finish", finish)
    make_trainer(config).fit()
    restore = restore_events(config)[-1]
    assert (restore["global_step"], restore["source"], restore["epoch"]) == (config.steps_per_epoch, "memory", 1)
    result = load_snapshot(config.checkpoint_dir)
    assert result["global_step"] == config.epochs * config.steps_per_epoch
    assert_same_parameters(result["model"], load_snapshot(reference.checkpoint_dir)["model"])


def test_a_cursor_at_the_end_of_an_epoch_loads_as_the_start_of_the_next():
    """A state written by an older version at the epoch's end (cursor == epoch length) still trains."""
    sampler = ElasticSampler(dataset_size=96, global_batch_size=16, seed=0)
    sampler.load_state_dict({"epoch": 0, "samples_consumed": 96})
    assert sampler.state_dict() == {"epoch": 1, "samples_consumed": 0}
    assert len(sampler.plan_epoch_remainder(0, 2, 8)) == sampler.steps_per_epoch
