"""The live metrics endpoint (--metrics_port) over real HTTP: it answers while the worker group is torn
down and re-formed, its counters go on across incarnations, and it ends with its node's agent.

The first test drives the metrics server process alone (runlog/metrics_node.py starts it); the second
runs `python -m elastic_ddp.train` with a port in use; the third is a job of real torchrun agents on
127.0.0.1 in which a node freezes (a watchdog eviction), then, with a node that joins, loses a
worker, then a node, and gains one, while the test scrapes rank 0's node and parses what it gets
with prometheus_client's parser: the restart causes, the watchdog's figures, and each node's own
agent's rendezvous rounds (runlog/metrics_agent.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.metrics import open_node_metrics
from elastic_ddp.runlog.metrics_node import (
    ENDPOINT_FILE,
    Endpoint,
    MetricsEndpointError,
    ensure_server,
    is_running,
    make_private_directory,
    read_endpoint,
)
from elastic_ddp.testbed.local_cluster import LocalJob, LocalNode, wait_for
from tests.support.cluster import hold_settings, node_logs, pause_at, release, world_reached
from tests.support.metrics import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 240 steps. The job is held (elastic_ddp/chaos/held_train.py) and each phase of a scenario first
# moves its stop 20 steps on (`held_job`, `go_on`), so the job trains while a fault lands and cannot
# end before the test releases it; then the few steps left run at full speed.
DATASET, BATCH, EPOCHS = 1536, 64, 10
STEPS_PER_PHASE = 20
TRAINING_ARGS = ["--model", "mlp", "--no-augment", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET),
                 "--global_batch_size", str(BATCH), "--micro_batch_size", "32", "--snapshot_every_steps", "20",
                 "--log_interval", "5", "--metrics_port", "0"]
P = "elastic_ddp_"


def status_of(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


# ----------------------------------------------------------------------------- the server alone

def test_the_server_serves_get_metrics_only_is_reused_and_ends_with_the_process_it_watches(tmp_path):
    directory = tmp_path / "metrics"
    make_private_directory(directory)
    metrics = open_node_metrics(directory, 20, None)  # this process stands for rank 0
    metrics.record(schema.STEP, {"global_step": 7, "epoch": 0}, time.time())
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # stands for the agent
    try:
        endpoint, started = ensure_server(directory, "127.0.0.1", 0, watched.pid)
        assert started and endpoint.port > 0 and endpoint.watched_pid == watched.pid
        values = scrape(endpoint.url)
        assert values[f"{P}global_step"] == 7 and values[f"{P}steps_committed_total"] == 1
        assert status_of(endpoint.url.removesuffix("/metrics") + "/") == 404
        assert status_of(endpoint.url.removesuffix("metrics") + "anything") == 404
        assert status_of(endpoint.url, "POST") == 501 and status_of(endpoint.url, "DELETE") == 501
        assert ensure_server(directory, "127.0.0.1", 0, watched.pid) == (endpoint, False), "the running one"

        other = tmp_path / "other"
        make_private_directory(other)
        with pytest.raises(MetricsEndpointError, match=rf"cannot listen on 127\.0\.0\.1:{endpoint.port}: "
                                                       "Address already in use; expected a free port"):
            ensure_server(other, "127.0.0.1", endpoint.port, watched.pid)
        with pytest.raises(MetricsEndpointError, match=r"cannot listen on 192\.0\.2\.1: Cannot assign requested"):
            ensure_server(other, "192.0.2.1", 0, watched.pid)  # TEST-NET-1: no address of this machine
    finally:
        watched.kill()
        watched.wait()
    wait_for(lambda: not is_running(endpoint.pid, endpoint.start_ticks), 30, "the server's end after its agent's")
    assert not (directory / ENDPOINT_FILE).exists()
    assert "ended: stopped" in (directory / "server.log").read_text()


@pytest.mark.timeout(120)
def test_a_port_in_use_stops_the_worker_in_one_line_before_any_process_group(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "elastic_ddp.train", "--model", "mlp", "--checkpoint_dir",
                                 str(tmp_path / "ck"), "--memory_dir", str(tmp_path / "memory"),
                                 "--metrics_port", str(port)], capture_output=True, text=True, timeout=100,
                                check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"--metrics_port/--metrics_addr: cannot listen on 127.0.0.1:{port}: Address already in use" in last
    assert "Traceback" not in result.stderr and not (tmp_path / "ck").exists()


# ------------------------------------------------------------------------------ a job that fails

def endpoint_of(job: LocalJob, node: LocalNode) -> Endpoint:
    found: list[Endpoint] = []

    def listening() -> bool:
        found[:] = [e for d in job.node_memory_dir(node.name).glob("elastic_ddp-metrics-*")
                    if (e := read_endpoint(d)) is not None]
        return bool(found)

    wait_for(listening, 60, f"the metrics endpoint of {node.name}", still_possible=job.why_ended)
    return found[0]


class Watch:
    """Scrapes one endpoint while the test waits; every scrape must answer."""

    def __init__(self, url: str):
        self.url = url
        self.scrapes: list[tuple[float, dict[str, float]]] = []

    def until(self, condition, timeout: float, what: str, job: LocalJob) -> dict[str, float]:
        def scraped() -> bool:
            self.scrapes.append((time.time(), scrape(self.url)))
            return condition(self.scrapes[-1][1])

        wait_for(scraped, timeout, what, interval=0.05, still_possible=job.why_ended)
        return self.scrapes[-1][1]

    def series(self, name: str, since: float = 0.0) -> list[float]:
        return [values[name] for at, values in self.scrapes if at >= since and name in values]


def new_group(world_size: int, incarnations: int, downtime_before: float):
    """A scrape that shows incarnation `incarnations`, of `world_size` ranks, past its first step (which
    adds its time without training)."""
    return lambda v: (v.get(f"{P}incarnations_total") == incarnations and v.get(f"{P}world_size") == world_size
                      and v.get(f"{P}downtime_seconds_total", 0) > downtime_before)


def start_time(job: LocalJob, number: int) -> float:
    return sorted(e["time"] for e in job.events("start"))[number - 1]


def world_sizes(watch: Watch, since: float) -> list[int]:
    """The world sizes the endpoint showed from `since` on, one entry per change."""
    sizes: list[int] = []
    for size in watch.series(f"{P}world_size", since):
        if not sizes or sizes[-1] != size:
            sizes.append(int(size))
    return sizes


def held_job(local_jobs, hold):
    """A job of TRAINING_ARGS held at the slow pace, that stops after step STEPS_PER_PHASE until `go_on`."""
    settings = hold_settings(hold)
    pause_at(hold, STEPS_PER_PHASE)
    return local_jobs(training_args=TRAINING_ARGS, **settings)


def go_on(hold, values: dict[str, float]) -> None:
    """Let the held job train STEPS_PER_PHASE steps past the step the endpoint showed last."""
    pause_at(hold, int(values.get(f"{P}global_step", 0)) + STEPS_PER_PHASE)


def test_the_endpoint_answers_through_restarts_and_its_counters_go_on(local_jobs, tmp_path):
    hold = tmp_path / "hold"
    job = held_job(local_jobs, hold)
    # The run's gauges are served by rank 0's node, so the host must stay rank 0. torch ranks nodes
    # by name (address, then agent pid): an address that sorts before the others' ("localhost")
    # keeps it first, whatever pids the others get (a joiner's pid after the machine's pids wrapped
    # around sorted first once, and the host's endpoint lost the run's gauges).
    host, frozen = job.add_node("host", local_addr="127.0.0.1"), job.add_node("frozen")
    first = world_reached(job, 2)  # (the host may have trained alone before: --nnodes=1:4)
    assert next(r for r in first["ranks"] if r["rank"] == 0)["agent_pid"] == host.pid, (
        "torch gives rank 0 to the node whose name sorts first: the host's address")
    watch = Watch(endpoint_of(job, host).url)

    # 0. A frozen node shows as a watchdog eviction and a peer_evicted restart. (In a world of two:
    # with a third node, its watchdog could leave the frozen one behind first, and rank 0 would see
    # that node's exit, node_lost: docs/operations.md.)
    groups = len(job.events("start"))
    before_freeze = watch.until(lambda v: v.get(f"{P}global_step", 0) >= 10 and v.get(f"{P}world_size") == 2
                                and v.get(f"{P}watchdog_longest_heartbeat_gap_seconds", 0) > 0, 120,
                                "step 10 in the world of 2, heartbeats seen", job)
    go_on(hold, before_freeze)  # (rank 0 waits in its next all-reduce for the frozen peer)
    frozen.freeze()  # SIGSTOP, agent and workers: its sockets stay open, gloo does not fail
    try:
        after_freeze = watch.until(new_group(1, groups + 1, before_freeze.get(f"{P}downtime_seconds_total", 0.0)),
                                   120, "training without the frozen node", job)
    finally:
        frozen.kill()
    assert (after_freeze[f"{P}watchdog_evictions_total"]
            - before_freeze.get(f"{P}watchdog_evictions_total", 0)) == 1
    assert (after_freeze[f'{P}restarts_total{{cause="peer_evicted"}}']
            - before_freeze.get(f'{P}restarts_total{{cause="peer_evicted"}}', 0)) == 1
    assert after_freeze[f"{P}lost_steps_total"] == before_freeze.get(f"{P}lost_steps_total", 0)

    # The restarts below, in a world of host and a node that joins now.
    other = job.add_node("other")
    group = job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == 2
                               and {r["agent_pid"] for r in e["ranks"]} == {host.pid, other.pid}, 120,
                               "the group of host and other")
    after_freeze_at = group["time"]
    other_endpoint = endpoint_of(job, other)
    assert other_endpoint.url != watch.url, "every node serves its own endpoint"
    other_values = scrape(other_endpoint.url)
    assert f"{P}global_step" not in other_values, "rank 0's node alone has the run's gauges"
    assert other_values[f"{P}agent_rendezvous_rounds_total"] >= 1, "every node serves its own agent's rounds"
    groups = len(job.events("start"))
    # (rank 0's watchdog reports its first gap once a peer's heartbeat has changed twice)
    before = watch.until(lambda v: v.get(f"{P}global_step", 0) >= 15 and v.get(f"{P}world_size") == 2
                         and v.get(f"{P}watchdog_longest_heartbeat_gap_seconds", 0) > 0, 120,
                         "step 15 in the world of 2 on the endpoint, heartbeats seen", job)
    before_at = watch.scrapes[-1][0]
    assert before[f"{P}incarnations_total"] == groups
    assert before[f"{P}agent_rendezvous_rounds_total"] >= 1 and before[f"{P}agent_rendezvous_in_progress"] == 0
    assert before[f"{P}agent_rendezvous_seconds_total"] > 0 and before[f"{P}watchdog_bound_seconds"] == 3

    def grew(values: dict[str, float], name: str) -> float:
        return values.get(name, 0.0) - before.get(name, 0.0)

    # 1. The other node's worker dies: the whole group is torn down and re-formed, rank 0's process too.
    go_on(hold, before)  # (rank 0 trains: its next all-reduce fails, no SIGTERM stops it first)
    # Past the group's second step, whose forward rebuilds DDP's buckets in one blocking call
    # (training/in_process.py, InterruptibleDDP): the kill lands where a lost peer is told at once.
    restored = next(e["global_step"] for e in job.events("restore") if e["incarnation"] == group["incarnation"])
    watch.until(lambda v: v.get(f"{P}global_step", 0) >= restored + 3, 60, "the group's third step", job)
    killed_at = time.time()
    os.kill(next(r["pid"] for r in group["ranks"] if r["rank"] == 1), signal.SIGKILL)
    restarted = watch.until(new_group(2, groups + 1, before.get(f"{P}downtime_seconds_total", 0.0)), 120,
                            "the re-formed group training", job)
    during = [values for at, values in watch.scrapes if killed_at < at < start_time(job, groups + 1)]
    assert during, "a scrape while the group re-formed"
    assert all(values[f"{P}global_step"] >= before[f"{P}global_step"] for values in during), "the last values stay"
    assert grew(restarted, f'{P}restarts_total{{cause="worker_crash"}}') == 1
    assert grew(restarted, f'{P}restores_total{{source="memory"}}') == 1
    assert grew(restarted, f"{P}lost_steps_total") == 0 and restarted[f"{P}last_recovery_lost_steps"] == 0
    assert 0 < restarted[f"{P}last_recovery_downtime_seconds"] == grew(restarted, f"{P}downtime_seconds_total")

    # 2. The other node is lost, agent and all: the world goes down; its endpoint ends with its agent.
    go_on(hold, restarted)
    other.kill()
    wait_for(lambda: not is_running(other_endpoint.pid, other_endpoint.start_ticks), 30,
             "the lost node's metrics server's end")
    shrunk = watch.until(new_group(1, groups + 2, restarted[f"{P}downtime_seconds_total"]), 120,
                         "training in the smaller world", job)
    assert grew(shrunk, f'{P}restarts_total{{cause="node_lost"}}') == 1

    # 3. A node joins (the job waits for it a few steps on): the world goes back up.
    pause_at(hold, int(shrunk[f"{P}global_step"]) + 3)
    joiner = job.add_node("joiner")
    grown = watch.until(new_group(2, groups + 3, shrunk[f"{P}downtime_seconds_total"]), 120,
                        "training with the joined node", job)
    release(hold)
    assert grew(grown, f'{P}restarts_total{{cause="node_joined"}}') == 1
    # The lost node's survivor keeps its own state when it re-forms in process (issue 44): `live`.
    restores = grew(grown, f'{P}restores_total{{source="memory"}}') + grew(grown, f'{P}restores_total{{source="live"}}')
    assert restores == 3 and grew(grown, f"{P}lost_steps_total") == 0

    causes = {name: value for name, value in grown.items() if name.startswith(f"{P}restarts_total")}
    assert sum(causes.values()) == sum(before.get(name, 0) for name in causes) + 3, causes
    # The host's agent took part in a round for each of the three restarts (more if a group re-formed
    # twice), and the rendezvous time counts on.
    assert grew(grown, f"{P}agent_rendezvous_rounds_total") >= 3
    assert grew(grown, f"{P}agent_rendezvous_seconds_total") > 0
    assert grew(grown, f"{P}watchdog_evictions_total") == 0, "no peer froze since: nothing evicted"
    gaps = watch.series(f"{P}watchdog_longest_heartbeat_gap_seconds", since=after_freeze_at)
    assert 0 < max(gaps) < 3, gaps  # (0 again at each group's start, and in the world of 1)
    for name in (f"{P}steps_committed_total", f"{P}incarnations_total", f"{P}downtime_seconds_total",
                 f"{P}agent_rendezvous_rounds_total", f"{P}agent_rendezvous_seconds_total"):
        series = watch.series(name)
        assert series == sorted(series), f"{name} went down: {series}"
    steps = watch.series(f"{P}global_step", since=before_at)
    assert min(steps) >= before[f"{P}global_step"] and steps[-1] > before[f"{P}global_step"], steps
    assert world_sizes(watch, since=before_at) == [2, 1, 2]
    assert host.wait(timeout=180) == 0 and joiner.wait(timeout=60) == 0, node_logs(job)
    metrics_dir = next(job.node_memory_dir("host").glob("elastic_ddp-metrics-*"))
    wait_for(lambda: not (metrics_dir / ENDPOINT_FILE).exists(), 30, "the host's server's end with its agent")
    assert "metrics: http://127.0.0.1:" in host.log_text()
