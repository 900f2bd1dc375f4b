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
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.history import read_events
from elastic_ddp.snapshot import replica_transfer
from elastic_ddp.snapshot.replica_transfer import (
    ReplicaOffer,
    ReplicaReceiver,
    ReplicaTarget,
    SnapshotReplicator,
    _report_round,
)
from elastic_ddp.snapshot.replication import SIDE_GROUP_TIMEOUT
from elastic_ddp.snapshot.store import CheckpointStore
from elastic_ddp.snapshot.transport import ProcessGroupTransport

PAYLOAD = 300_000


def payload(step: int) -> bytes:
    return bytes([step % 256]) * PAYLOAD


def write_and_offer(store: CheckpointStore, replicator: SnapshotReplicator, step: int) -> None:
    entry = store.write(step, 0, step, payload(step))
    replicator.offer(entry)


def main(scenario: str, rank: int, world: int, store_file: str, run_dir: str) -> None:
    run = Path(run_dir)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    store = CheckpointStore(run / f"rank{rank}", keep_last=2)
    group_ranks = list(range(world))
    group = dist.new_group(group_ranks, backend="gloo", timeout=SIDE_GROUP_TIMEOUT)
    result: dict = {"rank": rank}
    if rank == 0:
        targets = [ReplicaTarget(rank=r, node=r) for r in group_ranks[1:]]
        events = EventLog(run / "events.jsonl", incarnation=1, enabled=True)
        deadline = timedelta(seconds=3) if scenario == "frozen" else replica_transfer.SEND_DEADLINE
        if scenario == "garbage":
            send_garbage_then_one_replica(group, store)
        else:
            replicator = SnapshotReplicator(store, group, targets, group_ranks, events, send_deadline=deadline)
            if scenario == "frozen":
                dist.barrier()  # the target is about to stop itself
                time.sleep(0.5)
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


def send_garbage_then_one_replica(group, store: CheckpointStore) -> None:
    """Frames a replica receiver must refuse, through the real transport, then a good one."""
    transport = ProcessGroupTransport(group)
    size = dist.get_world_size(group)
    good = payload(9)
    digest = hashlib.sha256(good).hexdigest()
    bad_frames = [
        ({"kind": "snapshot"}, good),  # a header of another shape
        ({"kind": "snapshot", "global_step": -1, "epoch": 0, "samples_consumed": 0, "sha256": digest}, good),
        ({"kind": "snapshot", "global_step": True, "epoch": 0, "samples_consumed": 0, "sha256": digest}, good),
        ({"kind": "snapshot", "global_step": 9, "epoch": 0, "samples_consumed": 9, "sha256": "0" * 64}, good),
        ({"kind": "snapshot", "global_step": 9, "epoch": 0, "samples_consumed": 9, "sha256": digest}, b"forged"),
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
