"""Heartbeats beside the rendezvous state: each node's newest beat in a key of its own.

torch's dynamic rendezvous keeps every node's heartbeat in the one state value that all agents
change by compare-and-set. A heartbeat is then a write of the whole state that competes with every
join and leave: 64 agents beating once a second need 64 winning writes a second before any join
gets one, and etcd-v3 wins about 20 a second on a 2-core machine (docs/benchmarks-history.md, "Rendezvous
at scale"). With a `HeartbeatChannel`, `state_holder.ElasticStateHolder` publishes a heartbeat
that is the only change of its state as a plain write of its own key, which never conflicts, and
merges the peers' published beats into every state it reads before torch looks for expired nodes.
A change of the state itself (a join, a leave, a removal) still goes through the compare-and-set
and carries the writer's newest view of every heartbeat.

A channel's contract:

- `publish(node, beat)`: make `beat` this node's newest published heartbeat (overwrites).
- `read()`: every node's newest published heartbeat, `{node: beat}`. Entries that do not decode
  (`decode_beat`) are skipped: the values come from the network and are treated as untrusted.

Every agent of a run must use the same backend and version: an agent that does not merge the
channel sees the others' heartbeats in the state grow old and drops them after the expiry.
Beats are absolute UTC times, as in torch's own state, so the machines' clocks must agree as they
must for torch.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Protocol

from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc

# A published heartbeat is a small JSON object; anything longer is not one of ours.
MAX_BEAT_BYTES = 1024
MAX_ADDR_CHARS = 255  # a DNS name is at most 253 characters


class HeartbeatChannel(Protocol):
    """Where the nodes of one rendezvous publish their heartbeats (see the module docstring)."""

    def publish(self, node: NodeDesc, beat: datetime) -> None: ...

    def read(self) -> dict[NodeDesc, datetime]: ...


def node_key(node: NodeDesc) -> str:
    """The name of `node`'s heartbeat key, unique per node (the name torch prints for it)."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


def encode_beat(node: NodeDesc, beat: datetime) -> bytes:
    """The published value of `node`'s heartbeat `beat` (an aware datetime)."""
    return json.dumps({"addr": node.addr, "pid": node.pid, "local_id": node.local_id,
                       "beat": beat.timestamp()}).encode()


def decode_beat(value: bytes) -> tuple[NodeDesc, datetime] | None:
    """The (node, beat) that `value` publishes, or None if it is not a valid published heartbeat:
    too long, not JSON, nested too deep, a field missing or of the wrong type, a time that is not
    finite or not representable."""
    if not isinstance(value, bytes | bytearray) or len(value) > MAX_BEAT_BYTES:
        return None
    try:
        fields = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep: findings.md 20
        return None
    if not isinstance(fields, dict):
        return None
    addr, pid, local_id, stamp = (fields.get(name) for name in ("addr", "pid", "local_id", "beat"))
    if not (isinstance(addr, str) and 0 < len(addr) <= MAX_ADDR_CHARS and _is_count(pid) and _is_count(local_id)
            and isinstance(stamp, int | float) and not isinstance(stamp, bool) and math.isfinite(stamp)):
        return None
    try:
        beat = datetime.fromtimestamp(stamp, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None
    return NodeDesc(addr, pid, local_id), beat


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
