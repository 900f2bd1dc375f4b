"""Elasticity with real torchrun agents as separate nodes on 127.0.0.1, real gloo, real SIGKILLs.

These run stock torchrun (`torch.distributed.run`), the path the README promises; the chaos tests
run the same promises through `elastic_ddp.agent.launcher`.

Each test asserts the final global step and that the audit log shows every sample of every epoch
exactly once in the surviving trajectory. The jobs are held (elastic_ddp/chaos/held_train.py) until the
test's scenario has happened, so that no test depends on how fast training is; a job that ends
early anyway fails the wait at once, saying so.
"""

from __future__ import annotations

import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.chaos.held_train import run_to
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, LocalJob
from tests.support.cluster import assert_exactly_once, hold_settings, node_logs, pause_at, release, world_reached

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DATASET, BATCH, EPOCHS = 1536, 64, 3
STEPS = EPOCHS * DATASET // BATCH


def training_args(dataset_size: int = DATASET) -> list[str]:
    return ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(dataset_size),
            "--global_batch_size", str(BATCH), "--micro_batch_size", "16",
            "--snapshot_every_steps", "5", "--log_interval", "10"]


TRAINING_ARGS = training_args()


def assert_finished_exactly_once(job: LocalJob, dataset_size: int = DATASET) -> None:
    assert load_snapshot(job.checkpoint_dir)["global_step"] == EPOCHS * dataset_size // BATCH
    assert_exactly_once(job, dataset_size, EPOCHS, BATCH)


def test_the_whole_job_killed_and_relaunched_resumes_without_redoing_work(local_jobs, tmp_path):
    hold = tmp_path / "hold"
    settings = hold_settings(hold)
    run_to(hold, STEPS // 2)  # full speed to mid-run, stopped there until the kill
    job = local_jobs(launcher=STOCK_LAUNCHER, training_args=TRAINING_ARGS, nproc_per_node=2, **settings)
    job.add_node("a")
    job.add_node("b")
    job.wait_for_step(STEPS // 2, timeout=120)
    for node in reversed(job.nodes):
        node.kill()
    newest_before_relaunch = load_snapshot(job.checkpoint_dir)["global_step"]
    assert 0 < newest_before_relaunch < STEPS

    # The same run directory: a relaunch of the same command.
    relaunched = local_jobs(launcher=STOCK_LAUNCHER, training_args=TRAINING_ARGS, name="job", nproc_per_node=2)
    relaunched.add_node("a2")
    assert relaunched.wait(timeout=180) == {"a2": 0}, node_logs(relaunched)
    restores = relaunched.events("restore")
    assert restores[-1]["global_step"] == newest_before_relaunch
    assert_finished_exactly_once(relaunched)


def test_plain_torchrun_environment_survives_a_kill_and_a_rejoin(local_jobs, tmp_path):
    """The default path: stock torchrun with torch's c10d and two workers per node, started without
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE in its environment, only elastic_ddp installed. A node is
    killed (world 4 -> 2, a verified restore), then a node added mid-run grows the world (2 -> 4) and
    both nodes finish. Without the plugin's fix, the agent-shared TCPStore makes restarted workers
    hang in init_process_group (findings.md, trap 2)."""
    hold = tmp_path / "hold"
    job = local_jobs(launcher=STOCK_LAUNCHER, training_args=TRAINING_ARGS, nproc_per_node=2,
                     agent_env={"OMP_NUM_THREADS": "1"}, **hold_settings(hold))
    host = job.add_node("host")
    other = job.add_node("other")
    world_reached(job, 4)
    job.wait_for_step(10, timeout=90)
    other.kill()
    shrunk = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 2, 90, "restore in world 2")
    assert shrunk["previous_world_size"] == 4 and shrunk["verified"]
    # The join must land mid-run however slowly the joiner starts (CUDA workers on an H200 took
    # longer than the held steps left): the group waits a few steps on until it is stopped for it.
    pause_at(hold, shrunk["global_step"] + 3)
    rejoined = job.add_node("rejoined")
    grown = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 4, 90, "rejoin in world 4")
    release(hold)
    assert grown["previous_world_size"] == 2 and grown["global_step"] < STEPS
    assert host.wait(timeout=180) == 0 and rejoined.wait(timeout=60) == 0, node_logs(job)
    assert "shares its rendezvous TCPStore" not in node_logs(job)
    assert_finished_exactly_once(job)
