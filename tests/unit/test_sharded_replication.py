"""Sharded snapshots on node-local disks (snapshot/sharded/node_local*.py, file_frames.py), with real
gloo groups in forked processes, each rank a "node" of its own (GROUP_RANK, a checkpoint directory
and a memory directory each): every step is committed on both nodes and each node holds the other's
files; a node's whole directory is deleted and three nodes (the survivor and two empty ones) restore
the same tensors resharded, the files they lacked fetched from the survivor; a damaged replica is
refused with its reason and the older complete step taken; a full disk and a file damaged on the
way are refused, reported, and training goes on.

    .venv/bin/python -m pytest -q tests/unit/test_sharded_replication.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.snapshot.sharded import file_frames
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.safe_reader import read_tensors
from tests.support.training import Crash, crash_at, make_trainer, small_config

pytestmark = pytest.mark.timeout(120)


def _config(run: Path, directory: str, rank: int, epochs: int = 2):
    """8 steps of 48 samples (2 epochs of 192), snapshots every 3 steps and at epoch ends: 3, 4, 6, 8."""
    return small_config(run, sharding="fsdp", epochs=epochs, dataset_size=192, global_batch_size=48,
                        micro_batch_size=8, snapshot_every_steps=3, watchdog_timeout_s=0,
                        checkpoint_dir=directory, memory_dir=str(run / f"memory-{directory[-3:]}-{rank}"))


def _damaging_send(transport, rank, step, path, entry):
    """file_frames.send_file, but one byte of the file flipped on the way."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    header = {"kind": file_frames.KIND, "global_step": step, "name": path.name, "size": entry["size"],
              "checksum": entry["checksum"]}
    transport.send(rank, header, bytes(data))


def _node(rank: int, world_size: int, run: str, directories: list[str], faults: str, crash: int,
          store: str) -> None:
    """Rank `rank` alone on node `rank`, its checkpoint directory `directories[rank]`: trains (until an
    injected crash after step `crash`, when not 0), then writes its full model to `run/model-RANK.pt`."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    if faults == "node 1 full, sends damaged" and rank == 1:
        file_frames.free_bytes = lambda directory: 0
        file_frames.send_file = _damaging_send
    if faults == "count checksums":  # each file this rank checksums, in run/read-RANK.txt
        checksum = steps.file_checksum

        def counted(path: Path) -> str:
            with open(Path(run) / f"read-{rank}.txt", "a") as read:
                read.write(f"{path.parent.name}/{path.name}\n")
            return checksum(path)

        steps.file_checksum = counted
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        trainer = make_trainer(_config(Path(run), directories[rank], rank), after_step=crash_at(crash) if crash else None)
        try:
            trainer.fit()
        except Crash:
            return
        model_state, _ = get_state_dict(trainer.state.model, trainer.state.optimizer)
        full = {name: value.full_tensor().clone() for name, value in model_state.items()}
        torch.save({"model": full, "step": trainer.global_step}, Path(run) / f"model-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _fresh_store(run: Path) -> str:
    """A rendezvous file no earlier group used: a FileStore file left by the last group (its last
    user may still be closing it) hands the next group that group's stale addresses."""
    return str(run / f"store-{uuid.uuid4().hex}")


def _run(run: Path, directories: list[Path], faults: str = "", crash: int = 0) -> None:
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(_node, args=(len(directories), str(run), [str(d) for d in directories], faults, crash,
                                    _fresh_store(run)),
                       nprocs=len(directories), start_method="forkserver", join=True)


def _events(directory: Path, kind: str) -> list[dict]:
    return [event for event in read_events(directory / EVENT_LOG_NAME) if event["event"] == kind]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Two nodes (a rank each, ck0 and ck1) trained 8 steps with sharded snapshots at 3, 4, 6 and 8."""
    run = tmp_path_factory.mktemp("two-nodes")
    _run(run, [run / "ck0", run / "ck1"])
    return run


def _copy_of(trained: Path, tmp_path: Path) -> Path:
    for name in ("ck0", "ck1"):
        shutil.copytree(trained / name, tmp_path / name)
    return tmp_path


def test_each_node_commits_every_step_and_holds_the_other_nodes_files(trained):
    for node in ("ck0", "ck1"):
        committed = [step for step, _ in steps.committed_steps(trained / node)]
        assert committed == [8, 6, 4]  # (3 pruned: --keep_last 3)
        for _, directory in steps.committed_steps(trained / node):
            steps.verify(directory)  # the whole step, every file of both ranks, on each node
    names = sorted(path.name for path in (trained / "ck1" / "sharded-000000008").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "trainer.snap"]
    replicated = _events(trained / "ck0", "snapshot_replicated")
    assert [(event["global_step"], event["nodes"]) for event in replicated] == [(3, [1]), (4, [1]), (6, [1]), (8, [1])]
    assert not _events(trained / "ck0", "replication_failed")


def test_a_lost_node_directory_is_restored_resharded_from_the_survivor(trained, tmp_path):
    """ck0 is gone; the survivor ck1 and two empty nodes form a group of 3: step 8 is restored, the
    files the new nodes lack fetched from the survivor, and the model is the one step 8 holds."""
    run = _copy_of(trained, tmp_path)
    shutil.rmtree(run / "ck0")
    _run(run, [run / "ck1", run / "ck2", run / "ck3"])
    restore = _events(run / "ck1", "restore")[-1]
    assert (restore["global_step"], restore["source"], restore["world_size"], restore["previous_world_size"]) == (
        8, "file", 3, 2)
    assert restore["file"].startswith("sharded-000000008, 4 file(s) fetched (.metadata, __0_0.distcp, "
                                      "__1_0.distcp, trainer.snap) from rank 0 on node 0"), restore
    assert restore["source_rank"] == 0 and restore["refused"] == []
    for node in ("ck2", "ck3"):
        steps.verify(run / node / "sharded-000000008")
    saved = {name[len("model."):]: value for name, value in read_tensors(run / "ck1" / "sharded-000000008").items()
             if name.startswith("model.")}
    loaded = torch.load(run / "model-0.pt", weights_only=True)
    assert loaded["step"] == 8 and loaded["model"].keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded["model"][name], value), name


def test_a_damaged_replica_is_refused_with_its_reason_and_the_older_step_restored(trained, tmp_path):
    """ck0 is gone and ck1's copy of rank 0's file of step 8 is damaged: step 8 is refused, naming
    the file and why, and the group restores step 6, whose files the survivor holds whole."""
    run = _copy_of(trained, tmp_path)
    shutil.rmtree(run / "ck0")
    damaged = run / "ck1" / "sharded-000000008" / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    _run(run, [run / "ck1", run / "ck4"], crash=7)
    restore = _events(run / "ck1", "restore")[-1]
    assert (restore["global_step"], restore["source"], restore["world_size"]) == (6, "file", 2)
    refusal = restore["refused"][0]
    assert refusal["global_step"] == 8 and refusal["source"] == "file"
    assert refusal["reason"].startswith("file(s) __0_0.distcp of its 4 are on no node of this group (lost with "
                                        f"their node, or damaged: {damaged}: its checksum does not match"), refusal


def test_a_full_disk_and_a_damaged_copy_are_refused_and_training_goes_on(tmp_path):
    """Node 1's disk is full (to the copies) and the files it sends arrive damaged: every copy is
    refused, reported with its reason, each node commits its own files, and training ends."""
    _run(tmp_path, [tmp_path / "ck0", tmp_path / "ck1"], faults="node 1 full, sends damaged")
    assert torch.load(tmp_path / "model-0.pt", weights_only=True)["step"] == 8
    failed = {(event["global_step"], event["node"], event["error"]) for event in
              _events(tmp_path / "ck0", "replication_failed")}
    for step in (3, 4, 6, 8):
        assert {(step, 1, f"{name} refused: too little free disk space") for name in
                (".metadata", "__0_0.distcp", "trainer.snap")} <= failed
        assert (step, 0, "__1_0.distcp refused: it arrived damaged (its size or checksum is not the manifest's)") \
            in failed
    assert not _events(tmp_path / "ck0", "snapshot_replicated")
    assert sorted(p.name for p in (tmp_path / "ck1" / "sharded-000000008").iterdir()) == [
        "__1_0.distcp", "checksums.json"]
    assert sorted(p.name for p in (tmp_path / "ck0" / "sharded-000000008").iterdir()) == [
        ".metadata", "__0_0.distcp", "checksums.json", "trainer.snap"]


def _agree_node(rank: int, run: str, directories: list[str], store: str) -> None:
    """Rank `rank` of len(`directories`), each a node with its own directory: `agree` alone, each
    file checksum this rank computes recorded; writes {choice, last_replicated, refused, read} to
    `run/agreed-RANK.json`."""
    from types import SimpleNamespace

    from elastic_ddp.snapshot.sharded import node_local_restore

    world_size = len(directories)
    read: list[str] = []
    checksum = steps.file_checksum
    steps.file_checksum = lambda path: read.append(f"{path.parent.name}/{path.name}") or checksum(path)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        local = SimpleNamespace(context=SimpleNamespace(rank=rank, world_size=world_size), root=Path(directories[rank]),
                                layout=SimpleNamespace(directory_of=list(range(world_size))), group=None,
                                last_replicated_step=None)
        choice, refused = node_local_restore.agree(local, {}, node_local_restore.survey(local))
        result = {"choice": choice and choice.step, "last_replicated": local.last_replicated_step,
                  "refused": refused, "read": sorted(read)}
        (Path(run) / f"agreed-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _agree(run: Path, directories: list[Path]) -> list[dict]:
    mp.start_processes(_agree_node, args=(str(run), [str(d) for d in directories], _fresh_store(run)), nprocs=len(directories),
                       start_method="forkserver", join=True)
    return [json.loads((run / f"agreed-{rank}.json").read_text()) for rank in range(len(directories))]


def test_a_restore_reads_the_files_of_the_step_it_takes_not_every_kept_step(trained, tmp_path):
    """Kept on both nodes: steps 4, 6 and 8, each whole. The agreement checks sizes first, then each
    node checksums its copies of the newest step alone; with step 8 damaged on both nodes (same size,
    one byte flipped), step 8 is refused with the reason and step 6 read and taken; step 4 never."""
    run = _copy_of(trained, tmp_path)
    directories = [run / "ck0", run / "ck1"]
    assert [step for step, _ in steps.committed_steps(directories[0])] == [8, 6, 4]
    agreed = _agree(run, directories)
    for rank, result in enumerate(agreed):
        assert (result["choice"], result["last_replicated"], result["refused"]) == (8, 8, []), result
        assert {name.split("/")[0] for name in result["read"]} == {"sharded-000000008"}, result["read"]
        assert len(result["read"]) == len(json.loads((directories[rank] / "sharded-000000008" / steps.MANIFEST)
                                                     .read_bytes())["files"]), result["read"]
    for directory in directories:
        damaged = directory / "sharded-000000008" / "__1_0.distcp"
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    for result in _agree(run, directories):
        assert (result["choice"], result["last_replicated"]) == (6, 6), result
        [refusal] = result["refused"]
        assert refusal["global_step"] == 8 and "__1_0.distcp" in refusal["reason"] \
            and "its checksum does not match" in refusal["reason"], refusal
        assert {name.split("/")[0] for name in result["read"]} == {"sharded-000000008", "sharded-000000006"}


def test_a_restore_that_the_memory_state_wins_reads_no_durable_file(tmp_path):
    """Two nodes crash after step 7 (steps 3, 4 and 6 durable on both, 7 in their memory): the
    restart restores step 7 from memory without checksumming a file of the durable steps; they were
    weighed by name and size alone."""
    directories = [tmp_path / "ck0", tmp_path / "ck1"]
    _run(tmp_path, directories, crash=7)
    assert [step for step, _ in steps.committed_steps(directories[0])] == [6, 4, 3]
    _run(tmp_path, directories, faults="count checksums")
    restore = _events(directories[0], "restore")[-1]
    assert (restore["global_step"], restore["source"], restore["lost_steps"]) == (7, "memory", 0), restore
    read = [line for rank in (0, 1) for line in (tmp_path / f"read-{rank}.txt").read_text().splitlines()]
    assert read, "no checksum was counted: the counting did not take"
    assert not [name for name in read if name.startswith(("sharded-000000003/", "sharded-000000004/",
                                                         "sharded-000000006/"))], read
    assert torch.load(tmp_path / "model-0.pt", weights_only=True)["step"] == 8


def test_a_step_of_an_abandoned_trajectory_is_replaced_and_the_same_one_kept(tmp_path):
    """On node-local disks a retrained step replaces the directory of that step that another manifest
    left (seal with replace); a directory with the same manifest is kept as it is."""
    files = {name: {"size": 1, "checksum": steps.file_checksum(_write(tmp_path / "one", name, b"a"))}
             for name in (".metadata", steps.TRAINER_FILE)}
    steps.seal(tmp_path / "one", 5, files, replace=True)
    old = steps.committed_directory(tmp_path, 5)
    (old / "kept-mark").write_bytes(b"")
    steps.seal(_copy_files(tmp_path / "one-again", old, files), 5, files, replace=True)
    assert (old / "kept-mark").exists()  # the same manifest: kept
    other = {name: {"size": 1, "checksum": steps.file_checksum(_write(tmp_path / "two", name, b"b"))}
             for name in (".metadata", steps.TRAINER_FILE)}
    steps.seal(tmp_path / "two", 5, other, replace=True)
    assert not (old / "kept-mark").exists() and (old / ".metadata").read_bytes() == b"b"
    steps.verify(old)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sharded-000000005"]


def _write(directory: Path, name: str, data: bytes) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / name).write_bytes(data)
    return directory / name


def _copy_files(directory: Path, source: Path, files: dict) -> Path:
    for name in files:
        _write(directory, name, (source / name).read_bytes())
    return directory
