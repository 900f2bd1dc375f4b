"""Snapshot replication over the job's own gloo process groups, with real processes.

Each test starts a small gloo job (tests/support/replication_peer.py, one process per rank, a
FileStore for the rendezvous): rank 0 writes snapshots and replicates them, the other ranks are
targets with checkpoint directories of their own. No port of ours is opened anywhere.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def play(tmp_path: Path, scenario: str, world: int, wait_for_ranks: tuple[int, ...] | None = None) -> list[dict]:
    """Run `scenario` on `world` ranks; return each rank's result (SIGKILL what is left at the end)."""
    store_file = tmp_path / "store"
    peers = [subprocess.Popen([sys.executable, "-m", "tests.support.replication_peer", scenario, str(rank),
                               str(world), str(store_file), str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    waited = range(world) if wait_for_ranks is None else wait_for_ranks
    try:
        for rank in waited:
            output = peers[rank].communicate(timeout=90)[0]
            assert peers[rank].returncode == 0, f"rank {rank} of {scenario} failed:\n{output[-3000:]}"
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.send_signal(signal.SIGKILL)
                peer.wait(timeout=10)
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in waited]


def test_every_target_stores_each_replica_verified_and_pruned_like_a_local_write(tmp_path):
    source, *targets = play(tmp_path, "replicate", world=3)
    assert source["manifest"] == [10, 15] and not source["broken"]
    for target in targets:
        assert target["stored"] == 3 and target["manifest"] == [10, 15] and target["newest_ok"]
    assert source["events"].count("snapshot_replicated") == 3 and "replication_failed" not in source["events"]


def test_frames_that_are_not_replicas_are_refused_and_the_receiver_goes_on_serving(tmp_path):
    # Bad shapes, a negative step, a bool for a step, a wrong checksum, a forged payload, and headers
    # that are not JSON objects (bad UTF-8, an array, nesting 5000 deep): each refused, then a good
    # replica lands.
    source, target = play(tmp_path, "garbage", world=2)
    assert target["stored"] == 1 and target["manifest"] == [9] and target["newest_ok"]


def test_a_target_without_room_refuses_without_stopping_the_others(tmp_path):
    source, roomy, cramped = play(tmp_path, "refuse", world=3)
    assert roomy["stored"] == 1 and roomy["manifest"] == [7]
    assert cramped["stored"] == 0 and cramped["manifest"] == []
    assert "snapshot_replicated" in source["events"] and "replication_failed" in source["events"]


def test_a_frozen_target_costs_rank_0_one_deadline_and_never_blocks_training(tmp_path):
    # The target SIGSTOPs itself; rank 0's transfer gives up at its 3 s deadline, replication stops
    # for this worker group, and `finish` returns (training would go on meanwhile: offers never wait).
    [source] = play(tmp_path, "frozen", world=2, wait_for_ranks=(0,))
    assert source["broken"] and "replication_failed" in source["events"]
    assert source["seconds"][-1] < 20
    assert source["manifest"] == [7] and source["newest_ok"]  # rank 0's own snapshot is untouched


def test_hundreds_of_random_frames_through_the_real_transport_never_stop_the_receiver(tmp_path):
    source, target = play(tmp_path, "fuzz", world=2)  # FUZZ_FRAMES of tests/support/replication_peer.py
    assert target["stored"] == 1 and target["manifest"] == [9] and target["newest_ok"]


def test_shared_directories_are_found_by_probing_and_a_copied_directory_is_not_one_of_them(tmp_path):
    results = play(tmp_path, "directories", world=3)
    assert [result["directories"] for result in results] == [[0, 0, 2]] * 3
    assert all(result["writable"] and result["probes_left"] == [] for result in results)
