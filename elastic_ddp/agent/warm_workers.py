"""The warm-worker server: plain torchrun's workers forked from a process that has imported torch once.

When torchrun creates an `elastic-c10d` or `etcd-v3` rendezvous handler for a job whose training
module is one of `warm_client.WARM_MODULES` (`-m elastic_ddp.train`), the plugin calls
`start_warm_worker_server()` in the agent: it binds a listening socket in Linux's abstract namespace
(`@elastic_ddp-warm-<agent pid>-<random>`: no file, gone with the processes that hold it), starts
`python -m elastic_ddp.agent.warm_workers FD` (no shell) with that socket, and puts the address in
the agent's `ELASTIC_DDP_WARM_WORKERS`, which every worker torchrun starts inherits. The server
imports the launcher's preload modules (`ELASTIC_DDP_PRELOAD`, default torch, torch._dynamo,
torch.optim and the trainer) while the agent is in its first rendezvous; a worker that connects
before that is done waits in the socket's backlog. Each worker's first lines (elastic_ddp/warm_client.py)
send their request; the server accepts, checks the caller's uid, forks at once, and relays each
child's exit status to its client when the child ends (pidfds in one selector: one thread, as a
process that forks must be).

The child: a session of its own (`setsid`), ended by the kernel if the server ends
(PR_SET_PDEATHSIG); it reads the request within `REQUEST_TIMEOUT_S` (argv, cwd, sys.path, the
environment, the client's stdin/stdout/stderr), takes them as its own, sets torch's threads from
OMP_NUM_THREADS, writes one line (`... forked warm ...`) to its stderr, and runs the module with
runpy as `__main__`. A daemon thread SIGKILLs its process group when the client's connection
closes: torchrun killing the client ends the worker. The server ends with the agent
(PR_SET_PDEATHSIG, and a check of its parent every `PARENT_CHECK_S`); it runs in a session of its
own, so a Ctrl-C meant for the agent's terminal does not end it first.

Security: the abstract namespace is open to every local user of the network namespace. A connection
from another uid (SO_PEERCRED) is closed unread; a request larger than `MAX_REQUEST_BYTES`, slower
than `REQUEST_TIMEOUT_S` or not our JSON ends that child only. The server runs whatever module a
client of its own uid names (that user could run it anyway); it is started only for the modules that
ask for it. Nothing of a request is logged (the environment may hold secrets).

Turn it off with `--rdzv_conf ...,warm_workers=0` or `ELASTIC_DDP_WARM_WORKERS=0` in the agent's
environment; `python -m elastic_ddp.agent.launcher` turns it off itself (its own fork server).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import runpy
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from elastic_ddp.agent.launcher import end_with_the_parent, preload_modules, set_torch_threads_from_environment
from elastic_ddp.warm_client import (
    EXITED,
    KILLED,
    LENGTH,
    MAX_REQUEST_BYTES,
    RECORD,
    SERVER_MODULE,
    STANDARD_FDS,
    STARTED,
    VARIABLE,
    peer_credentials,
)

ADDRESS_PREFIX = "elastic_ddp-warm-"
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
REQUEST_TIMEOUT_S = 10  # from the fork to the whole request read (an alarm: SIGALRM ends the child)
PARENT_CHECK_S = 1.0
BACKLOG = 64  # connections waiting while the server imports: every worker of a node at once
BAD_REQUEST_EXIT_CODE = 2
_LOG = "elastic_ddp.agent.warm_workers: "


def start_warm_worker_server() -> str | None:
    """Start the server for this agent's workers and name it in `ELASTIC_DDP_WARM_WORKERS`; its
    address, or None when that variable is already set (`0`: turned off; or a server runs)."""
    if os.environ.get(VARIABLE) or not sys.platform.startswith("linux"):
        return None
    name = f"{ADDRESS_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(b"\0" + name.encode())
        listener.listen(BACKLOG)
        # The agent keeps no copy of the socket: when the server is gone, connecting is refused at once.
        subprocess.Popen([sys.executable, "-m", SERVER_MODULE, str(listener.fileno()), str(os.getpid())],
                         pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
    os.environ[VARIABLE] = "@" + name
    return os.environ[VARIABLE]


class WarmWorkerServer:
    """Accept, fork, relay exit statuses (module docstring); `serve` returns when the agent is gone."""

    def __init__(self, listener: socket.socket, agent_pid: int):
        self.listener = listener
        self.agent_pid = agent_pid
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (child pid, its connection)

    def serve(self) -> None:
        while os.getppid() == self.agent_pid:
            for key, _ in self.selector.select(PARENT_CHECK_S):
                if key.data is None:
                    self._accept()
                else:
                    self._relay(key.fd)

    def _accept(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except OSError:
            return
        try:
            uid = peer_credentials(connection)[1]
        except OSError:
            uid = -1
        if uid != os.getuid():
            sys.stderr.write(f"{_LOG}refused a connection from uid {uid}\n")
            connection.close()
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            self._close_all_but(connection)
            run_child(connection, server_pid=os.getppid())
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, connection)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)

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
        """In a child: close the server's listener, selector and the other children's descriptors."""
        self.listener.close()
        self.selector.close()
        for pidfd, (_, other) in self.children.items():
            os.close(pidfd)
            other.close()
        self.children = {}


def run_child(connection: socket.socket, server_pid: int) -> None:
    """A forked child: become the client's worker and run its module; never returns."""
    os.setsid()
    end_with_the_parent(server_pid)
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
        header += _receive_exactly(connection, LENGTH.size - len(header))
        (length,) = LENGTH.unpack(header)
        if length > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
        request = json.loads(_receive_exactly(connection, length))
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
            or not set(targets) <= set(STANDARD_FDS)):
        raise ValueError("not a request")
    return module, argv, path, env, cwd, targets


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(min(size - len(data), 1 << 16))
        if not chunk:
            raise ValueError("incomplete request")
        data += chunk
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
    # frames) tore down torch's modules too and took 0.93 s per worker from the module's end to the
    # client's exit, against 0.06 s this way (medians of 5, twice each, interleaved, 2026-11-26), a
    # cost paid at every group restart; tests/unit/test_warm_workers.py checks the order.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


def main(argv: list[str]) -> None:
    agent_pid = int(argv[1])  # not getppid(): the agent may have ended already (a bad flag)
    end_with_the_parent(agent_pid)
    listener = socket.socket(fileno=int(argv[0]))
    started = time.monotonic()
    for module in preload_modules():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            sys.stderr.write(f"{_LOG}could not preload {module} ({exc}); workers will import it themselves\n")
    sys.stderr.write(f"{_LOG}ready in {time.monotonic() - started:.1f} s (agent {agent_pid})\n")
    WarmWorkerServer(listener, agent_pid).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
