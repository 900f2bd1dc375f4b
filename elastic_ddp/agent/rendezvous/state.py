"""What the rendezvous (`handler`) keeps in its backend: small records, plain JSON, about
its nodes (`NodeDesc`, defined here).

- An **arrival**, one per node and round, in a key of the node's own: the node (`NodeDesc`:
  address, pid, local id). Written once by the node itself; never changed by another.
- A **liveness** value, one per node, in a key of the node's own: its name and, with dead-node
  probes on, its beacon port (`probes`); in a store without leases (c10d) also the time the
  node last wrote it (a heartbeat, `boards.c10d`).
- A **round record**, one per run (c10d: one per round), written only by the node that closes a round: the round's
  number, its members in rank order and its spares (the redundancy list: nodes that arrived beyond
  `max_nodes`, waiting for a place).

Both are decoded with a schema check and nothing else: a value that is not JSON, is too long, is
nested too deep, misses a field or has one of the wrong type is refused (`decode_*` returns None,
or the caller raises `RendezvousStateError`). torch's dynamic rendezvous unpickles the state it reads, so
whoever can write its key runs code on every agent (findings.md 10); nothing here executes or
imports what it reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# An arrival is about 100 bytes; a round record about 80 bytes per node. Anything longer than
# these bounds is not ours (100 000 nodes with 255-character names still fit the record's).
MAX_ARRIVAL_BYTES = 1024
MAX_RECORD_BYTES = 64 * 1024 * 1024
MAX_ADDR_CHARS = 255  # a DNS name is at most 253 characters


@dataclass(frozen=True, order=True)
class NodeDesc:
    """A node of the rendezvous: one rendezvous handler of one torchrun agent, identified as
    torch's dynamic rendezvous identifies its nodes (`agent_setup.local_node` makes this process's).
    Ordered by its fields in this order: a round's ranks follow it (`rounds.closed_round`).
    Prints as its `node_name`, as torch's prints in torch's logs.

    Not guaranteed: unique across restarts in place. A container that restarts torchrun as PID 1
    with the same address comes back as the same node (findings.md 15).
    """

    addr: str  # --local_addr, else this host's FQDN: where its peers reach it
    pid: int  # the agent's process id
    local_id: int  # the handler's number in its process (a per-process counter from 0)

    def __repr__(self) -> str:
        return node_name(self)


def node_name(node: NodeDesc) -> str:
    """The name of `node`'s keys, unique per node: `addr_pid_local_id` (the name torch prints)."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


def encode_node(node: NodeDesc) -> dict:
    return {"addr": node.addr, "pid": node.pid, "local_id": node.local_id}


def decode_node(fields: object) -> NodeDesc | None:
    """The node `fields` describes, or None if it is not a valid node description."""
    if not isinstance(fields, dict):
        return None
    addr, pid, local_id = (fields.get(name) for name in ("addr", "pid", "local_id"))
    if not (isinstance(addr, str) and 0 < len(addr) <= MAX_ADDR_CHARS and _is_count(pid) and _is_count(local_id)):
        return None
    return NodeDesc(addr, pid, local_id)


def encode_arrival(node: NodeDesc) -> bytes:
    """The value of `node`'s arrival key."""
    return json.dumps(encode_node(node)).encode()


def decode_arrival(value: bytes) -> NodeDesc | None:
    """The node an arrival value names, or None if it is not a valid arrival (see module docstring)."""
    fields = _json(value, MAX_ARRIVAL_BYTES)
    return None if fields is None else decode_node(fields)


def encode_alive(node: NodeDesc, port: int | None, at: float | None = None) -> bytes:
    """The value of `node`'s liveness key; `port`: its beacon's, None without probes; `at`: the
    writer's wall-clock time, for a backend without leases (a heartbeat; 0: the node left)."""
    fields = {**encode_node(node), "port": port}
    if at is not None:
        fields["at"] = at
    return json.dumps(fields).encode()


def decode_alive(value: bytes) -> tuple[NodeDesc, int | None] | None:
    """(node, beacon port or None) from a liveness value, or None if it is not a valid one."""
    fields = _json(value, MAX_ARRIVAL_BYTES)
    node = decode_node(fields)
    if node is None:
        return None
    port = fields.get("port")  # type: ignore[union-attr]
    if port is not None and not (_is_count(port) and 0 < port < 65536):
        return None
    return node, port


def decode_heartbeat(value: bytes) -> tuple[NodeDesc, int | None, float] | None:
    """(node, beacon port or None, time) from a heartbeat (`encode_alive` with `at`), or None if
    it is not a valid one."""
    alive = decode_alive(value)
    if alive is None:
        return None
    at = _json(value, MAX_ARRIVAL_BYTES).get("at")  # type: ignore[union-attr]: a dict, as decode_alive found
    if not isinstance(at, int | float) or isinstance(at, bool) or not 0 <= at < 2**40:
        return None
    return alive[0], alive[1], float(at)


@dataclass(frozen=True)
class RoundRecord:
    """A closed round: `members` in rank order (rank = index), `spares` waiting beyond max_nodes."""

    round: int
    members: tuple[NodeDesc, ...]
    spares: tuple[NodeDesc, ...] = ()

    def rank_of(self, node: NodeDesc) -> int | None:
        """`node`'s rank in this round, or None if it is not a member."""
        try:
            return self.members.index(node)
        except ValueError:
            return None

    def encode(self) -> bytes:
        return json.dumps({"round": self.round, "members": [encode_node(n) for n in self.members],
                           "spares": [encode_node(n) for n in self.spares]}).encode()


def decode_record(value: bytes) -> RoundRecord | None:
    """The round record `value` holds, or None if it is not a valid one (see module docstring):
    also refused are a negative round, no members, and a node named twice."""
    fields = _json(value, MAX_RECORD_BYTES)
    if not isinstance(fields, dict) or not _is_count(fields.get("round")):
        return None
    members, spares = fields.get("members"), fields.get("spares")
    if not isinstance(members, list) or not isinstance(spares, list) or not members:
        return None
    nodes = [decode_node(item) for item in members + spares]
    if any(node is None for node in nodes) or len(set(nodes)) != len(nodes):
        return None
    return RoundRecord(fields["round"], tuple(nodes[:len(members)]), tuple(nodes[len(members):]))


def _json(value: object, limit: int) -> object | None:
    if not isinstance(value, bytes | bytearray) or len(value) > limit:
        return None
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep: findings.md 20
        return None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
