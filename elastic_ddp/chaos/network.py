"""Network faults for the chaos harness: every node a host of its own, its link cut on cue.

A plan with `partition_node`, `heal_node` or `blip_node` (elastic_ddp/chaos/plan.py) runs each node
(its torchrun agent and workers) in a network namespace of its own, with its own address on a
bridge (elastic_ddp/testbed/netns.py), started with `--local_addr=<its address>`; the standalone
c10d store gets a namespace of its own too ("store"), so the rendezvous endpoint is a real
address on the bridge. The workers' gloo uses the node's link (`GLOO_SOCKET_IFNAME=eth0`), which
our elastic-c10d backend would also pick by itself; torch's c10d needs it named.

Namespaces need root: without, the plan is refused in one line before anything starts.
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic_ddp.chaos.plan import NETWORK_ACTIONS, Fault, FaultPlan, PlanError
from elastic_ddp.testbed.netns import NODE_LINK, NetworkBed, why_unavailable

STORE = "store"  # the standalone store's host
RDZV_PORT = 29400


def refusal(plan: FaultPlan) -> str | None:
    """Why `plan` cannot be played here (one line), or None."""
    if not plan.needs_network_bed:
        return None
    reason = why_unavailable()
    if reason is None:
        return None
    used = sorted({fault.action for fault in plan.faults if fault.action in NETWORK_ACTIONS})
    return f"network faults ({', '.join(used)}) run each node in a network namespace of its own: {reason}"


class ChaosNetwork:
    """The bed of a plan's nodes (`node0`, `node1`, ... in start order) and the store's host."""

    def __init__(self, plan: FaultPlan):
        problem = refusal(plan)
        if problem is not None:
            raise PlanError(problem)
        count = plan.initial_nodes + sum(fault.action == "add_node" for fault in plan.faults)
        self.bed = NetworkBed([*(f"node{index}" for index in range(count)), STORE])
        self.env = {"GLOO_SOCKET_IFNAME": NODE_LINK}

    def open(self) -> ChaosNetwork:
        self.bed.open()
        return self

    def endpoint(self, standalone_store: bool) -> str:
        """The rendezvous endpoint: the store's own host, or node0 where the first node hosts it."""
        return f"{self.bed.address(STORE if standalone_store else 'node0')}:{RDZV_PORT}"

    def node_options(self, name: str) -> dict:
        """`LocalJob.add_node` keyword arguments that make `name` a host of its own."""
        return {"local_addr": self.bed.address(name), "command_prefix": self.bed.prefix(name)}

    def store_prefix(self) -> Sequence[str]:
        return self.bed.prefix(STORE)

    def listening(self, endpoint: str) -> bool:
        """Whether the store answers on `endpoint`, asked from node0 (the host's own namespace may
        answer for any address)."""
        host, port = endpoint.rsplit(":", 1)
        return self.bed.connects("node0", host, int(port), timeout=0.5)

    def fire(self, fault: Fault, node: str) -> str:
        """Play a network fault on `node`; the node's state afterwards (partitioned or live)."""
        if fault.action == "partition_node":
            self.bed.partition(node)
            return "partitioned"
        if fault.action == "heal_node":
            self.bed.heal(node)
        else:
            self.bed.blip(node, fault.seconds)
        return "live"

    def close(self) -> None:
        self.bed.close()


def open_network(plan: FaultPlan) -> ChaosNetwork | None:
    """The plan's network, opened, or None when it has no network fault."""
    return ChaosNetwork(plan).open() if plan.needs_network_bed else None

