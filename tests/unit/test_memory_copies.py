"""Memory copies: the last committed step kept in node memory as training stops, and what a restore
accepts from them (elastic_ddp/snapshot/memory_copies.py, docs/failure-semantics.md). The partial
copy of a writer that has ended: tests/cluster/test_memory_copies_killed_writer.py (a real process).

    .venv/bin/python -m pytest -q tests/unit/test_memory_copies.py
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.runlog.audit import exactly_once_violations, read_entries
from elastic_ddp.runlog.metrics_node import start_ticks
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.files.backends import open_storage
from elastic_ddp.snapshot.files.errors import SnapshotError
from elastic_ddp.snapshot.memory_copies import SCOPE_TOKEN_NAME, MemoryTier, open_memory_tier, scope_token
from elastic_ddp.snapshot.training_state import Snapshot
from elastic_ddp.training.reporting import RunLog
from elastic_ddp.workload.sampler import ElasticSampler
from tests.support.training import Crash, assert_same_parameters, crash_at, make_trainer, small_config

FINGERPRINT = {"model": "m", "dataset_size": 10}


def snapshot_of(step: int, fingerprint: dict | None = None) -> Snapshot:
    return Snapshot(states={"progress": {"global_step": step}, "sampler": {"epoch": 0, "samples_consumed": step},
                            "model": {"w": torch.full((4,), float(step))}},
                    rng_per_rank=[], fingerprint=fingerprint or FINGERPRINT, world_size=2, incarnation=0, wall_time=0.0)


def tier(tmp_path, token: str = "a" * 32, fingerprint: dict | None = None) -> MemoryTier:
    return MemoryTier(tmp_path / "memory", "run", str(tmp_path / "ck"), fingerprint or FINGERPRINT, token)


def restore_events(config) -> list[dict]:
    return [e for e in read_events(os.path.join(config.checkpoint_dir, "events.jsonl")) if e["event"] == "restore"]


# ------------------------------------------------------------------------------- the tier itself

def test_a_kept_copy_is_found_again_and_a_sibling_reuses_it(tmp_path):
    memory = tier(tmp_path)
    kept = memory.keep(snapshot_of(7))
    assert kept is not None and kept.written and kept.path.name.startswith("memory-000000007-")
    again = memory.keep(snapshot_of(7))  # a second rank of the node, same step
    assert again is not None and not again.written and again.path == kept.path
    newest = memory.newest()
    assert newest.global_step == 7 and torch.equal(newest.snapshot.states["model"]["w"], torch.full((4,), 7.0))
    assert oct(memory.directory.stat().st_mode & 0o777) == "0o700"


def test_copies_are_pruned_to_the_newest_two_and_cleared_at_the_end(tmp_path):
    memory = tier(tmp_path)
    for step in (3, 4, 5):
        memory.keep(snapshot_of(step))
    assert sorted(path.name[7:16] for path in memory.directory.glob("memory-*")) == ["000000004", "000000005"]
    memory.clear()
    assert not memory.directory.exists() and memory.newest() is None


def test_a_torn_copy_is_refused_with_a_line_and_the_previous_one_is_used(tmp_path, caplog):
    memory = tier(tmp_path)
    memory.keep(snapshot_of(4))
    newest = memory.keep(snapshot_of(5)).path
    newest.write_bytes(newest.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING):
        assert memory.newest().global_step == 4
    assert f"memory copy refused: {newest}" in caplog.text


def test_a_stale_copy_of_an_earlier_run_is_refused_and_removed(tmp_path, caplog):
    old = tier(tmp_path, token="a" * 32).keep(snapshot_of(5)).path
    new = tier(tmp_path, token="b" * 32)  # the checkpoint directory was created anew: another token,
    assert new.directory != old.parent and new.newest() is None  # so another directory
    new.keep(snapshot_of(3))
    moved = os.replace(old, new.directory / old.name) or new.directory / old.name  # were it found there
    with caplog.at_level(logging.WARNING):
        assert new.newest().global_step == 3
    assert ("is stale: it is from an earlier run whose checkpoint directory has since been created anew or emptied"
            in caplog.text) and not moved.exists()


def test_a_copy_of_another_model_is_refused(tmp_path, caplog):
    tier(tmp_path).keep(snapshot_of(5))
    with caplog.at_level(logging.WARNING):
        assert tier(tmp_path, fingerprint={**FINGERPRINT, "model": "other"}).newest() is None
    assert "written by an incompatible run (model: snapshot has 'm', this run has 'other')" in caplog.text


def test_a_directory_others_can_write_is_not_used(tmp_path, caplog):
    memory = tier(tmp_path)
    memory.keep(snapshot_of(5))
    memory.directory.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        assert memory.newest() is None
        assert memory.keep(snapshot_of(6)) is None
    assert "is not a private directory of this user" in caplog.text
    memory.directory.chmod(0o700)
    (tmp_path / "memory").chmod(0o777)  # a root anyone may write to, without the sticky bit
    assert memory.newest() is None
    assert "is writable by every user and not sticky" in caplog.text


def test_the_scope_token_is_created_once_and_checked(tmp_path):
    storage = open_storage(str(tmp_path / "ck"))
    first = scope_token(storage)
    assert len(first) == 32 and scope_token(storage) == first
    (tmp_path / "ck" / SCOPE_TOKEN_NAME).write_bytes(b"\xff" * 10_000)
    with pytest.raises(SnapshotError, match="is not a scope token"):
        scope_token(storage)


@pytest.mark.parametrize(("local_rank", "level"), [(0, logging.ERROR), (1, logging.INFO)])
def test_a_node_that_cannot_keep_copies_says_why_in_one_line_an_error_on_its_local_rank_0(tmp_path, caplog,
                                                                                          local_rank, level):
    """open_memory_tier, how both sessions open the memory directory: an unusable one, or a checkpoint
    directory without a scope token, turns this node's copies off with one line naming why."""
    context = DistributedContext(rank=local_rank, local_rank=local_rank, world_size=2, local_world_size=2,
                                 device=torch.device("cpu"), backend="gloo")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / SCOPE_TOKEN_NAME).write_text("not a token")
    for memory_dir, checkpoint_dir, why in [(tmp_path / "a-file" / "memory", tmp_path / "other-ck", "Not a directory"),
                                            (tmp_path / "memory", tmp_path / "ck", "no scope token in")]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="elastic_ddp.snapshot.memory_copies"):
            assert open_memory_tier(str(memory_dir), open_storage(str(checkpoint_dir)), context, FINGERPRINT) is None
        [line] = [record for record in caplog.records if "memory copies are off on this node" in record.getMessage()]
        assert line.levelno == level and why in line.getMessage()
    opened = open_memory_tier(str(tmp_path / "memory"), open_storage(str(tmp_path / "other-ck")), context, FINGERPRINT)
    assert opened is not None and oct(opened.directory.stat().st_mode & 0o777) == "0o700"


# ------------------------------------------------------------------------------- in the trainer

def test_a_crash_resumes_from_the_last_committed_step_not_the_last_snapshot(tmp_path):
    reference = small_config(tmp_path / "reference", snapshot_every_steps=0)
    make_trainer(reference).fit()
    config = small_config(tmp_path / "run", snapshot_every_steps=0)  # files only at epoch ends (6, 12)
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(9)).fit()
    assert load_snapshot(config.checkpoint_dir)["global_step"] == 6
    resumed = make_trainer(config)
    resumed.fit()
    restore = restore_events(config)[-1]
    assert (restore["global_step"], restore["source"], restore["lost_steps"]) == (9, "memory", 0)
    assert restore["file"] is None and restore["source_rank"] == 0
    assert_same_parameters(load_snapshot(config.checkpoint_dir)["model"], load_snapshot(reference.checkpoint_dir)["model"])
    assert not any((tmp_path / "run" / "memory").glob("*/memory-*")), "a finished run leaves no memory copy"


def test_a_step_half_applied_is_never_kept(tmp_path, caplog):
    config = small_config(tmp_path, snapshot_every_steps=0, memory_dir=str(tmp_path / "memory"))
    trainer = make_trainer(config)

    def fail_in_step_4(optimizer, args, kwargs):
        if trainer.global_step == 3:  # the parameters have moved, the step count has not
            raise Crash("in the middle of step 4")

    trainer.state.optimizer.register_step_post_hook(fail_in_step_4)
    with caplog.at_level(logging.ERROR), pytest.raises(Crash):
        trainer.fit()
    assert "stopped in the middle of applying step 4: that state is not kept" in caplog.text
    assert not any((tmp_path / "memory").glob("*/memory-*"))
    resumed = make_trainer(config)
    resumed.fit()
    assert restore_events(config) == [], "nothing to restore: started again from scratch"


def test_a_failure_in_forward_or_backward_keeps_the_step_before(tmp_path):
    config = small_config(tmp_path, snapshot_every_steps=0)
    trainer = make_trainer(config)
    forward = trainer.model.forward

    def forward_that_fails_in_step_5(inputs):
        if trainer.global_step == 4:
            raise Crash("a collective failed in step 5")
        return forward(inputs)

    trainer.model.forward = forward_that_fails_in_step_5
    with pytest.raises(Crash):
        trainer.fit()
    resumed = make_trainer(config)
    resumed.fit()
    assert restore_events(config)[-1]["global_step"] == 4


def test_the_audit_log_gets_every_ranks_share_of_the_last_step_that_counted(tmp_path):
    """One rank, as the survivor of a world of 3 that stopped after step 5 counted (step 6 was
    committed and never counted): it writes the shares of ranks 1 and 2 of step 5 too, and the
    oracle accepts them as a whole world (and a repeat as one); nothing of step 6."""
    config = small_config(tmp_path, audit_log=str(tmp_path / "audit"))
    sampler = ElasticSampler(config.dataset_size, config.global_batch_size, config.seed, config.drop_last)
    plans = sampler.plan_epoch_remainder(0, 3, config.micro_batch_size)
    context = DistributedContext(rank=0, local_rank=0, world_size=3, local_world_size=1, device=torch.device("cpu"),
                                 backend="gloo")
    log = RunLog(config, context, 0, len(plans), StartupTimeline())
    for step, plan in enumerate(plans[:6], start=1):
        log.step_committed(plan, step, torch.tensor(1.0), lr=0.1)
    log.steps_counted(5)  # step 6 committed, not counted (a sharded step whose exchange never ended)
    log.stopped_early("RuntimeError: Connection reset by peer")
    log.stopped_early("again")
    log.close()
    entries = read_entries(tmp_path / "audit")
    assert sorted(e["rank"] for e in entries if e["step"] == 5) == [0, 1, 1, 2, 2]
    assert not any(e["step"] == 6 for e in entries)
    assert next(e["samples"] for e in entries if e["step"] == 5 and e["rank"] == 2) == plans[4].samples_of(2, 3)
    # Steps 1-4 lack ranks 1 and 2 (they were never written here); step 5 is whole.
    problems = exactly_once_violations(entries, config.dataset_size, 1, config.global_batch_size)
    assert not any(problem.startswith("step 5:") for problem in problems)
    assert any(problem.startswith("step 4:") for problem in problems)


def test_a_memory_copy_wins_a_tie_and_a_newer_file_wins_over_an_older_copy(tmp_path):
    config = small_config(tmp_path, snapshot_every_steps=0)
    with pytest.raises(Crash):  # step 6 ends epoch 0: a file and a memory copy of the same step
        make_trainer(config, after_step=crash_at(6)).fit()
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(8)).fit()
    assert [(e["global_step"], e["source"]) for e in restore_events(config)] == [(6, "memory")]
    # A restart that uses no copies (--no-memory_copies) redoes 7 and 8 and stops after the next
    # file snapshot (12); the copy of step 8 is still there, and loses to the newer file.
    no_copies = small_config(tmp_path, snapshot_every_steps=0, memory_copies=False)
    with pytest.raises(Crash):
        make_trainer(no_copies, after_step=crash_at(12)).fit()
    assert sorted(path.name[7:16] for path in (tmp_path / "memory").glob("*/memory-*")) == ["000000006", "000000008"]
    make_trainer(config).fit()
    assert [(e["global_step"], e["source"]) for e in restore_events(config)] == [
        (6, "memory"), (6, "file"), (12, "file")]


# ------------------------------------------------------------------------------- hygiene (issue 27, defect 6)

def snapshot_at(step: int, incarnation: int, value: float | None = None) -> Snapshot:
    """`snapshot_of(step)` committed in `incarnation`, its weights `value` (default: the step)."""
    snapshot = snapshot_of(step)
    weights = torch.full((4,), float(step if value is None else value))
    return Snapshot(states={**snapshot.states, "model": {"w": weights}}, rng_per_rank=[], fingerprint=FINGERPRINT,
                    world_size=2, incarnation=incarnation, wall_time=0.0)


def test_a_different_state_of_the_same_step_is_kept_and_the_later_one_is_the_newest(tmp_path):
    """After a rollback and retraining, "step 7" of incarnation 2 is another state than that of 1."""
    memory = tier(tmp_path)
    assert memory.keep(snapshot_at(7, incarnation=1, value=1.0)).written
    second = memory.keep(snapshot_at(7, incarnation=2, value=2.0))
    assert second is not None and second.written, "the other state of step 7 was not written"
    newest = memory.newest()
    assert (newest.global_step, newest.incarnation) == (7, 2)
    assert torch.equal(newest.snapshot.states["model"]["w"], torch.full((4,), 2.0))
    assert not memory.keep(snapshot_at(7, incarnation=2, value=2.0)).written  # a sibling: the same state


def test_a_copy_that_a_restore_would_refuse_does_not_stop_a_sibling_keeping_a_good_one(tmp_path):
    memory = tier(tmp_path)
    torn = memory.keep(snapshot_at(7, incarnation=1)).path
    torn.write_bytes(torn.read_bytes()[:-100])
    again = memory.keep(snapshot_at(7, incarnation=1))
    assert again is not None and again.written and again.path != torn
    assert memory.newest().global_step == 7


def test_memory_copies_of_one_step_from_two_incarnations_are_two_states_and_the_later_wins():
    from elastic_ddp.snapshot.exchange.restore_agreement import FILE, MEMORY, Offer
    old = Offer(10, MEMORY, "blake3:a", 100, incarnation=1)
    new = Offer(10, MEMORY, "blake3:b", 100, incarnation=2)
    assert not old.same_state(new) and old.same_state(Offer(10, MEMORY, "blake3:c", 100, incarnation=1))
    assert max([old, new], key=lambda offer: offer.rank) is new
    # The file of the retrained step 10 beats an old trajectory's memory copy of step 10, and a
    # memory copy still wins the tie with the file of its own incarnation.
    file_of_new = Offer(10, FILE, "blake3:d", 100, incarnation=2)
    assert max([old, file_of_new], key=lambda offer: offer.rank) is file_of_new
    assert max([file_of_new, new], key=lambda offer: offer.rank) is new


def test_a_fresh_run_in_an_emptied_checkpoint_directory_starts_from_scratch(tmp_path, caplog):
    config = small_config(tmp_path, snapshot_every_steps=0)
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(9)).fit()
    for path in (tmp_path / "ck").iterdir():  # rm -r ck/*: the shell's glob leaves hidden files
        if not path.name.startswith("."):
            path.unlink()
    with caplog.at_level(logging.INFO):
        make_trainer(config).fit()
    assert restore_events(config) == [], "an emptied directory resumed an old run's memory copy"
    assert "starting from scratch" in caplog.text


def test_a_tier_refuses_a_memory_dir_under_a_directory_another_user_owns(tmp_path, caplog):
    if os.getuid() != 0:
        pytest.skip("needs root, to give a directory to another user (os.chown)")
    foreign = tmp_path / "theirs"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, 12345, 12345)
    memory = MemoryTier(foreign / "memory", "run", str(tmp_path / "ck"), FINGERPRINT, "a" * 32)
    with pytest.raises(SnapshotError, match=f"{foreign} belongs to uid 12345"):
        memory.open()
    with caplog.at_level(logging.ERROR):
        assert memory.keep(snapshot_of(5)) is None


def test_a_directory_another_user_created_under_the_name_ps_shows_does_not_switch_the_tier_off(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root, to give a directory to another user (os.chown)")
    import hashlib
    derivable = hashlib.sha256(f"{os.getuid()}\0run\0{tmp_path / 'ck'}".encode()).hexdigest()[:20]
    squatted = tmp_path / "memory" / f"elastic_ddp-{derivable}"
    squatted.mkdir(parents=True, mode=0o700)
    os.chown(squatted, 12345, 12345)
    memory = tier(tmp_path)
    memory.open()
    assert memory.keep(snapshot_of(5)) is not None and memory.newest().global_step == 5
    os.chown(memory.directory, 12345, 12345)  # now someone took ours: one clear error, tier off
    with pytest.raises(SnapshotError, match="is not a private directory of this user"):
        memory.open()


def _age(directory, seconds: float) -> None:
    old = time.time() - seconds
    for path in [*directory.iterdir(), directory]:
        os.utime(path, (old, old))


def test_copies_of_abandoned_runs_are_removed_at_start_and_nothing_a_restart_needs(tmp_path, caplog):
    def run(run_id: str) -> MemoryTier:
        memory = MemoryTier(tmp_path / "memory", run_id, str(tmp_path / "ck"), FINGERPRINT, "a" * 32)
        memory.open()
        memory.keep(snapshot_of(5))
        return memory

    ended = subprocess.Popen(["true"])
    ended.wait()
    dead = ended.pid  # the agent of a run that was cancelled
    abandoned, recent, alive, own = run("abandoned"), run("recent"), run("alive"), run("run")
    for memory in (abandoned, recent, own):
        (memory.directory / "agent").write_text(f"{dead} 1\n")
    (alive.directory / "agent").write_text(f"{os.getpid()} {start_ticks(os.getpid())}\n")
    for memory in (abandoned, alive, own):
        _age(memory.directory, 2 * 86400)
    metrics = tmp_path / "memory" / "elastic_ddp-metrics-0123456789abcdef0123"
    metrics.mkdir(mode=0o700)
    _age(metrics, 2 * 86400)
    with caplog.at_level(logging.INFO):
        MemoryTier(tmp_path / "memory", "run", str(tmp_path / "ck"), FINGERPRINT, "a" * 32).open(remove_abandoned=True)
    assert not abandoned.directory.exists()
    assert f"removed the memory copies of an abandoned run: {abandoned.directory}" in caplog.text
    assert recent.directory.exists() and alive.directory.exists() and metrics.exists()
    assert own.newest().global_step == 5, "this run's own copy is what its restart needs"


def test_a_memory_dir_too_small_for_one_state_is_warned_about_at_start(tmp_path, caplog, monkeypatch):
    real = shutil.disk_usage
    memory_dir = tmp_path / "memory"

    def small_shm(path):
        usage = real(path)
        return usage._replace(free=1000) if str(path).startswith(str(memory_dir)) else usage

    monkeypatch.setattr(shutil, "disk_usage", small_shm)
    with caplog.at_level(logging.WARNING):
        make_trainer(small_config(tmp_path, epochs=1)).fit()
    assert caplog.text.count("cannot hold a memory copy of this state") == 1
    assert "sizeLimit" in caplog.text and str(memory_dir) in caplog.text


def test_a_restored_state_kept_again_before_any_step_is_the_same_copy(tmp_path):
    """A worker group that restores step 6 from memory and fails before committing step 7 keeps the
    restored state under the incarnation that committed it: no second copy of the same state."""
    config = small_config(tmp_path, snapshot_every_steps=0)
    with pytest.raises(Crash):
        make_trainer(config, after_step=crash_at(6)).fit()
    trainer = make_trainer(config)
    forward = trainer.model.forward

    def fail_in_step_7(inputs):
        raise Crash("a collective failed in step 7")

    trainer.model.forward = fail_in_step_7
    with pytest.raises(Crash):
        trainer.fit()
    trainer.model.forward = forward
    copies = list((tmp_path / "memory").glob("*/memory-*"))
    assert [path.name[7:16] for path in copies] == ["000000006"], copies
    kept = [e for e in read_events(os.path.join(config.checkpoint_dir, "events.jsonl")) if e["event"] == "memory_copy"]
    assert [(e["global_step"], e["written"]) for e in kept] == [(6, True), (6, False)]
