"""The live metrics: what each event does to them, their names, units and labels, the multi-process
files that carry them across worker groups, the flags, and the dashboard and alerts that use them.

In one process, through prometheus_client's own registry and collector; the server process, the
endpoint over HTTP and real restarts are in tests/cluster/test_metrics_endpoint.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, values
from prometheus_client.multiprocess import MultiProcessCollector

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.metrics import COUNTERS, GAUGES, PREFIX, RunMetrics, open_node_metrics
from elastic_ddp.runlog.metrics_agent import exposed_names as agent_series
from elastic_ddp.runlog.metrics_node import (
    Endpoint,
    forget_stale_gauges,
    metrics_directory,
    remove_files_of_ended_processes,
    served_elsewhere,
)
from elastic_ddp.runlog.metrics_server import MAX_ANSWERING, MAX_PENDING, MetricsHTTPServer
from elastic_ddp.runlog.reader import PreviousIncarnation
from elastic_ddp.testbed.local_cluster import wait_for

REPO = Path(__file__).resolve().parents[2]
DEAD_PID = 2**22 + 1  # above Linux's largest pid_max: never a running process
UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_steps", "_step", "_total")
UNITLESS = {"global_step", "epoch", "samples_per_second", "training_loss", "learning_rate", "eval_loss",
            "world_size", "nodes", "training_finished", "snapshot_replica_nodes", "stragglers"}


def feed(metrics: RunMetrics, kind: schema.EventKind, at: float = 1000.0, **fields) -> None:
    assert fields.keys() == kind.field_set, (kind, sorted(fields))  # as the event log would refuse it
    metrics.record(kind, fields, at)


def start(metrics: RunMetrics, world_size: int, at: float = 1000.0) -> None:
    feed(metrics, schema.START, at, round=1, world_size=world_size, local_world_size=1, nodes=world_size,
         ranks=[], restart_count=0, run_id="job", in_process=False)


def restore(metrics: RunMetrics, step: int, source: str = "memory", lost_steps: int | None = 0,
            at: float = 1000.0) -> None:
    feed(metrics, schema.RESTORE, at, global_step=step, epoch=1, samples_consumed=step * 64, checksum="blake3:x",
         verified=True, source=source, source_rank=0, source_host="a", file=None, previous_world_size=4,
         world_size=3, lost_steps=lost_steps, lost_seconds=0.5 if lost_steps else 0.0, refused=[])


def exposed_names(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples
            if not sample.name.endswith("_created")}


def value(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(f"{PREFIX}_{name}", labels)


# ------------------------------------------------------------------------------ names and labels

def test_every_metric_has_the_prefix_a_unit_or_is_a_count_and_counters_end_in_total():
    registry = CollectorRegistry()
    RunMetrics(snapshot_interval_steps=50, registry=registry)
    families = list(registry.collect())
    assert {family.name for family in families} == {f"{PREFIX}_{name}" for name in (*GAUGES, *COUNTERS)}
    for family in families:
        short = family.name.removeprefix(f"{PREFIX}_")
        assert family.name.startswith(f"{PREFIX}_") and family.documentation, family.name
        assert short.endswith(UNIT_SUFFIXES) or short in UNITLESS or family.type == "counter", family.name
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name


def test_labels_take_only_their_fixed_values_whatever_the_events_say():
    registry = CollectorRegistry()
    metrics = RunMetrics(snapshot_interval_steps=50, registry=registry)
    labelled = {family.name: {tuple(sorted(s.labels.items())) for s in family.samples}
                for family in registry.collect() if any(s.labels for s in family.samples)}
    assert labelled == {
        f"{PREFIX}_restarts": {(("cause", cause),) for cause in ("worker_crash", "node_lost", "node_joined",
                                                                 "peer_evicted", "drain", "relaunched")},
        f"{PREFIX}_restores": {(("source", source),) for source in ("file", "memory", "live")},
    }
    restore(metrics, 10, source="a source of a later version")
    after = {tuple(sorted(s.labels.items())) for family in registry.collect() for s in family.samples if s.labels}
    assert after == set().union(*labelled.values()), "no series for an unknown label value"


# ---------------------------------------------------------------------------------- the updates

def test_a_first_worker_group_sets_the_training_gauges_and_counts_steps():
    registry = CollectorRegistry()
    metrics = RunMetrics(snapshot_interval_steps=24, registry=registry)
    start(metrics, world_size=4)
    for step in (1, 2, 3):
        feed(metrics, schema.STEP, 1000.0 + step, global_step=step, epoch=0)
    feed(metrics, schema.PROGRESS, global_step=3, epoch=0, loss=0.75, lr=0.01, samples_per_second=1234.5,
         world_size=4)
    feed(metrics, schema.EVAL, global_step=3, epoch=0, loss=0.5, accuracy=0.875, samples=100)
    assert value(registry, "incarnations_total") == 1 and value(registry, "world_size") == 4
    assert value(registry, "global_step") == 3 and value(registry, "steps_committed_total") == 3
    assert value(registry, "last_step_timestamp_seconds") == 1003.0
    assert (value(registry, "training_loss"), value(registry, "learning_rate"), value(registry, "samples_per_second")) \
        == (0.75, 0.01, 1234.5)
    assert (value(registry, "eval_loss"), value(registry, "eval_accuracy_ratio")) == (0.5, 0.875)
    assert value(registry, "snapshot_interval_steps") == 24
    assert sum(value(registry, "restarts_total", cause=c) for c in ("node_lost", "node_joined", "worker_crash")) == 0
    assert value(registry, "downtime_seconds_total") == 0, "a first group recovers from nothing"


def test_a_restart_counts_its_kind_its_source_what_it_lost_and_the_time_without_training():
    registry = CollectorRegistry()
    previous = PreviousIncarnation(world_size=4, last_event_time=990.0, finished=False)
    metrics = RunMetrics(snapshot_interval_steps=24, previous=previous, registry=registry)
    start(metrics, world_size=3, at=995.0)
    restore(metrics, 30, source="file", lost_steps=7)
    feed(metrics, schema.STEP, 1002.5, global_step=31, epoch=1)
    feed(metrics, schema.STEP, 1003.0, global_step=32, epoch=1)
    assert value(registry, "restarts_total", cause="node_lost") == 1
    assert value(registry, "restores_total", source="file") == 1 and value(registry, "restores_total", source="memory") == 0
    assert value(registry, "last_recovery_lost_steps") == 7 and value(registry, "lost_steps_total") == 7
    assert value(registry, "last_recovery_lost_seconds") == 0.5
    assert value(registry, "last_recovery_downtime_seconds") == 12.5, "first step minus the last event before"
    assert value(registry, "downtime_seconds_total") == 12.5, "counted once, at the first step"


@pytest.mark.parametrize("before, after, finished, cause", [
    (2, 4, False, "node_joined"), (4, 4, False, "worker_crash"), (4, 4, True, "relaunched"),
    (None, 4, False, "worker_crash")])
def test_the_restart_cause_without_a_stop_reason_follows_the_world_sizes(before, after, finished, cause):
    registry = CollectorRegistry()
    metrics = RunMetrics(24, PreviousIncarnation(before, 990.0, finished), registry=registry)
    start(metrics, world_size=after)
    assert value(registry, "restarts_total", cause=cause) == 1


def test_snapshots_replication_and_memory_copies():
    registry = CollectorRegistry()
    metrics = RunMetrics(snapshot_interval_steps=50, registry=registry)
    feed(metrics, schema.SNAPSHOT_CAPTURED, global_step=50, blocked_seconds=0.02)
    assert value(registry, "snapshot_interval_steps") == 50 and value(registry, "snapshot_interval_seconds") == 0
    feed(metrics, schema.SNAPSHOT, 1010.0, global_step=50, epoch=0, file="snapshot-50.pt", checksum="blake3:x",
         size_bytes=4096, write_seconds=0.3)
    feed(metrics, schema.SNAPSHOT_FAILED, global_step=100, error="disk full")
    feed(metrics, schema.REPLICATION, replicas=1, target_nodes=["b"], target_ranks=[2])
    feed(metrics, schema.SNAPSHOT_REPLICATED, global_step=50, checksum="blake3:x", nodes=["b"], seconds=0.1)
    feed(metrics, schema.REPLICATION_FAILED, global_step=100, node="b", error="gone")
    feed(metrics, schema.MEMORY_COPY, global_step=120, reason="drain", size_bytes=4096, seconds=0.01, written=True)
    feed(metrics, schema.MEMORY_COPY_FAILED, global_step=121, reason="RuntimeError", error="non-finite")
    feed(metrics, schema.FINISHED, global_step=121, seconds=10.0)
    assert (value(registry, "last_snapshot_step"), value(registry, "last_snapshot_timestamp_seconds"),
            value(registry, "last_snapshot_size_bytes"), value(registry, "last_snapshot_write_seconds"),
            value(registry, "last_snapshot_blocked_seconds")) == (50, 1010.0, 4096, 0.3, 0.02)
    assert value(registry, "snapshots_total") == 1 and value(registry, "snapshot_failures_total") == 1
    assert (value(registry, "snapshot_replica_nodes"), value(registry, "last_replicated_step"),
            value(registry, "last_replication_seconds"), value(registry, "replication_failures_total")) == (1, 50, 0.1, 1)
    assert value(registry, "memory_copies_total") == 1 and value(registry, "memory_copy_failures_total") == 1
    assert value(registry, "training_finished") == 1


def test_on_the_overhead_budget_the_interval_is_the_cadences():
    registry = CollectorRegistry()
    metrics = RunMetrics(snapshot_interval_steps=None, registry=registry)
    assert value(registry, "snapshot_interval_steps") == 0  # (in files: absent until told)
    feed(metrics, schema.SNAPSHOT_CADENCE, global_step=10, every_steps=240, interval_s=61.5, blocked_seconds=0.6,
         writer_cpu_seconds=0.0, budget=0.01)
    assert value(registry, "snapshot_interval_steps") == 240 and value(registry, "snapshot_interval_seconds") == 61.5


def test_the_event_log_tells_its_sink_every_event_and_a_failing_sink_does_not_stop_it(tmp_path, caplog):
    seen = []
    log = EventLog(tmp_path / "events.jsonl", incarnation=7, enabled=True,
                   sink=lambda kind, fields, now: seen.append((kind.name, fields["global_step"])))
    log.emit(schema.STEP, global_step=1, epoch=0)
    assert seen == [("step", 1)]
    assert EventLog(tmp_path / "other.jsonl", 7, enabled=False, sink=seen.append)._sink is None, "rank 0's alone"

    def broken(kind, fields, now):
        raise ValueError("boom")

    failing = EventLog(tmp_path / "failing.jsonl", incarnation=7, enabled=True, sink=broken)
    with caplog.at_level(logging.WARNING):
        failing.emit(schema.STEP, global_step=1, epoch=0)
        failing.emit(schema.STEP, global_step=2, epoch=0)
    failing.close()
    assert len((tmp_path / "failing.jsonl").read_text().splitlines()) == 2
    assert [r.getMessage() for r in caplog.records if "live metrics" in r.getMessage()] == [
        "live metrics missed a step event (ValueError: boom); training goes on"]


# ------------------------------------------------------------------ files that outlive a process

def collect(directory: Path) -> dict[str, float]:
    return {(s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name): s.value
            for family in MultiProcessCollector.merge([str(p) for p in directory.glob("*.db")])
            for s in family.samples}


def test_counters_go_on_and_gauges_keep_the_newest_value_across_worker_group_processes(tmp_path):
    """Two incarnations' rank 0 as two processes (their own file names): the files of the one that
    ended still count, and the later one's gauges win."""
    directory = tmp_path / "metrics"
    first = open_node_metrics(directory, 24, None, process_identifier=lambda: DEAD_PID)
    start(first, world_size=4)
    for step in range(1, 11):
        feed(first, schema.STEP, 1000.0 + step, global_step=step, epoch=0)
    during_the_restart = collect(directory)
    second = open_node_metrics(directory, 24, PreviousIncarnation(4, 1010.0, False),
                               process_identifier=lambda: os.getpid())
    start(second, world_size=3)
    restore(second, 10)
    feed(second, schema.STEP, 1020.0, global_step=11, epoch=0)
    after = collect(directory)
    assert during_the_restart[f"{PREFIX}_global_step"] == 10 and during_the_restart[f"{PREFIX}_world_size"] == 4
    assert after[f"{PREFIX}_steps_committed_total"] == 11 and after[f"{PREFIX}_incarnations_total"] == 2
    assert after[f"{PREFIX}_global_step"] == 11 and after[f"{PREFIX}_world_size"] == 3
    assert after[f'{PREFIX}_restarts_total{{"cause": "node_lost"}}'] == 1
    assert after[f"{PREFIX}_last_recovery_downtime_seconds"] == 10.0
    assert oct(directory.stat().st_mode & 0o777) == "0o700"

    forget_stale_gauges(directory)  # this node no longer holds rank 0: the ended process's gauges go
    assert {p.name for p in directory.glob("*.db")} == {
        f"counter_{DEAD_PID}.db", f"counter_{os.getpid()}.db", f"gauge_mostrecent_{os.getpid()}.db"}
    remove_files_of_ended_processes(directory)  # the node's agent ended
    assert {p.name for p in directory.glob("*.db")} == {f"counter_{os.getpid()}.db", f"gauge_mostrecent_{os.getpid()}.db"}


def test_the_processs_own_prometheus_client_mode_is_left_as_it_was(tmp_path):
    chosen = values.ValueClass
    open_node_metrics(tmp_path / "metrics", 24, None, process_identifier=lambda: DEAD_PID + 1)
    assert values.ValueClass is chosen and "PROMETHEUS_MULTIPROC_DIR" not in os.environ


def test_the_metrics_directory_is_per_user_run_and_checkpoint_dir_under_the_memory_dir(tmp_path):
    one = metrics_directory(tmp_path, "job1", "ck")
    assert one.parent == tmp_path and one.name.startswith("elastic_ddp-metrics-")
    assert one == metrics_directory(tmp_path, "job1", os.path.abspath("ck"))
    assert len({one, metrics_directory(tmp_path, "job2", "ck"), metrics_directory(tmp_path, "job1", "s3://b/ck")}) == 3


# ------------------------------------------------------------------------------------ the flags

def test_metrics_are_off_by_default_and_listen_on_loopback():
    config = TrainingConfig.from_args([])
    assert (config.metrics_port, config.metrics_addr) == (None, "127.0.0.1")
    assert TrainingConfig.from_args(["--metrics_port", "0", "--metrics_addr", "::"]).metrics_addr == "::"


@pytest.mark.parametrize("overrides, message", [
    ({"metrics_port": 65536}, "--metrics_port: got 65536; expected a TCP port from 1 to 65535, or 0 for a free one"),
    ({"metrics_port": -1}, "--metrics_port: got -1; expected a TCP port"),
    ({"metrics_addr": "localhost"}, "--metrics_addr: got 'localhost'; expected an IP address"),
    ({"metrics_addr": "10.0.0.300"}, "--metrics_addr: got '10.0.0.300'; expected an IP address"),
    ({"metrics_port": 9400, "memory_copies": False, "memory_dir": ""}, "--memory_dir: got an empty path"),
])
def test_a_bad_metrics_flag_is_one_line_naming_it(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingConfig(model="mlp", **overrides)


def test_the_help_says_that_binding_beyond_loopback_is_the_users_choice():
    from elastic_ddp.config import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--metrics_addr METRICS_ADDR" in text and "explicit choice" in text and "(default: 127.0.0.1)" in text


# ---------------------------------------------------------------------- the dashboard and alerts

METRIC_NAME = re.compile(rf"\b{PREFIX}_[a-z0-9_]+")


def all_exposed_names() -> set[str]:
    """The run's series (rank 0's) and the agent's (every node's, runlog/metrics_agent.py)."""
    registry = CollectorRegistry()
    RunMetrics(snapshot_interval_steps=50, registry=registry)
    return exposed_names(registry) | agent_series()


def test_the_alert_rules_parse_and_name_only_metrics_that_exist():
    rules = yaml.safe_load((REPO / "docs" / "prometheus-alerts.yaml").read_text())
    [group] = rules["groups"]
    alerts = {rule["alert"]: rule["expr"] for rule in group["rules"]}
    assert {"ElasticDDPTrainingStalled", "ElasticDDPRestartsFrequent", "ElasticDDPSnapshotStale",
            "ElasticDDPReplicationFailing"} <= alerts.keys()
    exposed = all_exposed_names()
    for name, expression in alerts.items():
        used = set(METRIC_NAME.findall(expression))
        assert used and used <= exposed, (name, used - exposed)
        assert expression.count("(") == expression.count(")"), name


def test_the_dashboard_parses_and_names_only_metrics_that_exist():
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    expressions.append(dashboard["templating"]["list"][1]["definition"])
    exposed = all_exposed_names()
    used = {name for expression in expressions for name in METRIC_NAME.findall(expression)}
    assert used <= exposed, used - exposed
    shown = {name.removesuffix("_total") for name in used}
    missing = {f"{PREFIX}_{name}" for name in (*GAUGES, *COUNTERS)} - shown
    missing |= {name.removesuffix("_total") for name in agent_series()} - shown
    assert not missing, f"metrics the dashboard does not show: {sorted(missing)}"


def test_operations_md_lists_every_metric():
    text = (REPO / "docs" / "operations.md").read_text()
    missing = sorted(name for name in all_exposed_names() if f"`{name}`" not in text)
    assert not missing, f"docs/operations.md, 'Live metrics', lacks {missing}"


def test_clients_that_trickle_their_requests_are_dropped_at_the_deadline_and_scrapes_go_on():
    """A slowloris: as many clients as there are answering slots, each sending a byte every 0.25 s
    and never ending its headers. Each is dropped at its connection's deadline (not reset by every byte as a timeout per
    read was), and a scrape is answered after."""
    server = MetricsHTTPServer(("127.0.0.1", 0), CollectorRegistry(), connection_timeout_s=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port, stop, dropped = server.server_address[1], threading.Event(), []

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            try:
                for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"x" * 10_000:
                    client.sendall(bytes([byte]))
                    if stop.wait(0.25):
                        return
            except OSError:
                dropped.append(True)

    slow = [threading.Thread(target=trickle, daemon=True) for _ in range(MAX_ANSWERING)]
    for thread in slow:
        thread.start()
    try:
        wait_for(lambda: len(dropped) == MAX_ANSWERING, 30, "every trickling client dropped", interval=0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            assert answer.status == 200
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return answer.status


def test_scrapes_are_answered_while_slow_clients_reconnect_as_soon_as_they_are_dropped():
    """Eight clients that trickle their headers and reconnect the moment they are dropped (at a 1 s
    deadline here) once kept the endpoint nearly unanswered: they held every connection slot. A
    request now takes a slot only once complete: every scrape is answered while they come and go."""
    server = MetricsHTTPServer(("127.0.0.1", 0), CollectorRegistry(), connection_timeout_s=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port, stop, reconnects = server.server_address[1], threading.Event(), []

    def trickle_and_reconnect() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                    for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"x" * 10_000:
                        client.sendall(bytes([byte]))
                        if stop.wait(0.05):
                            return
            except OSError:
                reconnects.append(True)

    slow = [threading.Thread(target=trickle_and_reconnect, daemon=True) for _ in range(8)]
    for thread in slow:
        thread.start()
    try:
        wait_for(lambda: len(reconnects) >= 8, 30, "the slow clients dropped and back", interval=0.05)
        answered = [scrape(port) for _ in range(20)]
        assert answered == [200] * 20
        assert len(reconnects) >= 8  # they kept coming meanwhile
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_a_scrape_pushes_out_the_oldest_of_too_many_silent_connections():
    """More connections than the reception holds, none sending a byte: the newest, a scrape, is
    answered; the oldest was pushed out (closed) to make room."""
    server = MetricsHTTPServer(("127.0.0.1", 0), CollectorRegistry())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_PENDING + 8)]
    try:
        assert scrape(port) == 200
        assert silent[0].recv(1) == b""  # closed by the server
    finally:
        for connection in silent:
            connection.close()
        server.shutdown()
        server.server_close()


def test_a_second_node_on_the_machine_says_where_its_metrics_are_served():
    """Two nodes of one run on one machine share the first one's server: the second, asked for
    another port, names the URL that serves it instead of nothing at all."""
    first = Endpoint(addr="127.0.0.1", port=9101, pid=500, start_ticks=1, watched_pid=100, watched_start_ticks=1)
    assert served_elsewhere(first, 100, "127.0.0.1", 9101) is None  # its own server
    assert served_elsewhere(first, 200, "127.0.0.1", 0) is None  # any port would do
    assert served_elsewhere(first, 200, "127.0.0.1", 9101) is None  # the very port asked for
    line = served_elsewhere(first, 200, "127.0.0.1", 9102)
    assert line == ("metrics: --metrics_addr 127.0.0.1 --metrics_port 9102 is not served: this run's nodes on this "
                    "machine share one metrics directory, whose server (pid 500, for the node of agent pid 100) "
                    "serves them all at http://127.0.0.1:9101/metrics; scrape that URL")
    assert served_elsewhere(first, 200, "0.0.0.0", 0) is not None  # another address asked for
