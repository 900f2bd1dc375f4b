"""Dead-node probes for the rendezvous: a killed member leaves the next round at once, not
when its lease expires.

The same evidence as `liveness` (read its docstring for the reasoning): every node listens on a
beacon port (`liveness.Beacon`) that it publishes in its liveness key, and a node counts as exited
when

    its beacon, at the port its liveness key names now, accepted a connection from this agent
    before, and now refuses one.

Here the "before" is taken once per round: when a node joins a round, a background thread reads the
liveness keys once (one range read) and probes each fellow member's beacon once. When that node
later closes a round (`handler`), only the members of the last round that are still alive
by their lease but have not arrived are probed again. So a node costs one read per round and, in
connections, one per fellow member per round plus one per suspect; none of it touches etcd's writes.

A probe that times out or cannot resolve says nothing here (the lease decides, unless this node's
workers named the node silent: `silence` asks its beacon for an answer); a node restarted under
the same name publishes a new port, which this agent has not reached, so it is never judged by its
predecessor's refusal. `probe_dead_nodes=0` in `--rdzv_conf` turns the probes off (no beacon).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable

from elastic_ddp.agent.rendezvous.liveness import Answer, Beacon, probe
from elastic_ddp.agent.rendezvous.state import NodeDesc

logger = logging.getLogger(__name__)

Ports = dict[NodeDesc, int | None]


def _address(node: NodeDesc, port: int) -> tuple | None:
    try:
        found = socket.getaddrinfo(node.addr, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return found[0][4] if found else None


class ExitWitness:
    """This agent's beacon and what it has seen of its peers' beacons (module docstring). Thread-safe."""

    def __init__(self, enabled: bool = True) -> None:
        self._beacon = Beacon() if enabled else None
        self._reached: dict[tuple[NodeDesc, int], tuple] = {}  # (node, port) -> the address that accepted
        self._reported: set[tuple[NodeDesc, int]] = set()  # found exited and said so
        self._lock = threading.Lock()

    @property
    def port(self) -> int | None:
        """This agent's beacon port, to publish; None with the probes off."""
        return self._beacon.port if self._beacon is not None else None

    def observe_soon(self, read_ports: Callable[[], Ports], members: Iterable[NodeDesc]) -> None:
        """In a background thread: read the published ports and probe each of `members` not reached yet."""
        if self._beacon is None:
            return
        wanted = list(members)
        threading.Thread(target=self._observe, args=(read_ports, wanted), name="rdzv-observe",
                         daemon=True).start()

    def _observe(self, read_ports: Callable[[], Ports], members: list[NodeDesc]) -> None:
        try:
            ports = read_ports()
        except Exception as exc:  # noqa: BLE001 - only an optimisation is lost: the lease still decides
            logger.debug("could not read the beacon ports: %s", exc)
            return
        for node in members:
            port = ports.get(node)
            with self._lock:
                if port is None or (node, port) in self._reached:
                    continue
            address = _address(node, port)
            if address is not None and probe(address) is Answer.ACCEPTED:
                with self._lock:
                    self._reached[(node, port)] = address

    def reached(self, node: NodeDesc, port: int | None) -> tuple | None:
        """The address at which `node`'s beacon at `port` accepted a connection from this agent, or None."""
        with self._lock:
            return self._reached.get((node, port)) if port is not None else None

    def exited(self, suspects: Ports) -> set[NodeDesc]:
        """The `suspects` (node -> the port its liveness key names now) found exited. Each one is
        logged once as a warning, the line in the agent's log that says why the round went on without
        it (a closer asks again at every poll while the round waits for someone else)."""
        found = set()
        for node, port in suspects.items():
            with self._lock:
                address = self._reached.get((node, port)) if port is not None else None
            if address is not None and probe(address) is Answer.REFUSED:
                with self._lock:
                    first = (node, port) not in self._reported
                    self._reported.add((node, port))
                if first:
                    logger.warning("node %s has exited (its beacon refuses connections): left out of the next round "
                                   "of the rendezvous", node)
                found.add(node)
        return found

    def any_answers(self) -> bool:
        """Whether a beacon reached before answers a probe now (accepts or refuses: its machine is
        reachable); tells a cut-off network from a cut-off store node (`c10d.watch`)."""
        with self._lock:
            addresses = list(self._reached.values())
        return any(probe(address) is not Answer.UNKNOWN for address in addresses)

    def close(self) -> None:
        if self._beacon is not None:
            self._beacon.close()
