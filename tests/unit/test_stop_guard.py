"""The stop guard's watchdog path: a silent peer ends this worker within a bound, whatever the
training thread is blocked in (elastic_ddp/training/stop_guard.py, docs/failure-semantics.md
"The watchdog"). Under NCCL the training thread can wait for ever inside a commit (the grad
scaler's step waits on an all-reduce a frozen peer never finishes) while it holds the state's lock;
here an optimizer pre-hook blocks inside the commit the same way, on the CPU.

    .venv/bin/python -m pytest -q tests/unit/test_stop_guard.py
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runtime.watchdog import SILENT_PEER_EXIT_CODE
from elastic_ddp.snapshot.staging import settled_device_work
from elastic_ddp.training import stop_guard
from tests.support.training import Crash, make_trainer, silent_peer_at, small_config

BOUND_S = 5.0  # what the watchdog may take on top of its own bound; the test waits twice that


def test_the_watchdog_ends_a_worker_stuck_inside_a_commit_without_waiting_for_it(tmp_path, monkeypatch, caplog):
    config = small_config(tmp_path, snapshot_every_steps=0)
    trainer = make_trainer(config)
    exits: list[int] = []
    monkeypatch.setattr(stop_guard, "end_worker_now", exits.append)  # instead of os._exit
    outcome: dict[str, float | bool] = {}

    def stuck_in_step_4(optimizer, args, kwargs):
        if trainer.global_step != 3:
            return
        # Inside the commit of step 4, holding the state's lock, as scaler.step() waiting on NCCL
        # would: the peer watchdog finds a peer silent now, on its own thread.
        watchdog = threading.Thread(target=trainer.run.stop_guard._stop_for_silent_peer,
                                    args=("rank(s) [1] sent no heartbeat for over 3 s",), daemon=True)
        started = time.monotonic()
        watchdog.start()
        watchdog.join(timeout=2 * BOUND_S)
        outcome.update(ended=not watchdog.is_alive(), seconds=time.monotonic() - started)
        raise Crash("the collective never ended (the collective timeout, much later)")

    trainer.state.optimizer.register_step_pre_hook(stuck_in_step_4)
    with caplog.at_level(logging.ERROR), pytest.raises(Crash):
        trainer.fit()
    assert outcome["ended"], "the watchdog waited for the training thread stuck inside the commit"
    assert outcome["seconds"] < BOUND_S and exits == [SILENT_PEER_EXIT_CODE]
    assert not list(Path(config.memory_dir).glob("*/memory-*")), "nothing could be kept without waiting"
    assert "the state of step 3 is not kept in memory: the training thread has been applying step 4" in caplog.text
    events = read_events(os.path.join(config.checkpoint_dir, "events.jsonl"))
    [failed] = [e for e in events if e["event"] == "memory_copy_failed"]
    assert failed["global_step"] == 3 and failed["reason"].startswith("peer watchdog: rank(s) [1]")
    assert "applying step 4" in failed["error"]


def test_the_watchdog_still_keeps_the_last_step_when_the_training_thread_is_between_commits(tmp_path, monkeypatch):
    config = small_config(tmp_path, snapshot_every_steps=0)
    exits: list[int] = []
    monkeypatch.setattr(stop_guard, "end_worker_now", exits.append)

    with pytest.raises(Crash):
        make_trainer(config, after_step=silent_peer_at(5)).fit()
    assert exits == [SILENT_PEER_EXIT_CODE]
    assert [path.name[7:16] for path in Path(config.memory_dir).glob("*/memory-*")] == ["000000005"]


def test_a_silent_peer_handed_to_an_in_process_re_form_ends_the_worker_only_if_the_re_form_never_begins(
        tmp_path, monkeypatch):
    """Where the worker re-forms in process and the store answered, the watchdog's thread asks for
    the round and returns; the way out (keep, end) waits SILENT_PEER_REFORM_WAIT_S for the training
    thread to begin the re-form (`stop_watching`), and is taken only if it does not. A silent store
    (this node may be the one cut off) takes the way out at once."""
    config = small_config(tmp_path, snapshot_every_steps=0)
    exits: list[int] = []
    handed: list[str] = []
    monkeypatch.setattr(stop_guard, "end_worker_now", exits.append)
    monkeypatch.setattr(stop_guard, "SILENT_PEER_REFORM_WAIT_S", 0.2)
    silent = "rank(s) [1] sent no heartbeat for over 3 s"

    def after_step(trainer) -> None:
        guard = trainer.run.stop_guard
        guard.in_process = lambda reason: handed.append(reason) or True
        if trainer.global_step == 2:  # the training thread begins the re-form in time: no way out
            guard._stop_for_silent_peer(silent, connected=True)
            way_out = guard._way_out
            guard.stop_watching(switched_after=trainer.global_step)
            way_out.join(timeout=10)
            assert exits == [], "the way out was taken although the re-form began"
        if trainer.global_step == 3:  # the store did not answer (this node may be the one cut off): no handover
            guard._stop_for_silent_peer("the worker group's store (rank 0's) has not answered", connected=False)
            assert exits == [SILENT_PEER_EXIT_CODE]
            exits.clear()
        if trainer.global_step == 4:  # it never does (blocked in a collective nothing can fail)
            guard._stop_for_silent_peer(silent, connected=True)
            assert exits == [], "the watchdog's thread ended the worker before the re-form's deadline"
            guard._way_out.join(timeout=10)
            raise Crash("the worker ended")

    with pytest.raises(Crash):
        make_trainer(config, after_step=after_step).fit()
    assert handed == [silent, silent]
    assert exits == [SILENT_PEER_EXIT_CODE]
    assert sorted(path.name[7:16] for path in Path(config.memory_dir).glob("*/memory-*")) == ["000000003",
                                                                                             "000000004"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_copy_from_another_thread_never_waits_behind_a_blocked_stream_for_longer_than_its_bound():
    """The default stream busy for seconds stands for one blocked behind an all-reduce that never ends."""
    weights = {"model": {"w": torch.ones(1 << 20, device="cuda")}}
    torch.cuda._sleep(int(5e9))  # queued on the default stream before the copy: its work is not done
    started = time.monotonic()
    with settled_device_work(weights, 0.2) as settled:
        assert not settled
    assert time.monotonic() - started < 1.0
    torch.cuda.synchronize()
    with settled_device_work(weights, 0.2) as settled:
        assert settled
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(int(5e9))  # queued by the training thread after: must not delay the copy
        started = time.monotonic()
        copied = weights["model"]["w"].cpu()
    assert time.monotonic() - started < 1.0 and bool((copied == 1).all())
    torch.cuda.synchronize()
