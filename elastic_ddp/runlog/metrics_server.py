"""`python -m elastic_ddp.runlog.metrics_server`: one node's /metrics endpoint, alive across worker groups.

Started detached by the first worker of a node (runlog/metrics_node.py), not by hand:

    python -m elastic_ddp.runlog.metrics_server --directory DIR --addr 127.0.0.1 --port 0 \\
        --watch_pid AGENT_PID --watch_start_ticks TICKS

It serves `GET /metrics`: what the node's workers wrote to DIR through prometheus_client's
multi-process mode (runlog/metrics.py), summed over every process that wrote there, ended ones
included, so that counters go on across worker groups and a scrape while the group re-forms gets
the last values; and the watched agent's rendezvous rounds (runlog/metrics_agent.py). Nothing else:
another path is a 404, another method a 501; no request is logged.

A hostile network is assumed. Each connection is dropped CONNECTION_TIMEOUT_S after its accept
however it trickles its bytes (a deadline for the whole connection, not for each read). A request
is read by one reception thread, without a thread or an answering slot of its own, until its head
is complete: at most MAX_PENDING connections wait there (one more pushes out the oldest, so a
new scrape always gets its turn), each head at most MAX_REQUEST_BYTES. Only a complete request
takes one of the MAX_ANSWERING answering slots (an answer takes milliseconds). So clients that
hold connections open, or reconnect as soon as they are dropped, cost a scrape nothing until they
open MAX_PENDING connections within the time the scrape takes to send its head. It reads nothing
but DIR and has nothing secret to show: its environment is PATH, PYTHONPATH and the locale. It
imports neither torch nor the trainer, and listens a fraction of a second after its start.

Once listening it writes DIR/endpoint.json and prints one line, `{"port": N}`, to the worker that
started it (`{"error": "..."}` when it cannot listen), then runs until the watched process (the
node's torchrun agent) ends, and removes its endpoint file, the files of ended processes and the
agent's rendezvous file.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import io
import json
import os
import selectors
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from elastic_ddp.runlog.metrics_agent import AgentRendezvousCollector, remove_agent_file
from elastic_ddp.runlog.metrics_node import (
    ENDPOINT_FILE,
    WATCH_INTERVAL_S,
    Endpoint,
    is_running,
    locked,
    read_endpoint,
    remove_files_of_ended_processes,
    start_ticks,
    write_endpoint,
)

METRICS_PATH = "/metrics"
MAX_PENDING = 64  # connections whose request is still coming; one more pushes out the oldest
MAX_ANSWERING = 8  # complete requests answered at once; more are closed unanswered (a scraper needs one)
MAX_REQUEST_BYTES = 8192  # a request head longer than this is dropped (a scrape's is about 200 bytes)
CONNECTION_TIMEOUT_S = 10.0  # a connection not done this long after its accept (request and answer) is dropped
RECEIVE_BYTES = 4096
COLLECT_ATTEMPTS = 3


class NodeCollector:
    """The metrics in a multi-process directory. A file removed between listing and reading (the
    stale gauges of a node that no longer holds rank 0, metrics_node.forget_stale_gauges) makes
    prometheus_client's collector raise: list again."""

    def __init__(self, directory: Path):
        self.directory = directory

    def collect(self):
        for _ in range(COLLECT_ATTEMPTS):
            try:
                return MultiProcessCollector.merge(glob.glob(os.path.join(self.directory, "*.db")), accumulate=True)
            except FileNotFoundError:
                continue
        return []


class MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics and nothing else (BaseHTTPRequestHandler answers 501 to other methods)."""

    server: MetricsHTTPServer
    timeout = CONNECTION_TIMEOUT_S
    server_version = "elastic_ddp-metrics"
    sys_version = ""

    def __init__(self, request: socket.socket, client_address: object, server: MetricsHTTPServer, head: bytes,
                 deadline: float):
        self.head, self.deadline = head, deadline  # the request as the reception read it; when to drop it
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BytesIO(self.head)  # complete: the handler reads no byte of the client's
        self._deadline = threading.Timer(max(0.0, self.deadline - time.monotonic()), self._drop)
        self._deadline.daemon = True
        self._deadline.start()

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def _drop(self) -> None:
        """The connection outlived its deadline: end it; the handler's blocked read or write returns."""
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def do_GET(self) -> None:
        if urlsplit(self.path).path != METRICS_PATH:
            self.send_error(404, f"only {METRICS_PATH} is served")
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        """No request is logged."""


class MetricsHTTPServer(HTTPServer):
    """Serves `registry` at `address` (IPv4 or IPv6): connections admitted to the reception, which
    reads their requests, and complete ones answered in threads of their own, MAX_ANSWERING at a
    time, each connection dropped `connection_timeout_s` after its accept (module docstring)."""

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry,
                 connection_timeout_s: float = CONNECTION_TIMEOUT_S):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.registry = registry
        self.connection_timeout_s = connection_timeout_s
        self._answering = threading.BoundedSemaphore(MAX_ANSWERING)
        self._reception = _Reception(self._answer)  # first: a failed bind calls server_close, which closes it
        super().__init__(address, MetricsHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the address's name up (socket.getfqdn), which can stall on a
        # machine without DNS; the name is only used in CGI variables.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: socket.socket, client_address: object) -> None:
        self._reception.admit(request, client_address, time.monotonic() + self.connection_timeout_s)

    def _answer(self, pending: _Pending) -> None:
        """(The reception's thread.) A complete request: answered in a thread, when a slot is free."""
        if not self._answering.acquire(blocking=False):
            _close(pending.connection)
            return
        threading.Thread(target=self._answer_in_thread, args=(pending,), name="metrics-answer", daemon=True).start()

    def _answer_in_thread(self, pending: _Pending) -> None:
        try:
            pending.connection.setblocking(True)
            MetricsHandler(pending.connection, pending.address, self, pending.head, pending.deadline)
        except OSError:
            pass  # a client that went away, or was dropped at its deadline, is not worth a traceback
        finally:
            _close(pending.connection)
            self._answering.release()

    def server_close(self) -> None:
        self._reception.close()
        super().server_close()


@dataclass
class _Pending:
    """A connection whose request is still coming."""

    connection: socket.socket
    address: object
    deadline: float  # time.monotonic() when it is dropped, whatever it has sent
    head: bytes = b""


class _Reception:
    """One thread that reads the requests of every admitted connection (non-blocking) and hands each
    complete one to `answer`; it drops a connection that closes, sends more than MAX_REQUEST_BYTES,
    or outlives its deadline, and the oldest when MAX_PENDING are waiting."""

    def __init__(self, answer: Callable[[_Pending], None]):
        self._answer = answer
        self._selector = selectors.DefaultSelector()
        self._waking, self._wake = socket.socketpair()
        self._waking.setblocking(False)
        self._selector.register(self._waking, selectors.EVENT_READ, None)
        self._admitted: collections.deque[_Pending] = collections.deque()  # from the accepting thread
        self._pending: dict[int, _Pending] = {}  # connection fd -> its request so far, oldest first
        self._closing = False
        self._thread = threading.Thread(target=self._receive, name="metrics-reception", daemon=True)
        self._thread.start()

    def admit(self, connection: socket.socket, address: object, deadline: float) -> None:
        self._admitted.append(_Pending(connection, address, deadline))
        self._wake_up()

    def close(self) -> None:
        self._closing = True
        self._wake_up()
        self._thread.join(timeout=5)

    def _wake_up(self) -> None:
        try:
            self._wake.send(b"w")
        except BlockingIOError:
            pass  # already awake

    def _receive(self) -> None:
        try:
            while not self._closing:
                timeout = min((p.deadline for p in self._pending.values()), default=None)
                events = self._selector.select(None if timeout is None else max(0.0, timeout - time.monotonic()))
                for key, _ in events:
                    if key.data is None:
                        self._take_admitted()
                    else:
                        self._read(key.data)
                self._drop_expired()
        finally:
            for pending in [*self._pending.values(), *self._admitted]:
                _close(pending.connection)
            self._selector.close()
            self._waking.close()
            self._wake.close()

    def _take_admitted(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._waking.recv(RECEIVE_BYTES)
        while self._admitted:
            pending = self._admitted.popleft()
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending.values())))
            pending.connection.setblocking(False)
            self._pending[pending.connection.fileno()] = pending
            self._selector.register(pending.connection, selectors.EVENT_READ, pending)

    def _read(self, pending: _Pending) -> None:
        try:
            chunk = pending.connection.recv(RECEIVE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        pending.head += chunk
        if not chunk or len(pending.head) > MAX_REQUEST_BYTES:
            self._drop(pending)
        elif b"\r\n\r\n" in pending.head or b"\n\n" in pending.head:  # a GET's head is the whole request
            self._forget(pending)
            self._answer(pending)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self._drop(pending)

    def _forget(self, pending: _Pending) -> None:
        self._selector.unregister(pending.connection)
        del self._pending[pending.connection.fileno()]

    def _drop(self, pending: _Pending) -> None:
        self._forget(pending)
        _close(pending.connection)


def _close(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
    connection.close()


def node_registry(directory: Path, agent_pid: int | None = None) -> CollectorRegistry:
    """What the node serves: the metrics in `directory`, and the rendezvous rounds of the agent `agent_pid`."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(directory))
    if agent_pid is not None:
        registry.register(AgentRendezvousCollector(agent_pid))
    return registry


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name if __spec__ else 'metrics_server'}",
                                     description="A node's /metrics endpoint (started by the first worker).")
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--watch_pid", type=int, required=True)
    parser.add_argument("--watch_start_ticks", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        server = MetricsHTTPServer((args.addr, args.port), node_registry(args.directory, args.watch_pid))
    except OSError as exc:
        _reply({"error": exc.strerror or str(exc)})
        return 1
    own_ticks = start_ticks(os.getpid())
    assert own_ticks is not None, "a running process has a start time"
    endpoint = Endpoint(addr=args.addr, port=server.server_address[1], pid=os.getpid(), start_ticks=own_ticks,
                        watched_pid=args.watch_pid, watched_start_ticks=args.watch_start_ticks)
    write_endpoint(args.directory, endpoint)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} serving {endpoint.url} (pid {endpoint.pid}) while pid "
          f"{args.watch_pid} runs", file=sys.stderr, flush=True)
    _reply({"port": endpoint.port})
    try:
        while is_running(args.watch_pid, args.watch_start_ticks):
            time.sleep(WATCH_INTERVAL_S)
    finally:
        server.shutdown()
        server.server_close()
        _clean_up(args.directory, endpoint)
        remove_agent_file(args.watch_pid)
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {args.watch_pid} ended: stopped", file=sys.stderr, flush=True)
    return 0


def _reply(message: dict) -> None:
    """The one line for the worker that started this server; stdout is closed after it."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _clean_up(directory: Path, endpoint: Endpoint) -> None:
    """The node's agent ended: remove this server's endpoint file (unless a newer server's is there)
    and the metric files of ended processes."""
    with locked(directory):
        current = read_endpoint(directory)
        if current is not None and current.pid == endpoint.pid:
            (directory / ENDPOINT_FILE).unlink(missing_ok=True)
        remove_files_of_ended_processes(directory)


if __name__ == "__main__":
    sys.exit(main())
