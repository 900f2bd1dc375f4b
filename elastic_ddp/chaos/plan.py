"""Fault plans as data: what to break, when, and where; from JSON or drawn from a seed.

A plan is an ordered list of `Fault`s. The harness fires them one after the other: each waits for
its trigger, which it evaluates only after the previous fault has fired.

    {"initial_nodes": 2, "min_nodes": 1, "max_nodes": 4, "seed": 7,
     "faults": [
       {"action": "kill_node", "target": "random", "at_step": 40},
       {"action": "kill_node", "target": "rank0", "at_step": 80, "on_event": "snapshot_captured"},
       {"action": "add_node", "at_seconds": 30},
       {"action": "terminate_node", "target": "newest", "at_step": 150, "settle": false}
     ]}

Actions: `kill_node` (SIGKILL the agent and every process under it: a lost machine),
`kill_worker` (SIGKILL one training process; `worker` picks the local rank, default random),
`terminate_node` (SIGTERM to the agent: a drain, as a spot-instance notice would do it),
`freeze_node` / `thaw_node` (SIGSTOP / SIGCONT the whole node: a machine that stops answering
while its sockets stay open), `add_node` (start one more agent). Network faults (root only: each
node then runs in a network namespace of its own on a bridge, elastic_ddp/testbed/netns.py):
`partition_node` (the node's link goes down: its packets vanish, no reset), `heal_node` (the
link comes back), `blip_node` (a partition healed after `seconds`).

Triggers: `at_seconds` (since the job started), `at_step` (the event log shows this global step),
`on_event` (an event of this kind appears in the event log, at or after `at_step` if given, e.g.
`snapshot_captured` to land a kill while rank 0 writes that snapshot). With `settle` (the default)
step and event triggers only count a worker group that started after the previous fault fired, so
each fault hits a job that has recovered from the one before. A fault with no trigger fires as
soon as the previous one has.

Targets: `random` (a live node, drawn from the plan's seed), `rank0` (the node running global
rank 0 now), `newest` / `oldest` (by start), or a node name (`node0`, `node1`, ... in start order).
Nodes that host the rendezvous store are never picked by `random`, `rank0`, `newest` or `oldest`;
name them explicitly to kill the store host on purpose.

Not checked here: whether a plan can finish before the training does (the harness reports faults
that never fired).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

NETWORK_ACTIONS = ("partition_node", "heal_node", "blip_node")
ACTIONS = ("kill_node", "kill_worker", "terminate_node", "freeze_node", "thaw_node", "add_node", *NETWORK_ACTIONS)
# Actions after which the node no longer takes part in training.
REMOVING_ACTIONS = ("kill_node", "terminate_node", "freeze_node", "partition_node")
SYMBOLIC_TARGETS = ("random", "rank0", "newest", "oldest")


class PlanError(ValueError):
    """A fault plan that cannot be followed as written."""


@dataclass(frozen=True)
class Fault:
    """One fault: an action, the node it hits, and the trigger that fires it."""

    action: str
    target: str = "random"
    at_seconds: float | None = None
    at_step: int | None = None
    on_event: str | None = None
    settle: bool = True
    worker: int | None = None  # kill_worker: the local rank to kill (None: a random one)
    seconds: float | None = None  # blip_node: how long the link stays down

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise PlanError(f"fault action: got {self.action!r}; expected one of {', '.join(ACTIONS)}")
        if self.at_seconds is not None and self.at_seconds < 0:
            raise PlanError(f"fault at_seconds: got {self.at_seconds}; expected 0 or more")
        if self.at_step is not None and self.at_step < 0:
            raise PlanError(f"fault at_step: got {self.at_step}; expected 0 or more")
        if self.worker is not None and self.action != "kill_worker":
            raise PlanError(f"fault worker: only kill_worker takes it (got it on {self.action})")
        if (self.action == "blip_node") != (self.seconds is not None):
            raise PlanError(f"fault seconds: {'blip_node needs it' if self.action == 'blip_node' else 'only blip_node takes it'}"
                            f" (got {self.seconds} on {self.action})")
        if self.seconds is not None and not self.seconds > 0:
            raise PlanError(f"fault seconds: got {self.seconds}; expected more than 0")
        if not self.target:
            raise PlanError("fault target: got an empty name; expected random, rank0, newest, oldest or a node name")

    def describe(self) -> str:
        when = []
        if self.at_seconds is not None:
            when.append(f"at {self.at_seconds:g} s")
        if self.at_step is not None:
            when.append(f"at step {self.at_step}")
        if self.on_event is not None:
            when.append(f"on {self.on_event}")
        target = "" if self.action == "add_node" else f" {self.target}"
        target += f" for {self.seconds:g} s" if self.seconds is not None else ""
        return f"{self.action}{target}" + (f" ({', '.join(when)})" if when else "")


@dataclass(frozen=True)
class FaultPlan:
    """Faults in firing order, and the shape of the job they are played against."""

    faults: tuple[Fault, ...]
    initial_nodes: int = 2
    min_nodes: int = 1
    max_nodes: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise PlanError(f"min_nodes/max_nodes: got {self.min_nodes}/{self.max_nodes}; expected "
                            "1 <= min_nodes <= max_nodes")
        if not self.min_nodes <= self.initial_nodes <= self.max_nodes:
            raise PlanError(f"initial_nodes: got {self.initial_nodes}; expected between min_nodes "
                            f"({self.min_nodes}) and max_nodes ({self.max_nodes})")

    @property
    def needs_network_bed(self) -> bool:
        """Whether a fault of the plan is a network fault (its nodes then need namespaces)."""
        return any(fault.action in NETWORK_ACTIONS for fault in self.faults)

    @property
    def nnodes(self) -> str:
        """torchrun's --nnodes for this plan."""
        return f"{self.min_nodes}:{self.max_nodes}"

    def to_dict(self) -> dict[str, Any]:
        document = asdict(self)
        document["faults"] = [{key: value for key, value in asdict(fault).items()
                               if value is not None and not (key == "settle" and value)} for fault in self.faults]
        return document

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> FaultPlan:
        if not isinstance(document, dict) or not isinstance(document.get("faults"), list):
            raise PlanError('a fault plan is a JSON object with a "faults" list')
        known_fault = {f.name for f in fields(Fault)}
        faults = []
        for index, entry in enumerate(document["faults"]):
            unknown = set(entry) - known_fault if isinstance(entry, dict) else {"(not an object)"}
            if unknown:
                raise PlanError(f"fault {index}: unknown keys {sorted(unknown)}; expected some of {sorted(known_fault)}")
            faults.append(Fault(**entry))
        known_plan = {f.name for f in fields(cls)}
        unknown = set(document) - known_plan
        if unknown:
            raise PlanError(f"fault plan: unknown keys {sorted(unknown)}; expected some of {sorted(known_plan)}")
        return cls(**{**document, "faults": tuple(faults)})

    @classmethod
    def load(cls, path: str | Path) -> FaultPlan:
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"fault plan {path}: cannot be read as JSON ({exc})") from exc
        return cls.from_dict(document)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def random_plan(seed: int, total_steps: int, faults: int = 8, initial_nodes: int = 3, min_nodes: int = 1,
                max_nodes: int = 4, nproc_per_node: int = 1, first_step: int | None = None,
                last_step: int | None = None) -> FaultPlan:
    """A seeded plan of at least `faults` faults at increasing global steps in [first_step, last_step].

    It always contains: a kill of a random node, a kill of a single worker, a kill of the node
    running rank 0 that lands while rank 0 writes a snapshot (`on_event: snapshot_captured`), a
    kill of the node running rank 0 at a plain step, and a join at `first_step`, as the first fault
    (a join needs the job to run on for several seconds before it is admitted); the rest are
    kills of random nodes, of rank 0's node and of single workers. After a kill, a node often
    joins at once (always when the job is down to min_nodes), while the survivors re-form the
    group; a kill that would go below min_nodes becomes a worker kill (its node stays), a join
    that would go above max_nodes is preceded by a kill. Kills need a node that does not host the
    rendezvous store: play these plans with a standalone store or etcd-v3.
    """
    if faults < 5:
        raise PlanError(f"faults: got {faults}; a random plan needs at least 5 to include every kind")
    first_step = max(1, total_steps // 10) if first_step is None else first_step
    last_step = (total_steps * 8) // 10 if last_step is None else last_step
    if last_step - first_step < 2 * faults:
        raise PlanError(f"total_steps: got {total_steps}; too few steps to place {faults} faults apart")
    rng = random.Random(seed)
    kinds = ["kill_random", "kill_worker", "kill_rank0_during_snapshot", "kill_rank0"]
    kinds += rng.choices(["kill_random", "kill_worker", "kill_rank0"], k=faults - len(kinds) - 1)
    rng.shuffle(kinds)
    kinds.insert(0, "join")  # first: a join needs many seconds of training left to be admitted on a busy machine
    steps = [first_step, *sorted(rng.sample(range(first_step + 1, last_step + 1), faults - 1))]
    nodes = initial_nodes
    planned: list[Fault] = []
    for kind, step in zip(kinds, steps):
        if kind == "join":
            if nodes + 1 > max_nodes:
                planned.append(Fault("kill_node", "random", at_step=step))
                nodes -= 1
                step = None  # the join follows the kill at once
            planned.append(Fault("add_node", at_step=step, settle=step is not None))
            nodes += 1
        elif kind == "kill_worker" or nodes - 1 < min_nodes:
            # (at min_nodes no node may go: a worker is killed instead, its node stays)
            planned.append(Fault("kill_worker", "random", at_step=step, worker=rng.randrange(nproc_per_node)))
        else:
            target = "random" if kind == "kill_random" else "rank0"
            on_event = "snapshot_captured" if kind == "kill_rank0_during_snapshot" else None
            planned.append(Fault("kill_node", target, at_step=step, on_event=on_event))
            nodes -= 1
            if nodes < max_nodes and (nodes == min_nodes or rng.random() < 0.5):
                planned.append(Fault("add_node", settle=False))  # arrives while the survivors re-form
                nodes += 1
    return FaultPlan(tuple(planned), initial_nodes, min_nodes, max_nodes, seed)
