"""One process's connection to an etcd cluster: failover, retries, TLS, auth and the key lease.

`EtcdConnection.call(what, operation)` runs `operation(client)` against one etcd member and
retries it on transient failures (member down, no leader, leader changed, request timed out),
moving on to the next endpoint each time, with exponential back-off and jitter, for at most
`retry_timeout` seconds in all. This is what lets torchrun agents ride out an etcd restart or the
loss of a member: torch's agent dies on any exception from the rendezvous backend.

Errors that retrying cannot fix are raised at once, each with a message that names the cause and
the fix: `EtcdAuthenticationError` (wrong password, no user, missing permission), `EtcdTlsError`
(certificate not trusted). `EtcdUnavailableError` means no endpoint answered within the budget;
it names every endpoint tried and the last error. All three are `RendezvousConnectionError`s.

Leases are kept alive over one long-lived LeaseKeepAlive stream per connection (`keep_alive`):
etcd3's `refresh_lease` opens a stream per refresh, and grpc-python serves each with a thread of
its own: hundreds of threads a second with hundreds of agents (docs/benchmarks-history.md).

Limits: an operation whose request reached etcd but whose answer was lost (a deadline exceeded
mid-commit) is retried too, so a write may be applied twice; callers make their writes
idempotent or check (see `boards.etcd.EtcdRoundBoard.close_round`, `EtcdV3Store.add`). A single
attempt may take `read_timeout`, so an operation can last up to `retry_timeout + read_timeout`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import tenacity
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_ddp.agent.rendezvous.etcd.client import Etcd3Client, Etcd3Exception, etcd3, etcdrpc
from elastic_ddp.agent.rendezvous.etcd.options import EtcdV3Options

logger = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC waits up to 120 s between reconnects by default; an etcd member back after 3 s must be
# used again within a second, not minutes later.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_TRANSIENT_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
})
_TLS_MARKERS = ("handshake", "certificate", "ssl")
# A member cut off from its quorum (a partition) cannot serve a linearizable read: the request waits
# until the deadline gRPC sent with it, and etcd answers UNKNOWN "context deadline exceeded" when its
# side of the deadline ends first (DEADLINE_EXCEEDED when the client's does). Another member may answer.
_SERVER_DEADLINE = "context deadline exceeded"


class EtcdUnavailableError(RendezvousConnectionError):
    """No etcd endpoint answered within the retry budget."""


class EtcdAuthenticationError(RendezvousConnectionError):
    """etcd refused the credentials, wants some, or denied the user access to the keys."""


class EtcdTlsError(RendezvousConnectionError):
    """The TLS handshake with etcd failed (typically: the server certificate is not trusted)."""


class _Retry(Exception):
    """An attempt failed in a way that another attempt (perhaps on another member) may not."""

    def __init__(self, endpoint: str, detail: str) -> None:
        super().__init__(f"{endpoint}: {detail}")
        self.endpoint = endpoint
        self.detail = detail


def _rpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error under `exc` (etcd3 re-raises them as its own exceptions, losing the details)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.RpcError) and hasattr(seen, "code"):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def is_lease_not_found(exc: BaseException) -> bool:
    """Whether `exc` is etcd's answer that a lease does not exist (expired, or revoked already)."""
    rpc = _rpc_error(exc)
    return (rpc is not None and rpc.code() == grpc.StatusCode.NOT_FOUND
            and "lease not found" in (rpc.details() or "").lower())


class _KeepAliveFailed(grpc.RpcError):
    """The keep-alive stream gave no answer in time, or etcd ended it: transient, retried."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code, self.details = lambda: code, lambda: detail


class _KeepAliveStream:
    """One LeaseKeepAlive stream on one client; each refresh is a request on it, answered in order.
    Two threads for its whole life (gRPC's, which sends the requests, and the reader of the
    answers), where a stream per refresh cost a thread per refresh. Not thread-safe: one refresh at a time."""

    def __init__(self, client: Etcd3Client) -> None:
        self.client = client
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._call = client.leasestub.LeaseKeepAlive(iter(self._requests.get, None), metadata=client.metadata,
                                                     credentials=client.call_credentials)
        threading.Thread(target=self._read, name="etcd-lease-keepalive", daemon=True).start()

    def _read(self) -> None:
        try:
            for answer in self._call:
                self._answers.put(answer)
            self._answers.put(_KeepAliveFailed(grpc.StatusCode.UNAVAILABLE, "etcd ended the keep-alive stream"))
        except grpc.RpcError as exc:
            self._answers.put(exc)

    def refresh(self, lease: int, timeout: float) -> int:
        """The lease's new TTL; 0 if etcd no longer has it. Raises grpc.RpcError (the stream is then dead)."""
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease))
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise _KeepAliveFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to a lease keep-alive") from None
        if isinstance(answer, BaseException):
            raise answer
        return answer.TTL

    def close(self) -> None:
        self._requests.put(None)  # ends gRPC's sending thread
        self._call.cancel()


class EtcdConnection:
    """Clients for every endpoint, the one that worked last tried first. Thread-safe.

    Also holds this process's lease: every key written through `lease_id` is attached to it, and
    etcd deletes the keys `ttl` seconds after the lease was last refreshed. The lease is refreshed
    whenever it is used and a third of its TTL has passed, so the keys of a run live as long as one
    of its agents writes, and go away `ttl` seconds after the last one stops. The lease is never
    revoked: other agents may still need the keys attached to it.
    """

    def __init__(self, options: EtcdV3Options) -> None:
        self._options = options
        self._clients: dict[int, Etcd3Client] = {}
        self._logged_out: set[int] = set()  # endpoints whose auth token etcd no longer accepts
        self._preferred = 0
        self._lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._lease: int | None = None
        self._lease_refreshed_at = 0.0
        self._keep_alive_lock = threading.Lock()
        self._keep_alive_stream: _KeepAliveStream | None = None

    @property
    def options(self) -> EtcdV3Options:
        return self._options

    def call(self, what: str, operation: Callable[[Etcd3Client], T]) -> T:
        """Run `operation(client)`, retrying transient failures on every endpoint in turn.

        `what` names the operation in logs and errors ("read the rendezvous state").
        Raises EtcdUnavailableError once `retry_timeout` has passed, EtcdAuthenticationError or
        EtcdTlsError at once, RendezvousConnectionError for any other refusal by etcd.
        """
        started = time.monotonic()
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_delay(self._options.retry_timeout),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=1.0),
            retry=tenacity.retry_if_exception_type(_Retry),
            before_sleep=lambda state: self._log_retry(what, state),
        )
        try:
            result = retrying(self._attempt, what, operation)
        except tenacity.RetryError as exc:
            last = exc.last_attempt.exception()
            raise EtcdUnavailableError(self._unavailable_message(what, last)) from last
        attempts = retrying.statistics.get("attempt_number", 1)
        if attempts > 1:
            logger.info("etcd answered (%s) after %d attempts in %.1f s", what, attempts,
                        time.monotonic() - started)
        return result

    def lease_id(self, client: Etcd3Client) -> int:
        """The lease to attach to a key written now; call it inside `call`'s operation."""
        with self._lease_lock:
            now = time.monotonic()
            if self._lease is not None and now - self._lease_refreshed_at > self._options.ttl / 3:
                if self.keep_alive(client, self._lease) > 0:
                    self._lease_refreshed_at = now
                else:
                    self._lease = None  # it expired: its keys are gone already
            if self._lease is None:
                self._lease = client.lease(self._options.ttl).id
                self._lease_refreshed_at = now
            return self._lease

    def keep_alive(self, client: Etcd3Client, lease: int) -> int:
        """Refresh `lease` on this connection's keep-alive stream (opened on `client`, or again on it
        after a failure or a fail-over); call it inside `call`'s operation. Its new TTL; 0 if etcd
        no longer has the lease (it expired or was revoked)."""
        with self._keep_alive_lock:
            stream = self._keep_alive_stream
            if stream is None or stream.client is not client:
                if stream is not None:
                    stream.close()
                stream = self._keep_alive_stream = _KeepAliveStream(client)
            try:
                return stream.refresh(lease, self._options.read_timeout)
            except BaseException:
                stream.close()
                self._keep_alive_stream = None
                raise

    def close(self) -> None:
        """Close every channel. The lease is left to expire (see the class docstring)."""
        with self._keep_alive_lock:
            if self._keep_alive_stream is not None:
                self._keep_alive_stream.close()
                self._keep_alive_stream = None
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def _attempt(self, what: str, operation: Callable[[Etcd3Client], T]) -> T:
        index = self._preferred
        try:
            return operation(self._client(index))
        except (grpc.RpcError, Etcd3Exception) as exc:
            raise self._failure(index, what, exc) from exc

    def _client(self, index: int) -> Etcd3Client:
        with self._lock:
            client = self._clients.get(index)
            if client is None:
                client = self._new_client(index)
                self._clients[index] = client
            elif index in self._logged_out:
                # Log in again on the same channel: closing it would cancel other threads' calls.
                self._authenticate(client)
            self._logged_out.discard(index)
            return client

    def _new_client(self, index: int) -> Etcd3Client:
        options = self._options
        host, port = options.endpoints[index]
        client = etcd3.client(host, port, ca_cert=options.ca_cert, cert_key=options.key,
                              cert_cert=options.cert, timeout=options.read_timeout,
                              grpc_options=_GRPC_OPTIONS)
        if options.user is not None:
            try:
                self._authenticate(client)
            except BaseException:
                client.close()
                raise
        return client

    def _authenticate(self, client: Etcd3Client) -> None:
        # etcd3 0.12 can authenticate by itself, but only in its constructor (so never again when
        # etcd forgets the token on restart), and it then sends the token as call credentials,
        # which gRPC refuses on a plain-text channel. Sending it as metadata works on both.
        assert self._options.user is not None and self._options.password is not None
        request = etcdrpc.AuthenticateRequest(name=self._options.user,
                                              password=self._options.password.reveal())
        answer = etcdrpc.AuthStub(client.channel).Authenticate(request, self._options.read_timeout)
        client.metadata = (("token", answer.token),)

    def _failure(self, index: int, what: str, exc: BaseException) -> Exception:
        """The exception to raise for `exc`: `_Retry` if another attempt may work, else the final one.

        Side effects prepare the next attempt: fail over, log in again, or take a new lease.
        """
        endpoint = self._options.endpoint_names[index]
        rpc = _rpc_error(exc)
        if rpc is None:
            return RendezvousConnectionError(f"etcd at {endpoint} failed to {what}: {exc!r}")
        code, detail = rpc.code(), rpc.details() or ""
        lowered = detail.lower()
        # Only a TLS connection has a TLS handshake: on plain http, gRPC's "tcp handshaker shutdown"
        # (a connection that did not come up in time) is an unavailable endpoint, retried.
        tls = self._options.protocol == "https"
        if tls and code in _TRANSIENT_CODES and any(marker in lowered for marker in _TLS_MARKERS):
            return EtcdTlsError(
                f"TLS handshake with etcd at {endpoint} failed: {detail}. The server certificate must be "
                f"signed by the CA in ca_cert={self._options.ca_cert} and name the host {endpoint}")
        if code in _TRANSIENT_CODES or (code == grpc.StatusCode.UNKNOWN and lowered == _SERVER_DEADLINE):
            self._fail_over(index)
            return _Retry(endpoint, detail)
        logged_in = self._options.user is not None
        if logged_in and (code == grpc.StatusCode.UNAUTHENTICATED or "auth store is old" in lowered):
            with self._lock:  # etcd forgot our token (restart, --auth-token-ttl): log in again
                self._logged_out.add(index)
            return _Retry(endpoint, detail)
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in lowered:
            with self._lease_lock:
                self._lease = None
            return _Retry(endpoint, detail)
        return self._refusal(endpoint, what, code, detail)

    def _refusal(self, endpoint: str, what: str, code: grpc.StatusCode, detail: str) -> Exception:
        user = self._options.user
        if "authentication failed" in detail:
            return EtcdAuthenticationError(
                f"etcd at {endpoint}: authentication failed for user {user!r}: wrong user name or "
                f"password (the password is read from rdzv_conf password_file)")
        if "user name is empty" in detail or code == grpc.StatusCode.UNAUTHENTICATED:
            return EtcdAuthenticationError(
                f"etcd at {endpoint} requires authentication: set rdzv_conf user=<name> and "
                f"password_file=<file holding the password>")
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdAuthenticationError(
                f"etcd at {endpoint}: user {user!r} may not {what}: grant its role readwrite on "
                f"the key prefix {self._options.key_prefix}/ (etcdctl role grant-permission --prefix)")
        return RendezvousConnectionError(f"etcd at {endpoint} refused to {what}: {code.name}: {detail}")

    def _fail_over(self, index: int) -> None:
        with self._lock:
            if self._preferred == index:
                self._preferred = (index + 1) % len(self._options.endpoints)

    def _log_retry(self, what: str, state: tenacity.RetryCallState) -> None:
        failure = state.outcome.exception() if state.outcome else None
        level = logging.WARNING if state.attempt_number == 1 else logging.DEBUG
        logger.log(level, "etcd failed to %s (%s); retrying on %s for up to %.0f s", what, failure,
                   ", ".join(self._options.endpoint_names), self._options.retry_timeout)

    def _unavailable_message(self, what: str, last: BaseException | None) -> str:
        options = self._options
        message = (f"no etcd endpoint answered within retry_timeout={options.retry_timeout:g}s to "
                   f"{what}; tried {', '.join(options.endpoint_names)}; last error from {last}")
        if options.protocol == "http" and last is not None and "socket closed" in str(last).lower():
            message += "; if etcd serves TLS, set rdzv_conf protocol=https and ca_cert=<CA file>"
        return message
