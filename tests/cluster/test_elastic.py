"""Elasticity with real torchrun agents as separate nodes on 127.0.0.1, real gloo, real SIGKILLs.

These run stock torchrun (`torch.distributed.run`), the path the README promises; the chaos tests
run the same promises through `elastic_ddp.agent.launcher`. The default path exactly as a user types
it (torch's `c10d`, torch's defaults, no store opt-out), with a kill and a join, is
tests/cluster/test_own_loop.py's DDP job.

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
from tests.support.cluster import assert_exactly_once, hold_settings, node_logs

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

