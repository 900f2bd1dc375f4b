"""Run torchrun agents on this machine as if each were a separate node, and fail them for real.

Used by the quick start, the tests, the benchmarks and the chaos harness. Each `LocalNode` is
one `torchrun` agent process with its workers; all nodes meet through the same rendezvous on
127.0.0.1.

Killing a node is harder than it looks: torchrun starts every worker in a new session, so
`os.killpg(agent_pid, SIGKILL)` leaves the workers training on. `LocalNode.kill` therefore walks
/proc for every descendant of the agent (`elastic_ddp.runtime.procfs`) and signals each of their process
groups (Linux only).

A node can also stand for a container (`LocalJob.add_node(local_addr=..., pid_namespace=True)`): its
agent is PID 1 of a PID namespace of its own, with an address of its own, so that a node started
again comes back with the same torch node identity (address, pid, counter), as a container
restarted in place does; killing that PID 1 ends every process in the namespace.

A node can also stand for a separate host on a network (`add_node(command_prefix=...)` with the
prefix of `elastic_ddp.testbed.netns.NetworkBed.prefix`): its agent runs in a network namespace of
its own, with its own address, where the network can fail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from elastic_ddp.agent.rendezvous.defaults import AGENT_ENV, MONITOR_INTERVAL_S, RDZV_CONF
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.runtime.procfs import children_by_parent, process_tree
from elastic_ddp.testbed.rdzv_switch import switched_backend

# The backends whose store lives in the first node's agent (torch's, and ours built on it).
C10D_BACKENDS = ("c10d", "elastic-c10d")
# The agent program: torchrun with workers forked by a warm-worker server and dead-node probes
# (elastic_ddp/agent/launcher.py); STOCK_LAUNCHER is plain torchrun.
LAUNCHER = "elastic_ddp.agent.launcher"
STOCK_LAUNCHER = "torch.distributed.run"
# What runs a node's command as PID 1 of a PID namespace of its own (util-linux, root only); the
# namespace ends with that PID 1, and with this process.
PID_NAMESPACE = ("unshare", "--pid", "--fork", "--kill-child")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; there is a small race by nature)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def torchrun_command(
    *,
    nnodes: str, nproc_per_node: int,
    rdzv_endpoint: str, rdzv_id: str,
    rdzv_backend: str = "c10d",
    max_restarts: int = 10,
    rdzv_conf: str | None = RDZV_CONF,
    monitor_interval: float | None = MONITOR_INTERVAL_S,
    module: str = "elastic_ddp.train",
    training_args: Sequence[str] = (),
    launcher: str = LAUNCHER,
) -> list[str]:
    """The argv of one torchrun agent, with the shipped rendezvous defaults unless overridden.

    Pass `rdzv_conf=None`, `monitor_interval=None` and `launcher=STOCK_LAUNCHER` to get stock
    torchrun behaviour. A `module` that ends in `.py` is a script's path (torchrun runs it as a
    file, as a user's `torchrun ... train.py` does); any other, a module (`-m`).
    """
    rdzv_backend = switched_backend(rdzv_backend)  # the tests' switch, unset: as given
    command = [
        sys.executable, "-m", launcher,
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc_per_node}",
        f"--rdzv_backend={rdzv_backend}",
        f"--rdzv_endpoint={rdzv_endpoint}",
        f"--rdzv_id={rdzv_id}",
        f"--max_restarts={max_restarts}",
    ]
    if rdzv_conf:
        command.append(f"--rdzv_conf={rdzv_conf}")
    if monitor_interval is not None:
        command.append(f"--monitor_interval={monitor_interval}")
    command += [module] if module.endswith(".py") else ["-m", module]
    return [*command, *training_args]


def signal_tree(root_pid: int, sig: int) -> list[int]:
    """Send `sig` to `root_pid`, all its descendants and all their process groups.

    Returns the pids that were signalled. Processes that vanish meanwhile are ignored.
    """
    pids = process_tree(root_pid)
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


class JobEnded(Exception):
    """Every node of a job exited, so what a caller waits for (a step, an event, a fault's trigger)
    can no longer happen. Tests let it fail the test; the chaos harness stops playing its plan."""


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1,
             still_possible: Callable[[], str | None] | None = None) -> None:
    """Poll `condition` until it is true; raise TimeoutError naming `what` after `timeout` seconds.

    `still_possible()` returns None while the condition can still come true, else the reason why
    not, which ends the wait at once with JobEnded (a job that finished cannot reach a step).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        impossible = still_possible() if still_possible is not None else None
        if impossible is not None and not condition():
            raise JobEnded(f"{impossible} before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def port_is_listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class LocalNode:
    """One torchrun agent standing in for one machine.

    The agent runs in its own session so that signals meant for the test or the harness do not
    reach it, and so that `kill` can take down exactly this node. Output goes to `log_path`.
    With `pid_namespace` it runs as PID 1 of a PID namespace of its own (`PID_NAMESPACE`), as
    torchrun does in a container; `command_prefix` comes first (e.g. `ip netns exec NAME`: a
    prefix that execs the command, so that the process started is the agent).
    """

    def __init__(self, name: str, command: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None, agent_env: dict[str, str] = AGENT_ENV, pid_namespace: bool = False,
                 command_prefix: Sequence[str] = ()):
        self.name = name
        self.command = list(command)
        self.log_path = Path(log_path)
        self.env = {**os.environ, **agent_env, **(env or {})}
        self.cwd = cwd
        self.pid_namespace = pid_namespace
        self.command_prefix = list(command_prefix)
        self.process: subprocess.Popen | None = None

    def start(self) -> LocalNode:
        """Start the agent; again after it exited, the same command (a machine or container restarted)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [*self.command_prefix, *(PID_NAMESPACE if self.pid_namespace else ()), *self.command]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, "node not started"
        return self.process.pid

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def worker_pids(self) -> list[int]:
        """The live descendants of the agent (its workers and their helpers)."""
        return process_tree(self.pid)[1:] if self.is_running() else []

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the agent and every process under it: a lost machine when `sig` is SIGKILL. In a
        PID namespace of its own, SIGKILL goes to the namespace's PID 1 alone and the kernel ends
        every other process in it, as when a container's main process dies."""
        namespace_init = self._namespace_init() if self.pid_namespace and sig == signal.SIGKILL else None
        if namespace_init is not None:
            os.kill(namespace_init, sig)
        else:
            signal_tree(self.pid, sig)
        if sig == signal.SIGKILL:
            self.process.wait(timeout=30)

    def _namespace_init(self) -> int | None:
        """The host pid of the PID namespace's PID 1 (the one child of `unshare`), None if gone."""
        children = children_by_parent().get(self.pid, []) if self.is_running() else []
        return children[0] if children else None

    def freeze(self) -> None:
        """SIGSTOP the whole node: its sockets stay open, like a machine that lost its network."""
        signal_tree(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        signal_tree(self.pid, signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM to the agent alone, as a scheduler or a spot-instance notice would send it."""
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Wait for the agent to exit; return its exit code (TimeoutExpired after `timeout`)."""
        return self.process.wait(timeout=timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Best-effort clean-up: SIGKILL whatever is left of this node."""
        if self.process is not None and self.process.poll() is None:
            self.kill(signal.SIGKILL)


class LocalJob:
    """An elastic job of `LocalNode`s on 127.0.0.1 sharing one rendezvous and one run directory.

    `run_dir` receives the nodes' logs, the snapshots (`ck/`), the event log (`ck/events.jsonl`)
    and the audit log (`audit/`). With c10d, the first node added hosts the rendezvous store:
    `add_node` waits until it listens, so that it is known which node the job cannot lose.

    With `per_node_checkpoint_dirs`, each node gets its own `--checkpoint_dir` (`<name>-ck/`), as
    separate machines with local disks would (same flag, different disks); the event log, which
    is the harness's view of the run and not recovery state, then goes to `run_dir/events.jsonl`.

    Every node gets its own `--memory_dir` (`<name>-memory/`): separate machines have separate
    memory, and a lost node's memory copies must not be found by the others on this one machine.
    """

    def __init__(self, run_dir: Path, training_args: Sequence[str], *, nnodes: str = "1:4",
                 nproc_per_node: int = 1, rdzv_backend: str = "c10d", rdzv_endpoint: str | None = None,
                 run_id: str = "local-job", max_restarts: int = 20, rdzv_conf: str | None = RDZV_CONF,
                 monitor_interval: float | None = MONITOR_INTERVAL_S, env: dict[str, str] | None = None,
                 agent_env: dict[str, str] = AGENT_ENV, module: str = "elastic_ddp.train",
                 per_node_checkpoint_dirs: bool = False, launcher: str = LAUNCHER):
        self.run_dir = Path(run_dir)
        self.per_node_checkpoint_dirs = per_node_checkpoint_dirs
        self.checkpoint_dir = self.run_dir / "ck"  # unused by the nodes with per_node_checkpoint_dirs
        self.audit_dir = self.run_dir / "audit"
        self.event_log = (self.run_dir if per_node_checkpoint_dirs else self.checkpoint_dir) / EVENT_LOG_NAME
        self.rdzv_backend = rdzv_backend
        self.run_id = run_id
        self.rdzv_endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
        self.env = env
        self.agent_env = agent_env
        self.command = torchrun_command(
            nnodes=nnodes, nproc_per_node=nproc_per_node, rdzv_endpoint=self.rdzv_endpoint, rdzv_id=run_id,
            rdzv_backend=rdzv_backend, max_restarts=max_restarts, rdzv_conf=rdzv_conf,
            monitor_interval=monitor_interval, module=module, launcher=launcher,
            training_args=[*training_args, "--checkpoint_dir", str(self.checkpoint_dir),
                           "--audit_log", str(self.audit_dir),
                           *(["--event_log", str(self.event_log)] if per_node_checkpoint_dirs else [])],
        )
        self.nodes: list[LocalNode] = []

    def add_node(self, name: str | None = None, start_timeout: float = 60, hosts_store: bool = True,
                 local_addr: str | None = None, pid_namespace: bool = False, command_prefix: Sequence[str] = (),
                 agent_args: Sequence[str] = ()) -> LocalNode:
        """Start one more agent. With c10d the first one hosts the store and this waits until it
        listens, unless `hosts_store` is False (the store runs elsewhere, see elastic_ddp.chaos.store).

        `local_addr` is the node's address as torch names it (torchrun's `--local_addr`), e.g. a
        127.0.0.x of its own; with `pid_namespace` the agent is PID 1 of a PID namespace of its own
        (root only). With both, the node is a container: started again, it has the same identity.
        `command_prefix` runs the agent in something (a network namespace: `NetworkBed.prefix`);
        `agent_args` are torchrun options of this node alone (a later `--rdzv_conf` wins)."""
        name = name or f"node{len(self.nodes)}"
        command = self.command
        own_options = [*([f"--local_addr={local_addr}"] if local_addr is not None else []), *agent_args]
        if own_options:
            # torchrun's own options (each `--key=value`) end where the training module or script begins
            target_at = next(at for at in range(3, len(command)) if not command[at].startswith("--"))
            command = [*command[:target_at], *own_options, *command[target_at:]]
        if self.per_node_checkpoint_dirs:  # the last --checkpoint_dir on the command line wins
            command = [*command, "--checkpoint_dir", str(self.node_checkpoint_dir(name))]
        command = [*command, "--memory_dir", str(self.node_memory_dir(name))]
        node = LocalNode(name, command, self.run_dir / f"{name}.log", env=self.env,
                         cwd=self.run_dir, agent_env=self.agent_env, pid_namespace=pid_namespace,
                         command_prefix=command_prefix).start()
        self.nodes.append(node)
        if self.rdzv_backend in C10D_BACKENDS and len(self.nodes) == 1 and hosts_store:
            host, port = self.rdzv_endpoint.rsplit(":", 1)
            wait_for(lambda: port_is_listening(host, int(port)) or not node.is_running(), start_timeout,
                     f"the c10d store of {name} on {self.rdzv_endpoint}")
        return node

    def node_checkpoint_dir(self, name: str) -> Path:
        """The `--checkpoint_dir` of node `name`."""
        return self.run_dir / f"{name}-ck" if self.per_node_checkpoint_dirs else self.checkpoint_dir

    def node_memory_dir(self, name: str) -> Path:
        """The `--memory_dir` of node `name` (its "node-local memory")."""
        return self.run_dir / f"{name}-memory"

    def events(self, kind: str | None = None) -> list[dict]:
        events = read_events(self.event_log)
        return [e for e in events if kind is None or e["event"] == kind]

    def last_step(self) -> int:
        steps = self.events("step")
        return steps[-1]["global_step"] if steps else 0

    def wait_for_step(self, step: int, timeout: float) -> None:
        wait_for(lambda: self.last_step() >= step, timeout, f"global step {step} in {self.event_log}", 0.05,
                 still_possible=self.why_ended)

    def wait_for_event(self, predicate: Callable[[dict], bool], timeout: float, what: str) -> dict:
        """The newest event that satisfies `predicate`, once there is one. Fails at once (JobEnded)
        when every node has exited without it, rather than waiting out `timeout`."""
        found: list[dict] = []

        def seen() -> bool:
            found[:] = [e for e in self.events() if predicate(e)]
            return bool(found)

        wait_for(seen, timeout, what, still_possible=self.why_ended)
        return found[-1]

    def why_ended(self) -> str | None:
        """Why nothing more can happen in this job (None while a node still runs)."""
        if not self.nodes or any(node.is_running() for node in self.nodes):
            return None
        codes = ", ".join(f"{node.name} exited {node.process.returncode}" for node in self.nodes)
        return f"the job ended ({codes}; last step {self.last_step()}; logs in {self.run_dir})"

    def wait(self, timeout: float) -> dict[str, int]:
        """Wait for every node's agent to exit; return {node name: exit code}."""
        deadline = time.monotonic() + timeout
        return {node.name: node.wait(max(0.1, deadline - time.monotonic())) for node in self.nodes}

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
