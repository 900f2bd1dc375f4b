"""The chaos harness: run an elastic job of local nodes, break it as a plan says, check the promises.

    harness = ChaosHarness("runs/chaos", ["--model", "mlp", "--epochs", "3"], random_plan(7, total_steps=300))
    report = harness.run()
    assert report.ok, report.summary()

Each node is a real torchrun agent on 127.0.0.1 (`elastic_ddp.testbed.local_cluster.LocalNode`) with real
gloo workers; faults are real signals. The harness follows the plan (elastic_ddp/chaos/plan.py),
reading triggers from the run's event log, never guessing with sleeps (when each fault fires and
which node it hits: elastic_ddp/chaos/targets.py); then it waits for the job to finish within a
deadline, and `chaos.verdict` checks what elastic_ddp promises (docs/failure-semantics.md) and
measures each fault's recovery.

Where the rendezvous store lives matters. With `store="standalone"` (the default) the c10d store
runs in a process of its own (elastic_ddp/chaos/store.py) and every node can be killed, rank 0's
included. With `store="node"` the first node hosts it, as with plain torchrun, and symbolic targets
never pick that node: killing it ends the job (trap 5 in the docs). With `rdzv_backend="etcd-v3"`
pass the etcd endpoints as `rdzv_endpoint`.
A held job (`hold`, elastic_ddp/chaos/held_train.py) runs at full speed to the next fault's step and
stops there until it fires (paced before an event or time trigger, and after a SIGTERM); released once done.

Network faults (`partition_node`, `heal_node`, `blip_node`) put every node and the standalone store
on a host of its own (a network namespace, root only: elastic_ddp/chaos/network.py).
Not done here: faults on the store itself, and any check of the model's numbers (see elastic_ddp/chaos/equivalence.py for that).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elastic_ddp.agent.rendezvous.defaults import AGENT_ENV, MONITOR_INTERVAL_S, RDZV_CONF
from elastic_ddp.chaos import held_train
from elastic_ddp.chaos.network import ChaosNetwork
from elastic_ddp.chaos.plan import NETWORK_ACTIONS, Fault, FaultPlan, PlanError
from elastic_ddp.chaos.targets import FaultTargeting, Firing
from elastic_ddp.chaos.verdict import ChaosReport, FaultRecord, judge
from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.reader import EventFollower
from elastic_ddp.runtime.procfs import process_tree
from elastic_ddp.testbed.local_cluster import (
    C10D_BACKENDS,
    LAUNCHER,
    JobEnded,
    LocalJob,
    LocalNode,
    port_is_listening,
    wait_for,
)

logger = logging.getLogger(__name__)

STORES = ("standalone", "node")
POLL_SECONDS = 0.005
# The agents log their rendezvous rounds and restarts (torch's elastic loggers read LOGLEVEL).
HARNESS_AGENT_ENV = {**AGENT_ENV, "LOGLEVEL": "INFO"}
# torchrun logs this (at INFO) just before it connects to the rendezvous store.
AGENT_READY_LINE = "Starting elastic_operator with launch configs"


class DeadlineExceeded(Exception):
    """The run took longer than the harness's deadline."""


def expected_final_step(training_args: Sequence[str]) -> tuple[TrainingConfig, int]:
    """The run's config (elastic_ddp flags; others are ignored) and epochs x steps per epoch."""
    config, _ = TrainingConfig.from_known_args(list(training_args))
    return config, config.epochs * config.steps_per_epoch


class ChaosHarness:
    """Plays a `FaultPlan` against a local elastic job (see module docs)."""

    def __init__(self, run_dir: str | Path, training_args: Sequence[str], plan: FaultPlan, *,
                 nproc_per_node: int = 1, store: str = "standalone", rdzv_backend: str = "c10d",
                 rdzv_endpoint: str | None = None, rdzv_conf: str | None = RDZV_CONF,
                 monitor_interval: float | None = MONITOR_INTERVAL_S, agent_env: dict[str, str] = HARNESS_AGENT_ENV,
                 module: str = "elastic_ddp.train", deadline_s: float = 600, max_restarts: int = 100,
                 run_id: str = "chaos", launcher: str = LAUNCHER, env: dict[str, str] | None = None,
                 on_plan_done: Callable[[], None] | None = None, hold: str | Path | None = None):
        if store not in STORES:
            raise ValueError(f"store: got {store!r}; expected one of {', '.join(STORES)}")
        self.run_dir = Path(run_dir)
        self.training_args = list(training_args)
        self.plan = plan
        self.config, self.expected_steps = expected_final_step(training_args)
        self.deadline_s = deadline_s
        self.standalone_store = rdzv_backend in C10D_BACKENDS and store == "standalone"
        if self.standalone_store:
            rdzv_conf = f"{rdzv_conf},is_host=false" if rdzv_conf else "is_host=false"
        self.network = ChaosNetwork(plan) if plan.needs_network_bed else None  # PlanError where it cannot be
        if self.network is not None:
            if rdzv_backend not in C10D_BACKENDS:
                raise PlanError(f"network faults: played with a c10d store, not with --rdzv_backend={rdzv_backend}")
            rdzv_endpoint, env = self.network.endpoint(self.standalone_store), {**self.network.env, **(env or {})}
        self.job = LocalJob(self.run_dir, training_args, nnodes=plan.nnodes, nproc_per_node=nproc_per_node,
                            rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, run_id=run_id,
                            max_restarts=max_restarts, rdzv_conf=rdzv_conf, monitor_interval=monitor_interval,
                            agent_env=agent_env, module=module, launcher=launcher, env=env)
        self.on_plan_done, self.hold = on_plan_done, hold  # a held job's release (chaos/held_train.py), its hold file
        self.nproc_per_node = nproc_per_node
        self.store_host: str | None = (None if self.standalone_store or rdzv_backend not in C10D_BACKENDS
                                       else "node0")
        self.store_process: subprocess.Popen | None = None
        self.events = EventFollower(self.job.event_log)
        self.rng = random.Random(plan.seed)
        self.state: dict[str, str] = {}  # node name -> live, killed, terminated, frozen
        self.targeting = FaultTargeting(self.job, self.events, self.state, store_host=self.store_host, rng=self.rng,
                                        max_nodes=plan.max_nodes)
        self.ended: dict[str, float] = {}
        self.started_at = 0.0
        self._deadline = 0.0

    # ------------------------------------------------------------------------------ running

    def run(self) -> ChaosReport:
        """Start the job, play the plan, wait for the end, check; always cleans up its processes."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        self._deadline = time.monotonic() + self.deadline_s
        records = [FaultRecord(i, fault.describe(), _fault_dict(fault)) for i, fault in enumerate(self.plan.faults)]
        problems: list[str] = []
        try:
            self._steer_hold(0)
            if self.network is not None:
                self.network.open()
            for _ in range(self.plan.initial_nodes):
                self._add_node()
            if self.standalone_store:
                # Open the store once every initial agent is waiting for it, so that they all
                # make the first round (agents that start late on a busy machine would otherwise
                # miss its 1 s last call, and the group would re-form for each of them).
                self._wait_until_agents_dial_the_store()
                self._start_store()
            self._wait_for_initial_group()
            self._play(records)
            if self.on_plan_done is not None:
                self.on_plan_done()
            self._wait_for_the_end(problems)
        except DeadlineExceeded as exc:
            problems.append(str(exc))
        finally:
            self.stop()
        return self._report(records, problems)

    def stop(self) -> None:
        """SIGKILL every node still running and the standalone store."""
        for node in self.job.nodes:
            node.stop()
        if self.store_process is not None and self.store_process.poll() is None:
            self.store_process.kill()
            self.store_process.wait(timeout=30)
        if self.network is not None:
            self.network.close()

    def _start_store(self) -> None:
        host, port = self.job.rdzv_endpoint.rsplit(":", 1)
        prefix = self.network.store_prefix() if self.network is not None else []
        with open(self.run_dir / "store.log", "ab") as log:
            self.store_process = subprocess.Popen([*prefix, sys.executable, "-m", "elastic_ddp.chaos.store",
                                                   self.job.rdzv_endpoint],
                                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        listening = (self.network.listening if self.network is not None
                     else lambda endpoint: port_is_listening(host, int(port)))
        wait_for(lambda: listening(self.job.rdzv_endpoint) or self.store_process.poll() is not None, 60,
                 f"the standalone c10d store on {self.job.rdzv_endpoint}")
        if self.store_process.poll() is not None:
            raise RuntimeError(f"the standalone c10d store exited; see {self.run_dir / 'store.log'}")

    def _wait_until_agents_dial_the_store(self) -> None:
        """Until each initial agent has logged its launch configuration, the line torchrun writes
        right before it connects to the rendezvous store (with LOGLEVEL=INFO; without it, no wait)."""
        if self.job.agent_env.get("LOGLEVEL") != "INFO":
            return
        while not all(AGENT_READY_LINE in node.log_text() or not node.is_running() for node in self.job.nodes):
            if time.monotonic() > self._deadline:
                raise DeadlineExceeded(f"the agents did not start within {self.deadline_s:.0f} s")
            time.sleep(0.05)

    def _add_node(self) -> LocalNode:
        name = f"node{len(self.job.nodes)}"
        options = self.network.node_options(name) if self.network is not None else {}
        node = self.job.add_node(name, hosts_store=not self.standalone_store, **options)
        self.state[node.name] = "live"
        return node

    def _wait_for_initial_group(self) -> None:
        """Wait until every initial node trains in one group. Nodes that start late make the
        first group re-form, and a fault landing while torchrun's agents exchange ranks right
        after a rendezvous can end the whole job (docs/failure-semantics.md)."""
        world_size = self.plan.initial_nodes * self.nproc_per_node
        while not any(g.start["world_size"] == world_size and g.first_step is not None
                      for g in self.events.groups.values()):
            try:
                self._check_time_and_liveness()
            except JobEnded:
                return  # reported by the checks: the plan did not fire
            self.events.poll()
            time.sleep(POLL_SECONDS)

    def _play(self, records: list[FaultRecord]) -> None:
        since, joiner = self.started_at, None
        for fault, record in zip(self.plan.faults, records):
            try:
                firing = self._wait_for_trigger(fault, since, joiner)
            except JobEnded:
                for later in records[record.index:]:
                    later.not_fired_because = "the job had ended"
                return
            self._fire(record, firing)
            self._steer_hold(record.index + 1, draining=fault.action == "terminate_node")
            since = record.fired_at
            joiner = self.job.nodes[-1].pid if fault.action == "add_node" else None
            logger.info("fault %d fired: %s on %s at step %s", record.index, record.description, record.node,
                        record.step_when_fired)

    def _steer_hold(self, next_fault: int, draining: bool = False) -> None:
        """Stop a held job at the next fault's step (paced before an event or a time, and after a SIGTERM:
        drain votes are up to 200 fast steps apart, runtime/drain.py, so it may not land before a stop)."""
        if self.hold is None:
            return
        for fault in self.plan.faults[next_fault:]:
            if fault.on_event is not None or fault.at_seconds is not None:
                break
            if fault.at_step is not None and not draining:
                held_train.run_to(self.hold, fault.at_step)
                return
        if next_fault < len(self.plan.faults):
            held_train.pace(self.hold)
        else:
            held_train.release(self.hold)

    def _check_time_and_liveness(self) -> None:
        if time.monotonic() > self._deadline:
            raise DeadlineExceeded(f"the run did not finish within {self.deadline_s:.0f} s")
        if not any(node.is_running() for node in self.job.nodes if self.state[node.name] in ("live", "terminated")):
            raise JobEnded("every agent has exited: no later fault can fire")

    def _wait_for_trigger(self, fault: Fault, since: float, joiner: int | None) -> Firing:
        """Poll the event log until `fault` may fire and its target is known (chaos/targets.py)."""
        seen_event = len(self.events.events)
        while True:
            self._check_time_and_liveness()
            self.events.poll()
            triggered, event = self.targeting.triggered(fault, since=since, joiner=joiner, seen_event=seen_event,
                                                        seconds_into_run=time.time() - self.started_at)
            if triggered:
                firing = self.targeting.resolve(fault, event)
                if firing is not None:
                    return firing
            time.sleep(POLL_SECONDS)

    # ------------------------------------------------------------------------------- firing

    def _fire(self, record: FaultRecord, firing: Firing) -> None:
        fault, node, event = firing.fault, firing.node, firing.event
        if node is not None:
            record.held_rank0 = self.targeting.holds_rank0(node)
        if event is not None and event["event"] == schema.SNAPSHOT_CAPTURED.name:
            record.snapshot_step = event["global_step"]
            self.events.poll()
            record.during_snapshot_write = not any(
                e.get("global_step") == record.snapshot_step and e.get("incarnation") == event["incarnation"]
                for e in self.events.of_kind(schema.SNAPSHOT))
        record.step_when_fired = self.events.newest_step()
        record.fired_at = time.time()
        if fault.action == "add_node":
            node = self._add_node()
            record.pid = node.pid
        elif fault.action == "kill_node":
            node.kill()
            self.state[node.name] = "killed"
        elif fault.action == "kill_worker":
            workers = self.targeting.live_workers(node)
            local_rank = fault.worker if fault.worker is not None else self.rng.choice(workers)["local_rank"]
            worker = next((w for w in workers if w["local_rank"] == local_rank), None)
            if worker is None:
                raise PlanError(f"{fault.describe()}: {node.name} has no worker of local rank {local_rank} "
                                f"(nodes run {self.nproc_per_node})")
            _kill_process_tree(worker["pid"])
            record.pid = worker["pid"]
        elif fault.action == "terminate_node":
            node.terminate()
            self.state[node.name] = "terminated"
        elif fault.action == "freeze_node":
            node.freeze()
            self.state[node.name] = "frozen"
        elif fault.action == "thaw_node":
            node.thaw()
            self.state[node.name] = "live"
        elif fault.action in NETWORK_ACTIONS:
            self.state[node.name] = self.network.fire(fault, node.name)
        record.fired = True
        record.node = node.name
        record.pid = record.pid or node.pid
        record.seconds_into_run = round(record.fired_at - self.started_at, 3)

    # ---------------------------------------------------------------------------- finishing

    def _wait_for_the_end(self, problems: list[str]) -> None:
        """Wait for every live or draining agent to exit; frozen nodes are then killed."""
        while True:
            running = []
            for node in self.job.nodes:
                if self.state[node.name] in ("live", "terminated"):
                    if node.is_running():
                        running.append(node.name)
                    else:
                        self.ended.setdefault(node.name, round(time.time() - self.started_at, 2))
            if not running:
                break
            if time.monotonic() > self._deadline:
                raise DeadlineExceeded(f"the run did not finish within {self.deadline_s:.0f} s "
                                       f"({', '.join(running)} still running; see their logs in {self.run_dir})")
            time.sleep(0.1)
        for node in self.job.nodes:
            if self.state[node.name] in ("frozen", "partitioned") and node.is_running():
                logger.info("%s is still %s at the end: killing it", node.name, self.state[node.name])
                node.kill()

    def _report(self, records: list[FaultRecord], problems: list[str]) -> ChaosReport:
        self.events.poll()
        return judge(self.job, self.plan, self.config, self.expected_steps, records, problems,
                     groups=sorted(self.events.groups.values(), key=lambda g: g.started),
                     ended=self.ended, started_at=self.started_at,
                     whole_job_nodes=frozenset({self.store_host} if self.store_host else ()))


def _kill_process_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants, one by one, never by process group: a worker's group depends
    on how it started (torchrun's child, or forked into a session of its own by the warm-worker
    server), and a group kill of the wrong one takes more than the worker."""
    for member in process_tree(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fault_dict(fault: Fault) -> dict[str, Any]:
    return {key: value for key, value in asdict(fault).items() if value is not None}
