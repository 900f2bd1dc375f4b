"""A worker that plain torchrun starts as `python -m elastic_ddp.train`, run warm: forked, not imported.

Plain torchrun starts every worker as a new `python -m MODULE` process, which imports torch, torch._dynamo
and the trainer again after every failure (seconds: docs/operations.md). When the agent's rendezvous is one of
ours (`elastic-c10d`, `etcd-v3`), the agent runs a warm-worker server that has imported them once
(elastic_ddp/agent/warm_workers.py) and puts its address in `ELASTIC_DDP_WARM_WORKERS`, which the
workers inherit. The first lines of `elastic_ddp.train` (and `elastic_ddp.chaos.held_train`) then call
`become_warm_worker` before any other import, and so does `elastic_ddp.handoff.warm_start` for any module
(`python -m elastic_ddp.agent.launcher` starts the server itself and every worker through it): this
process, the one torchrun started and watches, becomes a thin client. It sends the server its argv,
working directory, `sys.path`, environment and its stdin/stdout/stderr (SCM_RIGHTS); the server
forks a child that runs the module as `__main__` in their place. The client forwards SIGTERM,
SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the child's process group (torchrun signals the client's
group, which the child is not in), and ends as the child ended: with its exit code, or killed by
the same signal, so torchrun sees what it would have seen. When the client dies (SIGKILL included),
its connection closes and the child kills its own process group: a worker killed by torchrun is
gone, as a cold one would be.

Only the agent's own workers and its own server can speak (docs/operations.md, "Security"). The
agent puts a 256-bit key beside the address (`@name#KEY`, torchrun passes the variable to its
workers) and nowhere else; the abstract socket's name is visible to every process of the network
namespace, containers with `hostNetwork` included, the key is not. The server proves it holds the
key first, on a nonce of the client's (HMAC-SHA256), so a process that took the name of a dead
server gets no request, no environment and no fd from a worker; then the client proves it, on a
nonce of the server's, before the server forks anything for it. The key itself never crosses the
socket, and is never logged nor handed to the training process's environment.

No server, a server that is gone, refuses (it could not fork, or runs as many children as it
takes) or does not prove the key, or one that does not answer within `ANSWER_TIMEOUT_S` (it has
not finished its imports): the module runs cold in this process, after one line on stderr that
names the address, never the key. Only a listener that is a child of this worker's own agent (the
server forked from it) gets that long; any other (a process that bound a dead server's name) must
accept and prove the key within `PROOF_TIMEOUT_S`, so it delays each new worker by that much at
most, and learns nothing. `ELASTIC_DDP_WARM_WORKERS=0` (or unset) runs it cold without a word.

Not guaranteed: the pid torchrun knows is the client's, not the training process's. Signals sent to
the client by pid are not forwarded except those five: `kill -STOP <client>` stops the client only
(freeze the child: its pid is in the event log's `start` ranks, or stop the node's whole process tree),
`kill -KILL <client>` does end the child. Off Linux nothing changes (no server is started).

Torch-free and bottom layer: it imports nothing of elastic_ddp, so that it costs the client no
import; `python -X importtime -m elastic_ddp.train` shows it ahead of any torch import.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import socket
import struct
import sys
import time

# The server's address and the key that proves who speaks ("@name#KEY": the abstract namespace, 64
# hex digits) in the workers' environment, or OFF.
VARIABLE = "ELASTIC_DDP_WARM_WORKERS"
OFF = "0"
# The modules whose first lines call `become_warm_worker`: the rendezvous plugin starts a server for no other.
WARM_MODULES = ("elastic_ddp.train", "elastic_ddp.chaos.held_train", "elastic_ddp.handoff.warm_start")
# The server's process name (/proc/PID/comm, `ps -o comm`; at most 15 bytes). It is forked from its
# agent, so its command line is the agent's; `runtime.distributed.agent_pid` looks for this name.
SERVER_PROCESS_NAME = "edp-warm-server"
# A request (argv, cwd, sys.path, the environment) larger than this is refused: no real one is near it.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# How long the client waits for the server to fork its child. The server imports the rest of its
# preload while the agent is in its first rendezvous; a client that comes sooner waits, which costs less than a cold
# start even on a busy 2-core machine (the imports started earlier). A server that does not answer
# in this time is taken as stuck, and the client runs cold.
ANSWER_TIMEOUT_S = 60.0
# How long the client waits to connect, and for the proof of a listener that is not its own agent's
# child (the server is forked from the agent that started this worker): a process that took the
# name of a dead server and never answers costs each new worker this long, then it runs cold. The
# server's backlog holds every worker of a node, so a connect to our own server never waits.
PROOF_TIMEOUT_S = 2.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STANDARD_FDS = (0, 1, 2)
# Messages on a connection: the request's length, then (server to client) fixed-size records.
LENGTH = struct.Struct("=I")
RECORD = struct.Struct("=cq")
CREDENTIALS = struct.Struct("=iII")  # struct ucred: pid, uid, gid
TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds
# The child's pid; its exit code; the signal that killed it; the server's refusal (an errno) before any fork.
STARTED, EXITED, KILLED, REFUSED = b"P", b"X", b"S", b"R"
# The handshake: each side sends a fresh nonce; the server answers the client's with its proof, the
# client the server's with its own (HMAC-SHA256 under the key, a label per side so that neither
# proof can be replayed as the other).
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
KEY_BYTES = 32
SERVER_LABEL, CLIENT_LABEL = b"elastic_ddp-warm server", b"elastic_ddp-warm client"
SERVER_GONE_EXIT_CODE = 1


class WarmWorkerUnavailable(Exception):
    """No server of ours answered in time: run cold."""


def variable_value(name: str, key: bytes) -> str:
    """What the agent puts in VARIABLE for its server at the abstract `name` with `key`."""
    return f"@{name}#{key.hex()}"


def parse_variable(value: str) -> tuple[bytes, bytes]:
    """(socket address, key) from VARIABLE's value "@name#KEY"; "@name" is the abstract name "\\0name"."""
    name, _, key = value.partition("#")
    if not name.startswith("@") or len(name) < 2 or len(key) != 2 * KEY_BYTES:
        raise WarmWorkerUnavailable(f"{VARIABLE} is not '@name#KEY' (an abstract socket name and a {KEY_BYTES}-byte "
                                    "hex key)")
    try:
        return b"\0" + name[1:].encode(), bytes.fromhex(key)
    except ValueError:
        raise WarmWorkerUnavailable(f"{VARIABLE}'s key is not hex") from None


def proof(key: bytes, label: bytes, asked: bytes, answered: bytes) -> bytes:
    """The handshake's proof that its sender holds `key`, on the nonce `asked` of the other side."""
    return hmac.new(key, label + asked + answered, hashlib.sha256).digest()


def peer_credentials(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDENTIALS.size)
    pid, uid, _ = CREDENTIALS.unpack(credentials)
    return pid, uid


def become_warm_worker(module: str) -> None:
    """Run `module` (this `python -m module` process's own) in a child of the warm-worker server and
    end as it ends; return at once when there is no server to ask, after one line when it fails."""
    value = os.environ.pop(VARIABLE, "")
    if value in ("", OFF):
        return
    address = value.partition("#")[0]  # the key is never written anywhere
    relay = _SignalRelay()
    try:
        connection = _connect(*parse_variable(value))
        pid = _request(connection, module)
    except (OSError, ValueError, WarmWorkerUnavailable) as exc:
        relay.restore()
        sys.stderr.write(f"elastic_ddp.handoff.warm_client: no warm-worker server answered at {address} ({exc}); "
                         f"starting {module} cold\n")
        sys.stderr.flush()
        return
    relay.start_forwarding(pid)
    _end_as_the_child(connection, pid)


def _connect(address: bytes, key: bytes) -> socket.socket:
    """A connection to the server at `address` that has proved it holds `key`, and to which this
    client has proved it (module docstring); nothing else is sent before the server's proof."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A Unix socket's connect() to a full backlog waits, up to SO_SNDTIMEO; with Python's own
        # timeout (a non-blocking socket) it would fail at once with EAGAIN instead.
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, TIMEVAL.pack(int(PROOF_TIMEOUT_S), 0))
        connection.connect(address)
        pid, uid = peer_credentials(connection)
        if uid != os.getuid():
            raise WarmWorkerUnavailable("the server runs as another user: refused")
        # Our agent's server may still be importing its preload: it is given the time to. Any other
        # listener (a process that took a dead server's name) must prove the key at once.
        ours = parent_pid(pid) == os.getppid()
        connection.settimeout(PROOF_TIMEOUT_S)
        asked = os.urandom(NONCE_BYTES)
        connection.sendall(asked)
        try:
            answer = receive_exactly(connection, NONCE_BYTES + PROOF_BYTES,
                                     within_s=ANSWER_TIMEOUT_S if ours else PROOF_TIMEOUT_S)
        except TimeoutError:
            raise WarmWorkerUnavailable(f"the listener (pid {pid}, not this agent's server) did not prove the "
                                        f"agent's key within {PROOF_TIMEOUT_S:g} s: refused") from None
        if answer is None:
            raise WarmWorkerUnavailable("the server closed the connection")
        connection.settimeout(ANSWER_TIMEOUT_S)
        answered, server_proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(server_proof, proof(key, SERVER_LABEL, asked, answered)):
            raise WarmWorkerUnavailable("the server did not prove the agent's key: refused")
        connection.sendall(proof(key, CLIENT_LABEL, answered, asked))
    except BaseException:
        connection.close()
        raise
    return connection


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid` as this process sees it (/proc/PID/stat), or None: gone, or
    not visible (pid 0: a process of another PID namespace, another container)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()  # the name, in parentheses, may hold spaces
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _request(connection: socket.socket, module: str) -> int:
    """Send the request and our standard fds; the child's pid."""
    fds = [fd for fd in STANDARD_FDS if _is_open(fd)]
    request = json.dumps({"module": module, "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path,
                          "env": dict(os.environ), "fds": fds}).encode()
    if len(request) > MAX_REQUEST_BYTES:
        raise WarmWorkerUnavailable(f"the request is {len(request)} bytes, over {MAX_REQUEST_BYTES}")
    try:
        socket.send_fds(connection, [LENGTH.pack(len(request))], fds)
        connection.sendall(request)
    except OSError:
        kind, value = _read_record(connection)  # a refusal closes the connection while the request goes
        if kind != REFUSED:
            raise
    else:
        kind, value = _read_record(connection)
    if kind is None:
        raise WarmWorkerUnavailable("the server closed the connection")
    if kind == REFUSED:
        raise WarmWorkerUnavailable(f"the server refused: {os.strerror(value)}")
    if kind != STARTED:
        _end_with(kind, value)  # the child ended before it started the module: end the same way
    connection.settimeout(None)
    return value


def _end_as_the_child(connection: socket.socket, pid: int) -> None:
    """Wait for the server's word on how the child ended, and end the same way."""
    while True:
        kind, value = _read_record(connection)
        if kind is None:
            sys.stderr.write(f"elastic_ddp.handoff.warm_client: the warm-worker server ended before the worker (pid {pid}), "
                             "which ended with it\n")
            sys.stderr.flush()
            os._exit(SERVER_GONE_EXIT_CODE)
        if kind in (EXITED, KILLED):
            _end_with(kind, value)


def _end_with(kind: bytes, value: int) -> None:
    if kind == KILLED:
        signal.signal(value, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [value])
        os.kill(os.getpid(), value)
        os._exit(128 + value)  # a signal that does not end a process (SIGCHLD...)
    os._exit(value & 0xFF)


def _read_record(connection: socket.socket) -> tuple[bytes | None, int]:
    data = receive_exactly(connection, RECORD.size)
    return (None, 0) if data is None else RECORD.unpack(data)


def receive_exactly(connection: socket.socket, size: int, within_s: float | None = None) -> bytes | None:
    """`size` bytes, or None when the other side closes first (a reset too: it closed with data unread).
    `within_s`: TimeoutError unless all of them came within that many seconds, however they trickle."""
    data = b""
    deadline = None if within_s is None else time.monotonic() + within_s
    while len(data) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(data)} of {size} bytes in {within_s:g} s")
            connection.settimeout(left)
        try:
            chunk = connection.recv(size - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class _SignalRelay:
    """Forward FORWARDED_SIGNALS to the child's process group; those that come before its pid is
    known wait for it."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        self.previous = {number: signal.signal(number, self._handle) for number in FORWARDED_SIGNALS}

    def _handle(self, number: int, frame: object) -> None:
        if self.pid is None:
            self.pending.append(number)
            return
        try:
            os.killpg(self.pid, number)
        except (ProcessLookupError, PermissionError):
            pass  # it has ended: the server says how

    def start_forwarding(self, pid: int) -> None:
        self.pid = pid
        for number in self.pending:
            self._handle(number, None)

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        for number in self.pending:  # what came meanwhile now reaches this (cold) process
            os.kill(os.getpid(), number)
