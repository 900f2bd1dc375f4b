"""Dead-node probes, the evidence: a killed agent's port refuses connections at once.

A rendezvous learns that a node is gone from its liveness: a lease (etcd) or heartbeat times
(the TCPStore) that expire `keep_alive_interval x keep_alive_max_attempt` (5 s shipped) after the
node's last refresh. After a kill the survivors would wait for exactly that before they could form
the next round.

A killed agent leaves a sharper trace: the kernel closes its sockets. So each agent listens on a
TCP port of its own (its *beacon*, `Beacon`), which its peers reach at the node's address
(`--local_addr`, else its FQDN), and a node counts as exited when

    its beacon accepted a connection from this agent before, and now refuses one.

A refusal is the kernel's answer for a port nobody listens on: the agent process has exited
(SIGKILL, crash, OOM kill, a drained agent that has left). Everything else leaves the node to its
lease: a probe that times out (a machine powered off, a network partition: `Answer.UNKNOWN`), a
node this agent never reached (killed within about a second of the round forming, a firewall, an
agent without probes), and a frozen agent (SIGSTOP), whose kernel still accepts connections. So a
probe can only make a dead node leave sooner; it cannot evict a live agent. (A frozen or cut-off
node leaves sooner on another piece of evidence, its workers' watchdog verdict and a beacon that
does not answer: `silence`.)

A verdict is about one agent process, not about its name: torch names a node by its address, pid
and a counter, and a container restarted in place runs torchrun as PID 1 at the same address again,
the same name (docs/failure-semantics.md, "A node restarted with the same identity"). Its new beacon
listens on another port, which the probing agent has not reached, so it is never judged by its
predecessor's refusal (`probes`).

This module is the evidence only (the beacon, one probe, the `probe_dead_nodes` switch); who is
probed and when is the rendezvous's (`probes`, `silence`).
"""

from __future__ import annotations

import enum
import socket
import threading

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.defaults import conf_switch

# The `--rdzv_conf` key that turns the probes off (`probe_dead_nodes=0`), e.g. where agents'
# ports cannot reach each other. Default on.
PROBE_DEAD_NODES_KEY = "probe_dead_nodes"
# Seconds a probe waits for a connection. A refusal from a live host comes back in a round trip;
# a timeout only means "unknown", so this bounds what a lost machine costs a probe, not safety.
PROBE_TIMEOUT_S = 0.25
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
    (`silence`). The socket is not inherited by child processes (Python's
    default), so workers that outlive their agent do not keep it open.
    """

    def __init__(self) -> None:
        # Python's default backlog is 128: every fellow member of a round probes this beacon once,
        # and at hundreds of nodes the handshakes beyond it are dropped, which a probe takes for
        # "unknown" (the node is then left to its lease).
        if socket.has_dualstack_ipv6():
            self._socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                                backlog=socket.SOMAXCONN)
        else:
            self._socket = socket.create_server(("", 0), backlog=socket.SOMAXCONN)
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


def probes_enabled(params: RendezvousParameters) -> bool:
    """`probe_dead_nodes` of `--rdzv_conf` (default on); a bad value raises ValueError naming it."""
    return conf_switch(params, PROBE_DEAD_NODES_KEY)
