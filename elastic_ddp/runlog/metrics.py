"""Live Prometheus metrics of a run, fed by its events: what an operator watches while it trains.

Rank 0's event log (runlog/events.py) hands every event it writes to `RunMetrics.record`, so the
metrics say what the event log and the report say, from the one place that sees every event; rank
0's peer watchdog tells `heartbeat_gap` and `peer_evicted` (wired by the training layer: the
watchdog itself imports nothing of runlog). With
`--metrics_port` they are written through prometheus_client's multi-process mode into the node's
metrics directory (`open_node_metrics`), which the node's metrics server serves
(runlog/metrics_server.py, started by runlog/metrics_node.py). The files of a worker group that ended
stay: counters go on counting across incarnations (the server sums the files of every process), and
gauges keep their last value (the newest write wins) while the group re-forms.

Names: one prefix, `elastic_ddp_`; units in the names (`_seconds`, `_bytes`, `_ratio`, `_total` for
counters); a label only where its values are a small fixed set, every series created at 0 from the
start. docs/operations.md ("Live metrics") lists them with the alerts and the dashboard.

Not guaranteed:
- They are rank 0's, served by rank 0's node. When rank 0 moves to another node (its node left, or
  the ranks were handed out again), the series go on from that node's endpoint; a node that no longer
  holds rank 0 drops its gauges at its next worker-group start and keeps its counters. Aggregate over
  the nodes: max() of gauges, sum() of rate() or increase() of counters.
- A worker group that rank 0 did not see (one that failed before its first event) is not counted.
- The restart cause is rank 0's view (runlog/metrics_causes.py says where it can be wrong).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, values

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.metrics_causes import RESTART_CAUSES, GroupEnd, restart_cause
from elastic_ddp.runlog.metrics_node import make_private_directory
from elastic_ddp.runlog.reader import PreviousIncarnation

PREFIX = "elastic_ddp"
MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
RESTORE_SOURCES = ("file", "memory", "live")

GAUGES = {
    "global_step": "The newest committed optimizer step (after a restore: the restored one, until the next step).",
    "epoch": "The epoch of the newest committed step, counted from 0.",
    "last_step_timestamp_seconds": "Unix time of the newest committed step: time() minus this is how long "
                                   "training has stalled.",
    "samples_per_second": "Training throughput over the last --log_interval steps, all ranks together.",
    "training_loss": "Mean per-sample training loss over the last --log_interval steps, all ranks.",
    "learning_rate": "The learning rate of the newest --log_interval window.",
    "eval_loss": "Mean per-sample loss of the newest evaluation on --eval_dataset.",
    "eval_accuracy_ratio": "Accuracy (0..1) of the newest evaluation on --eval_dataset (absent when the targets "
                           "are not class indices).",
    "world_size": "Ranks in the current worker group.",
    "nodes": "Nodes (torchrun agents) in the current worker group.",
    "training_finished": "1 once every epoch is trained and the last snapshot is durable, 0 while training.",
    "last_recovery_lost_steps": "Committed steps the newest restore rolled back (0: it lost nothing).",
    "last_recovery_lost_seconds": "Training time those rolled-back steps had taken.",
    "last_recovery_downtime_seconds": "Seconds without training in the newest restart: from the last event of "
                                      "the worker group before to the first step of this one.",
    "snapshot_interval_steps": "Steps between durable snapshots: --snapshot_every_steps (or an epoch, if shorter), "
                               "or on the overhead budget the current spacing.",
    "snapshot_interval_seconds": "On the overhead budget (--snapshot_budget): the current spacing of durable "
                                 "snapshots in seconds.",
    "last_snapshot_timestamp_seconds": "Unix time at which the newest snapshot became durable.",
    "last_snapshot_step": "The global step of the newest durable snapshot.",
    "last_snapshot_write_seconds": "How long writing the newest durable snapshot took (in the background).",
    "last_snapshot_size_bytes": "The size of the newest durable snapshot file.",
    "last_snapshot_blocked_seconds": "How long training waited to copy the state of the newest snapshot.",
    "snapshot_replica_nodes": "Nodes that receive a copy of each snapshot in the current worker group.",
    "last_replicated_step": "The global step of the newest snapshot that reached the replica nodes.",
    "last_replication_seconds": "How long the newest replication took.",
    "watchdog_longest_heartbeat_gap_seconds": "The longest a live peer's heartbeat stayed unchanged, as rank 0's peer "
                                              "watchdog saw it in the current worker group (0 at its start).",
    "watchdog_bound_seconds": "--watchdog_timeout_s: a peer silent this long is left behind (0: the watchdog is off).",
    "slowest_rank_speed_ratio": "The slowest rank's own time per sample against the fastest's, as rank 0 scored it "
                                "at its last heartbeat read (1: every rank as fast; 0.5: one at half speed).",
    "stragglers": "Ranks named slow and not yet back to speed (the straggler events say which).",
}
# name: (help, the label and its values, or None)
COUNTERS: dict[str, tuple[str, tuple[str, tuple[str, ...]] | None]] = {
    "steps_committed": ("Optimizer steps committed, steps done again after a rollback included.", None),
    "incarnations": ("Worker groups that started (one per rendezvous round that reached training).", None),
    "restarts": (("Worker groups that followed an earlier one of the run, by cause: worker_crash, node_lost, "
                  "node_joined, peer_evicted (the watchdog left a silent peer behind), drain (SIGTERM), relaunched "
                  "(the run had finished)."), ("cause", RESTART_CAUSES)),
    "restores": (("Resumes from saved state, by where it came from: memory (a survivor's copy), file (a "
                  "snapshot) or live (the survivors' own state, re-formed in process)."), ("source", RESTORE_SOURCES)),
    "lost_steps": ("Committed steps rolled back by restores, in all.", None),
    "downtime_seconds": (("Seconds without training between a worker group's last event and the next one's "
                          "first step, in all."), None),
    "snapshots": ("Snapshots that became durable.", None),
    "snapshot_failures": ("Snapshots that could not be captured or written (the previous ones are kept).", None),
    "replication_failures": ("Snapshot copies that did not reach a replica node.", None),
    "memory_copies": ("Times rank 0 kept its last committed step in node memory as training stopped early.", None),
    "memory_copy_failures": ("Times rank 0 kept no memory copy as training stopped early.", None),
    "watchdog_evictions": (("Times rank 0's peer watchdog found a peer (or the group's store) silent for the bound "
                            "and the group was re-formed without the silent one (in process, or by torchrun's "
                            "restart of its workers)."), None),
}

EventHandler = Callable[[dict[str, Any], float], None]


class RunMetrics:
    """The run's metrics (see the module docstring), in `registry` (None: written to the files of
    the multi-process directory in force, see `open_node_metrics`). Feed it every event of rank 0.

    `snapshot_interval_steps`: the most steps between durable snapshots (None: on the overhead
    budget, where `snapshot_cadence` events tell it); `previous`: the worker group before this one,
    as the event log tells it (None for the first), and `previous_end` how it stopped;
    `watchdog_bound_s`: --watchdog_timeout_s.
    """

    def __init__(self, snapshot_interval_steps: int | None, previous: PreviousIncarnation | None = None,
                 registry: CollectorRegistry | None = None, previous_end: GroupEnd | None = None,
                 watchdog_bound_s: float = 0.0):
        self.previous, self.previous_end = previous, previous_end
        self._first_step_seen = False
        self.gauges = {name: Gauge(f"{PREFIX}_{name}", text, registry=registry, multiprocess_mode="mostrecent")
                       for name, text in GAUGES.items()}
        self.counters: dict[str, Counter] = {}
        for name, (text, label) in COUNTERS.items():
            counter = Counter(f"{PREFIX}_{name}", text, labelnames=(label[0],) if label else (), registry=registry)
            for value in label[1] if label else ():
                counter.labels(value)  # every series exists from the start, at 0
            self.counters[name] = counter
        if snapshot_interval_steps is not None:
            self.gauges["snapshot_interval_steps"].set(snapshot_interval_steps)
        self._set(watchdog_bound_seconds=watchdog_bound_s, watchdog_longest_heartbeat_gap_seconds=0,
                  slowest_rank_speed_ratio=1, stragglers=0)
        self._stragglers: set[int] = set()  # ranks named and not back, in this worker group
        self._handlers: dict[str, EventHandler] = {
            schema.START.name: self._started,
            schema.RESTORE.name: self._restored,
            schema.STEP.name: self._stepped,
            schema.PROGRESS.name: self._progressed,
            schema.EVAL.name: self._evaluated,
            schema.FINISHED.name: lambda fields, now: self.gauges["training_finished"].set(1),
            schema.SNAPSHOT_CAPTURED.name: self._set_from("last_snapshot_blocked_seconds", "blocked_seconds"),
            schema.SNAPSHOT_CADENCE.name: lambda fields, now: self._set(
                snapshot_interval_steps=fields["every_steps"], snapshot_interval_seconds=fields["interval_s"]),
            schema.SNAPSHOT.name: self._snapshot_durable,
            schema.SNAPSHOT_FAILED.name: self._count("snapshot_failures"),
            schema.REPLICATION.name: lambda fields, now: self.gauges["snapshot_replica_nodes"].set(
                len(fields["target_nodes"] or ())),
            schema.SNAPSHOT_REPLICATED.name: self._replicated,
            schema.REPLICATION_FAILED.name: self._count("replication_failures"),
            schema.MEMORY_COPY.name: self._count("memory_copies"),
            schema.MEMORY_COPY_FAILED.name: self._count("memory_copy_failures"),
            schema.STRAGGLER.name: self._straggler,
        }

    def record(self, kind: schema.EventKind, fields: dict[str, Any], time: float) -> None:
        """One event of `kind` with its `fields`, written at `time` (Unix seconds)."""
        handler = self._handlers.get(kind.name)
        if handler is not None:
            handler(fields, time)

    def heartbeat_gap(self, seconds: float) -> None:
        """Rank 0's peer watchdog saw a new longest heartbeat gap (from its thread)."""
        self.gauges["watchdog_longest_heartbeat_gap_seconds"].set(seconds)

    def peer_evicted(self) -> None:
        """Rank 0's peer watchdog found a peer silent and stops this worker group (from its thread)."""
        self.counters["watchdog_evictions"].inc()

    def rank_speeds(self, slowest_ratio: float) -> None:
        """Rank 0 scored the ranks' speeds (from the watchdog's thread)."""
        self.gauges["slowest_rank_speed_ratio"].set(slowest_ratio)

    # ---------------------------------------------------------------------------- the handlers

    def _started(self, fields: dict[str, Any], now: float) -> None:
        self.counters["incarnations"].inc()
        self._set(world_size=fields["world_size"], nodes=fields["nodes"], training_finished=0)
        if self.previous is not None:
            cause = restart_cause(self.previous, self.previous_end, fields["world_size"])
            self.counters["restarts"].labels(cause).inc()

    def _restored(self, fields: dict[str, Any], now: float) -> None:
        self._set(global_step=fields["global_step"], epoch=fields["epoch"])
        if fields["source"] in RESTORE_SOURCES:
            self.counters["restores"].labels(fields["source"]).inc()
        if fields["lost_steps"] is not None:
            self._set(last_recovery_lost_steps=fields["lost_steps"],
                      last_recovery_lost_seconds=fields["lost_seconds"] or 0.0)
            self.counters["lost_steps"].inc(fields["lost_steps"])

    def _stepped(self, fields: dict[str, Any], now: float) -> None:
        self._set(global_step=fields["global_step"], epoch=fields["epoch"], last_step_timestamp_seconds=now)
        self.counters["steps_committed"].inc()
        if not self._first_step_seen:
            self._first_step_seen = True
            previous = self.previous
            if previous is not None and not previous.finished:
                downtime = max(0.0, now - previous.last_event_time)
                self._set(last_recovery_downtime_seconds=downtime)
                self.counters["downtime_seconds"].inc(downtime)

    def _progressed(self, fields: dict[str, Any], now: float) -> None:
        self._set(samples_per_second=fields["samples_per_second"], training_loss=fields["loss"],
                  learning_rate=fields["lr"], world_size=fields["world_size"])

    def _evaluated(self, fields: dict[str, Any], now: float) -> None:
        self._set(eval_loss=fields["loss"])
        if fields["accuracy"] is not None:
            self._set(eval_accuracy_ratio=fields["accuracy"])

    def _snapshot_durable(self, fields: dict[str, Any], now: float) -> None:
        self._set(last_snapshot_timestamp_seconds=now, last_snapshot_step=fields["global_step"],
                  last_snapshot_write_seconds=fields["write_seconds"], last_snapshot_size_bytes=fields["size_bytes"])
        self.counters["snapshots"].inc()

    def _replicated(self, fields: dict[str, Any], now: float) -> None:
        self._set(last_replicated_step=fields["global_step"], last_replication_seconds=fields["seconds"])

    def _straggler(self, fields: dict[str, Any], now: float) -> None:
        (self._stragglers.add if fields["state"] == "named" else self._stragglers.discard)(fields["rank"])
        self._set(stragglers=len(self._stragglers))

    def _set_from(self, gauge: str, field: str) -> EventHandler:
        return lambda fields, now: self.gauges[gauge].set(fields[field])

    def _count(self, counter: str) -> EventHandler:
        return lambda fields, now: self.counters[counter].inc()

    def _set(self, **gauge_values: float) -> None:
        for name, value in gauge_values.items():
            self.gauges[name].set(value)


def open_node_metrics(directory: Path, snapshot_interval_steps: int | None, previous: PreviousIncarnation | None,
                      process_identifier: Callable[[], int] = os.getpid, previous_end: GroupEnd | None = None,
                      watchdog_bound_s: float = 0.0) -> RunMetrics:
    """RunMetrics whose values go to files in `directory` (this node's metrics directory), for the
    node's metrics server. `process_identifier` names this process's files (tests stand in for
    several processes with it)."""
    make_private_directory(directory)
    with _values_in_files(directory, process_identifier):
        return RunMetrics(snapshot_interval_steps, previous, registry=None, previous_end=previous_end,
                          watchdog_bound_s=watchdog_bound_s)


_switching = threading.Lock()


@contextlib.contextmanager
def _values_in_files(directory: Path, process_identifier: Callable[[], int]) -> Iterator[None]:
    """Metrics created inside keep their values in files in `directory`.

    prometheus_client picks where values live once, when it is imported (multi-process mode when
    PROMETHEUS_MULTIPROC_DIR is set then), and a metric takes the choice in force when it is
    created. Ours go to `directory` whatever the process chose; the process's own choice, for any
    metrics of yours, is left as it was.
    """
    with _switching:
        chosen, variable = values.ValueClass, os.environ.get(MULTIPROCESS_DIR_VARIABLE)
        os.environ[MULTIPROCESS_DIR_VARIABLE] = str(directory)
        values.ValueClass = _file_values(str(directory), process_identifier)
        try:
            yield
        finally:
            values.ValueClass = chosen
            if variable is None:
                del os.environ[MULTIPROCESS_DIR_VARIABLE]
            else:
                os.environ[MULTIPROCESS_DIR_VARIABLE] = variable


@functools.cache
def _file_values(directory: str, process_identifier: Callable[[], int]) -> type:
    """One value class per directory and process, so that a second RunMetrics in the same process
    (a second `fit`) writes to the same files and its counters go on from the first's."""
    return values.MultiProcessValue(process_identifier)
