"""The `--rdzv_conf` keys of `--rdzv_backend=etcd-v3`, parsed and checked before anything connects.

    torchrun --rdzv_backend=etcd-v3 --rdzv_endpoint=h1:2379,h2:2379,h3:2379 \
        --rdzv_conf=protocol=https,ca_cert=/etc/etcd/ca.pem,user=trainer,password_file=/run/secrets/etcd \
        ...

Every bad value raises `ValueError` naming the key, the value and what is allowed, in one line.
The password is read from `password_file` here and kept in a `Secret`, whose repr and str never
show it. The table of keys is in docs/etcd.md.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/elastic_ddp/rendezvous"

# The --rdzv_conf keys this module reads (the etcd board's own, for agent_setup's check).
ETCD_KEYS = frozenset({
    "protocol", "ca_cert", "cert", "key", "user", "password_file", "read_timeout", "retry_timeout",
    "key_prefix", "ttl", "plaintext_credentials",
})


class Secret:
    """A string that never shows itself in logs, reprs or exception messages."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret itself: pass it to the one call that needs it, nowhere else."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


@dataclass(frozen=True)
class EtcdV3Options:
    """Connection and rendezvous settings for etcd-v3, one field per `--rdzv_conf` key."""

    # (host, port) of every etcd member to try, in order; from `--rdzv_endpoint`.
    endpoints: tuple[tuple[str, int], ...]
    # "http" or "https". https needs `ca_cert`.
    protocol: str = "http"
    # PEM file of the CA that signed the etcd server certificates.
    ca_cert: str | None = None
    # PEM files of a client certificate and its key, for etcd's --client-cert-auth (mTLS).
    cert: str | None = None
    key: str | None = None
    # etcd user, and the password read from `password_file`.
    user: str | None = None
    password: Secret | None = None
    # Seconds one etcd request may take before it counts as failed (and is retried).
    read_timeout: float = 2.0
    # Seconds an operation keeps retrying over all endpoints before it raises.
    retry_timeout: float = 30.0
    # Every key of a run lives under "<key_prefix>/<run_id>/".
    key_prefix: str = DEFAULT_KEY_PREFIX
    # Seconds the keys of a run outlive the last agent that wrote them (an etcd lease).
    ttl: int = 7200

    @property
    def endpoint_names(self) -> list[str]:
        return [f"{host}:{port}" for host, port in self.endpoints]

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> EtcdV3Options:
        """Parse `--rdzv_endpoint` and `--rdzv_conf`; raise ValueError on the first bad value."""
        config = params.config
        protocol = _choice(config, "protocol", "http", ("http", "https"))
        ca_cert = _readable_file(config, "ca_cert")
        cert = _readable_file(config, "cert")
        key = _readable_file(config, "key")
        user = _text(config, "user")
        password = _password(config)
        _check_pairs(protocol, ca_cert, cert, key, user, password)
        endpoints = _endpoints(params.endpoint)
        _check_credentials_in_clear(protocol, user, endpoints, _flag(config, "plaintext_credentials"))
        _warn_if_open(protocol, user, endpoints)
        return cls(
            endpoints=endpoints,
            protocol=protocol,
            ca_cert=ca_cert,
            cert=cert,
            key=key,
            user=user,
            password=password,
            read_timeout=_positive_float(config, "read_timeout", cls.read_timeout),
            retry_timeout=_positive_float(config, "retry_timeout", cls.retry_timeout),
            key_prefix=_key_prefix(config),
            ttl=_ttl(config),
        )


def run_key(key_prefix: str, run_id: str) -> str:
    """The etcd key under which everything of run `run_id` lives (no trailing slash)."""
    if not run_id:
        raise ValueError("The run id must be a non-empty string.")
    return f"{key_prefix}/{run_id}"


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"rdzv_conf {key}={value!r} is invalid: {allowed}")


def _endpoints(endpoint: str | None) -> tuple[tuple[str, int], ...]:
    items = [item.strip() for item in (endpoint or "").split(",") if item.strip()]
    try:
        parsed = tuple(parse_rendezvous_endpoint(item, default_port=DEFAULT_PORT) for item in items)
    except ValueError as exc:
        raise ValueError(f"--rdzv_endpoint={endpoint!r} is invalid: expected host[:port] items separated "
                         f"by commas, e.g. etcd1:2379,etcd2:2379 ({exc})") from exc
    return parsed or (("localhost", DEFAULT_PORT),)


def _text(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is None:
        return None
    value = str(value).strip()
    if not value:
        raise _bad(key, value, "must not be empty; leave the key out instead")
    return value


def _choice(config: dict[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = _text(config, key)
    if value is None:
        return default
    if value.lower() not in allowed:
        raise _bad(key, value, f"allowed values are {', '.join(allowed)}")
    return value.lower()


def _readable_file(config: dict[str, Any], key: str) -> str | None:
    path = _text(config, key)
    if path is not None and not (Path(path).is_file() and os.access(path, os.R_OK)):
        raise _bad(key, path, "must be the path of an existing, readable file")
    return path


def _password(config: dict[str, Any]) -> Secret | None:
    path = _readable_file(config, "password_file")
    if path is None:
        return None
    try:
        password = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise _bad("password_file", path, f"cannot be read as text ({type(exc).__name__})") from exc
    if not password:
        raise _bad("password_file", path, "the file is empty; it must hold the password")
    return Secret(password)


def _check_pairs(protocol: str, ca_cert: str | None, cert: str | None, key: str | None,
                 user: str | None, password: Secret | None) -> None:
    if protocol == "https" and ca_cert is None:
        raise _bad("protocol", protocol, "https needs ca_cert=<PEM of the CA that signed the etcd "
                                         "server certificates> (the system bundle works for a public CA)")
    tls_files = {"ca_cert": ca_cert, "cert": cert, "key": key}
    given = next(((name, path) for name, path in tls_files.items() if path is not None), None)
    if protocol == "http" and given is not None:
        raise _bad(*given, "TLS files are used only with protocol=https (add protocol=https)")
    if (cert is None) != (key is None):
        raise _bad("cert" if key is None else "key", cert or key, "cert and key must be given together")
    if user is not None and password is None:
        raise _bad("user", user, "needs password_file=<file holding the password>")
    if password is not None and user is None:
        raise _bad("password_file", "<set>", "needs user=<etcd user name>")


def _flag(config: dict[str, Any], key: str) -> bool:
    value = config.get(key)
    if value is None:
        return False
    text = str(value).strip().lower()
    if text not in ("1", "0", "true", "false", "yes", "no"):
        raise _bad(key, value, "expected 1 or 0 (also true/false, yes/no)")
    return text in ("1", "true", "yes")


def _check_credentials_in_clear(protocol: str, user: str | None, endpoints: tuple[tuple[str, int], ...],
                                allowed: bool) -> None:
    """A password sent over plain http can be read by anyone on the network path (etcd's auth token
    too). Refused towards a host that is not this machine unless `plaintext_credentials=1`."""
    if user is None or protocol == "https":
        return
    remote = [f"{host}:{port}" for host, port in endpoints if not _is_loopback(host)]
    if remote and not allowed:
        raise _bad("user", user, f"its password would go over plain http to {', '.join(remote)}: use "
                                 "protocol=https with ca_cert=... (docs/operations.md, \"Securing etcd\"), or set "
                                 "plaintext_credentials=1 on a network you trust")
    logger.warning("etcd-v3: the password of user %r goes over plain http (protocol=https keeps it private)", user)


# The open endpoint sets warned about in this process: one agent builds its options once, but
# tools and tests build them again and again.
_warned_open: set[tuple[str, ...]] = set()


def _warn_if_open(protocol: str, user: str | None, endpoints: tuple[tuple[str, int], ...]) -> None:
    """Warn, once per endpoint set, when etcd on another host is reached over plain http without a
    user. Then anyone who can reach etcd can rewrite the rendezvous: who is in a round, in which
    rank, and where the workers meet (nothing read there is executed: `state`)."""
    if protocol != "http" or user is not None:
        return
    remote = tuple(f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                   for host, port in endpoints if not _is_loopback(host))
    if not remote or remote in _warned_open:
        return
    _warned_open.add(remote)
    logger.warning("etcd-v3: etcd at %s is reached over plain http without a user: anyone who can reach it "
                   "can rewrite the rendezvous (who trains, in which rank, where the workers meet); use "
                   "protocol=https with ca_cert (and cert/key if etcd checks client certificates) and/or "
                   "user=...,password_file=... with etcd auth enabled (docs/etcd.md, \"TLS\" and \"Auth\")",
                   ", ".join(remote))


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _number(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key)
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise _bad(key, value, "must be a number of seconds") from exc
    if not math.isfinite(number):
        raise _bad(key, value, "must be a finite number of seconds")
    return number


def _positive_float(config: dict[str, Any], key: str, default: float) -> float:
    number = _number(config, key, default)
    if number <= 0:
        raise _bad(key, config.get(key), "must be more than 0 seconds")
    return number


def _ttl(config: dict[str, Any]) -> int:
    number = _number(config, "ttl", EtcdV3Options.ttl)
    if number != int(number) or number < 1:
        raise _bad("ttl", config.get("ttl"), "must be a whole number of seconds, at least 1")
    return int(number)


def _key_prefix(config: dict[str, Any]) -> str:
    prefix = _text(config, "key_prefix")
    if prefix is None:
        return DEFAULT_KEY_PREFIX
    if not prefix.startswith("/") or any(ch.isspace() for ch in prefix) or prefix.rstrip("/") == "":
        raise _bad("key_prefix", prefix, "must start with '/', name something below the root, and "
                                         "contain no whitespace, e.g. /elastic_ddp/rendezvous")
    return prefix.rstrip("/")
