"""EtcdV3RendezvousBackend against a real etcd: torch's backend contract, then what etcd adds.

The contract tests are a mixin shaped like torch's
test/distributed/elastic/rendezvous/rendezvous_backend_test.py, so another backend can reuse them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, cast

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_ddp.testbed.local_cluster import free_port, wait_for
from elastic_ddp.agent.rendezvous import EtcdConnection, EtcdUnavailableError, EtcdV3Options, EtcdV3RendezvousBackend

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdServer

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def connect(endpoint: str, run_id: str = "run", **conf: Any) -> EtcdConnection:
    params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **conf)
    return EtcdConnection(EtcdV3Options.from_params(params))


class RendezvousBackendContract(ABC):
    """torch's RendezvousBackend contract; subclasses provide `backend` and `corrupt_state`."""

    backend: RendezvousBackend

    @abstractmethod
    def corrupt_state(self) -> None:
        """Store a value that cannot be a valid state."""

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Token, bool]:
        result = self.backend.set_state(state, token)
        assert result is not None
        return cast(tuple[bytes, Token, bool], result)

    def test_get_state_returns_backend_state(self) -> None:
        self.backend.set_state(b"x")
        result = self.backend.get_state()
        assert result is not None
        state, token = result
        assert state == b"x"
        assert token is not None

    def test_get_state_returns_none_if_backend_state_does_not_exist(self) -> None:
        assert self.backend.get_state() is None

    def test_get_state_raises_error_if_backend_state_is_corrupt(self) -> None:
        self.corrupt_state()
        with pytest.raises(RendezvousStateError):
            self.backend.get_state()

    def test_set_state_raises_error_if_backend_state_is_corrupt(self) -> None:
        self.corrupt_state()
        with pytest.raises(RendezvousStateError):
            self.backend.set_state(b"x")

    def test_set_state_sets_backend_state_if_it_does_not_exist(self) -> None:
        state, token, has_set = self.set_state(b"x")
        assert (state, has_set) == (b"x", True)
        assert token is not None

    def test_set_state_sets_backend_state_if_token_is_current(self) -> None:
        _, token1, has_set1 = self.set_state(b"x")
        state2, token2, has_set2 = self.set_state(b"y", token1)
        assert state2 == b"y"
        assert token1 != token2
        assert has_set1 and has_set2
        assert self.backend.get_state() == (b"y", token2)

    def test_set_state_returns_current_backend_state_if_token_is_old(self) -> None:
        _, token1, _ = self.set_state(b"x")
        state2, token2, _ = self.set_state(b"y", token1)
        state3, token3, has_set = self.set_state(b"z", token1)
        assert (state3, token3, has_set) == (state2, token2, False)

    def test_set_state_returns_current_backend_state_if_token_is_none(self) -> None:
        state1, token1, _ = self.set_state(b"x")
        state2, token2, has_set = self.set_state(b"y")
        assert (state2, token2, has_set) == (state1, token1, False)

    @pytest.mark.parametrize("invalid_token", ["invalid", b"7", -3, 1.5, True])
    def test_set_state_returns_current_backend_state_if_token_is_invalid(self, invalid_token: Any) -> None:
        state1, token1, _ = self.set_state(b"x")
        state2, token2, has_set = self.set_state(b"y", token=invalid_token)
        assert (state2, token2, has_set) == (state1, token1, False)

    def test_set_state_with_invalid_token_and_no_state_returns_none(self) -> None:
        assert self.backend.set_state(b"y", token="invalid") is None


class TestEtcdV3BackendContract(RendezvousBackendContract):
    @pytest.fixture(autouse=True)
    def _backend(self, shared_etcd_server: EtcdServer, run_id: str) -> None:
        self.server = shared_etcd_server
        self.backend = EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint), run_id)

    def corrupt_state(self) -> None:
        self.server.etcdctl("put", cast(EtcdV3RendezvousBackend, self.backend).key, "not base64!")


def test_name_is_etcd_v3(shared_etcd_server: EtcdServer, run_id: str) -> None:
    assert EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint), run_id).name == "etcd-v3"


def test_empty_run_id_is_refused(shared_etcd_server: EtcdServer) -> None:
    with pytest.raises(ValueError, match="run id"):
        EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint), "")


def test_state_key_is_per_run_under_key_prefix(shared_etcd_server: EtcdServer, run_id: str) -> None:
    prefix = f"/{run_id}/jobs"
    connection = connect(shared_etcd_server.endpoint, key_prefix=prefix + "/")
    first, second = EtcdV3RendezvousBackend(connection, "a"), EtcdV3RendezvousBackend(connection, "b")
    first.set_state(b"state of a")
    assert second.get_state() is None
    stored = shared_etcd_server.etcdctl("get", "--print-value-only", f"{prefix}/a/state").stdout.strip()
    assert stored == "c3RhdGUgb2YgYQ=="  # base64 of b"state of a"


def test_only_one_of_two_writers_on_the_same_token_wins(shared_etcd_server: EtcdServer, run_id: str) -> None:
    first = EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint), run_id)
    second = EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint), run_id)
    _, token, _ = first.set_state(b"x")
    won = first.set_state(b"first", token)
    lost = second.set_state(b"second", token)
    assert won is not None and lost is not None
    assert won[2] and not lost[2]
    assert lost[:2] == won[:2]


def test_retried_write_that_already_landed_counts_as_set(shared_etcd_server: EtcdServer, run_id: str) -> None:
    backend = EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint), run_id)
    _, token, _ = backend.set_state(b"x")
    backend.set_state(b"y", token)
    # What a retry sees when its first attempt committed but the answer was lost: the same write
    # again, on the token that the first attempt consumed.
    state, _, has_set = backend.set_state(b"y", token)
    assert (state, has_set) == (b"y", True)


@pytest.mark.timeout(30)
def test_abandoned_state_expires_after_ttl(shared_etcd_server: EtcdServer, run_id: str) -> None:
    connection = connect(shared_etcd_server.endpoint, ttl="2")
    EtcdV3RendezvousBackend(connection, run_id).set_state(b"x")
    connection.close()
    reader = EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint), run_id)
    assert reader.get_state() is not None
    started = time.monotonic()
    wait_for(lambda: reader.get_state() is None, 15, "the state to expire with its lease")
    assert time.monotonic() - started < 10


@pytest.mark.timeout(30)
def test_live_writer_keeps_its_state_past_the_ttl(shared_etcd_server: EtcdServer, run_id: str) -> None:
    backend = EtcdV3RendezvousBackend(connect(shared_etcd_server.endpoint, ttl="2"), run_id)
    _, token, _ = backend.set_state(b"0")
    deadline = time.monotonic() + 5  # well past the 2 s TTL
    step = 0
    while time.monotonic() < deadline:
        step += 1
        result = backend.set_state(str(step).encode(), token)
        assert result is not None and result[2], "a heartbeating writer lost its state"
        token = result[1]
        time.sleep(0.2)  # the writer's heartbeat period (pacing, not a wait for a condition)


@pytest.mark.timeout(20)
def test_unreachable_etcd_raises_connection_error_after_retry_budget() -> None:
    dead = f"127.0.0.1:{free_port()}"
    backend = EtcdV3RendezvousBackend(connect(dead, retry_timeout="1.5"), "run")
    for operation in (backend.get_state, lambda: backend.set_state(b"x")):
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as raised:
            operation()
        assert 1.5 <= time.monotonic() - started < 5
        assert isinstance(raised.value, EtcdUnavailableError)
        assert dead in str(raised.value) and "retry_timeout=1.5s" in str(raised.value)
