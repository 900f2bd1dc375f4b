"""A multi-host test bed on one machine: each node in a network namespace of its own, on a bridge.

    with NetworkBed(["n0", "n1", "n2"]) as bed:
        bed.address("n0")                      # "10.213.0.1": n0's own address on the bridge
        bed.prefix("n1") + ["python", "x.py"]  # argv that runs x.py inside n1's namespace
        bed.apply(NetworkFault.parse("blip n1 1"))

Every node namespace has a loopback of its own and one link, `eth0`, with its address: one end of
a veth pair whose other end is a port of the bridge `br0`, which lives in a "switch" namespace of
its own. Nothing is created in the host's namespace, so no host interface, route or firewall rule
is touched (`ip netns list` shows the namespaces while the bed is up, `ip link` on the host never
changes). Root only (`why_unavailable` says why not, in one line).

Faults, as data (`NetworkFault`, e.g. from the text `partition n1`, `heal n1`, `blip n1 1`,
`partition n2 e1`, `partition-etcd e1 n2`): a partition of one node sets its port on the switch
down. Its packets then vanish: no reset, no refusal, a peer's `connect()` times out, as across a
pulled cable or a dead switch port; the node keeps its own address and loopback. A partition of
several nodes cuts them off together: their ports move to a bridge of their own, so they still
reach each other (a minority side). `heal` puts the ports back on `br0`, up; `blip` is a one-node
partition healed after SECONDS. `partition-etcd MEMBER [NODE ...]` is a partition whose first node
must be one of the bed's `etcd_members` (nodes that run an etcd member, tests/support/network.py).

Names are unique per bed (`edb<pid>x<random>-<node>`), so runs side by side never meet. Teardown
is guaranteed: `close()` (the context manager's exit, the pytest fixture's finalizer, and an
`atexit` hook while the bed is open) kills every process still in the bed's namespaces and
deletes them, which deletes their links and the bridge with them. While a bed is open, a SIGTERM
to a process that left SIGTERM at its default raises SystemExit in the main thread instead, so
that the exits and `atexit` hooks still run. A bed whose process was killed outright (SIGKILL)
leaves its namespaces behind; the next bed created on the machine removes every bed namespace
whose owner pid is gone (`remove_stale_beds`).

Not possible here: a slow or lossy link with delay or loss (`tc qdisc ... netem`: this kernel has
no sch_netem); a rate limit (`tbf`) works.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Every bed's namespaces are named BED_PREFIX + owner pid + "x" + random + "-" + what it is.
BED_PREFIX = "edb"
_BED_NAME = re.compile(rf"^{BED_PREFIX}(\d+)x[0-9a-f]+-")
SWITCH = "sw"
BRIDGE = "br0"
NODE_LINK = "eth0"  # the node's one link (GLOO_SOCKET_IFNAME=eth0 names it on every node)
SUBNET = "10.213.0"  # a /24: node i has SUBNET.(i+1)
IP_TIMEOUT_S = 10

ACTIONS = ("partition", "heal", "blip", "partition-etcd")
SIDED = ("partition", "heal", "partition-etcd")  # the actions that take more nodes


class NetworkBedError(RuntimeError):
    """An `ip` command of the bed failed (the message has its argv and its output)."""


@dataclass(frozen=True)
class NetworkFault:
    """One network fault: `partition NODE [NODE ...]`, `heal NODE [NODE ...]`, `blip NODE SECONDS`
    or `partition-etcd MEMBER [NODE ...]`; `side` holds the nodes after the first."""

    action: str
    node: str
    seconds: float | None = None
    side: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"network fault action: got {self.action!r}; expected one of {', '.join(ACTIONS)}")
        if not self.node or not all(self.side):
            raise ValueError("network fault node: got an empty name; expected a node of the bed")
        if (self.action == "blip") != (self.seconds is not None):
            raise ValueError(f"network fault seconds: {self.action} {'needs' if self.action == 'blip' else 'takes no'} "
                             f"SECONDS (got {self.seconds})")
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"network fault seconds: got {self.seconds}; expected more than 0")
        if self.side and self.action not in SIDED:
            raise ValueError(f"network fault {self.action}: takes one node (got {self.node}, {', '.join(self.side)})")
        if len({self.node, *self.side}) != 1 + len(self.side):
            raise ValueError(f"network fault nodes: got {self.node} {' '.join(self.side)}; expected distinct names")

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.node, *self.side)

    @classmethod
    def parse(cls, text: str) -> NetworkFault:
        """`partition NODE [NODE ...]`, `heal NODE [NODE ...]`, `blip NODE SECONDS` or
        `partition-etcd MEMBER [NODE ...]`; ValueError naming what is wrong."""
        words = text.split()
        usage = (f"network fault {text!r}: expected 'partition NODE [NODE ...]', 'heal NODE [NODE ...]', "
                 "'blip NODE SECONDS' or 'partition-etcd MEMBER [NODE ...]'")
        if len(words) < 2 or (words[0] not in SIDED and len(words) != 3):
            raise ValueError(usage)
        if words[0] in SIDED:
            return cls(words[0], words[1], side=tuple(words[2:]))
        try:
            seconds = float(words[2])
        except ValueError:
            raise ValueError(f"network fault {text!r}: SECONDS must be a number") from None
        return cls(words[0], words[1], seconds)

    def describe(self) -> str:
        return " ".join([self.action, *self.nodes]) + (f" {self.seconds:g}" if self.seconds is not None else "")


def why_unavailable() -> str | None:
    """None where beds can be made here; else the reason, in one line."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = f"{BED_PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"ip netns add was refused: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "delete", probe], check=False, capture_output=True, timeout=IP_TIMEOUT_S)
    return None


def _ip(*args: str) -> str:
    argv = ["ip", *args]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise NetworkBedError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def bed_namespaces() -> list[str]:
    """The names of every bed namespace on this machine (any run's)."""
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True,
                            timeout=IP_TIMEOUT_S).stdout
    names = (line.split()[0] for line in listed.splitlines() if line.strip())
    return [name for name in names if _BED_NAME.match(name)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_namespaces(names: Iterable[str]) -> None:
    """SIGKILL every process in each namespace, then delete it (its links go with it); never raises."""
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], check=False, capture_output=True, text=True,
                              timeout=IP_TIMEOUT_S).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True, timeout=IP_TIMEOUT_S)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


_open_beds: set[str] = set()


def _bed_opened(name: str) -> None:
    """SIGTERM raises SystemExit while any bed is open, where it would kill the process outright
    (the default handler, in the main thread); the process's own handlers are left alone."""
    _open_beds.add(name)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _bed_closed(name: str) -> None:
    _open_beds.discard(name)
    if (not _open_beds and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def remove_stale_beds() -> list[str]:
    """Delete the namespaces of beds whose owner process is gone (one killed outright); return them."""
    stale = [name for name in bed_namespaces() if not _pid_alive(int(_BED_NAME.match(name).group(1)))]
    remove_namespaces(stale)
    return stale


class NetworkBed:
    """Nodes in network namespaces of their own on one bridge (module docstring). Use it as a
    context manager, or call `close()`; `nodes` are the names faults and `prefix` take."""

    def __init__(self, nodes: Sequence[str], etcd_members: Sequence[str] = ()):
        if len(set(nodes)) != len(nodes) or not 1 <= len(nodes) <= 250:
            raise ValueError(f"nodes: got {list(nodes)}; expected 1 to 250 distinct names")
        if not set(etcd_members) <= set(nodes):
            raise ValueError(f"etcd_members: got {list(etcd_members)}; expected nodes of the bed ({', '.join(nodes)})")
        self.nodes = list(nodes)
        self.etcd_members = list(etcd_members)
        self._sides = 0  # bridges made for partitions of several nodes
        self.name = f"{BED_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self._created: list[str] = []
        self._closed = False

    def namespace(self, node: str) -> str:
        """The network namespace of `node` (`ip netns exec` takes it)."""
        self._check(node)
        return f"{self.name}-{node}"

    @property
    def switch(self) -> str:
        """The namespace that holds the bridge."""
        return f"{self.name}-{SWITCH}"

    def address(self, node: str) -> str:
        """`node`'s own address on the bridge."""
        self._check(node)
        return f"{SUBNET}.{self.nodes.index(node) + 1}"

    def prefix(self, node: str) -> list[str]:
        """The argv prefix that runs a command inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def port(self, node: str) -> str:
        """`node`'s port on the bridge (an interface of the switch namespace)."""
        self._check(node)
        return f"p{self.nodes.index(node)}"

    def open(self) -> NetworkBed:
        """Create the switch, the bridge and every node; on any failure remove what was made."""
        remove_stale_beds()
        atexit.register(self.close)
        _bed_opened(self.name)
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.switch, "link", "set", BRIDGE, "up")
            for node in self.nodes:
                self._add_node(node)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_node(self, node: str) -> None:
        namespace, port = self.namespace(node), self.port(node)
        self._add_namespace(namespace)
        # Both ends are made inside the namespaces: the host's own namespace never holds a link of the bed.
        _ip("-n", namespace, "link", "add", NODE_LINK, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", namespace, "addr", "add", f"{self.address(node)}/24", "dev", NODE_LINK)
        _ip("-n", namespace, "link", "set", NODE_LINK, "up")
        _ip("-n", self.switch, "link", "set", port, "master", BRIDGE)
        _ip("-n", self.switch, "link", "set", port, "up")

    def connects(self, node: str, address: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connect from inside `node`'s namespace to `address:port` succeeds in `timeout`.

        Ask from a node, not from here: the host's own network may answer for any address (a
        sandbox's proxy does), so a connect from the host's namespace proves nothing."""
        probe = ("import socket, sys\n"
                 "try:\n"
                 f"    socket.create_connection(({address!r}, {int(port)}), timeout={float(timeout)}).close()\n"
                 "except OSError:\n"
                 "    sys.exit(1)\n")
        done = subprocess.run([*self.prefix(node), sys.executable, "-c", probe], check=False,
                              capture_output=True, timeout=timeout + IP_TIMEOUT_S)
        return done.returncode == 0

    def partition(self, node: str, *side: str) -> None:
        """Cut `node` off (its port on the switch down: its packets vanish, no reset); with `side`,
        cut them all off together: their ports move to a bridge of their own, where they still
        reach each other and nothing else."""
        if not side:
            _ip("-n", self.switch, "link", "set", self.port(node), "down")
            return
        ports = [self.port(name) for name in (node, *side)]
        self._sides += 1
        bridge = f"br{self._sides}"
        _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", bridge, "up")
        for port in ports:
            _ip("-n", self.switch, "link", "set", port, "master", bridge)

    def partition_etcd(self, member: str, *side: str) -> None:
        """Cut off the node of etcd member `member` (with `side` on its side)."""
        if member not in self.etcd_members:
            raise ValueError(f"etcd member: got {member!r}; expected one of {', '.join(self.etcd_members) or 'none'}")
        self.partition(member, *side)

    def heal(self, node: str, *side: str) -> None:
        """Connect `node` (and `side`) again: the port back on the bridge of every node, up."""
        for port in [self.port(name) for name in (node, *side)]:
            _ip("-n", self.switch, "link", "set", port, "master", BRIDGE)
            _ip("-n", self.switch, "link", "set", port, "up")

    def blip(self, node: str, seconds: float) -> None:
        """Partition `node` for `seconds`, then heal it (returns after the heal)."""
        self.partition(node)
        try:
            time.sleep(seconds)  # the fault's own length, not a wait for a condition
        finally:
            self.heal(node)

    def apply(self, fault: NetworkFault) -> None:
        """Play one fault (a blip returns once healed)."""
        if fault.action == "blip":
            self.blip(fault.node, fault.seconds)
        else:
            getattr(self, fault.action.replace("-", "_"))(*fault.nodes)

    def close(self) -> None:
        """Kill every process in the bed's namespaces and delete them; safe to call again."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        remove_namespaces(reversed(self._created))
        _bed_closed(self.name)

    def __enter__(self) -> NetworkBed:  # noqa: PYI034 (Self needs Python 3.11)
        return self.open()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check(self, node: str) -> None:
        if node not in self.nodes:
            raise ValueError(f"node: got {node!r}; expected one of {', '.join(self.nodes)}")
