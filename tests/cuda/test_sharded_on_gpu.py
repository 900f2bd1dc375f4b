"""Sharded training (`--sharding fsdp`) on a GPU: FSDP2's mesh on cuda under a real one-rank NCCL
group, the same model as an unsharded run on the same GPU, and a crash resumed exactly from the
memory copy and from the files. tests/unit/test_sharded_training.py checks the same on the CPU.

    bash tests/run_cuda.sh tests/cuda/test_sharded_on_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.safe_reader import read_tensors
from tests.support.training import Crash, crash_at, make_trainer, small_config


def _final_model(directory: Path) -> dict[str, torch.Tensor]:
    (_, newest), *_ = steps.committed_steps(directory)
    return {name[len("model."):]: value for name, value in read_tensors(newest).items() if name.startswith("model.")}


def test_a_sharded_gpu_run_equals_the_unsharded_one_and_resumes_exactly(one_rank_nccl_group, deterministic_cuda,
                                                                        tmp_path):
    plain = small_config(tmp_path / "plain", device="cuda")
    make_trainer(plain).fit()
    expected = load_snapshot(plain.checkpoint_dir)["model"]

    reference = small_config(tmp_path / "reference", device="cuda", sharding="fsdp")
    trainer = make_trainer(reference)
    assert next(trainer.model.parameters()).device.type == "cuda"
    trainer.fit()
    uninterrupted = _final_model(Path(reference.checkpoint_dir))
    assert uninterrupted.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(uninterrupted[name], value.to(uninterrupted[name].device), rtol=0, atol=1e-5)

    for memory_copies, restored_step, source in ((False, 4, "file"), (True, 5, "memory")):
        interrupted = small_config(tmp_path / f"interrupted-{source}", device="cuda", sharding="fsdp",
                                   memory_copies=memory_copies)
        with pytest.raises(Crash):
            make_trainer(interrupted, after_step=crash_at(5)).fit()
        make_trainer(interrupted).fit()
        restore = next(e for e in read_events(Path(interrupted.checkpoint_dir) / EVENT_LOG_NAME)
                       if e["event"] == "restore")
        assert (restore["global_step"], restore["source"], restore["lost_steps"]) == (
            restored_step, source, 5 - restored_step)
        resumed = _final_model(Path(interrupted.checkpoint_dir))
        for name, value in uninterrupted.items():
            assert torch.equal(resumed[name], value), name
