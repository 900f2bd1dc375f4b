"""`python -m elastic_ddp.runlog.metrics_server`: one node's /metrics endpoint, alive across worker groups.

Started detached by the first worker of a node (runlog/metrics_node.py), not by hand:

    python -m elastic_ddp.runlog.metrics_server --directory DIR --addr 127.0.0.1 --port 0 \\
        --watch_pid AGENT_PID --watch_start_ticks TICKS

It serves `GET /metrics`: what the node's workers wrote to DIR through prometheus_client's
multi-process mode (runlog/metrics.py), summed over every process that wrote there, ended ones
included, so that counters go on across worker groups and a scrape while the group re-forms gets
the last values; and the watched agent's rendezvous rounds (runlog/metrics_agent.py). Nothing else:
another path is a 404, another method a 501; at most MAX_CONNECTIONS at once, each dropped
CONNECTION_TIMEOUT_S after its accept however it trickles its bytes (a deadline for the whole
connection, not for each read); no request is logged. It reads nothing
but DIR and has nothing secret to show: its environment is PATH, PYTHONPATH and the locale. It
imports neither torch nor the trainer, and listens a fraction of a second after its start.

Once listening it writes DIR/endpoint.json and prints one line, `{"port": N}`, to the worker that
started it (`{"error": "..."}` when it cannot listen), then runs until the watched process (the
node's torchrun agent) ends, and removes its endpoint file, the files of ended processes and the
agent's rendezvous file.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
MAX_CONNECTIONS = 8  # more at once are closed unanswered: a scraper needs one
CONNECTION_TIMEOUT_S = 10.0  # a connection not done this long after its accept (request and answer) is dropped
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

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(self.server.connection_timeout_s, self._drop)
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


class MetricsHTTPServer(ThreadingHTTPServer):
    """Serves `registry` at `address` (IPv4 or IPv6), MAX_CONNECTIONS requests at a time, each
    connection dropped `connection_timeout_s` after its accept."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry,
                 connection_timeout_s: float = CONNECTION_TIMEOUT_S):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.registry = registry
        self.connection_timeout_s = connection_timeout_s
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, MetricsHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the address's name up (socket.getfqdn), which can stall on a
        # machine without DNS; the name is only used in CGI variables.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        """A client that went away, or was dropped at its deadline, is not worth a traceback in the log."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


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
