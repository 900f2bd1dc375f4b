"""A node's live metrics: the directory the workers write them to, and the one process that serves them.

With `--metrics_port`, the first worker of each node (local rank 0) calls `serve_node_metrics`
before any process group: it makes sure that the node runs one metrics server
(`python -m elastic_ddp.runlog.metrics_server`), started detached by the first worker group and
reused by every later one, which serves `GET /metrics` from this node's metrics directory,
`MEMORY_DIR/elastic_ddp-metrics-<scope>` (private to the user; the scope is the user, torchrun's
run id and `--checkpoint_dir`, as for the memory copies). Rank 0 writes the run's metrics there
through prometheus_client's multi-process mode (runlog/metrics.py). The server ends when the
node's torchrun agent does.

Why a process of its own, started by a worker: the endpoint must answer while the worker group is
torn down and re-formed, so no worker can serve it; the torchrun agent outlives worker groups, but
it never sees the training flags (they go to the workers), runs our code only with our rendezvous
backends (not with torch's `c10d`) and imports nothing of the worker side (the agent-apart
contract); the warm launcher is optional. A worker sees the flags, runs under every launcher and
backend, and can leave behind a small process that watches the agent.

Not guaranteed: the server outlives its agent by up to `WATCH_INTERVAL_S`; a server killed on its
own (not with its node) comes back only at the node's next worker-group start. Several nodes of one
run on one machine share one server (the first one's address and port); the others say so in one
warning (`served_elsewhere`) instead of serving their own `--metrics_port`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import select
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_ddp.runtime.procfs import process_is_alive, read_stat

if TYPE_CHECKING:
    from elastic_ddp.config import TrainingConfig
    from elastic_ddp.runtime.distributed import DistributedContext

logger = logging.getLogger(__name__)

DIRECTORY_PREFIX = "elastic_ddp-metrics-"
ENDPOINT_FILE = "endpoint.json"  # the running server: address, port, its pid and the pid it watches
LOCK_FILE = "lock"  # serialises starting a server and a server's clean-up
SERVER_LOG = "server.log"  # the server's own stderr: its start, a bind error, its end
SERVER_MODULE = "elastic_ddp.runlog.metrics_server"
START_TIMEOUT_S = 30.0  # a Python start and an import of prometheus_client, on a loaded machine
WATCH_INTERVAL_S = 0.5  # how often the server looks at its agent
# The server's environment: no more than it needs to start (it never sees the job's tokens or passwords).
SERVER_ENVIRONMENT = ("PATH", "LANG", "LC_ALL", "TMPDIR")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds elastic_ddp/


class MetricsEndpointError(Exception):
    """The endpoint cannot be served as asked (a port in use, an address of another machine): one line
    that names the flag and the fix."""


@dataclass(frozen=True)
class Endpoint:
    """A running metrics server: where it listens, who it is, and the process whose life it shares."""

    addr: str
    port: int
    pid: int
    start_ticks: int  # the pid's start time (/proc), so that a reused pid is not taken for the server
    watched_pid: int
    watched_start_ticks: int

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"


def metrics_directory(memory_dir: str | os.PathLike, run_id: str, checkpoint_dir: str) -> Path:
    """This node's metrics directory of the run (see the module docstring)."""
    location = checkpoint_dir if "://" in checkpoint_dir else os.path.abspath(checkpoint_dir)
    scope = hashlib.sha256(f"{os.getuid()}\0{run_id}\0{location}".encode()).hexdigest()[:20]
    return Path(memory_dir).absolute() / f"{DIRECTORY_PREFIX}{scope}"


def make_private_directory(directory: Path) -> None:
    """Create `directory` as 0700; MetricsEndpointError when it is not this user's alone (others
    could forge the metrics or read them)."""
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise MetricsEndpointError(f"--memory_dir: {directory} is not a private directory of this user (owner uid "
                                   f"{info.st_uid}, mode {stat.filemode(info.st_mode)}); choose another --memory_dir")


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot), None when it does not run."""
    process = read_stat(pid)
    return process.start_ticks if process is not None and process.state != "Z" else None


def is_running(pid: int, ticks: int) -> bool:
    """Whether the process that started at `ticks` as `pid` still runs (not another one with its pid)."""
    return start_ticks(pid) == ticks


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Exclusive among the processes that start or end a server in `directory`."""
    handle = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def read_endpoint(directory: Path) -> Endpoint | None:
    """The server `directory` names (it may have ended since), or None."""
    try:
        return Endpoint(**json.loads((directory / ENDPOINT_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_endpoint(directory: Path, endpoint: Endpoint) -> None:
    temporary = directory / f"{ENDPOINT_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(asdict(endpoint)))
    os.replace(temporary, directory / ENDPOINT_FILE)


def remove_files_of_ended_processes(directory: Path, pattern: str = "*.db") -> None:
    """Delete the metric files (prometheus_client names them `<kind>_<pid>.db`) of processes that ended."""
    for path in directory.glob(pattern):
        pid = path.stem.rsplit("_", 1)[-1]
        if pid.isdigit() and not process_is_alive(int(pid)):
            path.unlink(missing_ok=True)


def forget_stale_gauges(directory: Path) -> None:
    """This node no longer holds rank 0: drop the gauges that an earlier rank 0 here left (the run's
    step, world size, ... now come from another node), keep the counters (they count on if rank 0
    comes back)."""
    remove_files_of_ended_processes(directory, "gauge_*.db")


def serve_node_metrics(config: TrainingConfig, context: DistributedContext) -> Endpoint | None:
    """On the first worker of a node with --metrics_port: the node's server, started or found
    running, and logged; None elsewhere. MetricsEndpointError when it cannot listen as asked."""
    if config.metrics_port is None or context.local_rank != 0:
        return None
    # The agent's pid: read by the worker runtime (the server, which imports this module, never calls this).
    from elastic_ddp.runtime.distributed import agent_pid

    directory = metrics_directory(config.memory_dir, context.run_id, config.checkpoint_dir)
    make_private_directory(directory)
    if context.rank != 0:
        forget_stale_gauges(directory)
    # Under torchrun the server lives as long as the node's agent; alone, as long as this process.
    watched = agent_pid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    endpoint, started = ensure_server(directory, config.metrics_addr, config.metrics_port, watched)
    logger.info("metrics: %s (%s, pid %d)", endpoint.url,
                "server started" if started else "served since an earlier worker group", endpoint.pid)
    shared = served_elsewhere(endpoint, watched, config.metrics_addr, config.metrics_port)
    if shared:
        logger.warning("%s", shared)
    return endpoint


def served_elsewhere(endpoint: Endpoint, watched_pid: int, addr: str, port: int) -> str | None:
    """The line that says where this node's metrics are served when it is not where its flags ask:
    several nodes of one run on one machine (one user, one --checkpoint_dir) share one metrics
    directory, so the first node's server serves them all, on its own address and port."""
    if endpoint.watched_pid == watched_pid or (endpoint.addr == addr and port in (0, endpoint.port)):
        return None
    return (f"metrics: --metrics_addr {addr} --metrics_port {port} is not served: this run's nodes on this machine "
            f"share one metrics directory, whose server (pid {endpoint.pid}, for the node of agent pid "
            f"{endpoint.watched_pid}) serves them all at {endpoint.url}; scrape that URL")


def ensure_server(directory: Path, addr: str, port: int, watched_pid: int,
                  timeout_s: float = START_TIMEOUT_S) -> tuple[Endpoint, bool]:
    """The server of `directory`: the running one, or one started now (then True)."""
    watched_ticks = start_ticks(watched_pid)
    if watched_ticks is None:
        raise MetricsEndpointError(f"--metrics_port: the process to serve for (pid {watched_pid}) does not run")
    with locked(directory):
        running = read_endpoint(directory)
        if running is not None and is_running(running.pid, running.start_ticks):
            if is_running(running.watched_pid, running.watched_start_ticks):
                return running, False
            # A server of an agent that has ended (this node restarted in place): it ends within a watch.
            _wait_until_ended(running, 4 * WATCH_INTERVAL_S)
        return _start_server(directory, addr, port, watched_pid, watched_ticks, timeout_s), True


def _wait_until_ended(endpoint: Endpoint, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while is_running(endpoint.pid, endpoint.start_ticks) and time.monotonic() < deadline:
        time.sleep(0.05)


# The servers this process started: it never waits for them (they outlive it by design), and
# keeping them here spares a warning about a Popen collected while its process runs.
_STARTED: list[subprocess.Popen] = []


def _start_server(directory: Path, addr: str, port: int, watched_pid: int, watched_ticks: int,
                  timeout_s: float) -> Endpoint:
    command = [sys.executable, "-m", SERVER_MODULE, "--directory", str(directory), "--addr", addr,
               "--port", str(port), "--watch_pid", str(watched_pid), "--watch_start_ticks", str(watched_ticks)]
    environment = {name: os.environ[name] for name in SERVER_ENVIRONMENT if name in os.environ}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH"))))
    with open(directory / SERVER_LOG, "ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                   env=environment, cwd=directory, start_new_session=True)
    _STARTED.append(process)
    with process.stdout:
        reply = _read_reply(process, timeout_s)
    if "error" in reply:
        where = f"{addr}:{port}" if port else addr
        raise MetricsEndpointError(f"--metrics_port/--metrics_addr: cannot listen on {where}: {reply['error']}; "
                                   "expected a free port (0: any free one) and an address of this machine")
    endpoint = read_endpoint(directory)
    if "port" not in reply or endpoint is None or endpoint.pid != process.pid:
        process.kill()
        raise MetricsEndpointError(f"--metrics_port: the metrics server did not start ({_log_tail(directory)}); "
                                   f"its log: {directory / SERVER_LOG}")
    return endpoint


def _read_reply(process: subprocess.Popen, timeout_s: float) -> dict:
    """The server's one line: {"port": N} once it listens, {"error": "..."} when it cannot; {} when
    it exits or says nothing within `timeout_s`."""
    readable, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not readable:
        return {}
    try:
        reply = json.loads(process.stdout.readline() or "{}")
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}


def _log_tail(directory: Path) -> str:
    try:
        lines = (directory / SERVER_LOG).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "no log"
