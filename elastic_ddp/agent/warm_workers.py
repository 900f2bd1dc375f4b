"""The warm-worker server: torchrun's workers forked from a process that has imported torch once.

Two callers start it in the agent, and one agent runs one server at most: `python -m
elastic_ddp.agent.launcher` once it has imported torchrun, for any `-m MODULE` (its workers run
`python -m elastic_ddp.handoff.warm_start MODULE`), and, for plain torchrun, the rendezvous plugin when
torchrun creates an `elastic-c10d` or `etcd-v3` handler for a job whose training module is one of
`warm_client.WARM_MODULES` (`-m elastic_ddp.train`). `start_warm_worker_server()` binds a listening
socket in Linux's abstract namespace (`@elastic_ddp-warm-<agent pid>-<random>`: no file, gone with
the processes that hold it), draws a 256-bit key, forks the server from the agent (which has
imported torch by then: torchrun imports it before it creates the handler), and puts the address
and the key in the agent's `ELASTIC_DDP_WARM_WORKERS`, which every worker torchrun starts inherits.
The server keeps only its socket, the readiness pipe and stdout/stderr (stdin is /dev/null), names
itself SERVER_PROCESS_NAME (`ps -o comm`; its command line is the agent's), imports the rest of the
preload modules (`ELASTIC_DDP_PRELOAD`, comma-separated; default `PRELOAD`: torch, torch._dynamo,
torch.optim and the trainer) while the agent creates its rendezvous handler, then writes READY_BYTE
to the agent's readiness pipe: a node that joins a running job waits for it (at most READY_WAIT_S)
before it arrives at a round (plugin.ready_handler), so that its round does not stop the running
nodes for its imports; a job's first round and a member's next ones do not wait. Forking, not
starting a new interpreter, saves the server torch's own import (1.0-1.5 s of CPU here, per node
start: docs/benchmarks.md).
A worker that connects before the imports are done (the wait timed out) waits in the socket's
backlog. Each worker's first lines (elastic_ddp/handoff/warm_client.py) connect; the server accepts, closes
a connection of another uid unread, proves it holds the key and has the client prove it (a nonce each
way, HMAC-SHA256; warm_client's docstring), all within `HANDSHAKE_TIMEOUT_S` and without blocking on
any client, and only then forks. It relays each child's exit status to its client when the child
ends (pidfds in one selector: one thread, as a process that forks must be).

The child: a session of its own (`setsid`), ended by the kernel if the server ends
(PR_SET_PDEATHSIG), named as a cold worker would be (the interpreter's name); it reads the request
within `REQUEST_TIMEOUT_S` (argv, cwd, sys.path, the environment, the client's stdin/stdout/stderr),
takes them as its own, sets torch's threads from OMP_NUM_THREADS, writes one line (`... forked warm
...`) to its stderr, and runs the module with runpy as `__main__`. A daemon thread SIGKILLs its
process group when the client's connection closes: torchrun killing the client ends the worker.
The server ends with the agent (PR_SET_PDEATHSIG, and a check of its parent every
`PARENT_CHECK_S`); it runs in a session of its own, so a Ctrl-C meant for the agent's terminal does
not end it first.

Security (docs/operations.md, "Security"): the abstract namespace is open to every process of the
network namespace, other containers of the host with `hostNetwork` among them, often with the same
uid. The uid is not trusted; the key is: it exists in this agent's, its server's and its workers'
environments only, which another container cannot read (a PID namespace of its own). A process
without it gets no fork and no code run, whatever its uid; a worker gives a server that cannot prove
it nothing. A request larger than `MAX_REQUEST_BYTES`, slower than `REQUEST_TIMEOUT_S` or not our
JSON ends that child only. The server outlives its own faults: a failed `pipe`, `fork` or
`pidfd_open` (EAGAIN at `pids.max`, EMFILE, ENOMEM) or more than `MAX_CHILDREN` workers refuse that
one request (the client starts cold and says why); at most `MAX_HANDSHAKES` connections wait for
their proof (a new one pushes out the oldest). Each kind of refusal is logged at most once per
`LOG_INTERVAL_S`; nothing of a request is logged (the environment holds secrets).

Limits: the agent must run one Python thread where it starts the server (torchrun's does: the
handler is created before its agent starts any; otherwise no server, one line), and the preload
modules must not start threads or initialise CUDA when imported (torch does neither): the server
forks. What the agent imported or registered before the fork (torchrun's modules; its atexit
handlers: none beyond torch's own in torch 2.13) is the workers' too. OpenMP reads OMP_NUM_THREADS
when torch is imported, in the agent: each child applies the OMP_NUM_THREADS of its client's
environment with `torch.set_num_threads`.

Turn it off with `--rdzv_conf ...,warm_workers=0` or `ELASTIC_DDP_WARM_WORKERS=0` in the agent's
environment.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hmac
import importlib
import json
import os
import re
import runpy
import secrets
import select
import selectors
import signal
import socket
import sys
import threading
import time
import traceback

from elastic_ddp.handoff.warm_client import (
    CLIENT_LABEL,
    EXITED,
    KEY_BYTES,
    KILLED,
    LENGTH,
    MAX_REQUEST_BYTES,
    NONCE_BYTES,
    PROOF_BYTES,
    RECORD,
    REFUSED,
    SERVER_LABEL,
    SERVER_PROCESS_NAME,
    STANDARD_FDS,
    STARTED,
    VARIABLE,
    peer_credentials,
    proof,
    receive_exactly,
    variable_value,
)

PRELOAD = ("torch", "torch._dynamo", "torch.optim", "elastic_ddp.training.trainer")
PRELOAD_VARIABLE = "ELASTIC_DDP_PRELOAD"
ADDRESS_PREFIX = "elastic_ddp-warm-"
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
REQUEST_TIMEOUT_S = 10  # from the fork to the whole request read (an alarm: SIGALRM ends the child)
PARENT_CHECK_S = 1.0
BACKLOG = 64  # connections waiting while the server imports: every worker of a node at once
READY_BYTE = b"R"  # what the server writes to the agent's readiness pipe once its preloads are imported
# At most this long, an agent waits for its server's imports before it enters the rendezvous
# (launcher.py, plugin.ready_handler); then it goes on, and its first workers wait in the backlog.
READY_WAIT_S = 60.0
HANDSHAKE_TIMEOUT_S = 5.0  # from the accept to the client's proof; a real client sends it at once
MAX_HANDSHAKES = BACKLOG  # connections waiting for their proof; one more pushes out the oldest
MAX_CHILDREN = 256  # running workers; a node runs nproc_per_node of them
LOG_INTERVAL_S = 10.0  # at most one line per kind of refusal in this time
ACCEPT_PAUSE_S = 0.1  # after a failed accept (EMFILE): the connection waits in the backlog, the server does not spin
BAD_REQUEST_EXIT_CODE = 2
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15
_GO = b"g"  # the server watches the child (its pidfd is open): it may start
_LOG = "elastic_ddp.agent.warm_workers: "


class StartedServer:
    """A warm-worker server this agent started: its address, and with `announce_ready`, the read end
    of a pipe that becomes readable when the server has its preload modules (or has ended)."""

    def __init__(self, address: str, ready: int | None = None):
        self.address = address
        self._ready = ready
        self._said_ready = False

    def wait_until_ready(self, timeout_s: float) -> bool:
        """Block until the server has its preload modules, at most `timeout_s`; whether it said so
        (False: the time ran out, the server ended first, or no pipe was asked for). The first call
        waits and closes the pipe; a later one returns the first one's answer at once."""
        if self._ready is None:
            return self._said_ready
        try:
            readable, _, _ = select.select([self._ready], [], [], timeout_s)
            self._said_ready = bool(readable) and os.read(self._ready, 1) == READY_BYTE
        finally:
            os.close(self._ready)
            self._ready = None
        return self._said_ready


# The server this process (an agent) started, if any: the launcher starts it before torchrun creates
# the rendezvous handler that waits on it (plugin.ready_handler).
_started_here: list[StartedServer] = []


def server_started_here() -> StartedServer | None:
    """The warm-worker server this process started, or None."""
    return _started_here[-1] if _started_here else None


def start_warm_worker_server(announce_ready: bool = False) -> StartedServer | None:
    """Fork the server for this agent's workers from this process (which has imported torch: the
    server imports only the rest of its preload) and name it, with its key, in
    `ELASTIC_DDP_WARM_WORKERS`; None when that variable is already set (`0`: turned off; or a server
    runs), off Linux, or when this process runs more than one Python thread (a fork copies only
    the calling thread, with whatever locks the others held: the workers then start cold, said in
    one line; the native pool that torch's import starts, OpenBLAS's, idles and handles a fork
    itself). With `announce_ready`, the server writes READY_BYTE to a pipe once its preloads are
    imported (`StartedServer.wait_until_ready`)."""
    if os.environ.get(VARIABLE) or not sys.platform.startswith("linux"):
        return None
    threads = threading.active_count()
    if threads != 1:
        sys.stderr.write(f"{_LOG}no warm-worker server: this agent runs {threads} Python threads where it would fork "
                         "the server (a process with threads cannot fork safely); its workers start cold\n")
        return None
    name = f"{ADDRESS_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    key = secrets.token_bytes(KEY_BYTES)
    ready_read, ready_write = os.pipe() if announce_ready else (None, None)
    agent_pid = os.getpid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(b"\0" + name.encode())
        listener.listen(BACKLOG)
        sys.stdout.flush(), sys.stderr.flush()  # nothing buffered here is written twice
        if os.fork() == 0:
            _serve_forked(listener, agent_pid, key, ready_write)  # never returns
        # The agent keeps no copy of the socket: when the server is gone, connecting is refused at once.
    if ready_write is not None:
        os.close(ready_write)  # the server holds the only write end: its end is EOF here
    os.environ[VARIABLE] = variable_value(name, key)
    _started_here.append(StartedServer("@" + name, ready_read))
    return _started_here[-1]


def _serve_forked(listener: socket.socket, agent_pid: int, key: bytes, ready: int | None) -> None:
    """The server, in the process just forked from the agent; never returns (`os._exit`)."""
    code = 1
    try:
        os.setsid()  # a Ctrl-C meant for the agent's terminal does not end it first
        end_with_the_parent(agent_pid)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        keep = sorted({0, 1, 2, listener.fileno(), *(() if ready is None else (ready,))})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            if high > low + 1:  # (an empty range is not always a no-op: closerange(0, 0) closes every fd)
                os.closerange(low + 1, high)  # the agent's sockets and files are not the workers' to hold
        name_this_process(SERVER_PROCESS_NAME)  # only now: a process of this name holds none of the agent's files
        started = time.monotonic()
        for module in preload_modules():
            try:
                importlib.import_module(module)
            except ImportError as exc:
                sys.stderr.write(f"{_LOG}could not preload {module} ({exc}); workers will import it themselves\n")
        sys.stderr.write(f"{_LOG}ready in {time.monotonic() - started:.1f} s (agent {agent_pid})\n")
        if ready is not None:  # the agent waits on this pipe (start_warm_worker_server(announce_ready=True))
            os.write(ready, READY_BYTE)
            os.close(ready)
        WarmWorkerServer(listener, agent_pid, key).serve()
        code = 0
    except BaseException:  # noqa: BLE001 - nothing may return into the agent's code in this process
        traceback.print_exc()
    finally:
        os._exit(code)


def name_this_process(name: str) -> None:
    """Set this process's name (/proc/self/comm, what `ps -o comm` and `top` show; 15 bytes kept)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


class _Handshake:
    """A connection of this uid on its way to proving the key (module docstring)."""

    def __init__(self, connection: socket.socket, deadline: float):
        self.connection = connection
        self.deadline = deadline
        self.received = b""
        self.client_nonce: bytes | None = None
        self.server_nonce = os.urandom(NONCE_BYTES)

    def wanted(self) -> int:
        return (NONCE_BYTES if self.client_nonce is None else PROOF_BYTES) - len(self.received)


class _RateLimitedLog:
    """At most one line of each kind per `interval_s` on stderr; the next one counts those held back."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.interval_s = interval_s
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def write(self, kind: str, line: str) -> None:
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        sys.stderr.write(f"{_LOG}{line}{f' ({held} more held back)' if held else ''}\n")
        sys.stderr.flush()
        self._next[kind] = now + self.interval_s


class WarmWorkerServer:
    """Accept, authenticate, fork, relay exit statuses (module docstring); `serve` returns when the
    agent is gone."""

    def __init__(self, listener: socket.socket, agent_pid: int, key: bytes):
        self.listener = listener
        self.agent_pid = agent_pid
        self.key = key
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.handshakes: dict[int, _Handshake] = {}  # connection fd -> its handshake, oldest first
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (child pid, its connection)
        self.log = _RateLimitedLog()
        self.accept_again_at: float | None = None  # the listener is out of the selector until then

    def serve(self) -> None:
        while os.getppid() == self.agent_pid:
            for key, _ in self.selector.select(self._select_timeout()):
                if key.data is None:
                    self._accept()
                elif isinstance(key.data, _Handshake):
                    self._advance(key.data)
                else:
                    self._relay(key.fd)
            self._expire_handshakes()
            if self.accept_again_at is not None and time.monotonic() >= self.accept_again_at:
                self.selector.register(self.listener, selectors.EVENT_READ, None)
                self.accept_again_at = None

    def _select_timeout(self) -> float:
        deadlines = [handshake.deadline for handshake in self.handshakes.values()]
        if self.accept_again_at is not None:
            deadlines.append(self.accept_again_at)
        return max(0.0, min([PARENT_CHECK_S, *(deadline - time.monotonic() for deadline in deadlines)]))

    def _accept(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except OSError as exc:  # EMFILE, ENOBUFS: the connection waits in the backlog
            self.log.write("accept", f"could not accept a connection: {exc}")
            self.selector.unregister(self.listener)
            self.accept_again_at = time.monotonic() + ACCEPT_PAUSE_S
            return
        try:
            uid = peer_credentials(connection)[1]
        except OSError:
            uid = -1
        if uid != os.getuid():
            self.log.write("uid", f"refused a connection from uid {uid}")
            connection.close()
            return
        if len(self.handshakes) >= MAX_HANDSHAKES:
            self._drop(next(iter(self.handshakes.values())), "handshakes", "too many connections without a proof")
        connection.setblocking(False)
        handshake = _Handshake(connection, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        self.handshakes[connection.fileno()] = handshake
        self.selector.register(connection, selectors.EVENT_READ, handshake)

    def _advance(self, handshake: _Handshake) -> None:
        """Read what came of the client's nonce or proof; answer the nonce, judge the proof."""
        try:
            chunk = handshake.connection.recv(handshake.wanted())
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(handshake, "handshakes", "a connection closed before its proof")
            return
        handshake.received += chunk
        if handshake.wanted():
            return
        if handshake.client_nonce is None:
            handshake.client_nonce, handshake.received = handshake.received, b""
            answer = proof(self.key, SERVER_LABEL, handshake.client_nonce, handshake.server_nonce)
            try:  # 64 bytes into a new connection's empty buffer: never blocks
                handshake.connection.sendall(handshake.server_nonce + answer)
            except OSError:
                self._drop(handshake, "handshakes", "a connection closed before its proof")
            return
        expected = proof(self.key, CLIENT_LABEL, handshake.server_nonce, handshake.client_nonce)
        if not hmac.compare_digest(handshake.received, expected):
            self._drop(handshake, "proof", "refused a connection that did not prove the agent's key")
            return
        self._forget(handshake)
        handshake.connection.setblocking(True)
        self._start_child(handshake.connection)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for handshake in [h for h in self.handshakes.values() if h.deadline <= now]:
            self._drop(handshake, "handshakes", f"no proof within {HANDSHAKE_TIMEOUT_S:g} s")

    def _forget(self, handshake: _Handshake) -> None:
        self.selector.unregister(handshake.connection)
        del self.handshakes[handshake.connection.fileno()]

    def _drop(self, handshake: _Handshake, kind: str, why: str) -> None:
        self._forget(handshake)
        handshake.connection.close()
        self.log.write(kind, f"dropped a connection: {why}")

    def _start_child(self, connection: socket.socket) -> None:
        """Fork the worker for an authenticated connection; a fault refuses this request only. The
        child waits for the server's word that its pidfd is open, so that a child the server could
        not watch never runs."""
        if len(self.children) >= MAX_CHILDREN:
            self._refuse(connection, errno.EAGAIN, f"{MAX_CHILDREN} workers run already")
            return
        try:
            go_read, go_write = os.pipe()
        except OSError as exc:
            self._refuse(connection, exc.errno, f"pipe failed: {exc}")
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(go_read)
            os.close(go_write)
            self._refuse(connection, exc.errno, f"fork failed: {exc}")
            return
        if pid == 0:
            os.close(go_write)
            self._close_all_but(connection)
            if os.read(go_read, 1) != _GO:
                os._exit(BAD_REQUEST_EXIT_CODE)  # the server refused this client: it said so
            os.close(go_read)
            run_child(connection, server_pid=os.getppid())
        os.close(go_read)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            os.close(go_write)  # the child reads the end of the pipe and exits
            os.waitpid(pid, 0)
            self._refuse(connection, exc.errno, f"pidfd_open failed: {exc}")
            return
        os.write(go_write, _GO)
        os.close(go_write)
        self.children[pidfd] = (pid, connection)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)

    def _refuse(self, connection: socket.socket, code: int | None, why: str) -> None:
        try:
            connection.sendall(RECORD.pack(REFUSED, code or errno.EAGAIN))
        except OSError:
            pass  # the client is gone: nobody waits for the answer
        connection.close()
        self.log.write("refused", f"refused a worker ({why}); it starts cold")

    def _relay(self, pidfd: int) -> None:
        pid, connection = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            record = RECORD.pack(KILLED, os.WTERMSIG(status))
        else:
            record = RECORD.pack(EXITED, os.waitstatus_to_exitcode(status))
        try:
            connection.sendall(record)
        except OSError:
            pass  # the client is gone (killed): nobody waits for the status
        connection.close()

    def _close_all_but(self, connection: socket.socket) -> None:
        """In a child: close the server's listener, selector and every other connection and pidfd."""
        self.listener.close()
        self.selector.close()
        for handshake in self.handshakes.values():
            handshake.connection.close()
        for pidfd, (_, other) in self.children.items():
            os.close(pidfd)
            other.close()
        self.handshakes, self.children = {}, {}


def run_child(connection: socket.socket, server_pid: int) -> None:
    """A forked child: become the client's worker and run its module; never returns."""
    os.setsid()
    end_with_the_parent(server_pid)
    name_this_process(os.path.basename(sys.executable))  # the name a worker started cold shows
    try:
        module = _take_request(connection)
    except (OSError, ValueError, RecursionError) as exc:
        sys.stderr.write(f"{_LOG}dropped a request: {type(exc).__name__}\n")
        sys.stderr.flush()
        os._exit(BAD_REQUEST_EXIT_CODE)
    try:
        connection.sendall(RECORD.pack(STARTED, os.getpid()))
    except OSError:
        os._exit(BAD_REQUEST_EXIT_CODE)  # the client is gone already
    threading.Thread(target=_end_when_the_client_is_gone, args=(connection,), name="end-with-the-client",
                     daemon=True).start()
    set_torch_threads_from_environment()
    client_pid = peer_credentials(connection)[0]
    sys.stderr.write(f"{_LOG}rank {os.environ.get('RANK', '?')} (pid {os.getpid()}) forked warm by the server "
                     f"{server_pid} for torchrun's worker process {client_pid}\n")
    os._exit(_run_as_main(module))


def _take_request(connection: socket.socket) -> str:
    """Read the request within REQUEST_TIMEOUT_S, check it, and take its fds, environment, cwd,
    sys.path and argv as this process's own; the module to run."""
    signal.alarm(REQUEST_TIMEOUT_S)
    header, fds, _, _ = socket.recv_fds(connection, LENGTH.size, len(STANDARD_FDS))
    try:
        header += _request_bytes(connection, LENGTH.size - len(header))
        (length,) = LENGTH.unpack(header)
        if length > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
        request = json.loads(_request_bytes(connection, length))
        signal.alarm(0)
        module, argv, path, env, cwd, targets = _checked(request, len(fds))
        for received, target in zip(fds, targets):
            os.dup2(received, target)
        for target in set(STANDARD_FDS) - set(targets):
            os.close(target)
    finally:
        for received in fds:
            if received not in STANDARD_FDS:
                os.close(received)
    os.environ.clear()
    os.environ.update({key: value for key, value in env.items() if key != VARIABLE})
    os.chdir(cwd)
    sys.path[:] = path
    sys.argv = list(argv)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.reconfigure(line_buffering=unbuffered or stream.isatty(), write_through=unbuffered)
    return module


def _checked(request: object, fd_count: int) -> tuple:
    """The fields of a request, or ValueError when it is not one of ours."""
    request = request if isinstance(request, dict) else {}
    module, argv, path = request.get("module"), request.get("argv"), request.get("path")
    env, cwd, targets = request.get("env"), request.get("cwd"), request.get("fds")
    if (not isinstance(module, str) or not MODULE_NAME.fullmatch(module) or not _strings(argv)
            or not _strings(path) or not isinstance(cwd, str) or not isinstance(env, dict)
            or not _strings([*env, *env.values()]) or not isinstance(targets, list) or len(targets) != fd_count
            or not all(type(target) is int and target in STANDARD_FDS for target in targets)):
        raise ValueError("not a request")
    return module, argv, path, env, cwd, targets


def _request_bytes(connection: socket.socket, size: int) -> bytes:
    data = receive_exactly(connection, size)
    if data is None:
        raise ValueError("incomplete request")
    return data


def _strings(values: object) -> bool:
    return isinstance(values, list) and all(isinstance(value, str) for value in values)


def _end_when_the_client_is_gone(connection: socket.socket) -> None:
    """The client (torchrun's worker process) closed the connection: it is gone, so is this worker."""
    try:
        while connection.recv(4096):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def _run_as_main(module: str) -> int:
    """Run `module` as `python -m module` would and end as that interpreter would; the exit code."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            sys.stderr.write(f"{exc.code}\n")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    # The interpreter's exit, less its teardown of modules: wait for the threads that are not
    # daemons, run the atexit handlers, flush (the caller then calls os._exit). Private calls, kept
    # on purpose: ending through the interpreter's own exit instead (SystemExit out of the server's
    # frames) tore down torch's modules too: 0.93 s per worker against 0.06 s this way, at every
    # group restart (docs/benchmarks-history.md); tests/unit/test_warm_workers.py checks the order.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


def end_with_the_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent `parent_pid` ends (PR_SET_PDEATHSIG), and
    exit at once if it has already ended (the parent changed). The parent is the thread that started
    this process: start it from a thread that lives as long as the parent does (the main thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.stderr.write(f"{_LOG}prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this process may "
                         "outlive its parent\n")
    elif os.getppid() != parent_pid:
        os._exit(1)


def set_torch_threads_from_environment() -> None:
    """Apply the OMP_NUM_THREADS of this worker's environment to torch, which was imported before the
    fork with the server's environment (OpenMP reads it at that import). Nothing to do when torch was
    not preloaded: its own import reads this environment."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def preload_modules() -> list[str]:
    """The modules the server imports before it forks: `ELASTIC_DDP_PRELOAD` (comma-separated) or PRELOAD."""
    preload = os.environ.get(PRELOAD_VARIABLE)
    return [m for m in preload.split(",") if m] if preload is not None else list(PRELOAD)
