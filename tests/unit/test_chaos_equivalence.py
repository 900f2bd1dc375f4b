"""The chaos harness's equivalence check (elastic_ddp/chaos/equivalence.py) on sharded runs: it reads the
final parameters of a sharded checkpoint directory as of a DDP one, skips a sharded step that does not
verify, and runs a sharded reference as the one worker of `torchrun --standalone` (FSDP2 needs a process
group). The same check on a real chaotic sharded job: tests/cluster/test_sharded_cluster.py."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.chaos.equivalence import compare_runs, final_model, reference_command
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.safe_reader import read_tensors
from tests.support.training import make_trainer, small_config


def test_a_sharded_run_compares_with_an_unsharded_one_and_a_step_that_does_not_verify_is_skipped(
        one_rank_gloo_group, tmp_path, caplog):
    plain = small_config(tmp_path / "plain", log_interval=1)
    sharded = small_config(tmp_path / "sharded", log_interval=1, sharding="fsdp", keep_last=2, memory_copies=False)
    make_trainer(plain).fit()
    make_trainer(sharded).fit()

    expected = load_snapshot(plain.checkpoint_dir)["model"]
    assert final_model(plain.checkpoint_dir).keys() == expected.keys()
    result = compare_runs(plain.checkpoint_dir, sharded.checkpoint_dir)
    assert result.within(1e-6, 1e-6), result.describe()  # world 1: the same sums in the same order
    assert (result.steps_compared, result.missing_steps) == (plain.epochs * plain.steps_per_epoch, []), result

    (newest_step, newest), (older_step, older), *_ = steps.committed_steps(Path(sharded.checkpoint_dir))
    shard = next(path for path in newest.iterdir() if path.suffix == ".distcp")
    with open(shard, "r+b") as handle:  # torn after its commit: the manifest's checksum no longer matches
        handle.seek(10)
        handle.write(b"\xff\xfe")
    with caplog.at_level(logging.WARNING, logger="elastic_ddp.snapshot.sharded.shared_choice"):
        fallen_back = final_model(sharded.checkpoint_dir)
    assert f"sharded snapshot of step {newest_step} refused" in caplog.text and "checksum does not match" in caplog.text
    older_model = {name[len("model."):]: value for name, value in read_tensors(older).items()
                   if name.startswith("model.")}
    assert (newest_step, older_step) == (12, 8)
    assert all(torch.equal(fallen_back[name], value) for name, value in older_model.items())
    assert not all(torch.equal(fallen_back[name], value) for name, value in expected.items()), "an older step"
    assert compare_runs(plain.checkpoint_dir, sharded.checkpoint_dir).parameter_difference > 1e-6


def test_a_directory_without_any_snapshot_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no valid elastic_ddp snapshot, neither a file nor a sharded step"):
        final_model(tmp_path)


def test_a_sharded_reference_runs_under_torchrun_and_an_unsharded_one_alone():
    args = ["--model", "mlp", "--epochs", "1"]
    assert reference_command(args, "ck") == [sys.executable, "-m", "elastic_ddp.train", *args, "--checkpoint_dir", "ck"]
    assert reference_command([*args, "--sharding", "fsdp"], "ck", module="my.train") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "my.train",
        *args, "--sharding", "fsdp", "--checkpoint_dir", "ck"]
