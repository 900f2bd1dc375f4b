"""Dead-node probes: drop a killed node from the rendezvous at once, not when its heartbeat expires.

torch's dynamic rendezvous (behind `c10d`, and behind our `etcd-v3`) learns that a node is gone
only from its heartbeats: a node stays a participant until `keep_alive_interval x
keep_alive_max_attempt` (5 s shipped) after its last one. After a kill the survivors' agents wait
for exactly that before they can form the next round; it was the floor of kill recovery.

A killed agent leaves a sharper trace: the kernel closes its sockets. So each agent here listens
on a TCP port of its own (its *beacon*, accepting and closing connections) and publishes the port
in the rendezvous store; peers reach it at the node's address (`--local_addr`, else its FQDN).
Whenever a node is waiting in the rendezvous (it is not a participant of a complete round), every
sync of the rendezvous state probes the *suspects* among the other nodes of that state, and a
node is removed at once, as torch removes one whose heartbeat expired, when

    its beacon accepted a connection from this agent before, and now refuses one.

The suspects (`rendezvous.state_holder`) are the nodes that can hold this one up: the participants
of a complete round that this node has left (after a failure every live agent leaves it at once
and rejoins; one that stays is the likely dead one), and any node whose heartbeat is overdue (1.5
heartbeat intervals). Probing every node at every sync instead cost N - 1 connections per agent
ten times a second: at 16 simulated agents the first rendezvous took up to 51 s
(docs/benchmarks-history.md, "Rendezvous at scale"). Heartbeats carry their writer's clock, so clock skew
between machines changes how often a node is probed, never which nodes a probe can remove. A node
killed while it waits in a forming round is found once its heartbeat is overdue (1.5 s shipped).

A refusal is the kernel's answer for a port nobody listens on: the agent process has exited
(SIGKILL, crash, OOM kill, a drained agent that has left). Everything else keeps torch's rule, the
heartbeat expiry: a probe that times out (a machine powered off, a network partition), a node
this agent never reached (killed within about a second of the round forming, a firewall, an agent
that does not run these probes), and a frozen agent (SIGSTOP), whose kernel still accepts
connections. So a probe can only make a dead node leave sooner; it cannot evict a live agent.
(The keyed rendezvous also leaves out a frozen or cut-off node sooner, on its workers' watchdog
verdict and a beacon that does not answer: `keyed_silence`. This module's probes do not.)

A verdict is about one agent process, not about its name. torch names a node by its address,
pid and a counter, and a container restarted in place runs torchrun as PID 1 at the same address
again: the same name (docs/failure-semantics.md, "A node restarted with the same identity"). So a
node found exited that is in a state again is looked up and probed again, and stays exited only
while the beacon published under its name refuses too; one that accepts makes it a live node,
probed like any other from then on (no beacon, or no answer: left to its heartbeat). A removed
node is in a state again only once an agent of that name has joined (or in a read that raced its
removal), so this costs a store read and a probe about once per restart, not per sync. Making the
name differ per start instead (a random counter) was not chosen: the name is torch's, made by its
private node generator before our handler exists, so that would take one more private hook, in
every agent, and an agent without it would still come back under the old name and be kept out;
the mistake is the verdict's.

While a node trains (a participant of a complete round) nothing waits on a dead peer, so there
are no death probes then; a peer is probed once, when first seen, to learn that it is reachable.
At most `OBSERVE_PER_SYNC` new peers are looked up at one sync, their beacon ports in one read
where the store has the extended API: 64 agents that each looked up 63 peers at the sync after a
round completed, two store reads each, held etcd and every agent for 8 s, long enough for their
heartbeats to expire (docs/benchmarks-history.md, "Rendezvous at scale").

The probes run in our state holder (`rendezvous.state_holder`), which our backends build
(`rendezvous.handler`). Limits: relies on torch's private state holder and handler attributes, all
named in `rendezvous.torch_internals` (torch 2.4-2.13); tests pin them and the behaviour.

Not guaranteed: an agent restarted with the name of an exited one but without probes
(`probe_dead_nodes=0`, torch's own `c10d` in the same rendezvous) publishes no beacon, so its
predecessor's port is still found, still refuses, and the restarted agent is removed whenever a
probing agent waits, until its own write completes a round first.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.defaults import conf_switch
from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc

logger = logging.getLogger(__name__)

# The `--rdzv_conf` key that turns the probes off (`probe_dead_nodes=0`), e.g. where agents'
# ports cannot reach each other. Default on.
PROBE_DEAD_NODES_KEY = "probe_dead_nodes"
# New peers whose beacon one `DeadNodeDetector.observe` looks up (the rest at the next syncs).
OBSERVE_PER_SYNC = 16
# Seconds a probe waits for a connection. A refusal from a live host comes back in a round trip;
# a timeout only means "unknown", so this bounds what a lost machine costs each sync, not safety.
PROBE_TIMEOUT_S = 0.25
STORE_KEY_PREFIX = "elastic_ddp.beacon."
# What a beacon sends on each connection it accepts: the proof that its process is running.
BEACON_ANSWER = b"!"


class Answer(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    UNKNOWN = "unknown"  # timed out, unreachable, or not resolvable: says nothing about the node


def probe(address: tuple, timeout: float = PROBE_TIMEOUT_S) -> Answer:
    """Connect to `address` (a socket address of family AF_INET or AF_INET6) and close at once."""
    family = socket.AF_INET6 if len(address) == 4 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        try:
            connection.connect(address)
        except ConnectionRefusedError:
            return Answer.REFUSED
        except OSError:
            return Answer.UNKNOWN
    return Answer.ACCEPTED


class Beacon:
    """A listening TCP port that accepts connections, answers each with `BEACON_ANSWER` and closes
    it, for as long as this process lives.

    It listens on every interface (dual-stack where the kernel has it), since peers reach this node
    by the address torch gives it (`--local_addr`, else the FQDN), which may be any of them. It
    reads nothing. The answer comes from this thread, which does nothing else: the kernel completes
    a connection to a frozen process's port too, so only the answer says that the process runs
    (`keyed_silence`). The socket is not inherited by child processes (Python's
    default), so workers that outlive their agent do not keep it open.
    """

    def __init__(self) -> None:
        if socket.has_dualstack_ipv6():
            self._socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self._socket = socket.create_server(("", 0))
        self.port: int = self._socket.getsockname()[1]
        threading.Thread(target=self._accept_forever, name="elastic-ddp-beacon", daemon=True).start()

    def _accept_forever(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                # Closed, or out of file descriptors. Either way the kernel keeps completing
                # handshakes until the backlog is full and then drops them: probes see "unknown",
                # never a refusal, while this process lives.
                return
            try:
                connection.send(BEACON_ANSWER)  # one byte into an empty buffer: never blocks
            except OSError:
                pass  # the prober has gone already (a probe that only connects)
            connection.close()

    def close(self) -> None:
        """Stop listening, as this process's exit would (connections are refused from now on)."""
        # shutdown() first: close() alone leaves the socket listening while accept() blocks on it.
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down
        self._socket.close()


def beacon_key(node: NodeDesc) -> str:
    return f"{STORE_KEY_PREFIX}{node}"


class DeadNodeDetector:
    """Which nodes of a rendezvous state have provably exited (see the module docstring).

    `observe` learns where each new node's beacon is and whether this agent reaches it; `dead`
    probes the reached ones again and returns those that now refuse. Nodes without a published
    beacon, or whose first probe was not accepted, are never reported; nor is a node once a probe
    of it timed out (it is left to its heartbeat, and later syncs do not wait for it again).
    A node found dead stays dead while the beacon published under its name refuses: `dead` looks
    it up and probes it again whenever it is among `nodes` (an agent restarted with the same name,
    see the module docstring), and forgets the verdict unless that probe is refused too.
    """

    def __init__(self, store: Store, timeout: float = PROBE_TIMEOUT_S) -> None:
        self._store = store
        self._timeout = timeout
        self._reached: dict[NodeDesc, tuple] = {}  # node -> the socket address that accepted
        self._seen: set[NodeDesc] = set()
        self._exited: set[NodeDesc] = set()

    def observe(self, nodes) -> None:
        """Learn where up to `OBSERVE_PER_SYNC` nodes of `nodes` not seen before have their beacon."""
        new = [node for node in dict.fromkeys(nodes) if node not in self._seen][:OBSERVE_PER_SYNC]
        if not new:
            return
        try:
            ports = self._published_ports(new)
        except Exception as exc:  # noqa: BLE001 - a store hiccup must not fail the rendezvous sync: ask again later
            logger.debug("could not read the beacons of nodes %s: %s", new, exc)
            return
        for node, port in zip(new, ports, strict=True):
            self._seen.add(node)
            address = self._reached_address(node, port) if port is not None else None
            if address is not None:
                self._reached[node] = address

    def dead(self, nodes, suspects=None) -> list[NodeDesc]:
        """The nodes of `nodes` known to have exited, once those of `suspects` (default: all of
        `nodes`) that were reached before are probed again, and those of `nodes` found exited
        before have been looked up again."""
        nodes = list(nodes)
        looked_up = [node for node in dict.fromkeys(nodes) if node in self._exited]
        for node in looked_up:
            self._look_up_exited(node)
        for node in nodes if suspects is None else suspects:
            address = self._reached.get(node)
            if address is None or node in looked_up:
                continue
            answer = probe(address, self._timeout)
            if answer is not Answer.ACCEPTED:
                del self._reached[node]
            if answer is Answer.REFUSED:
                self._exited.add(node)
        return [node for node in nodes if node in self._exited]

    def any_answers(self, other_than: NodeDesc) -> bool:
        """Whether a node reached before, other than `other_than` (this agent's), answers a probe
        now: accepts, or refuses (its machine is reachable). Tells a cut-off network from a cut-off
        peer (`store_watch`); one probe per reached node, `timeout` each at most."""
        return any(probe(address, self._timeout) is not Answer.UNKNOWN
                   for node, address in list(self._reached.items()) if node != other_than)

    def has_exited(self, node: NodeDesc) -> bool:
        """Whether `node` is known to have exited (as of the last `dead` that named it)."""
        return node in self._exited

    def _look_up_exited(self, node: NodeDesc) -> None:
        """Keep `node` exited only if the beacon published under its name now refuses too. If it
        accepts, the name has a live agent again (restarted with the same identity): reached, as
        if observed now. No beacon, or no answer: left to its heartbeat, as a node never reached."""
        try:
            port = self._published_port(node)
        except Exception as exc:  # noqa: BLE001 - a store hiccup says nothing about the node: ask at a later sync
            logger.debug("could not read the beacon of exited node %s: %s", node, exc)
            return
        answers = self._answers(node, port) if port is not None else {}
        if answers and set(answers.values()) == {Answer.REFUSED}:
            return
        self._exited.discard(node)
        address = _accepting(answers)
        if address is not None:
            self._reached[node] = address
            logger.info("node %s, found exited before, answers again (an agent restarted with the same identity): "
                        "a live node", node)
        else:
            logger.info("node %s, found exited before, no longer refuses (no beacon, or no answer): only its "
                        "heartbeat can remove it", node)

    def _published_ports(self, nodes: list[NodeDesc]) -> list[int | None]:
        """Each node's published beacon port, None where it publishes none or not a valid port.
        One check and one read for all of them when every one is published and the store has the
        extended API (multi_get), else two reads per node."""
        keys = [beacon_key(node) for node in nodes]
        if len(keys) > 1 and self._store.has_extended_api() and self._store.check(keys):
            return [_port(node, value) for node, value in zip(nodes, self._store.multi_get(keys), strict=True)]
        return [self._published_port(node) for node in nodes]

    def _published_port(self, node: NodeDesc) -> int | None:
        key = beacon_key(node)
        # check() first: a store's get() blocks until the key exists (the agent may not run probes).
        if not self._store.check([key]):
            logger.debug("node %s publishes no beacon: only its heartbeat can remove it", node)
            return None
        return _port(node, self._store.get(key))

    def _reached_address(self, node: NodeDesc, port: int) -> tuple | None:
        address = _accepting(self._answers(node, port))
        if address is None:
            logger.info("node %s's beacon (%s port %d) did not accept a connection: only its heartbeat can remove it",
                        node, node.addr, port)
        return address

    def _answers(self, node: NodeDesc, port: int) -> dict[tuple, Answer]:
        """How each socket address of `node` answers at `port`, until one accepts ({}: none resolved)."""
        try:
            candidates = socket.getaddrinfo(node.addr, port, type=socket.SOCK_STREAM)
        except OSError:
            candidates = []
        answers: dict[tuple, Answer] = {}
        for family, _, _, _, address in candidates:
            if family in (socket.AF_INET, socket.AF_INET6):
                answers[address] = probe(address, self._timeout)
                if answers[address] is Answer.ACCEPTED:
                    break
        return answers


def _accepting(answers: dict[tuple, Answer]) -> tuple | None:
    return next((address for address, answer in answers.items() if answer is Answer.ACCEPTED), None)


def _port(node: NodeDesc, value: bytes) -> int | None:
    """The beacon port `value` publishes, or None (logged) if it is not a TCP port number."""
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        logger.info("node %s published %r as its beacon port, which is not a port: only its heartbeat can remove it",
                    node, bytes(value[:32]))
        return None
    return port


def probes_enabled(params: RendezvousParameters) -> bool:
    """`probe_dead_nodes` of `--rdzv_conf` (default on); a bad value raises ValueError naming it."""
    return conf_switch(params, PROBE_DEAD_NODES_KEY)


def start_beacon(store: Store, node: NodeDesc) -> tuple[Beacon, DeadNodeDetector]:
    """This agent's beacon, published in the rendezvous `store` under `node`, and a detector that
    probes the others' through that store. Once per agent, before its first rendezvous."""
    beacon = Beacon()
    store.set(beacon_key(node), str(beacon.port))
    logger.info("this agent's beacon listens on port %d (dead-node probes on)", beacon.port)
    return beacon, DeadNodeDetector(store)
