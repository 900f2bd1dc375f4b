"""No shared filesystem: snapshots are replicated to other nodes' local directories, and losing the
node that holds rank 0 resumes from the newest snapshot a survivor holds, or, with memory copies
(the default), from the last step the survivors committed, which the new rank 0 then writes to its
own disk.

The multi-node tests give every node its own --checkpoint_dir (LocalJob(per_node_checkpoint_dirs=True)).
The c10d rendezvous store is hosted by the test process, not by a node: with c10d the node that hosts
the store cannot be lost without ending the job (findings.md, trap 5), and torchrun gives rank 0 to
the agent with the lowest pid, which would otherwise be the host.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from elastic_ddp import load_snapshot
from elastic_ddp.agent.rendezvous.defaults import RDZV_CONF
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.testbed.local_cluster import LocalJob, LocalNode, free_port
from tests.support.cluster import assert_exactly_once, hold_settings, node_logs, release

DATASET, BATCH, EPOCHS, EVERY = 3840, 64, 2, 20
STEPS = EPOCHS * DATASET // BATCH
TRAINING_ARGS = ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET),
                 "--global_batch_size", str(BATCH), "--micro_batch_size", "32",
                 "--snapshot_every_steps", str(EVERY), "--log_interval", "20", "--no-augment"]
FILES_ONLY = [*TRAINING_ARGS, "--no-memory_copies"]  # what the replicas alone guarantee


# ------------------------------------------------------------------------------ real jobs


@pytest.fixture
def external_store():
    """A c10d rendezvous store in the test process: no node is special, any can be killed."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                     timeout=timedelta(seconds=300))
    yield f"127.0.0.1:{port}"
    del store


def node_holding_rank_0(job: LocalJob, start: dict) -> LocalNode:
    """The node whose agent started rank 0 of the worker group that `start` announced."""
    [rank_0] = [rank for rank in start["ranks"] if rank["rank"] == 0]
    [holder] = [node for node in job.nodes if node.pid == rank_0["agent_pid"]]
    return holder


def kill_rank_0_node_after_a_replica(job: LocalJob, nodes: int) -> tuple[LocalNode, dict]:
    """Kill the node holding rank 0 right after a snapshot reached its replica; return it and the
    newest snapshot it had replicated."""
    start = job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == nodes, 120,
                               f"a worker group of {nodes} nodes")
    replicated = job.wait_for_event(lambda e: e["event"] == "snapshot_replicated" and e["global_step"] >= EVERY,
                                    120, "a replicated snapshot")
    assert replicated["incarnation"] == start["incarnation"]
    victim = node_holding_rank_0(job, start)
    victim.kill()
    replicated = [e for e in job.events("snapshot_replicated") if e["incarnation"] == replicated["incarnation"]][-1]
    return victim, replicated


def assert_resumed_from_the_newest_surviving_snapshot(job: LocalJob, victim: LocalNode, replicated: dict,
                                                      survivors: int) -> dict:
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == survivors, 120,
                                 f"the restore in a world of {survivors}")
    written = {e["global_step"]: e for e in job.events("snapshot") if e["incarnation"] == replicated["incarnation"]}
    # The newest snapshot a survivor holds is the newest replicated one (or, if the kill fell between
    # a replica landing and rank 0 logging it, the newest written): never an older one, never scratch.
    assert restore["global_step"] in {replicated["global_step"], max(written)}, (restore, replicated, max(written))
    assert restore["global_step"] >= replicated["global_step"] >= EVERY
    assert restore["checksum"] == written[restore["global_step"]]["checksum"], "not the snapshot rank 0 wrote"
    assert restore["verified"] and restore["lost_steps"] is not None
    assert not victim.is_running()
    return restore


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_nodes_without_shared_storage_survive_losing_rank_0s_node(local_jobs, external_store, tmp_path):
    """Memory copies on: the survivor resumes from the step it had committed (not the replica): its
    own state, re-formed in process (issue 44), or its memory copy after a restart; and, as the new
    rank 0, writes that state to its own disk."""
    job = local_jobs(TRAINING_ARGS, rdzv_endpoint=external_store, per_node_checkpoint_dirs=True,
                     **hold_settings(tmp_path / "hold"))
    job.add_node("a")
    job.add_node("b")
    victim, replicated = kill_rank_0_node_after_a_replica(job, nodes=2)
    committed = job.last_step()
    survivor = next(node for node in job.nodes if node is not victim)

    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1, 120, "the restore")
    assert restore["source"] == "live" or (restore["source"] == "memory" and restore["verified"]), restore
    assert restore["global_step"] >= max(committed - 1, replicated["global_step"]), (restore, committed)
    job.wait_for_event(lambda e: e["event"] == "snapshot" and e["incarnation"] == restore["incarnation"]
                       and e["global_step"] == restore["global_step"], 60, "the restored state written to disk")
    release(tmp_path / "hold")
    assert survivor.wait(timeout=180) == 0, node_logs(job)
    assert load_snapshot(job.node_checkpoint_dir(survivor.name))["global_step"] == STEPS
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_nodes_without_shared_storage_survive_losing_rank_0s_node(local_jobs, external_store, tmp_path):
    # The restart path, which restores from the replicas: re-formed in process, the survivors would
    # keep their own state and read no file.
    job = local_jobs(FILES_ONLY, rdzv_endpoint=external_store, per_node_checkpoint_dirs=True,
                     rdzv_conf=f"{RDZV_CONF},in_process=0", **hold_settings(tmp_path / "hold"))
    for name in ("a", "b", "c"):
        job.add_node(name)
    victim, replicated = kill_rank_0_node_after_a_replica(job, nodes=3)
    survivors = [node for node in job.nodes if node is not victim]

    assert_resumed_from_the_newest_surviving_snapshot(job, victim, replicated, survivors=2)
    release(tmp_path / "hold")
    assert [node.wait(timeout=180) for node in survivors] == [0, 0], node_logs(job)
    # The new rank 0 replicated to the other survivor: both hold the final snapshot.
    for node in survivors:
        assert load_snapshot(job.node_checkpoint_dir(node.name))["global_step"] == STEPS, node.name
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sharded_job_without_shared_storage_survives_losing_rank_0s_node(local_jobs, external_store, tmp_path):
    """--sharding fsdp on each node's own disk (docs/sharding.md, "Snapshots on each node's own
    disk"): every rank's shard files reach another node, so losing rank 0's node leaves the newest
    replicated step whole on the survivors; they restore it at world 2, the files a node lacks
    fetched from the other, and finish with every sample exactly once."""
    job = local_jobs([*FILES_ONLY, "--sharding", "fsdp"], rdzv_endpoint=external_store, per_node_checkpoint_dirs=True,
                     **hold_settings(tmp_path / "hold"))
    for name in ("a", "b", "c"):
        job.add_node(name)
    victim, replicated = kill_rank_0_node_after_a_replica(job, nodes=3)
    survivors = [node for node in job.nodes if node is not victim]

    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 2, 120,
                                 "the restore in a world of 2")
    written = [e["global_step"] for e in job.events("snapshot") if e["incarnation"] == replicated["incarnation"]]
    # Never an older step than the newest replicated one, never scratch (the kill may fall between a
    # step's copies landing and rank 0 logging them: then the newest written one).
    assert replicated["global_step"] <= restore["global_step"] <= max(written), (restore, replicated, written)
    assert restore["source"] == "file" and restore["verified"], restore
    assert "fetched" in restore["file"], restore  # rank 0's shards came from the survivors' copies
    release(tmp_path / "hold")
    assert [node.wait(timeout=180) for node in survivors] == [0, 0], node_logs(job)
    for node in survivors:  # the new group's steps are replicated too: each survivor holds the last one whole
        [(last, directory), *_] = steps.committed_steps(job.node_checkpoint_dir(node.name))  # newest first
        assert last == STEPS, (node.name, last)
        steps.verify(directory)
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
