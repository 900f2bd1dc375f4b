"""Assertions and messages for tests that run local multi-node jobs."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

# The hold file's writers are the held module's own (the tests used to carry copies of two of them).
from elastic_ddp.chaos.held_train import HOLD_VARIABLE, pace, pause_at, release, run_to  # noqa: F401 - re-exported
from elastic_ddp.runlog.audit import exactly_once_violations, read_entries
from elastic_ddp.testbed.local_cluster import LocalJob

REPO = Path(__file__).resolve().parents[2]
HELD_MODULE = "elastic_ddp.chaos.held_train"
FAULT_MODULE = "tests.support.fault_switch"  # held, with a fault switch
# Added to the training arguments of every job the `local_jobs` fixture makes, and of the
# references they are compared with: tests/run_cuda.sh sets "--device cuda --dist_backend gloo"
# (every node's workers on the one GPU; nccl refuses several ranks per GPU).
EXTRA_TRAINING_ARGS = shlex.split(os.environ.get("ELASTIC_DDP_TEST_TRAINING_ARGS", ""))


def hold_settings(hold_file: Path) -> dict:
    """LocalJob/ChaosHarness keyword arguments for a job held until `release(hold_file)`.

    The file is created now; while it exists every step sleeps (elastic_ddp/chaos/held_train.py)."""
    hold_file.parent.mkdir(parents=True, exist_ok=True)
    hold_file.touch()
    # The repository first, then what the caller's environment had (a GPU machine's packages may
    # only be on PYTHONPATH: replacing it left the nodes without blake3, seen on an H200).
    pythonpath = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    return {"module": HELD_MODULE, "env": {HOLD_VARIABLE: str(hold_file), "PYTHONPATH": pythonpath}}


def assert_exactly_once(job: LocalJob, dataset_size: int, epochs: int, global_batch_size: int) -> None:
    problems = exactly_once_violations(read_entries(job.audit_dir), dataset_size, epochs, global_batch_size)
    assert not problems, problems


def assert_workers_started_warm(job: LocalJob, node, starts: int) -> None:
    """Every worker `node` started (at least `starts` of them, from the `start` events) was forked by its
    agent's warm-worker server (elastic_ddp/agent/warm_workers.py), none started cold."""
    pids = [rank["pid"] for event in job.events("start") for rank in event["ranks"] if rank["agent_pid"] == node.pid]
    log = node.log_text()
    assert len(pids) >= starts and all(f"(pid {pid}) forked warm" in log for pid in pids), (pids, log[-4000:])
    assert "no warm-worker server answered" not in log


def node_logs(job: LocalJob) -> str:
    """The end of every node's log, for assertion messages."""
    return "\n".join(f"===== {node.name}\n{node.log_text()[-4000:]}" for node in job.nodes)


def world_reached(job: LocalJob, world_size: int, timeout: float = 90) -> dict:
    """Wait for the `start` event of a worker group of `world_size`; return it."""
    return job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == world_size, timeout,
                              f"a worker group of world size {world_size}")


def memory_restore_mid_epoch(job: LocalJob, world_size: int, previous_world_size: int, after: float,
                             steps_per_epoch: int) -> dict:
    """Wait for the restore of a group of `world_size` after `after` (Unix time); assert it came from
    memory, lost nothing, followed a group of `previous_world_size` and resumed mid-epoch (a step no
    snapshot file holds, when files are written only at epoch ends). Return it."""
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == world_size
                                 and e["time"] > after, 120, f"a restore in world {world_size}")
    assert restore["source"] == "memory" and restore["lost_steps"] == 0, restore
    assert restore["previous_world_size"] == previous_world_size and restore["verified"], restore
    assert restore["global_step"] % steps_per_epoch, ("a mid-epoch step: no snapshot file holds it", restore)
    return restore
