"""Silent members: a frozen or cut-off member leaves the next round on two pieces of evidence,
not when its lease expires.

A killed agent's beacon refuses connections (`probes`), but a frozen one (SIGSTOP, a hung
machine) and one behind a network partition refuse nothing: they held the next round up until their
lease expired (`keep_alive_interval x keep_alive_max_attempt`, 5 s shipped, counted from their last
refresh), although the survivors' workers had already named them. Here a member of the last round
that has not arrived counts as not alive once both of these hold:

1. **its workers' verdict**: this node's own workers' peer watchdog (elastic_ddp/runtime/watchdog.py)
   found that member's workers silent for the watchdog's bound (3 s shipped) and wrote so before
   ending (`elastic_ddp.handoff.verdicts`: one datagram naming node ranks of the round that started them); and
2. **its beacon's silence**: asked by this agent, the member's beacon did not answer within
   `ANSWER_S`; asked when the verdict comes, or up to `FRESH_S` before it, when the workers named
   the member as *suspect* (`SUSPECT_LEAD_S`, 0.5 s, before their watchdog's deadline: the answer
   is then in by the time the verdict comes). Its beacon must have accepted a connection
   from this agent before, at the address and port asked now (`probes.ExitWitness`): a node
   this agent never reached (a firewall, `probe_dead_nodes=0`) is never judged by a silence.

A connection alone proves nothing: the kernel completes the handshake into a frozen process's
listen backlog. The answer is a byte that the beacon's thread sends (`liveness.Beacon`). A partition
makes the connect time out. A live but slow node (its CPU starved) answers from a thread that does
nothing else, within scheduling delay, so it is kept; and its workers' heartbeats come from such a
thread too, so no verdict names it in the first place (docs/failure-semantics.md, "The watchdog").

A node wrongly left out (its beacon's answer lost while its workers were silent) is not shut out:
its own workers find the others silent and end, its agent arrives at the next round, the members
see it waiting (`num_nodes_waiting`) and restart, and the round after takes it in, as any joining
node. The cost is one more restart, never a second world: the rule that no live member may be
missing (`rounds.may_close`) is only given these two pieces of evidence in place of the lease.

The verdict and the suspicions are looked for while the workers train too, at each of torchrun's
monitor polls (one `recv` that peeks), so that the beacons are asked before the worker that wrote
the verdict has ended. A suspicion alone leaves nobody out.

Cost: nothing while training but that peek; per round this node's workers' watchdog fired in (or
named a suspect in), one liveness read and one connection per named node, on threads of their own. Turned off
with the dead-node probes (`probe_dead_nodes=0`: no beacons, nothing is reached).
"""

from __future__ import annotations

import enum
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable

from elastic_ddp.agent.rendezvous.liveness import BEACON_ANSWER
from elastic_ddp.agent.rendezvous.probes import ExitWitness, Ports
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord
from elastic_ddp.handoff.verdicts import SUSPECT_LEAD_S, VerdictInbox, verdict_address

logger = logging.getLogger(__name__)

# Seconds a beacon has to answer: what each round that leaves a silent node out waits for it. The
# beacon's thread does nothing but answer, in an agent process that is idle while its workers
# train, so scheduling delays it by milliseconds, not tenths. One lost SYN (retransmitted after
# 1 s) makes a live node miss it: then it is left out only if its workers were silent for the
# watchdog's bound as well, and it rejoins the round after (module docstring).
ANSWER_S = 0.3
# How long a beacon found silent on a suspicion (`elastic_ddp.handoff.verdicts.SUSPECT_LEAD_S` before the
# workers' deadline) still counts when their verdict comes: the lead, the answer and a margin.
FRESH_S = SUSPECT_LEAD_S + ANSWER_S + 0.5
# Errors of a connect that say the peer's machine is out of reach: no answer, as a timeout.
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}


class Reply(enum.Enum):
    ANSWERED = "answered"
    SILENT = "silent"  # no answer within the bound: timed out, refused, unreachable
    UNKNOWN = "unknown"  # closed without an answer (a beacon of an older release), or a local error


def ask(address: tuple, answer_s: float = ANSWER_S) -> Reply:
    """Whether the beacon at `address` (AF_INET or AF_INET6) answers within `answer_s` seconds."""
    family = socket.AF_INET6 if len(address) == 4 else socket.AF_INET
    deadline = time.monotonic() + answer_s
    with socket.socket(family, socket.SOCK_STREAM) as connection:
        connection.settimeout(answer_s)
        try:
            connection.connect(address)
            connection.settimeout(max(0.001, deadline - time.monotonic()))
            answer = connection.recv(len(BEACON_ANSWER))
        except (TimeoutError, ConnectionRefusedError):
            return Reply.SILENT
        except OSError as exc:
            return Reply.SILENT if exc.errno in _UNREACHABLE else Reply.UNKNOWN
    return Reply.ANSWERED if answer == BEACON_ANSWER else Reply.UNKNOWN


class SilenceJudge:
    """Which members of this node's last round are silent by both pieces of evidence (module
    docstring). `expect` when a round is joined; `start` when the next one is entered (and at
    torchrun's monitor polls); `silent` while it is being closed. Thread-safe."""

    def __init__(self, witness: ExitWitness, answer_s: float = ANSWER_S) -> None:
        self._witness = witness
        self._answer_s = answer_s
        self._expected: tuple[VerdictInbox, RoundRecord] | None = None  # the verdicts of the round joined last
        self._record: RoundRecord | None = None  # the round the three below are about
        self._named: set[NodeDesc] = set()  # named silent by the workers' verdict
        self._silent_at: dict[NodeDesc, float] = {}  # beacons that did not answer, and when that was known
        self._asking: set[NodeDesc] = set()  # nodes whose beacon has not answered or timed out yet
        self._answered: set[NodeDesc] = set()  # nodes whose beacon answered
        self._probes: list[threading.Thread] = []
        self._lock = threading.Lock()

    def expect(self, run_id: str, master_addr: str, master_port: int, node_rank: int, record: RoundRecord) -> None:
        """This node joined `record` as `node_rank`; its workers' store is at `master_addr:master_port`."""
        self.forget()
        try:
            inbox = VerdictInbox(verdict_address(run_id, master_addr, master_port, node_rank))
        except OSError as exc:  # only an optimisation is lost: the lease decides, as without a verdict
            logger.warning("no verdicts from this node's workers this round: %s", exc)
            return
        with self._lock:
            self._expected = (inbox, record)

    def forget(self) -> None:
        """Stop reading the last round's verdicts (this agent is ending, or in a new round)."""
        with self._lock:
            expected, self._expected = self._expected, None
        if expected is not None:
            expected[0].close()

    def start(self, read_ports: Callable[[], Ports], early: bool = False) -> None:
        """Read what the last round's workers sent, if anything, and ask the beacons of the nodes it
        names on threads of their own (the answers are read by `silent`). `early`: only if a datagram
        is there already (torchrun's monitor loop, while the workers train or the one that wrote it
        is still ending: the answers are in by the time this node arrives); a suspicion is asked
        about and the verdict still awaited, a verdict ends the reading, and the next round's own
        `start` keeps what was found."""
        with self._lock:
            expected = self._expected
            if expected is None or (early and not expected[0].waiting()):
                return
        inbox, record = expected
        ranks = inbox.take()
        suspects = inbox.suspects() - ranks
        final = bool(ranks) or not early
        if final:
            inbox.close()
        named = [record.members[rank] for rank in sorted(ranks) if rank < len(record.members)]
        suspected = [record.members[rank] for rank in sorted(suspects) if rank < len(record.members)]
        now = time.monotonic()
        with self._lock:
            if final:
                self._expected = None
            if self._record != record:
                self._record, self._named, self._silent_at, self._asking = record, set(), {}, set()
                self._answered = set()
            self._named.update(named)
            for node in named:  # a beacon found silent just before (a suspicion) is evidence still
                if now - self._silent_at.get(node, -FRESH_S) > FRESH_S:
                    self._silent_at.pop(node, None)
            to_ask = [node for node in suspected + named if node not in self._asking and node not in self._silent_at]
            self._asking.update(to_ask)
            found = [node for node in named if node in self._silent_at]
        for node in found:
            self._left_out(node)
        if named:
            logger.info("this node's workers found node(s) %s silent: asking the beacons of %s", named, to_ask)
        elif suspected:
            logger.info("this node's workers suspect node(s) %s: asking their beacons early", suspected)
        if to_ask:
            probe = threading.Thread(target=self._judge, args=(record, to_ask, read_ports), name="rdzv-silence",
                                     daemon=True)
            with self._lock:
                self._probes.append(probe)
            probe.start()

    def _judge(self, record: RoundRecord, nodes: list[NodeDesc], read_ports: Callable[[], Ports]) -> None:
        try:
            ports = read_ports()
        except Exception as exc:  # noqa: BLE001 - only an optimisation is lost: the lease still decides
            logger.debug("could not read the beacon ports: %s", exc)
            with self._lock:
                self._asking.difference_update(nodes)
            return
        targets = [(node, self._witness.reached(node, ports.get(node))) for node in nodes]
        with self._lock:
            self._asking.difference_update(node for node, address in targets if address is None)
        askers = [threading.Thread(target=self._ask, args=(record, node, address), daemon=True)
                  for node, address in targets if address is not None]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()

    def _ask(self, record: RoundRecord, node: NodeDesc, address: tuple) -> None:
        reply = ask(address, self._answer_s)
        with self._lock:
            self._asking.discard(node)
            if self._record != record:
                return
            if reply is Reply.SILENT:
                self._silent_at[node] = time.monotonic()
            elif reply is Reply.ANSWERED:
                self._answered.add(node)
            named = node in self._named
        if reply is not Reply.SILENT:
            logger.info("node %s, named by this node's workers, answers its beacon (%s): kept", node, reply.value)
        elif named:
            self._left_out(node)
        else:
            logger.info("node %s, suspected by this node's workers, did not answer its beacon within %g s",
                        node, self._answer_s)

    def _left_out(self, node: NodeDesc) -> None:
        logger.warning("node %s is silent (this node's workers found it silent, and its beacon did not answer "
                       "within %g s): left out of the next round of the rendezvous", node, self._answer_s)

    def silent(self, last: RoundRecord | None) -> set[NodeDesc]:
        """The members of `last` (the last closed round, as read now) found silent so far; none
        unless `last` is the round the verdict was about."""
        with self._lock:
            if self._record is None or last is None or self._record != last:
                return set()
            return {node for node in self._named if node in self._silent_at}

    def answering(self, last: RoundRecord | None, wait_s: float) -> set[NodeDesc]:
        """The members of `last` named silent by this node's workers whose beacon answered: their
        agent runs, only their workers are silent (frozen, or cut off from the others' workers).
        Waits up to `wait_s` for the beacons still being asked, when this node's workers named any."""
        with self._lock:
            if self._record is None or last is None or self._record != last or not self._named:
                return set()
        self.wait(wait_s)
        with self._lock:
            return self._named & self._answered if self._record == last else set()

    def asked(self, last: RoundRecord | None) -> set[NodeDesc]:
        """The members of `last` being asked now or found silent: the dead-node probes
        (`ExitWitness.exited`) need not ask them too (a beacon that is cut off would cost each of
        them a connect timeout per poll while the round waits; a refusal is silence here too)."""
        with self._lock:
            if self._record is None or last is None or self._record != last:
                return set()
            return self._asking | {node for node in self._named if node in self._silent_at}

    def wait(self, timeout: float) -> bool:
        """Wait, at most `timeout` seconds in all, until every beacon asked has answered or timed
        out; False if still asking. The probes that ended are forgotten."""
        deadline = time.monotonic() + timeout
        with self._lock:
            probes = list(self._probes)
        for probe in probes:
            probe.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._probes = [probe for probe in self._probes if probe.is_alive()]
            return not self._probes
