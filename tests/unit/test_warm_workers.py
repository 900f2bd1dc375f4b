"""Warm workers (elastic_ddp/handoff/warm_client.py, elastic_ddp/agent/warm_workers.py) with real processes.

A stand-in agent (a Python process that starts the server as the rendezvous plugin does) and clients
run as torchrun runs a worker: `python -m tests.unit.test_warm_workers ACTION ...`, this very file,
whose first lines hand the run to the server as `elastic_ddp.train`'s do. The server preloads what
this file imports, not torch (ELASTIC_DDP_PRELOAD): what is tested is the hand-off.

    .venv/bin/python -m pytest -q tests/unit/test_warm_workers.py
"""

from __future__ import annotations

if __name__ == "__main__":
    from elastic_ddp.handoff.warm_client import become_warm_worker

    become_warm_worker("tests.unit.test_warm_workers")

import atexit
import json
import os
import pwd
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic_ddp.agent.rendezvous.plugin import start_warm_workers, take_warm_workers
from elastic_ddp.agent.warm_workers import MAX_HANDSHAKES
from elastic_ddp.handoff.warm_client import (
    CLIENT_LABEL,
    LENGTH,
    NONCE_BYTES,
    PROOF_BYTES,
    RECORD,
    SERVER_LABEL,
    SERVER_PROCESS_NAME,
    VARIABLE,
    parse_variable,
    proof,
)
from elastic_ddp.runtime.procfs import command_line, process_is_alive, process_name, read_stat

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
THIS_MODULE = "tests.unit.test_warm_workers"
DRAIN_EXIT_CODE = 69  # what the target exits with on SIGTERM, as a drained worker does
# The stand-in agent: starts the server, says its address, and lives until its stdin closes.
AGENT = ("import os, sys\nfrom elastic_ddp.agent.warm_workers import start_warm_worker_server\n"
         "held = open('pyproject.toml')\n"  # a file of the agent's own, which its server must not hold
         f"start_warm_worker_server()\nprint(os.environ['{VARIABLE}'], flush=True)\nsys.stdin.read()\n")
BOUND_S = 15.0


def target(action: str, *args: str) -> None:
    """What a client asks the server to run (as this module's `__main__`)."""
    print(f"pid {os.getpid()} parent {os.getppid()} variable {os.environ.get(VARIABLE, 'unset')} "
          f"name {process_name('self')}", flush=True)
    if action == "exit":
        print("to stdout", flush=True)
        sys.stderr.write("to stderr\n")
        sys.exit(int(args[0]))
    if action == "signal":
        os.kill(os.getpid(), int(args[0]))
    if action == "end":  # returns with a thread still working, an atexit handler and unflushed output
        atexit.register(lambda: sys.stderr.write("atexit ran\n"))
        threading.Thread(target=lambda: (time.sleep(0.3), sys.stderr.write("thread done\n"))).start()
        sys.stdout.write("unflushed\n")  # (a pipe: block-buffered)
    if action == "wait":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(DRAIN_EXIT_CODE))
        print("ready", flush=True)
        while True:
            time.sleep(1)


def wait_until(condition, what: str, timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.02)


class Agent:
    """A stand-in torchrun agent with its warm-worker server; `variable`: what its workers inherit
    (the server's address and key)."""

    def __init__(self):
        env = {**os.environ, "ELASTIC_DDP_PRELOAD": "pytest,elastic_ddp.runtime.procfs"}
        env.pop(VARIABLE, None)
        self.process = subprocess.Popen([sys.executable, "-c", AGENT], cwd=REPO, env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.variable = self.process.stdout.readline().strip()
        assert self.variable.startswith("@elastic_ddp-warm-"), self.variable
        self.address = parse_variable(self.variable)[0]

    def server_pid(self) -> int:
        """The server's pid, once the process forked for it has named itself."""
        def named() -> list[int]:
            children = [int(p) for p in os.listdir("/proc") if p.isdigit()
                        and (stat := read_stat(p)) is not None and stat.parent == self.process.pid]
            return [p for p in children if process_name(p) == SERVER_PROCESS_NAME]
        wait_until(lambda: named(), "the agent's child naming itself the server")
        [server] = named()
        return server

    def client(self, *args: str) -> subprocess.Popen:
        return start_client(self.variable, *args)

    def stop(self) -> str:
        """End the agent (its server ends with it); the server's and agent's stderr."""
        if self.process.poll() is None:
            self.process.stdin.close()
        self.process.wait(timeout=BOUND_S)
        return self.process.stderr.read()


def start_client(variable: str, *args: str) -> subprocess.Popen:
    """What torchrun does for a worker: `python -m MODULE ARGS` with the agent's environment."""
    env = {**os.environ, VARIABLE: variable}
    return subprocess.Popen([sys.executable, "-m", THIS_MODULE, *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def agent():
    """One agent for the tests that leave its server as they found it."""
    started = Agent()
    yield started
    started.process.kill()
    started.stop()


@pytest.fixture
def own_agent():
    """An agent of the test's own, for the tests that kill or inspect its server."""
    started = Agent()
    yield started
    started.process.kill()
    started.stop()


def open_files(pid: int) -> dict[int, str]:
    """fd -> what it points at; a file the process closed while it was listed is left out (the server
    opens and closes module files as it preloads)."""
    files = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            files[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass
    return files


def test_the_server_forked_from_the_agent_holds_none_of_the_agents_files(own_agent):
    """The agent's files and sockets are not the server's (nor its workers') to hold: the server
    keeps its socket and stdout/stderr, and reads nothing from the agent's stdin."""
    held = str(REPO / "pyproject.toml")
    assert held in open_files(own_agent.process.pid).values()
    server_files = open_files(own_agent.server_pid())
    assert held not in server_files.values(), server_files
    assert server_files[0] == os.devnull, server_files
    assert sum(target.startswith("socket:") for target in server_files.values()) == 1, server_files


def connect_as(uid: int, address: bytes) -> bytes:
    """What a process of user `uid` reads after connecting to `address` (a forked child of this test:
    the venv's interpreter may not be readable by that user)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(BOUND_S)
                probe.connect(address)
                os.write(write_end, b"answer:" + probe.recv(64))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    assert answer.startswith(b"answer:"), "the probe as another user did not connect"
    return answer.removeprefix(b"answer:")


def first_line(client: subprocess.Popen) -> dict[str, str]:
    words = client.stdout.readline().split()
    return dict(zip(words[::2], words[1::2]))


def test_the_exit_code_and_the_output_reach_torchruns_process(agent):
    clients = {code: agent.client("exit", str(code)) for code in (0, 1, DRAIN_EXIT_CODE)}
    for code, client in clients.items():
        out, err = client.communicate(timeout=BOUND_S)
        assert client.returncode == code
        first, rest = out.split("\n", 1)
        child = dict(zip(first.split()[::2], first.split()[1::2]))
        assert int(child["pid"]) != client.pid and child["variable"] == "unset"  # forked, and never loops
        assert rest == "to stdout\n"
        assert "forked warm by the server" in err and f"torchrun's worker process {client.pid}" in err
        assert err.endswith("to stderr\n")


def test_a_worker_ends_as_its_interpreter_would(agent):
    """The module returned with a thread that is no daemon still working: the worker waits for it,
    then runs the atexit handlers and flushes what was written, in that order, as `python -m` does."""
    client = agent.client("end")
    out, err = client.communicate(timeout=BOUND_S)
    assert client.returncode == 0, err
    assert out.splitlines()[1:] == ["unflushed"], out
    assert err.endswith("thread done\natexit ran\n"), err


def test_the_workers_agent_is_found_through_the_server(agent):
    """What runtime.distributed.agent_pid relies on: the parent is named SERVER_PROCESS_NAME (its
    command line is the agent's: it was forked from it), its parent is the agent; the worker itself
    is named as a cold worker would be."""
    client = agent.client("exit", "0")
    child = first_line(client)
    client.communicate(timeout=BOUND_S)
    assert int(child["parent"]) == agent.server_pid()
    assert read_stat(agent.server_pid()).parent == agent.process.pid
    assert command_line(agent.server_pid()) == command_line(agent.process.pid)
    assert child["name"] == os.path.basename(sys.executable)[:15]


def test_a_worker_killed_by_a_signal_ends_its_client_with_the_same_signal(agent):
    client = agent.client("signal", str(int(signal.SIGABRT)))
    client.communicate(timeout=BOUND_S)
    assert client.returncode == -signal.SIGABRT


def test_sigterm_to_the_client_reaches_the_worker(agent):
    client = agent.client("wait")
    first_line(client)
    assert client.stdout.readline() == "ready\n"
    client.send_signal(signal.SIGTERM)
    client.communicate(timeout=BOUND_S)
    assert client.returncode == DRAIN_EXIT_CODE


def test_a_sigkilled_client_takes_its_worker_with_it(agent):
    client = agent.client("wait")
    child = int(first_line(client)["pid"])
    client.kill()
    client.communicate(timeout=BOUND_S)
    wait_until(lambda: not process_is_alive(child), f"worker {child} ends after its client's SIGKILL")


def test_the_workers_end_with_the_server_and_later_ones_start_cold(own_agent):
    client = own_agent.client("wait")
    child = int(first_line(client)["pid"])
    os.kill(own_agent.server_pid(), signal.SIGKILL)
    out, err = client.communicate(timeout=BOUND_S)
    assert client.returncode == 1 and "ended before the worker" in err
    wait_until(lambda: not process_is_alive(child), f"worker {child} ends with its server")
    cold = own_agent.client("exit", "0")
    out, err = cold.communicate(timeout=BOUND_S)
    assert cold.returncode == 0 and f"pid {cold.pid} " in out  # ran in torchrun's own process
    assert err.count("starting tests.unit.test_warm_workers cold") == 1


def test_without_a_server_the_worker_starts_cold():
    client = start_client("@elastic_ddp-warm-nobody-listens#" + "00" * 32, "exit", "0")
    out, err = client.communicate(timeout=BOUND_S)
    assert client.returncode == 0 and f"pid {client.pid} " in out and "variable unset" in out
    assert "no warm-worker server answered" in err


# A module of the user's, for elastic_ddp.handoff.warm_start: it reports what it was given, and exits with its last argument.
TOOL = """
import json, os, sys
with open(os.environ["TOOL_REPORT"], "w") as report:
    json.dump({"argv": sys.argv, "name": __name__, "pid": os.getpid(), "torch": "torch" in sys.modules,
               "main": sys.modules["__main__"].__dict__ is globals()}, report)
sys.exit(int(sys.argv[-1]))
"""
TOOL_ARGS = ["--epochs", "1", "-m", "x", "--", "3"]


def run_tool(tmp_path: Path, variable: str | None, *launch: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`python LAUNCH my_tool TOOL_ARGS` in `tmp_path`, where the tool lives, as torchrun starts a worker."""
    (tmp_path / "my_tool.py").write_text(TOOL)
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    env = {**os.environ, "TOOL_REPORT": str(report), "PYTHONPATH": str(REPO)}
    env.pop(VARIABLE, None)
    if variable is not None:
        env[VARIABLE] = variable
    done = subprocess.run([sys.executable, *launch, "my_tool", *TOOL_ARGS], check=False, cwd=tmp_path, env=env,
                          text=True, capture_output=True, timeout=BOUND_S)
    return done, json.loads(report.read_text())


def test_warm_start_runs_any_module_forked_warm_as_python_m_would(agent, tmp_path):
    """`python -m elastic_ddp.handoff.warm_start my_tool ARGS` (the launcher's workers): forked by the server, the
    module sees the argv, `__name__` and `__main__` that `python -m my_tool ARGS` gives it."""
    cold, expected = run_tool(tmp_path, None, "-m")
    warm, given = run_tool(tmp_path, agent.variable, "-m", "elastic_ddp.handoff.warm_start")
    assert cold.returncode == warm.returncode == 3, warm.stderr
    assert expected["argv"] == [str(tmp_path / "my_tool.py"), *TOOL_ARGS] and expected["name"] == "__main__"
    assert {key: given[key] for key in ("argv", "name", "main")} == {key: expected[key] for key in ("argv", "name", "main")}
    assert given["pid"] != expected["pid"] and "forked warm by the server" in warm.stderr, warm.stderr


@pytest.mark.parametrize("variable", [None, "0", "@elastic_ddp-warm-nobody-listens#" + "00" * 32])
def test_warm_start_without_a_server_runs_the_module_cold_in_its_own_process(tmp_path, variable):
    done, given = run_tool(tmp_path, variable, "-m", "elastic_ddp.handoff.warm_start")
    assert done.returncode == 3, done.stderr
    assert given["argv"] == [str(tmp_path / "my_tool.py"), *TOOL_ARGS] and given["name"] == "__main__" and given["main"]
    assert not given["torch"]  # the client imports no torch, whichever way it runs
    said = "no warm-worker server answered" in done.stderr and "starting my_tool cold" in done.stderr
    assert said is (variable not in (None, "0")), done.stderr


def test_warm_start_needs_a_module():
    done = subprocess.run([sys.executable, "-m", "elastic_ddp.handoff.warm_start"], check=False, cwd=REPO, text=True,
                          capture_output=True, timeout=BOUND_S)
    assert done.returncode == 1 and done.stderr == "usage: python -m elastic_ddp.handoff.warm_start MODULE [ARGS...]\n"


def test_the_agent_ending_ends_the_server(own_agent):
    server = own_agent.server_pid()
    own_agent.process.kill()
    own_agent.process.wait(timeout=BOUND_S)
    wait_until(lambda: not process_is_alive(server), "the server ends with its agent")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user (nobody)")
def test_another_user_is_refused(own_agent):
    nobody = pwd.getpwnam("nobody").pw_uid
    assert connect_as(nobody, own_agent.address) == b""  # closed unread, nothing forked
    client = own_agent.client("exit", "0")  # the server still serves
    client.communicate(timeout=BOUND_S)
    assert client.returncode == 0
    assert f"refused a connection from uid {nobody}" in own_agent.stop()


def handshake(variable: str) -> socket.socket:
    """A connection to the server at `variable` that has passed the handshake as a worker does."""
    address, key = parse_variable(variable)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(BOUND_S)
    connection.connect(address)
    asked = os.urandom(NONCE_BYTES)
    connection.sendall(asked)
    answer = receive_all(connection, NONCE_BYTES + PROOF_BYTES)
    assert answer[NONCE_BYTES:] == proof(key, SERVER_LABEL, asked, answer[:NONCE_BYTES]), "the server's proof"
    connection.sendall(proof(key, CLIENT_LABEL, answer[:NONCE_BYTES], asked))
    return connection


def receive_all(connection: socket.socket, size: int) -> bytes:
    """Up to `size` bytes, until the other side closes (or resets: it closed with data unread)."""
    data = b""
    try:
        while len(data) < size and (chunk := connection.recv(size - len(data))):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def old_protocol_request(module: str, argv: list[str]) -> bytes:
    """A request as a client sent it before the handshake existed: the length, then the JSON."""
    request = json.dumps({"module": module, "argv": argv, "cwd": "/", "path": sys.path, "env": {}, "fds": []})
    return LENGTH.pack(len(request)) + request.encode()


def test_garbage_closes_its_own_connection_only(own_agent):
    """Before the handshake: nothing is forked. After it, a bad request ends its own child (exit 2),
    an fd target that is not an int (1.0) included."""
    for garbage in (b"", b"\xff\xff\xff\xff", LENGTH.pack(5) + b"nope!", b"x" * (2 * NONCE_BYTES + 10)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sender:
            sender.settimeout(BOUND_S)
            sender.connect(own_agent.address)
            sender.sendall(garbage)
            sender.shutdown(socket.SHUT_WR)
            answer = receive_all(sender, 1024)
        assert len(answer) in (0, NONCE_BYTES + PROOF_BYTES), garbage  # the server's proof at most, no record
    bad_requests = [LENGTH.pack(5) + b"nope!", LENGTH.pack(2) + b"[]",
                    old_protocol_request(THIS_MODULE, ["x"]).replace(b'"fds": []', b'"fds": [1.0]')]
    bad_requests[2] = LENGTH.pack(len(bad_requests[2]) - LENGTH.size) + bad_requests[2][LENGTH.size:]
    for request in bad_requests:
        with handshake(own_agent.variable) as sender:
            if b"1.0" in request:
                socket.send_fds(sender, [request[:LENGTH.size]], [1])
                sender.sendall(request[LENGTH.size:])
            else:
                sender.sendall(request)
            sender.shutdown(socket.SHUT_WR)
            assert RECORD.unpack(receive_all(sender, RECORD.size)) == (b"X", 2), request
    client = own_agent.client("exit", "0")
    client.communicate(timeout=BOUND_S)
    assert client.returncode == 0
    log = own_agent.stop()
    assert log.count("dropped a request") == 3 and "dropped a connection" in log


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mount and PID namespaces (unshare)")
def test_a_process_of_another_container_with_the_same_uid_runs_nothing(own_agent, tmp_path):
    """Another container on the same network namespace (hostNetwork): a mount and PID namespace of
    its own, the same uid. It sees the server's name in /proc/net/unix but not the agent's
    processes, and asks, as the old protocol allowed, for `python -m timeit` with code in argv."""
    marker = tmp_path / "ran"
    attack = (f"import os, socket, sys, struct\n"
              f"names = [line.split()[-1] for line in open('/proc/net/unix') if '@elastic_ddp-warm-' in line]\n"
              f"print('sees', sys.argv[2] in names, 'agent', os.path.exists('/proc/{own_agent.process.pid}'), flush=True)\n"
              f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout({BOUND_S})\n"
              f"s.connect(b'\\0' + sys.argv[2][1:].encode())\n"
              f"s.sendall(bytes.fromhex(sys.argv[1])); s.shutdown(socket.SHUT_WR)\n"
              f"data = b''\n"
              f"try:\n"
              f"    while chunk := s.recv(4096): data += chunk\n"
              f"except ConnectionResetError: pass\n"
              f"print('read', len(data), flush=True)\n")
    request = old_protocol_request("timeit", ["timeit", "-n", "1", "-r", "1", f"open({str(marker)!r}, 'w').close()"])
    attacker = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", sys.executable, "-c", attack,
                               request.hex(), own_agent.variable.partition("#")[0]],
                              capture_output=True, text=True, timeout=BOUND_S, check=False)
    assert attacker.returncode == 0, attacker.stderr
    assert attacker.stdout.startswith("sees True agent False\n"), attacker.stdout  # the name, not the processes
    assert attacker.stdout.endswith(f"read {NONCE_BYTES + PROOF_BYTES}\n"), attacker.stdout  # no record: no fork
    assert not marker.exists(), "the other container's code ran in the agent's"
    client = own_agent.client("exit", "0")  # the server serves its own on
    client.communicate(timeout=BOUND_S)
    assert client.returncode == 0
    assert "refused a connection that did not prove the agent's key" in own_agent.stop()


def test_a_squatter_on_a_dead_servers_name_gets_nothing_from_a_worker(own_agent):
    """The server died; another process took its name. The worker sends its nonce and nothing
    more: no environment (a planted secret), no fd, and its key appears nowhere; it starts cold."""
    os.kill(own_agent.server_pid(), signal.SIGKILL)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    wait_until(lambda: try_bind(squatter, own_agent.address), "the dead server's name is free")
    squatter.listen(1)
    squatter.settimeout(BOUND_S)
    received: dict[str, object] = {}

    def serve_once() -> None:
        connection, _ = squatter.accept()
        with connection:
            connection.settimeout(BOUND_S)
            data, fds = b"", []
            first = connection.recv(NONCE_BYTES)
            connection.sendall(os.urandom(NONCE_BYTES + PROOF_BYTES))  # no proof: it does not hold the key
            data = first
            while True:
                chunk, more_fds, _, _ = socket.recv_fds(connection, 1 << 16, 8)
                fds += more_fds
                if not chunk:
                    break
                data += chunk
            received.update(data=data, fds=fds)

    thread = threading.Thread(target=serve_once, daemon=True)
    thread.start()
    env = {**os.environ, VARIABLE: own_agent.variable, "PLANTED_SECRET": "hunter2-planted"}
    client = subprocess.Popen([sys.executable, "-m", THIS_MODULE, "exit", "0"], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = client.communicate(timeout=BOUND_S)
    thread.join(BOUND_S)
    squatter.close()
    assert client.returncode == 0 and f"pid {client.pid} " in out, err  # cold, in torchrun's process
    assert "did not prove the agent's key" in err and own_agent.variable.partition("#")[2] not in err
    assert len(received["data"]) == NONCE_BYTES and received["fds"] == [], received
    assert b"hunter2" not in received["data"]


# A process of its own (not the worker's agent) that binds a dead server's name and never answers;
# with "full", its backlog is filled first, so that a connect() waits in the kernel.
SILENT_SQUATTER = """
import os, socket, sys, time
if os.fork():  # its parent is not the worker's (a child of the worker's agent would be given time)
    os._exit(0)
address = b"\\0" + sys.argv[1].encode()
squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
deadline = time.monotonic() + 15
while True:
    try:
        squatter.bind(address)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.01)
squatter.listen(0)
fillers = []
while sys.argv[2] == "full":
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    filler.setblocking(False)
    try:
        filler.connect(address)
    except BlockingIOError:
        break
    fillers.append(filler)
print(os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("backlog", ["open", "full"])
def test_a_silent_squatter_on_a_dead_servers_name_delays_a_worker_a_few_seconds_at_most(own_agent, backlog):
    """The server died; a process of its own took the name and never accepts or answers (its
    backlog open, or full so that a connect waits): each new worker starts cold within
    PROOF_TIMEOUT_S of trying, not after the minute a still-importing server of its own agent gets."""
    os.kill(own_agent.server_pid(), signal.SIGKILL)
    name = own_agent.address[1:].decode()
    starter = subprocess.Popen([sys.executable, "-c", SILENT_SQUATTER, name, backlog], stdout=subprocess.PIPE,
                               text=True)
    squatter = int(starter.stdout.readline())  # listening once it says its pid
    starter.wait(timeout=BOUND_S)
    try:
        env = {**os.environ, VARIABLE: own_agent.variable}
        client = subprocess.Popen([sys.executable, "-m", THIS_MODULE, "exit", "0"], cwd=REPO, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = client.communicate(timeout=BOUND_S)  # the old client waited 60 s here
    finally:
        os.kill(squatter, signal.SIGKILL)
        starter.stdout.close()
    assert client.returncode == 0 and f"pid {client.pid} " in out, err  # cold, in torchrun's process
    assert "no warm-worker server answered" in err and own_agent.variable.partition("#")[2] not in err


def try_bind(listener: socket.socket, address: bytes) -> bool:
    try:
        listener.bind(address)
    except OSError:
        return False
    return True


def test_a_failed_fork_refuses_one_worker_and_the_server_serves_on(own_agent):
    """The server runs out of file descriptors (RLIMIT_NOFILE lowered under it, the stand-in for
    EMFILE, EAGAIN at pids.max or ENOMEM): that worker starts cold and says why; the running one
    goes on; once there are fds again, workers start warm."""
    running = own_agent.client("wait")
    running_child = int(first_line(running)["pid"])
    server = own_agent.server_pid()
    limit = no_fd_after_one_more(server)
    soft, hard = resource.prlimit(server, resource.RLIMIT_NOFILE)
    resource.prlimit(server, resource.RLIMIT_NOFILE, (limit, hard))
    try:
        refused = own_agent.client("exit", "0")
        out, err = refused.communicate(timeout=BOUND_S)
    finally:
        resource.prlimit(server, resource.RLIMIT_NOFILE, (soft, hard))
    assert refused.returncode == 0 and f"pid {refused.pid} " in out, err  # cold
    assert "the server refused: Too many open files" in err, err
    assert process_is_alive(server) and process_is_alive(running_child)
    warm = own_agent.client("exit", "0")
    out, err = warm.communicate(timeout=BOUND_S)
    assert warm.returncode == 0 and "forked warm by the server" in err
    running.send_signal(signal.SIGTERM)
    running.communicate(timeout=BOUND_S)
    assert running.returncode == DRAIN_EXIT_CODE
    assert "pipe failed" in own_agent.stop()


def no_fd_after_one_more(pid: int) -> int:
    """The RLIMIT_NOFILE under which process `pid` can open one more file (the accepted
    connection) and then none."""
    open_fds = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    gaps = max(open_fds) + 1 - len(open_fds)
    assert gaps <= 1, f"process {pid}'s fds {sorted(open_fds)} have {gaps} gaps: no limit leaves exactly one free"
    return max(open_fds) + 2 - gaps


def test_connections_that_never_prove_the_key_do_not_hold_the_server(own_agent):
    """More silent connections than the server keeps waiting for a proof (the oldest are pushed
    out): a worker that comes after them still starts warm, and nothing was forked for them."""
    silent = []
    try:
        for _ in range(MAX_HANDSHAKES + 6):
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(own_agent.address)  # blocking: waits while the backlog is full
            silent.append(connection)
        client = own_agent.client("exit", "0")
        _, err = client.communicate(timeout=BOUND_S)
        assert client.returncode == 0 and "forked warm by the server" in err, err
        children = [p for p in os.listdir("/proc") if p.isdigit() and (stat := read_stat(p)) is not None
                    and stat.parent == own_agent.server_pid()]
        assert children == [], f"children forked for connections without a proof: {children}"
    finally:
        for connection in silent:
            connection.close()
    assert "too many connections without a proof" in own_agent.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user (nobody)")
def test_refusals_are_logged_a_few_times_not_once_each(own_agent):
    nobody = pwd.getpwnam("nobody").pw_uid
    for _ in range(20):
        assert connect_as(nobody, own_agent.address) == b""
    client = own_agent.client("exit", "0")
    client.communicate(timeout=BOUND_S)
    assert client.returncode == 0
    assert own_agent.stop().count(f"refused a connection from uid {nobody}") == 1


def test_rdzv_conf_warm_workers_is_checked_and_taken_out():
    assert take_warm_workers(SimpleNamespace(config={})) is True
    params = SimpleNamespace(config={"warm_workers": "0", "algorithm": "keyed"})
    assert take_warm_workers(params) is False and params.config == {"algorithm": "keyed"}
    with pytest.raises(ValueError, match=r"^--rdzv_conf warm_workers: got 'yes'; expected 1 .* or 0 "):
        take_warm_workers(SimpleNamespace(config={"warm_workers": "yes"}))


@pytest.mark.parametrize(("argv", "variable"), [
    (["--nnodes=2", "-m", "my_project.train"], None),  # not a module that asks for a warm worker
    (["--nnodes=2", "--no-python", "elastic_ddp.train"], None),
    (["--nnodes=2", "-m", "elastic_ddp.train"], "0"),  # turned off
    (["--nnodes=2", "-m", "elastic_ddp.train"], "@elastic_ddp-warm-1-2#" + "00" * 32),  # the launcher's, running
])
def test_no_server_is_started_where_none_would_be_used(monkeypatch, argv, variable):
    if variable is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, variable)
    start_warm_workers(SimpleNamespace(config={}), argv)
    assert os.environ.get(VARIABLE) == variable


if __name__ == "__main__":
    target(*sys.argv[1:])


READY_AGENT = ("import sys\nfrom elastic_ddp.agent.warm_workers import start_warm_worker_server\n"
               "server = start_warm_worker_server(announce_ready=True)\n"
               "print(server.wait_until_ready(float(sys.argv[1])), flush=True)\nsys.stdin.read()\n")


@pytest.mark.parametrize(("preload", "said_ready"), [("elastic_ddp.runtime.procfs", "True"),
                                                     ("no_such_module_here", "True")])
def test_the_launchers_agent_waits_until_its_server_has_its_imports(preload, said_ready):
    """A preload that imports, or one that fails (the server goes on and says why): either way the
    server says it is ready on the pipe, and the agent's wait returns True well within its bound."""
    env = {**os.environ, "ELASTIC_DDP_PRELOAD": preload}
    env.pop(VARIABLE, None)
    agent = subprocess.Popen([sys.executable, "-c", READY_AGENT, str(BOUND_S)], cwd=REPO, env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert agent.stdout.readline().strip() == said_ready
    finally:
        agent.stdin.close()
        agent.wait(timeout=BOUND_S)


def test_a_server_that_ends_before_its_imports_ends_the_agents_wait_at_once():
    """The pipe's write end lives only in the server: a server that dies unready is EOF, not a hang."""
    from elastic_ddp.agent.warm_workers import StartedServer

    read_end, write_end = os.pipe()
    os.close(write_end)  # as a server that ended before it wrote
    started = time.monotonic()
    assert StartedServer("@x", read_end).wait_until_ready(BOUND_S) is False
    assert time.monotonic() - started < BOUND_S / 2
    assert StartedServer("@x").wait_until_ready(BOUND_S) is False  # no pipe asked for


def test_a_second_wait_answers_as_the_first_and_closes_no_other_descriptor():
    """The launcher's server is handed to whatever asks (`server_started_here`): a second wait must
    not close the pipe's number again, which by then may be another file's."""
    from elastic_ddp.agent.warm_workers import READY_BYTE, StartedServer

    read_end, write_end = os.pipe()
    os.write(write_end, READY_BYTE)
    os.close(write_end)
    server = StartedServer("@x", read_end)
    assert server.wait_until_ready(BOUND_S) is True
    reused_read, reused_write = os.pipe()  # may take the closed pipe's number
    try:
        assert server.wait_until_ready(BOUND_S) is True
        os.fstat(reused_read)  # still open
    finally:
        os.close(reused_read)
        os.close(reused_write)


THREADED_AGENT = ("import os, sys, threading\nfrom elastic_ddp.agent.warm_workers import start_warm_worker_server\n"
                  "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
                  f"print(start_warm_worker_server(), os.environ.get('{VARIABLE}', 'unset'), flush=True)\n")


def test_an_agent_running_threads_forks_no_server_and_says_so():
    """A fork copies only the calling thread: an agent with another thread starts no server (its
    workers start cold, nothing names a server to them) and says why in one line."""
    env = {**os.environ}
    env.pop(VARIABLE, None)
    agent = subprocess.run([sys.executable, "-c", THREADED_AGENT], cwd=REPO, env=env, text=True,
                           stdin=subprocess.PIPE, capture_output=True, timeout=BOUND_S, check=True)
    assert agent.stdout.split() == ["None", "unset"], agent
    assert "no warm-worker server: this agent runs 2 Python threads" in agent.stderr, agent.stderr
