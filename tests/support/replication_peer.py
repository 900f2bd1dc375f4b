"""One rank of a small real gloo job that exercises snapshot replication, for
tests/cluster/test_replication_transport.py.

    python -m tests.support.replication_peer SCENARIO RANK WORLD STORE_FILE RUN_DIR

Every rank joins a gloo process group through a FileStore, then plays its part of SCENARIO.
Rank 0 writes snapshots into RUN_DIR/rank0 and replicates them; the other ranks are targets whose
checkpoint directories are RUN_DIR/rank<R>. Each rank ends by writing RUN_DIR/result-<R>.json
(what it saw), and exits 0 when its part ran to the end.

Scenarios:
- `replicate`: three snapshots replicated to every target, then `finish`.
- `garbage`: rank 0 sends frames that are not replicas (a non-JSON header, a JSON array, a header of
  another shape, a checksum that does not match), then one good replica, through the real transport.
- `refuse`: the last target has (it is told) 1000 bytes of free disk; a snapshot is sent to all.
- `frozen`: the target stops itself (SIGSTOP) before the snapshot is offered; rank 0's transfer must
  end at its deadline and leave training unblocked.
- `fuzz`: rank 0 sends FUZZ_FRAMES random and mutated headers (seeded) with random payloads through
  the real transport, then one good replica.
- `directories`: ranks 0 and 1 share RUN_DIR/shared; rank 2's directory is a copy of it (files and
  all); every rank reports which directories `shared_directories` finds to be the same place.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from elastic_ddp.testbed.local_cluster import wait_for
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.exchange import replica_transfer
from elastic_ddp.snapshot.files.checksum import checksum_of
from elastic_ddp.snapshot.exchange.replica_transfer import (
    ReplicaOffer,
    ReplicaReceiver,
    ReplicaTarget,
    SnapshotReplicator,
    _report_round,
)
from elastic_ddp.snapshot.exchange.replication import SIDE_GROUP_TIMEOUT
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.snapshot.exchange.transport import ProcessGroupTransport

PAYLOAD = 300_000
FUZZ_FRAMES = 300


def payload(step: int) -> bytes:
    return bytes([step % 256]) * PAYLOAD


def write_and_offer(store: SnapshotStore, replicator: SnapshotReplicator, step: int) -> None:
    entry = store.write(step, 0, step, payload(step))
    replicator.offer(entry)


def exchange_pids(world: int) -> list[int]:
    """Every rank's process id, by rank (a collective of the default group)."""
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    return pids


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def main(scenario: str, rank: int, world: int, store_file: str, run_dir: str) -> None:
    run = Path(run_dir)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    if scenario == "directories":
        report_directories(rank, run)
        os._exit(0)
    store = SnapshotStore(run / f"rank{rank}", keep_last=2)
    group_ranks = list(range(world))
    group = dist.new_group(group_ranks, backend="gloo", timeout=SIDE_GROUP_TIMEOUT)
    result: dict = {"rank": rank}
    if rank == 0:
        targets = [ReplicaTarget(rank=r, node=r) for r in group_ranks[1:]]
        events = EventLog(run / "events.jsonl", incarnation=1, enabled=True)
        deadline = timedelta(seconds=3) if scenario == "frozen" else replica_transfer.SEND_DEADLINE
        if scenario in ("garbage", "fuzz"):
            send_garbage_then_one_replica(group, store, fuzz=scenario == "fuzz")
        else:
            replicator = SnapshotReplicator(store, group, targets, group_ranks, events, send_deadline=deadline)
            if scenario == "frozen":
                target_pid = exchange_pids(world)[1]
                dist.barrier()  # the target is about to stop itself
                wait_for(lambda: is_stopped(target_pid), 20, f"rank 1 (pid {target_pid}) to stop itself")
            steps = (5, 10, 15) if scenario == "replicate" else (7,)
            for step in steps:
                write_and_offer(store, replicator, step)
                started = time.monotonic()
                replicator.finish(timeout=30) if step == steps[-1] else wait_until_sent(replicator)
                result.setdefault("seconds", []).append(round(time.monotonic() - started, 2))
            result["broken"] = replicator.broken
            events.close()
            result["events"] = [e["event"] for e in read_events(run / "events.jsonl")]
    else:
        if scenario == "refuse" and rank == world - 1:
            replica_transfer.free_bytes = lambda store: 1000
        if scenario == "frozen":
            exchange_pids(world)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGSTOP)  # the test SIGKILLs this process later
        receiver = ReplicaReceiver(store, group, group_ranks)
        receiver.finish(timeout=60)
        result["stored"] = receiver.stored
    result["manifest"] = [e.global_step for e in store.manifest_entries()]
    found = store.latest_valid()
    result["newest_ok"] = found is not None and found[1] == payload(found[0].global_step)
    (run / f"result-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def wait_until_sent(replicator: SnapshotReplicator) -> None:
    with replicator._condition:
        replicator._condition.wait_for(lambda: replicator._pending is None and not replicator._busy, 30)


def report_directories(rank: int, run: Path) -> None:
    import shutil

    from elastic_ddp.runtime.distributed import DistributedContext
    from elastic_ddp.snapshot.exchange.replication import shared_directories

    shared, copy = run / "shared", run / "copy"
    if rank == 0:
        SnapshotStore(shared).write(1, 0, 1, payload(1))
        (shared / ".store-id").write_text("0123456789abcdef")  # as versions before 0.2 wrote it
        shutil.copytree(shared, copy)  # pre-staged with rsync: the same files, another place
    dist.barrier()
    context = DistributedContext(rank=rank, local_rank=0, world_size=3, local_world_size=1,
                                 device=__import__("torch").device("cpu"), backend="gloo")
    directories, writable = shared_directories(SnapshotStore(copy if rank == 2 else shared), context)
    dist.barrier()  # every rank has removed its probe
    (run / f"result-{rank}.json").write_text(json.dumps({"rank": rank, "directories": directories,
                                                         "writable": writable,
                                                         "probes_left": sorted(p.name for p in (
                                                             copy if rank == 2 else shared).glob(".probe-*"))}))


def send_garbage_then_one_replica(group, store: SnapshotStore, fuzz: bool = False) -> None:
    """Frames a replica receiver must refuse, through the real transport, then a good one."""
    transport = ProcessGroupTransport(group)
    size = dist.get_world_size(group)
    good = payload(9)
    digest = checksum_of(good, "sha256")
    if fuzz:
        fuzz_frames(transport, group, size, digest)
    bad_frames = [
        ({"kind": "snapshot"}, good),  # a header of another shape
        ({"kind": "snapshot", "global_step": -1, "epoch": 0, "samples_consumed": 0, "checksum": digest}, good),
        ({"kind": "snapshot", "global_step": True, "epoch": 0, "samples_consumed": 0, "checksum": digest}, good),
        ({"kind": "snapshot", "global_step": 9, "epoch": 0, "samples_consumed": 9, "checksum": "sha256:" + "0" * 64}, good),
        ({"kind": "snapshot", "global_step": 9, "epoch": 0, "samples_consumed": 9, "checksum": digest}, b"forged"),
    ]
    for header, data in bad_frames:
        transport.send(0, header, data)
        _report_round(group, size, True, None)
    raw_frames = [b"\xff\xfe not json", b"[1, 2, 3]", b'{"kind": ' + b"[" * 5000 + b"]" * 5000 + b"}"]
    for raw in raw_frames:  # headers that are not JSON objects: sent as bytes, as a bad peer would
        transport_send_raw(transport, raw, good)
        _report_round(group, size, True, None)
    transport.send(0, ReplicaOffer(False, 9, 0, 9, digest).to_header(), good)
    _report_round(group, size, True, None)
    transport.send(0, ReplicaOffer(close=True).to_header(), b"")


def fuzz_frames(transport: ProcessGroupTransport, group, size: int, digest: str) -> None:
    """FUZZ_FRAMES random frames: mutated good headers, random JSON, random bytes; random payloads."""
    import random

    rng = random.Random(4242)
    seed = json.dumps(ReplicaOffer(False, 9, 0, 9, digest).to_header()).encode()
    for _ in range(FUZZ_FRAMES):
        kind = rng.randrange(3)
        if kind == 0:
            raw = bytearray(seed)
            for _ in range(rng.randint(1, 6)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif kind == 1:
            # (never a well-formed `close`: that one legitimately ends the stream)
            raw = json.dumps({rng.choice(["kind", "global_step", "checksum", "x"]): rng.choice(
                [None, -1, "snapshot", "Close", [1], {"a": 1}, 2**70]) for _ in range(rng.randint(0, 5))}).encode()
        else:
            raw = bytes(rng.randrange(256) for _ in range(rng.randint(2, 200)))
        transport_send_raw(transport, bytes(raw), bytes(rng.randrange(256) for _ in range(rng.randint(0, 4096))))
        _report_round(group, size, True, None)


def transport_send_raw(transport: ProcessGroupTransport, raw_header: bytes, data: bytes) -> None:
    """`ProcessGroupTransport.send` with a header given as bytes (so that it need not be JSON)."""
    import torch

    sizes = torch.tensor([len(raw_header), len(data)], dtype=torch.int64)
    transport._broadcast(sizes, 0)
    transport._vote(accepts=True)
    transport._broadcast(transport._to_tensor(raw_header), 0)
    transport._broadcast(transport._to_tensor(data), 0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
