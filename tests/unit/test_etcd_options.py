"""The `--rdzv_conf` keys of etcd-v3: defaults, a full configuration, secrets that never show, and
one-line errors for bad values.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_ddp.agent.rendezvous import EtcdV3Options
from elastic_ddp.agent.rendezvous.etcd.connection import EtcdConnection, EtcdTlsError

pytestmark = pytest.mark.timeout(60)


def params(endpoint: str, run_id: str = "run", min_nodes: int = 1, max_nodes: int = 1, **conf: Any
           ) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, min_nodes, max_nodes, **conf)


# --- --rdzv_conf validation: no etcd needed, every message names the key, value and the rule ---

@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    paths = {name: tmp_path / name for name in ("ca.pem", "cert.pem", "key.pem", "password", "empty")}
    for name, path in paths.items():
        path.write_text("" if name == "empty" else "hunter2\n" if name == "password" else "PEM")
    return {name: str(path) for name, path in paths.items()}


def test_defaults(files: dict[str, str]) -> None:
    options = EtcdV3Options.from_params(params(""))
    assert options.endpoints == (("localhost", 2379),)
    assert (options.protocol, options.read_timeout, options.retry_timeout, options.ttl) == ("http", 2.0, 30.0, 7200)
    assert options.key_prefix == "/elastic_ddp/rendezvous"


def test_full_configuration_is_parsed(files: dict[str, str]) -> None:
    options = EtcdV3Options.from_params(params(
        "h1:1234, h2 ,[::1]:5", protocol="HTTPS", ca_cert=files["ca.pem"], cert=files["cert.pem"],
        key=files["key.pem"], user="trainer", password_file=files["password"], read_timeout="2.5",
        retry_timeout=60, key_prefix="/jobs/", ttl="600"))
    assert options.endpoints == (("h1", 1234), ("h2", 2379), ("::1", 5))
    assert (options.protocol, options.user) == ("https", "trainer")
    assert (options.read_timeout, options.retry_timeout) == (2.5, 60)
    assert (options.key_prefix, options.ttl) == ("/jobs", 600)
    assert options.password is not None and options.password.reveal() == "hunter2"


def test_password_never_shows(files: dict[str, str]) -> None:
    options = EtcdV3Options.from_params(params("h", user="u", password_file=files["password"], protocol="https",
                                               ca_cert=files["ca.pem"]))
    assert "hunter2" not in repr(options) and "hunter2" not in str(options)
    assert "hunter2" not in f"{options.password}"


@pytest.mark.parametrize(("conf", "expected"), [
    ({"protocol": "ftp"}, "protocol='ftp' is invalid: allowed values are http, https"),
    ({"protocol": "https"}, "protocol='https' is invalid: https needs ca_cert"),
    ({"ca_cert": "CA"}, "ca_cert='/"),
    ({"key": "CA", "cert": "CA"}, "is invalid: TLS files are used only with protocol=https (add protocol=https)"),
    ({"protocol": "https", "ca_cert": "CA", "cert": "CA"}, "cert='"),
    ({"ca_cert": "/no/such/ca.pem", "protocol": "https"}, "ca_cert='/no/such/ca.pem' is invalid: must be the path"),
    ({"user": "u"}, "user='u' is invalid: needs password_file"),
    ({"password_file": "PASSWORD"}, "password_file='<set>' is invalid: needs user"),
    ({"user": "u", "password_file": "EMPTY"}, "the file is empty"),
    ({"read_timeout": "0"}, "read_timeout='0' is invalid: must be more than 0 seconds"),
    ({"retry_timeout": "soon"}, "retry_timeout='soon' is invalid: must be a number of seconds"),
    ({"retry_timeout": "inf"}, "retry_timeout='inf' is invalid: must be a finite number"),
    ({"ttl": "1.5"}, "ttl='1.5' is invalid: must be a whole number of seconds, at least 1"),
    ({"ttl": "0"}, "ttl='0' is invalid"),
    ({"key_prefix": "jobs"}, "key_prefix='jobs' is invalid: must start with '/'"),
    ({"key_prefix": "/"}, "key_prefix='/' is invalid"),
    ({"user": " "}, "user='' is invalid: must not be empty"),
])
def test_bad_values_raise_one_line_value_error(files: dict[str, str], conf: dict[str, str], expected: str) -> None:
    substitutions = {"CA": files["ca.pem"], "PASSWORD": files["password"], "EMPTY": files["empty"]}
    conf = {key: substitutions.get(value, value) for key, value in conf.items()}
    with pytest.raises(ValueError) as raised:
        EtcdV3Options.from_params(params("h", **conf))
    message = str(raised.value)
    assert "\n" not in message and expected in message
    assert message.startswith("rdzv_conf ")


def test_a_password_is_not_sent_over_plain_http_to_another_host(files: dict[str, str]) -> None:
    credentials = {"user": "trainer", "password_file": files["password"]}
    with pytest.raises(ValueError) as raised:
        EtcdV3Options.from_params(params("127.0.0.1:2379,etcd2:2379", **credentials))
    message = str(raised.value)
    assert message.startswith("rdzv_conf user='trainer' is invalid: its password would go over plain http to "
                              "etcd2:2379: use protocol=https") and "plaintext_credentials=1" in message
    assert "hunter2" not in message


def test_plain_http_credentials_need_a_loopback_endpoint_or_an_explicit_choice(files, caplog) -> None:
    credentials = {"user": "trainer", "password_file": files["password"]}
    with caplog.at_level(logging.WARNING):
        assert EtcdV3Options.from_params(params("localhost:2379,[::1]:2379", **credentials)).user == "trainer"
        assert EtcdV3Options.from_params(params("etcd2", plaintext_credentials="1", **credentials)).user == "trainer"
    assert caplog.text.count("goes over plain http (protocol=https keeps it private)") == 2
    with pytest.raises(ValueError, match="plaintext_credentials='maybe' is invalid: expected 1 or 0"):
        EtcdV3Options.from_params(params("etcd2", plaintext_credentials="maybe", **credentials))


def test_a_remote_plain_http_etcd_without_a_user_is_warned_about_once(files, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        EtcdV3Options.from_params(params("127.0.0.1:2379,etcd-open-1:2379,[2001:db8::7]:2379"))
        EtcdV3Options.from_params(params("127.0.0.1:2379,etcd-open-1:2379,[2001:db8::7]:2379"))
    [warning] = [r.getMessage() for r in caplog.records if "without a user" in r.getMessage()]
    assert "\n" not in warning
    assert "etcd-open-1:2379, [2001:db8::7]:2379" in warning and "127.0.0.1" not in warning
    assert "protocol=https" in warning and "user=" in warning and "docs/etcd.md" in warning


@pytest.mark.parametrize("endpoint, conf", [
    ("localhost:2379,127.0.0.5:2379,[::1]:2379", {}),
    ("etcd-open-2", {"protocol": "https", "ca_cert": "ca.pem"}),
    ("etcd-open-3", {"user": "trainer", "password_file": "password", "plaintext_credentials": "1"}),
])
def test_loopback_tls_or_a_user_is_not_warned_about_as_open(files, caplog, endpoint, conf) -> None:
    conf = {key: files.get(value, value) for key, value in conf.items()}
    with caplog.at_level(logging.WARNING):
        EtcdV3Options.from_params(params(endpoint, **conf))
    assert "without a user" not in caplog.text
    assert "hunter2" not in caplog.text


def test_bad_endpoint_is_named() -> None:
    with pytest.raises(ValueError, match=r"--rdzv_endpoint='h1:2379,h2:99999' is invalid"):
        EtcdV3Options.from_params(params("h1:2379,h2:99999"))


class _Unavailable(grpc.RpcError):
    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self._details = details
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_handshake_that_times_out_on_plain_http_is_retried_not_called_a_tls_error(files: dict[str, str]) -> None:
    """gRPC says "tcp handshaker shutdown" when a connection does not come up in time (seen with 256
    agents on one etcd): on plain http that is an endpoint to retry, not a certificate problem."""
    plain = EtcdConnection(EtcdV3Options.from_params(params("127.0.0.1:2379")))
    failure = plain._failure(0, "read the rendezvous state", _Unavailable("tcp handshaker shutdown"))
    assert not isinstance(failure, EtcdTlsError) and "handshaker" in str(failure)
    tls = EtcdConnection(EtcdV3Options.from_params(params("127.0.0.1:2379", protocol="https", ca_cert=files["ca.pem"])))
    assert isinstance(tls._failure(0, "read", _Unavailable("SSL handshake failed")), EtcdTlsError)


def test_a_member_cut_off_from_its_quorum_is_failed_over_not_a_refusal() -> None:
    """A member on the minority side of a partition answers a read with UNKNOWN "context deadline
    exceeded" once its side of the request's deadline ends (seen in tests/cluster/test_network_etcd.py:
    the agent died on it); the next member may answer, so it is retried there."""
    connection = EtcdConnection(EtcdV3Options.from_params(params("10.0.0.1:2379,10.0.0.2:2379")))
    failure = connection._failure(0, "read the rendezvous state",
                                  _Unavailable("context deadline exceeded", grpc.StatusCode.UNKNOWN))
    assert not isinstance(failure, RendezvousConnectionError), failure
    assert connection._preferred == 1
    other = connection._failure(1, "read", _Unavailable("something else", grpc.StatusCode.UNKNOWN))
    assert isinstance(other, RendezvousConnectionError) and "refused to read: UNKNOWN" in str(other)
