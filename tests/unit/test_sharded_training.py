"""Sharded training (`--sharding fsdp`) in one process with a real gloo group of one rank: FSDP2
shards, DCP snapshots committed per step, a resume equal to an uninterrupted run, and snapshots
that are torn or would run code refused. Memory parts: a damaged one (truncated, or holding NaNs)
is refused with its reason and the durable step restored; a diverged step is never kept in memory. tests/cluster/test_sharded_cluster.py reshards across
world sizes with real torchrun nodes.

    .venv/bin/python -m pytest -q tests/unit/test_sharded_training.py
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.memory_shards import ShardCopy, checksum_of
from elastic_ddp.snapshot.sharded.safe_reader import RestrictedUnpickler, UnsafeCheckpointError
from elastic_ddp.training.sharding import ShardingError, shard_blocks
from elastic_ddp.workload.models import MLP, MiniResNet
from tests.support.training import Crash, crash_at, make_trainer, small_config


def _sharded(tmp_path, **overrides):
    return small_config(tmp_path, sharding="fsdp", **overrides)


def _final_model(config) -> dict[str, torch.Tensor]:
    return load_snapshot(config.checkpoint_dir)["model"]


def tmp_path_of(config) -> Path:
    return Path(config.checkpoint_dir)


def test_blocks_come_from_the_model_or_the_globs():
    assert shard_blocks(MLP()) == ["net.1", "net.3", "net.5"]
    assert shard_blocks(MiniResNet()) == ["stem", "layers.0", "layers.1", "head"]
    assert shard_blocks(MLP(), ("net.[13]",)) == ["net.1", "net.3"]
    with pytest.raises(ShardingError, match=r"^--shard_blocks: got layers\.\*, which matches no submodule of MLP; "
                                            r"expected globs over names such as net, net\.0, net\.1, net\.2$"):
        shard_blocks(MLP(), ("layers.*",))


def test_sharding_without_a_process_group_is_refused_in_one_line(tmp_path):
    with pytest.raises(ShardingError, match=r"^--sharding fsdp: got no process group; expected a run under torchrun"):
        make_trainer(_sharded(tmp_path))


def test_a_sharded_run_equals_the_unsharded_one_and_resumes_exactly(one_rank_gloo_group, tmp_path, monkeypatch):
    plain = small_config(tmp_path / "plain")
    make_trainer(plain).fit()
    expected = load_snapshot(plain.checkpoint_dir)["model"]

    reference = _sharded(tmp_path / "reference")
    make_trainer(reference).fit()
    uninterrupted = _final_model(reference)
    assert uninterrupted.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(uninterrupted[name], value, rtol=0, atol=1e-6)

    read: list[str] = []  # the directory of each file checksummed
    checksum = steps.file_checksum
    monkeypatch.setattr(steps, "file_checksum", lambda path: read.append(path.parent.name) or checksum(path))
    for memory_copies, restored_step, source in ((False, 4, "file"), (True, 5, "memory")):
        interrupted = _sharded(tmp_path / f"interrupted-{source}", memory_copies=memory_copies)
        with pytest.raises(Crash):
            make_trainer(interrupted, after_step=crash_at(5)).fit()
        assert [step for step, _ in steps.committed_steps(tmp_path_of(interrupted))] == [4]
        read.clear()
        make_trainer(interrupted).fit()
        # A memory state at least as new as the newest step wins before a file of a step is read.
        assert ("sharded-000000004" in read) == (source == "file"), (source, read)
        restore = next(e for e in read_events(tmp_path_of(interrupted) / EVENT_LOG_NAME) if e["event"] == "restore")
        assert (restore["global_step"], restore["source"], restore["lost_steps"]) == (
            restored_step, source, 5 - restored_step)
        resumed = _final_model(interrupted)
        for name, value in uninterrupted.items():
            assert torch.equal(resumed[name], value), name
        assert len(steps.committed_steps(tmp_path_of(interrupted))) <= interrupted.keep_last
    assert not any((tmp_path / "interrupted-memory" / "memory").rglob("shard-*"))  # the finished run removed them


def test_load_snapshot_reads_a_sharded_run_as_it_reads_a_ddp_one(one_rank_gloo_group, tmp_path):
    """One call for either kind of run, no process group needed: the sharded step's model, its
    optimizer state by parameter name, and the unsharded rest, equal to the DDP run's."""
    plain = small_config(tmp_path / "plain", optimizer="adamw")
    sharded = _sharded(tmp_path / "sharded", optimizer="adamw")
    make_trainer(plain).fit()
    make_trainer(sharded).fit()
    expected, got = load_snapshot(plain.checkpoint_dir), load_snapshot(sharded.checkpoint_dir)
    assert [got[key] for key in ("global_step", "epoch", "samples_consumed")] == [
        expected[key] for key in ("global_step", "epoch", "samples_consumed")]
    assert got["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=0, atol=1e-6)
    names = list(expected["model"])  # the MLP's parameters, in the optimizer's index order
    assert set(got["optimizer"]["state"]) == set(names)
    assert [group["params"] for group in got["optimizer"]["param_groups"]] == [names]
    for index, name in enumerate(names):
        for key, value in expected["optimizer"]["state"][index].items():
            torch.testing.assert_close(got["optimizer"]["state"][name][key], value, rtol=0, atol=1e-6)
    assert got["scheduler"] == expected["scheduler"]


def test_a_torn_shard_is_refused_and_the_older_step_restored(one_rank_gloo_group, tmp_path):
    config = _sharded(tmp_path, keep_last=3, memory_copies=False)
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(9)).fit()
    (newest_step, newest), (older_step, _), *_ = steps.committed_steps(tmp_path_of(config))
    shard = next(path for path in newest.iterdir() if path.suffix == ".distcp")
    with open(shard, "r+b") as handle:
        handle.seek(10)
        handle.write(b"\xff\xfe")
    trainer = make_trainer(config, after_step=crash_at(older_step + 1))
    with pytest.raises(Crash):
        trainer.fit()
    restores = [e for e in read_events(tmp_path_of(config) / EVENT_LOG_NAME) if e["event"] == "restore"]
    assert (newest_step, restores[-1]["global_step"]) == (8, older_step) == (8, 6)  # 6: the epoch end


def test_an_index_that_would_run_code_is_refused_before_anything_is_loaded(one_rank_gloo_group, tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    with pytest.raises(UnsafeCheckpointError, match=r"refers to posix\.system, which a DCP index never holds"):
        RestrictedUnpickler(io.BytesIO(pickle.dumps(Payload())), "planted").load()

    config = _sharded(tmp_path, memory_copies=False)
    make_trainer(config).fit()
    (step, newest), *_ = steps.committed_steps(tmp_path_of(config))
    (newest / ".metadata").write_bytes(pickle.dumps(Payload()))
    steps.commit(newest.rename(steps.temporary_directory(newest.parent, step, 0)), step)  # re-listed: checksums match
    make_trainer(config).fit()  # refuses it, restores the step before
    assert not (tmp_path / "ran").exists()
    restores = [e for e in read_events(tmp_path_of(config) / EVENT_LOG_NAME) if e["event"] == "restore"]
    assert restores[-1]["global_step"] < step


def test_a_stateless_optimizer_resumes_from_memory_exactly(one_rank_gloo_group, tmp_path):
    """Plain SGD keeps no state, so get_state_dict steps it with zero gradients at each snapshot to
    initialise it: that step is not a commit and must not replace the memory part of the step."""
    reference = _sharded(tmp_path / "reference", momentum=0.0)
    make_trainer(reference).fit()
    interrupted = _sharded(tmp_path / "interrupted", momentum=0.0)
    with pytest.raises(Crash):
        make_trainer(interrupted, after_step=crash_at(5)).fit()
    make_trainer(interrupted).fit()
    restore = next(e for e in read_events(tmp_path_of(interrupted) / EVENT_LOG_NAME) if e["event"] == "restore")
    assert (restore["global_step"], restore["source"], restore["lost_steps"]) == (5, "memory", 0)
    resumed, expected = _final_model(interrupted), _final_model(reference)
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name


def _damage(copy: ShardCopy, how: str) -> ShardCopy:
    """`copy` with its data truncated or made NaN, its checksum made to match (damaged before it was hashed)."""
    data = (bytes(copy.data[:len(copy.data) // 2]) if how == "truncated"
            else torch.full((len(copy.data) // 4,), float("nan")).numpy().tobytes())
    return dataclasses.replace(copy, data=data, checksum=checksum_of(copy.index, data))


@pytest.mark.parametrize("how, reason", [("truncated", "its parts could not be read"),
                                         ("non-finite", "non-finite values in model.")])
def test_a_damaged_memory_part_falls_back_to_the_durable_step(one_rank_gloo_group, tmp_path, how, reason):
    """The memory part of step 5 (the only one kept once step 5 is committed: step 4's was dropped)
    is damaged but whole (its checksum matches): the restart refuses it with the reason and restores
    the durable step 4, instead of failing."""
    config = _sharded(tmp_path)
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(5)).fit()
    parts = sorted((tmp_path / "memory").rglob("shard-*.bin"))
    assert [path.name.split("-")[1] for path in parts] == ["000000005"]
    for path in parts:
        path.write_bytes(_damage(ShardCopy.from_bytes(path.read_bytes(), str(path)), how).to_bytes())
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(5)).fit()
    restore = next(e for e in read_events(tmp_path_of(config) / EVENT_LOG_NAME) if e["event"] == "restore")
    assert (restore["global_step"], restore["source"], restore["lost_steps"]) == (4, "file", 1)
    assert [item["global_step"] for item in restore["refused"]] == [5]
    assert all(item["reason"].startswith(f"refused: {reason}") for item in restore["refused"])


def test_a_diverged_step_is_never_kept_in_memory(one_rank_gloo_group, tmp_path, caplog):
    """NaNs appear in the weights after step 5: steps 6 and 7 are not kept (said once), so the
    restart resumes from step 5 in memory, the last finite state."""
    def diverge_then_crash(trainer) -> None:
        if trainer.global_step == 5:
            with torch.no_grad():
                next(trainer.state.model.parameters()).to_local().fill_(float("nan"))
        crash_at(7)(trainer)

    config = _sharded(tmp_path)
    with caplog.at_level(logging.ERROR), pytest.raises(Crash):
        make_trainer(config, after_step=diverge_then_crash).fit()
    said = [record.getMessage() for record in caplog.records if "not kept in memory" in record.getMessage()]
    assert len(said) == 1 and said[0].startswith("the state of step 6 holds non-finite values")
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(6)).fit()
    restore = next(e for e in read_events(tmp_path_of(config) / EVENT_LOG_NAME) if e["event"] == "restore")
    assert (restore["global_step"], restore["source"]) == (5, "memory")


def test_without_a_durable_step_a_failed_memory_restore_starts_afresh(one_rank_gloo_group, tmp_path):
    """No durable step yet, the only memory part truncated: the restart refuses it and trains from
    scratch, from the very weights an untouched run starts from (the failed load is undone, and the
    optimizer left without state, so that weight decay does not enter a momentum buffer early)."""
    config = _sharded(tmp_path / "interrupted", snapshot_every_steps=100, weight_decay=0.01)
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(2)).fit()
    for path in (tmp_path / "interrupted" / "memory").rglob("shard-*.bin"):
        path.write_bytes(_damage(ShardCopy.from_bytes(path.read_bytes(), str(path)), "truncated").to_bytes())
    restarted = make_trainer(config, after_step=crash_at(1))
    reference = make_trainer(_sharded(tmp_path / "reference", weight_decay=0.01), after_step=crash_at(1))
    for trainer in (restarted, reference):
        with pytest.raises(Crash):
            trainer.fit()
    assert not [e for e in read_events(tmp_path_of(config) / EVENT_LOG_NAME) if e["event"] == "restore"]
    for mine, expected in zip(restarted.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(mine.to_local(), expected.to_local())


class _Buffered(torch.nn.Module):
    """A buffer in the state dict (BatchNorm's) and one not in it, beside two linear blocks."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.register_buffer("table", torch.arange(6.0), persistent=False)

    def forward(self, x):
        return self.norm(self.second(self.first(x))) + self.table


def test_a_model_rebuilt_for_a_re_formed_group_is_the_one_taken_before_sharding(one_rank_gloo_group):
    """What an in-process re-form under fsdp shards again (training/sharding.py): the copy taken
    before the first sharding holds no parameter memory (meta) and keeps the buffers and the ties;
    rebuilt and loaded with the sharded model's state, it computes what that model computes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from elastic_ddp.training.sharding import parameterless_copy, place_model, rebuilt

    tied = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    skeleton_of_tied = parameterless_copy(tied)
    assert skeleton_of_tied[1].weight is skeleton_of_tied[0].weight and skeleton_of_tied[0].weight.is_meta

    torch.manual_seed(0)
    model = _Buffered()
    skeleton = parameterless_copy(model)
    assert all(parameter.is_meta for parameter in skeleton.parameters())
    assert torch.equal(skeleton.table, model.table) and not model.first.weight.is_meta
    sharded = place_model(model, "fsdp", "", torch.device("cpu"))
    fresh = rebuilt(skeleton, "", torch.device("cpu"))
    set_model_state_dict(fresh, get_model_state_dict(sharded))
    inputs = torch.randn(4, 6)
    sharded.eval(), fresh.eval()
    assert torch.equal(fresh(inputs), sharded(inputs))


def test_fsdps_collectives_give_a_lost_peer_to_the_run_and_issue_none_once_the_group_broke(one_rank_gloo_group):
    """`InterruptibleFSDPCollectives`: FSDP2's own calls, waited for through the alarm; gloo's error
    for a lost peer is handed to the run, which takes it (the step is abandoned), and nothing is
    issued on a group known broken. Another error propagates."""
    from elastic_ddp.training.in_process import BrokenGroupAlarm, InterruptibleFSDPCollectives, lost_peer

    class NoRound:  # the agent announced nothing: the alarm never fires
        def abandons_the_group(self) -> bool:
            return False

    handed: list[str] = []
    broken = [False]
    collectives = InterruptibleFSDPCollectives(
        BrokenGroupAlarm(NoRound()), lambda what, exc: lost_peer(exc) and not handed.append(f"{what}: {exc}"),
        lambda: broken[0])
    group = torch.distributed.group.WORLD
    output = collectives.all_gather.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    assert collectives.all_gather(output, torch.arange(4.0), group, async_op=True).wait()
    assert torch.equal(output, torch.arange(4.0)) and handed == []
    collectives.reduce_scatter(output, torch.ones(4), group, op=torch.distributed.ReduceOp.SUM)
    assert torch.equal(output, torch.ones(4))

    def raising(message: str):
        def call(*_args, **_kwargs):
            raise RuntimeError(message)
        return call

    gathering = collectives.all_gather
    gathering._call = raising("a bug")
    with pytest.raises(RuntimeError, match="a bug"):  # not a lost peer: propagates
        gathering(output, torch.arange(4.0), group)
    gathering._call = raising("gloo/transport/tcp/pair.cc:544] Connection closed by peer")  # refused at once
    assert gathering(output, torch.arange(4.0), group) is None
    assert handed == ["FSDP's all-gather: gloo/transport/tcp/pair.cc:544] Connection closed by peer"]
    failed: torch.futures.Future = torch.futures.Future()
    failed.set_exception(RuntimeError("gloo/transport/tcp: Connection reset by peer"))

    class FailedWork:
        def get_future(self):
            return failed

    gathering._call = lambda *_args, **_kwargs: FailedWork()
    assert gathering(output, torch.arange(4.0), group, async_op=True).wait()  # failed while waited for
    assert handed[1:] == ["FSDP's all-gather: gloo/transport/tcp: Connection reset by peer"]
    broken[0] = True
    gathering._call = raising("issued on a broken group")  # never called once broken
    assert gathering(output, torch.arange(4.0), group) is None and len(handed) == 2


def test_a_guarded_collective_waits_no_longer_than_its_timeout():
    """`_GuardedWork.wait(timeout)`: a collective not done within the timeout raises, as a c10d
    work's wait does; one done returns at once."""
    from datetime import timedelta

    from elastic_ddp.training.in_process import _GuardedWork

    pending: torch.futures.Future = torch.futures.Future()
    with pytest.raises(TimeoutError, match="FSDP's all-gather: not done within 0.05 s"):
        _GuardedWork(pending, lambda what, exc: False, "FSDP's all-gather").wait(timedelta(seconds=0.05))
    pending.set_result(None)
    assert _GuardedWork(pending, lambda what, exc: False, "FSDP's all-gather").wait(timedelta(seconds=5))
