"""No shared filesystem: snapshots are replicated to other nodes' local directories, and losing the
node that holds rank 0 resumes from the newest snapshot a survivor holds.

The multi-node tests give every node its own --checkpoint_dir (LocalJob(per_node_checkpoint_dirs=True)).
The c10d rendezvous store is hosted by the test process, not by a node: with c10d the node that hosts
the store cannot be lost without ending the job (findings.md, trap 5), and torchrun gives rank 0 to
the agent with the lowest pid, which would otherwise be the host.
"""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from elastic_ddp import load_snapshot
from elastic_ddp.checkpoint import CheckpointStore, ManifestEntry
from elastic_ddp.local_cluster import LocalJob, LocalNode, free_port
from elastic_ddp.replication import Member, ReplicaReceiver, ReplicationError, choose_replica_targets, send_snapshot
from tests.conftest import assert_exactly_once, node_logs

DATASET, BATCH, EPOCHS, EVERY = 3840, 64, 2, 20
STEPS = EPOCHS * DATASET // BATCH
TRAINING_ARGS = ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET),
                 "--global_batch_size", str(BATCH), "--micro_batch_size", "32",
                 "--snapshot_every_steps", str(EVERY), "--log_interval", "20", "--no-augment"]


# ------------------------------------------------------------------------------ target choice


def member(rank: int, group_rank: int, store_id: str, receiver: bool = True, local_rank: int = 0) -> Member:
    return Member(rank=rank, group_rank=group_rank, local_rank=local_rank, store_id=store_id,
                  receiver=("127.0.0.1", 1000 + rank) if receiver else None, token="t" if rank == 0 else "")


def test_targets_are_the_next_nodes_after_rank_0s_one_per_directory():
    members = [member(0, 2, "c"), member(1, 2, "c", receiver=False, local_rank=1), member(2, 0, "a"),
               member(3, 0, "a", receiver=False, local_rank=1), member(4, 1, "b"), member(5, 3, "d")]
    assert [m.group_rank for m in choose_replica_targets(members, 1)] == [3]
    assert [m.group_rank for m in choose_replica_targets(members, 2)] == [3, 0]
    assert [m.group_rank for m in choose_replica_targets(members, 9)] == [3, 0, 1]


def test_a_shared_directory_gets_no_replicas():
    members = [member(0, 0, "shared"), member(1, 1, "shared"), member(2, 2, "shared")]
    assert choose_replica_targets(members, 2) == []


def test_two_nodes_sharing_a_directory_get_one_replica_between_them():
    members = [member(0, 0, "a"), member(1, 1, "nfs"), member(2, 2, "nfs"), member(3, 3, "d")]
    assert [m.group_rank for m in choose_replica_targets(members, 3)] == [1, 3]


# ------------------------------------------------------------------------------ the transfer


@pytest.fixture
def receiver(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    store = CheckpointStore(tmp_path / "replica", keep_last=2)
    server = ReplicaReceiver.listen(store)
    server.serve("secret")
    yield server
    server.close()


def entry_for(step: int, data: bytes) -> ManifestEntry:
    return ManifestEntry(file="", global_step=step, epoch=0, samples_consumed=step,
                         sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), created_unix=0.0)


def test_a_replica_is_stored_verified_and_pruned_like_a_local_write(receiver):
    for step in (5, 10, 15):
        data = bytes([step]) * 100_000
        send_snapshot(receiver.address, "secret", entry_for(step, data), data)
    entries = receiver.store.manifest_entries()
    assert [e.global_step for e in entries] == [10, 15]
    assert receiver.store.latest_valid()[1] == bytes([15]) * 100_000


def test_a_replica_with_the_wrong_token_or_checksum_is_refused(receiver):
    data = b"x" * 1000
    with pytest.raises(ReplicationError, match="wrong token"):
        send_snapshot(receiver.address, "guess", entry_for(1, data), data)
    forged = entry_for(2, b"something else")
    with pytest.raises(ReplicationError, match="does not match the sender's"):
        send_snapshot(receiver.address, "secret", dataclasses.replace(forged, size_bytes=len(data)), data)
    assert receiver.store.manifest_entries() == []


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
    assert restore["sha256"] == written[restore["global_step"]]["sha256"], "not the snapshot rank 0 wrote"
    assert restore["verified"] and restore["lost_steps"] is not None
    assert not victim.is_running()
    return restore


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_nodes_without_shared_storage_survive_losing_rank_0s_node(local_jobs, external_store):
    job = local_jobs(TRAINING_ARGS, rdzv_endpoint=external_store, per_node_checkpoint_dirs=True)
    job.add_node("a")
    job.add_node("b")
    victim, replicated = kill_rank_0_node_after_a_replica(job, nodes=2)
    survivor = next(node for node in job.nodes if node is not victim)

    restore = assert_resumed_from_the_newest_surviving_snapshot(job, victim, replicated, survivors=1)
    assert restore["file"], "the survivor read it from its own directory"
    assert survivor.wait(timeout=180) == 0, node_logs(job)
    assert load_snapshot(job.node_checkpoint_dir(survivor.name))["global_step"] == STEPS
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_nodes_without_shared_storage_survive_losing_rank_0s_node(local_jobs, external_store):
    job = local_jobs(TRAINING_ARGS, rdzv_endpoint=external_store, per_node_checkpoint_dirs=True)
    for name in ("a", "b", "c"):
        job.add_node(name)
    victim, replicated = kill_rank_0_node_after_a_replica(job, nodes=3)
    survivors = [node for node in job.nodes if node is not victim]

    assert_resumed_from_the_newest_surviving_snapshot(job, victim, replicated, survivors=2)
    assert [node.wait(timeout=180) for node in survivors] == [0, 0], node_logs(job)
    # The new rank 0 replicated to the other survivor: both hold the final snapshot.
    for node in survivors:
        assert load_snapshot(job.node_checkpoint_dir(node.name))["global_step"] == STEPS, node.name
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
