"""Why a worker group followed an earlier one: the `cause` label of `elastic_ddp_restarts_total`.

Read from what rank 0's event log already holds: the world sizes of the two groups, and how the
earlier one stopped, as its `memory_copy` / `memory_copy_failed` reason and its `drain` event
tell it (training/stop_guard.py keeps the last committed step with one reason per way out). In
this order, the first that applies:

    relaunched     the earlier group had finished the run (a new job on the same checkpoints)
    peer_evicted   rank 0's peer watchdog found a peer (or the group's store) silent and stopped it
    node_joined    the world grew (the running group drained for the newcomer)
    drain          the group stopped on SIGTERM: a node left on purpose, or torchrun re-formed it
    node_lost      the world shrank without a drain: a node died or was cut off
    worker_crash   the same world, no drain: a worker failed (an exception, a killed worker) and
                   torchrun restarted the group on the same nodes

Not guaranteed: only rank 0's view counts. A frozen peer that another rank's watchdog left behind
first (that rank's exit failed rank 0's collective) is counted as node_lost; a group whose rank 0
was killed wrote no reason (node_lost or worker_crash, by the world sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.reader import TAIL_BYTES, PreviousIncarnation, read_events

RESTART_CAUSES = ("worker_crash", "node_lost", "node_joined", "peer_evicted", "drain", "relaunched")
# How the stop guard's reason begins when the peer watchdog stopped training (training/stop_guard.py).
WATCHDOG_REASON = "peer watchdog"
DRAIN_REASON = "drain"


@dataclass(frozen=True)
class GroupEnd:
    """How a worker group stopped, as rank 0 logged it."""

    watchdog: bool = False  # rank 0's peer watchdog stopped it
    drained: bool = False  # it stopped on SIGTERM


def how_it_ended(event_log: str | Path, current: int) -> GroupEnd | None:
    """How the newest incarnation other than `current` in the tail of `event_log` stopped (None: no such one)."""
    previous_id = None
    watchdog = drained = False
    for event in reversed(read_events(event_log, TAIL_BYTES)):
        if event["incarnation"] == current:
            continue
        if previous_id is None:
            previous_id = event["incarnation"]
        elif event["incarnation"] != previous_id:
            break
        kind, reason = event["event"], str(event.get("reason") or "")
        if kind in (schema.MEMORY_COPY.name, schema.MEMORY_COPY_FAILED.name):
            watchdog |= reason.startswith(WATCHDOG_REASON)
            drained |= reason == DRAIN_REASON
        drained |= kind == schema.DRAIN.name
    return GroupEnd(watchdog, drained) if previous_id is not None else None


def restart_cause(previous: PreviousIncarnation, end: GroupEnd | None, world_size: int) -> str:
    """The cause (one of RESTART_CAUSES) of a group of `world_size` ranks that followed `previous`."""
    end = end or GroupEnd()
    before = previous.world_size or world_size
    if previous.finished:
        return "relaunched"
    if end.watchdog:
        return "peer_evicted"
    if world_size > before:
        return "node_joined"
    if end.drained:
        return "drain"
    return "node_lost" if world_size < before else "worker_crash"
