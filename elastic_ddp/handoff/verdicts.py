"""The peer watchdog's verdict, handed from a worker to its torchrun agent in one datagram.

A worker whose peer watchdog (elastic_ddp/runtime/watchdog.py) found peers silent sends, just
before it ends with `SILENT_PEER_EXIT_CODE`, which nodes they were: their `GROUP_RANK`s, the ranks
of their nodes in the round that started this worker. Its agent's rendezvous (ours, not torch's)
reads it when it enters the next round, or at torchrun's monitor polls before
(elastic_ddp/agent/rendezvous/silence.py), and takes it as one of two pieces of evidence that a
member is not alive; the other is its own probe of that node's beacon.

Both sides find the address without talking to each other: it is made from what the worker's
environment holds and the agent's handler made itself when the round formed, the run id, rank 0's
store address and port (`MASTER_ADDR`, `MASTER_PORT`: a new port each round) and the node's rank
(`GROUP_RANK`). So a verdict is about one round of one node, and a later round never reads it.

The address is a Unix datagram socket in Linux's abstract namespace (no file: it is gone with the
agent's process, SIGKILL included, and nothing is left on the machine), bound by the agent for the
round (`VerdictInbox`). A worker whose agent reads no verdicts (torch's own `c10d`) finds nothing
bound there and sends nothing. The namespace is per network namespace, which a node's agent and
its workers share. Elsewhere than on Linux nothing is bound and the agent waits for the silent
node's lease, as without a verdict.

A worker may also name a peer as *suspect* (`send_suspicion`), `SUSPECT_LEAD_S` before its
watchdog's deadline for that peer, so that the agent asks the peer's beacon while the watchdog is
still confirming the silence; only a verdict makes the node leave the round.

A verdict is untrusted input for the agent: a datagram from another user (the kernel's credentials)
is dropped, one longer than `MAX_VERDICT_BYTES`, empty, nested too deep or not our JSON with one
list of node ranks is no verdict; reading never raises. Every poll (`waiting`, at torchrun's monitor
polls) drains what is queued, so datagrams of others do not stay in the queue. A forged verdict
cannot remove a live node on its own: the beacon probe must also go unanswered.

Not guaranteed: any local process can send datagrams here (the abstract namespace has no
permissions) and fill the queue between two polls. A worker's send therefore waits at most
`VERDICT_SEND_S` (`SUSPICION_SEND_S` for a suspicion) for room, then gives up: its watchdog still
stops it at once, and the agent leaves the silent node out when its lease ends instead of on the
verdict (seconds more, not the collective timeout).

    address = verdict_address("run", "10.0.0.1", 29511, group_rank=2)
    inbox = VerdictInbox(address)        # the agent, when the round forms
    send_suspicion(address, {1})         # the worker: node 1 of this round may be silent soon -> True
    send_verdict(address, {1})           # the worker: node 1 of this round is silent -> True
    inbox.waiting()                      # the agent's poll: True
    inbox.take()                         # the agent: {1}
    inbox.suspects()                     # {1}, once
    inbox.close()

The bottom layer of the package: it imports neither torch nor anything of elastic_ddp, so the agent
(which never imports the worker side) and the worker both use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from collections.abc import Iterable, Mapping

# A verdict names a few node ranks; 64 KiB holds over 8000 of them.
MAX_VERDICT_BYTES = 64 * 1024
# Seconds before its watchdog's deadline a worker names a peer as suspect: more than the agent's
# monitor poll (0.1 s) plus a beacon's answer bound (agent/rendezvous/silence.py, 0.3 s).
SUSPECT_LEAD_S = 0.5
# How long a send waits for room in a full queue: a verdict, three of the agent's polls (each drains
# the queue); a suspicion, which its watchdog's thread sends on its way, a fraction of its lead.
VERDICT_SEND_S = 0.3
SUSPICION_SEND_S = 0.1
# Datagrams one poll reads at most (the kernel queues 512 by default): a flood cannot hold the
# agent's monitor loop.
MAX_DATAGRAMS_PER_POLL = 4096
_VERDICT, _SUSPICION = "silent_node_ranks", "suspect_node_ranks"
_PREFIX = b"\0elastic_ddp-verdict-"
_CREDENTIALS = struct.Struct("=iII")  # struct ucred: pid, uid, gid
_SO_PASSCRED = getattr(socket, "SO_PASSCRED", None)
_SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", None)


def verdict_address(run_id: str, master_addr: str, master_port: int, group_rank: int) -> bytes:
    """The abstract socket address of node `group_rank`'s verdicts in the round whose workers' store
    is at `master_addr:master_port`. A digest: no character of a run id reaches the address."""
    key = json.dumps([run_id, master_addr, int(master_port), int(group_rank)]).encode()
    return _PREFIX + hashlib.sha256(key).hexdigest()[:32].encode()


def worker_verdict_address(environment: Mapping[str, str] = os.environ) -> bytes | None:
    """This worker's verdict address, from what torchrun put in its environment; None outside torchrun."""
    try:
        return verdict_address(environment["TORCHELASTIC_RUN_ID"], environment["MASTER_ADDR"],
                               int(environment["MASTER_PORT"]), int(environment["GROUP_RANK"]))
    except (KeyError, ValueError):
        return None


def send_verdict(address: bytes, silent_node_ranks: Iterable[int]) -> bool:
    """Send the verdict to this worker's agent; False if no agent reads verdicts at `address`.
    TimeoutError when the queue stays full for VERDICT_SEND_S (module docstring); another OSError
    propagates to the caller too."""
    return _send(address, _VERDICT, silent_node_ranks, VERDICT_SEND_S)


def send_suspicion(address: bytes, suspect_node_ranks: Iterable[int]) -> bool:
    """Name nodes whose workers' heartbeats are near the watchdog's bound (module docstring); as
    `send_verdict`, within SUSPICION_SEND_S."""
    return _send(address, _SUSPICION, suspect_node_ranks, SUSPICION_SEND_S)


def _send(address: bytes, kind: str, node_ranks: Iterable[int], wait_s: float) -> bool:
    text = json.dumps({kind: sorted({int(rank) for rank in node_ranks})}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        # Connected, a datagram socket waits (poll) for room in the receiver's queue, up to the timeout.
        sender.settimeout(wait_s)
        try:
            sender.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        sender.send(text)
    return True


class VerdictInbox:
    """The agent's end for one round: bound at `address` until `close`. Raises OSError where it
    cannot be bound (not Linux, or the address is taken); the caller then goes without verdicts."""

    def __init__(self, address: bytes) -> None:
        if _SO_PASSCRED is None or _SCM_CREDENTIALS is None:
            raise OSError("verdicts need Linux's abstract Unix sockets")
        self.address = address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, _SO_PASSCRED, 1)  # the sender's uid on each datagram
            self._socket.bind(address)
        except OSError:
            self._socket.close()
            raise
        self._socket.setblocking(False)
        self._taken: set[int] = set()
        self._suspected: set[int] = set()  # read by `take`, not yet returned by `suspects`
        self._unreported = False  # a valid datagram was read since `take` last returned

    def waiting(self) -> bool:
        """Read what is queued (`MAX_DATAGRAMS_PER_POLL` at most; what is not a valid verdict or
        suspicion of this user is dropped); whether a verdict or suspicion came that `take` has not
        returned yet."""
        self._drain()
        return self._unreported

    def take(self) -> set[int]:
        """The node ranks named by every valid verdict received so far (each worker of the node may
        send one), after reading what is queued as `waiting` does. Suspicions read on the way are
        kept for `suspects`."""
        self._drain()
        self._unreported = False
        return set(self._taken)

    def _drain(self) -> None:
        for _ in range(MAX_DATAGRAMS_PER_POLL):
            try:
                data, ancillary, flags, _ = self._socket.recvmsg(MAX_VERDICT_BYTES + 1,
                                                                 socket.CMSG_SPACE(_CREDENTIALS.size))
            except OSError:  # BlockingIOError: nothing more queued
                return
            if flags & socket.MSG_TRUNC or len(data) > MAX_VERDICT_BYTES or not _from_this_user(ancillary):
                continue
            verdict, suspicion = _parse(data, _VERDICT), _parse(data, _SUSPICION)
            self._unreported |= bool(verdict or suspicion)
            self._taken |= verdict
            self._suspected |= suspicion

    def suspects(self) -> set[int]:
        """The node ranks named as suspect in what `take` read since the last call."""
        suspected, self._suspected = self._suspected, set()
        return suspected

    def close(self) -> None:
        self._socket.close()


def _from_this_user(ancillary: list) -> bool:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SCM_CREDENTIALS and len(data) >= _CREDENTIALS.size:
            return _CREDENTIALS.unpack_from(data)[1] == os.getuid()
    return False


def _parse(data: bytes, kind: str) -> set[int]:
    try:
        ranks = json.loads(data).get(kind)
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):  # nested too deep: findings.md 20
        return set()
    if not isinstance(ranks, list) or not all(_is_rank(rank) for rank in ranks):
        return set()
    return set(ranks)


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
