"""Rank 0's replica sender and a target's receiver when a target is slow or gone (issue 27, item 5),
their collectives replaced by stand-ins: what is bounded, what is reported, what is never waited for.
Real transfers between processes: tests/cluster/test_replication_transport.py.

    .venv/bin/python -m pytest -q tests/unit/test_replica_transfer.py
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.exchange import replica_transfer
from elastic_ddp.snapshot.exchange.replica_transfer import (
    ReplicaOffer,
    ReplicaReceiver,
    ReplicaTarget,
    SnapshotReplicator,
    verdict_deadline,
)
from elastic_ddp.snapshot.exchange.transport import Frame, ProcessGroupTransport
from elastic_ddp.snapshot.files.checksum import checksum_of
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore

DEADLINE = timedelta(seconds=2)


@pytest.fixture
def sender(tmp_path, monkeypatch):  # monkeypatch first: its stand-ins outlive the sender's close
    store = SnapshotStore(tmp_path / "rank0", keep_last=3)
    events = EventLog(tmp_path / "events.jsonl", incarnation=1, enabled=True)
    replicator = SnapshotReplicator(store, None, [ReplicaTarget(rank=1, node=1)], [0, 1], events,
                                    send_deadline=DEADLINE)
    yield store, replicator, events
    replicator.close()
    events.close()


def sent_and_done(replicator: SnapshotReplicator) -> None:
    with replicator._condition:
        assert replicator._condition.wait_for(lambda: replicator._pending is None and not replicator._busy, 10)


def failures(events: EventLog) -> list[dict]:
    events.close()
    return [e for e in read_events(events.path) if e["event"] == "replication_failed"]


def test_after_a_broken_transfer_offers_are_dropped_and_finish_does_not_wait(sender, monkeypatch):
    store, replicator, events = sender

    def frozen_target(*args):
        raise TimeoutError("a snapshot transfer did not complete within 2 s")

    monkeypatch.setattr(replicator.transport, "send", frozen_target)
    replicator.offer(store.write(4, 0, 4, b"x" * 1000))
    sent_and_done(replicator)
    assert replicator.broken
    replicator.offer(store.write(8, 0, 8, b"y" * 1000))  # a drain's final snapshot
    started = time.monotonic()
    replicator.finish(timeout=5)
    assert time.monotonic() - started < 1, "finish waited for a replication that had stopped"
    dropped = [e for e in failures(events) if e["global_step"] == 8]
    assert dropped and "replication stopped for this worker group" in dropped[0]["error"]


def test_the_verdict_deadline_grows_with_the_snapshot(sender, monkeypatch):
    store, replicator, _ = sender
    asked: list[timedelta] = []
    monkeypatch.setattr(replicator.transport, "send", lambda *args: [True, True])
    monkeypatch.setattr(replica_transfer, "_report_round",
                        lambda group, size, stored, deadline: asked.append(deadline) or [True, True])
    entry = store.write(4, 0, 4, b"x" * 1000)
    replicator.offer(entry)
    sent_and_done(replicator)
    assert asked == [verdict_deadline(DEADLINE, entry.size_bytes)]
    assert verdict_deadline(DEADLINE, 10 * 2**30) > DEADLINE + timedelta(seconds=60), "10 GiB: a minute more"


def test_a_replica_sent_whose_verdict_is_late_is_reported_unconfirmed_not_lost(sender, monkeypatch):
    store, replicator, events = sender
    monkeypatch.setattr(replicator.transport, "send", lambda *args: [True, True])

    def slow_disk(group, size, stored, deadline):
        raise TimeoutError(f"replica verdicts did not arrive within {deadline.total_seconds():g} s")

    monkeypatch.setattr(replica_transfer, "_report_round", slow_disk)
    replicator.offer(store.write(4, 0, 4, b"x" * 1000))
    sent_and_done(replicator)
    [failure] = failures(events)
    assert failure["node"] == 1 and failure["error"].startswith("sent, not confirmed"), failure


def test_a_target_reports_within_a_deadline_and_keeps_no_payload_meanwhile(tmp_path, monkeypatch):
    data = b"z" * 5000
    frames = [Frame(ReplicaOffer(False, 9, 0, 9, checksum_of(data)).to_header(), data),
              Frame(ReplicaOffer(close=True).to_header(), b"")]
    monkeypatch.setattr(ProcessGroupTransport, "receive", lambda self, source, limits: frames.pop(0))
    asked: list = []

    def report(group, size, stored, deadline):
        asked.append((stored, deadline))
        return [True, stored]

    monkeypatch.setattr(replica_transfer, "_report_round", report)
    receiver = ReplicaReceiver(SnapshotStore(tmp_path / "rank1", keep_last=2), None, [0, 1])
    receiver.finish(timeout=10)
    assert receiver.stored == 1
    assert asked == [(True, verdict_deadline(replica_transfer.SEND_DEADLINE, len(data)))]
