"""When a fault of a chaos plan fires, and which node it hits.

`FaultTargeting` answers the chaos harness's (elastic_ddp/chaos/harness.py) two questions about
the next fault of its plan (elastic_ddp/chaos/plan.py), from the run's event log and the harness's
record of its nodes, never from sleeps or guesses:

- `triggered`: may it fire now? `at_seconds` since the run started, `at_step` reached by a worker
  group, `on_event` logged since the harness began to wait for this fault. With `settle`, only
  groups that started after the previous fault fired count (and, after an `add_node`, only groups
  that include the new node).
- `resolve`: what it hits, or None to wait a little longer. `rank0` is the node that runs the live
  global rank 0 (none between groups); `random`, `newest` and `oldest` choose among the live nodes
  of the newest group (any live node when none is in it), never the node that hosts the c10d
  store; a name is that node. `kill_worker` waits until its node runs live workers.

A plan that asks for the impossible (a node that does not exist, rank 0's node while it hosts the
store, a thaw of a node that is not frozen, a signal to a node that is gone, more than
`max_nodes`) raises PlanError. Firing, the signals themselves, is the harness's part.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from elastic_ddp.chaos.plan import Fault, PlanError
from elastic_ddp.runlog.reader import EventFollower
from elastic_ddp.runtime.procfs import process_is_alive
from elastic_ddp.testbed.local_cluster import LocalJob, LocalNode


@dataclass(frozen=True)
class Firing:
    """A fault whose trigger came and whose target is known: ready to fire."""

    fault: Fault
    node: LocalNode | None  # None for add_node (the harness starts the node)
    event: dict[str, Any] | None  # the event that fired an `on_event` trigger


class FaultTargeting:
    """Triggers and targets of one plan's faults against one local job (see the module docstring).

    `state` is the harness's record of its nodes (name -> live, killed, terminated, frozen or partitioned),
    read here and never written. `rng` is the plan's: the same seed draws the same targets.
    """

    def __init__(self, job: LocalJob, events: EventFollower, state: dict[str, str], *, store_host: str | None,
                 rng: random.Random, max_nodes: int):
        self.job = job
        self.events = events
        self.state = state
        self.store_host = store_host
        self.rng = rng
        self.max_nodes = max_nodes

    def triggered(self, fault: Fault, *, since: float, joiner: int | None, seen_event: int,
                  seconds_into_run: float) -> tuple[bool, dict[str, Any] | None]:
        """Whether `fault` may fire now, and the event that fired it (`on_event` triggers).

        `since`: when the previous fault fired; `joiner`: the agent pid it added, if it added a
        node; `seen_event`: how many events the log held when the wait for this fault began.
        """
        groups = self.events.groups.values()
        if fault.settle:
            groups = [g for g in self.events.groups_since(since) if joiner is None or joiner in g.agent_pids]
            if not any(g.first_step is not None for g in groups):
                return False, None
        if fault.at_seconds is not None and seconds_into_run < fault.at_seconds:
            return False, None
        incarnations = {g.incarnation for g in groups}
        if (fault.at_step is not None and fault.on_event is None
                and not any(g.newest_step and g.newest_step["global_step"] >= fault.at_step for g in groups)):
            return False, None
        if fault.on_event is not None:
            for event in self.events.events[seen_event:]:
                if (event.get("event") == fault.on_event and event.get("incarnation") in incarnations
                        and event.get("global_step", 0) >= (fault.at_step or 0)):
                    return True, event
            return False, None
        return True, None

    def resolve(self, fault: Fault, event: dict[str, Any] | None) -> Firing | None:
        """The firing of a triggered `fault`; None while its target cannot be hit yet."""
        if fault.action == "add_node":
            if sum(self.state[n.name] == "live" for n in self.job.nodes) >= self.max_nodes:
                raise PlanError(f"{fault.describe()}: the job already has max_nodes={self.max_nodes} nodes")
            return Firing(fault, None, event)
        node = self._target(fault)
        if node is None:
            return None
        if fault.action == "kill_worker":
            if not self.live_workers(node):
                return None  # its workers are being restarted: wait for them
        elif fault.action in ("thaw_node", "heal_node"):
            needed = "frozen" if fault.action == "thaw_node" else "partitioned"
            if self.state[node.name] != needed:
                raise PlanError(f"{fault.describe()}: {node.name} is not {needed}")
        elif self.state[node.name] != "live":
            raise PlanError(f"{fault.describe()}: {node.name} is {self.state[node.name]}")
        return Firing(fault, node, event)

    def live_workers(self, node: LocalNode) -> list[dict[str, Any]]:
        """The newest group's ranks that run on `node` and are alive (from the `start` event:
        workers forked by elastic_ddp.agent.launcher carry no RANK in /proc/PID/environ)."""
        group = self.events.newest_group()
        if group is None or not node.is_running():
            return []
        return [rank for rank in group.start.get("ranks") or []
                if rank["agent_pid"] == node.pid and process_is_alive(rank["pid"])]

    def holds_rank0(self, node: LocalNode) -> bool:
        return any(rank["rank"] == 0 for rank in self.live_workers(node))

    def _candidates(self) -> list[LocalNode]:
        """Live nodes a symbolic target may pick: never the store host; in the group if possible."""
        live = [n for n in self.job.nodes if self.state[n.name] == "live" and n.is_running()
                and n.name != self.store_host]
        group = self.events.newest_group()
        in_group = [n for n in live if group is not None and n.pid in group.agent_pids]
        return in_group or live

    def _target(self, fault: Fault) -> LocalNode | None:
        if fault.target == "rank0":
            for node in self.job.nodes:
                if self.state[node.name] == "live" and self.holds_rank0(node):
                    if node.name == self.store_host:
                        raise PlanError(f"{fault.describe()}: rank 0 runs on {node.name}, which hosts the c10d "
                                        "store; use store=standalone (or etcd-v3) to kill rank 0's node")
                    return node
            return None  # between groups: no rank 0 right now
        candidates = self._candidates()
        if fault.target == "random":
            return self.rng.choice(candidates) if candidates else None
        if fault.target in ("newest", "oldest"):
            if not candidates:
                return None
            return candidates[-1] if fault.target == "newest" else candidates[0]
        named = next((n for n in self.job.nodes if n.name == fault.target), None)
        if named is None:
            raise PlanError(f"{fault.describe()}: no node is named {fault.target!r} (nodes: "
                            f"{', '.join(n.name for n in self.job.nodes)})")
        return named
