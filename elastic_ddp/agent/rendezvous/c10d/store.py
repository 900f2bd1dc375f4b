"""The c10d store of `--rdzv_backend=elastic-c10d`: which node hosts it, and reaching it.

    store = create_tcp_store(params)   # a TCPStore at --rdzv_endpoint, hosted by this node or not

torch's `c10d` hosts the store on the node whose host name matches the endpoint
(`_matches_machine_hostname`), and on a machine whose host name resolves to loopback (127.0.1.1 on
Debian and Ubuntu) or to an address of another interface, no node does: every agent waits 60 s
for a store nobody started, then fails with a traceback. Here the node that hosts it is the one
whose own interface holds an address the endpoint resolves to (`addresses.holds`), whatever its
host name resolves to, or one that torch's rule picks; `--rdzv_conf is_host=1` (or 0) still
decides where given. As in torch, a
node that finds the endpoint's address its own but cannot listen there (another agent of this
machine hosts it already) joins as a client, unless `is_host=1` was given.

A node that does not host the store first makes sure that it reaches the endpoint's machine (a
connection accepted, or refused because the store is not up yet): one that does not (the connect
times out, no route, the name does not resolve) says so in one warning line within
`PROBE_TIMEOUT_S`, naming the endpoint, and keeps trying until `read_timeout` (torch's key,
60 s by default, the time torch's client waits for the store), then stops with one line
(`RendezvousConnectionError`) instead of torch's traceback. A store that refuses for all that time
(the host agent never started, a wrong port) is left to torch's client, as before.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elastic_ddp.agent.rendezvous import addresses, torch_internals

logger = logging.getLogger(__name__)

# torch's c10d defaults: the endpoint's port, and the seconds a store operation (and the client's
# first connection) waits.
DEFAULT_PORT = 29400
DEFAULT_READ_TIMEOUT_S = 60
# Seconds one attempt to reach the endpoint waits for the TCP handshake, and between attempts.
PROBE_TIMEOUT_S = 2.0
PROBE_INTERVAL_S = 1.0
# Seconds between connects within one probe after one failed with no route (`unanswered`).
NO_ROUTE_RETRY_S = 0.1


def endpoint_of(params: RendezvousParameters) -> tuple[str, int]:
    """(host, port) of `--rdzv_endpoint` (torch's parser; the port defaults to 29400)."""
    return parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)


def read_timeout_s(params: RendezvousParameters) -> int:
    """`read_timeout` of `--rdzv_conf` (torch's key, default 60); ValueError naming a bad value."""
    try:
        value = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ValueError(f"--rdzv_conf read_timeout: got {params.get('read_timeout')!r}; expected a whole number of "
                         "seconds above 0")
    return value


def hosts_store(params: RendezvousParameters) -> tuple[bool, bool]:
    """(whether this node hosts the store, whether `is_host` decided it) (module docstring)."""
    try:
        forced = params.get_as_bool("is_host")
    except ValueError:
        raise ValueError(f"--rdzv_conf is_host: got {params.get('is_host')!r}; expected 1 or 0 (also true/false, "
                         "yes/no)") from None
    if forced is not None:
        return forced, True
    host, _ = endpoint_of(params)
    # torch's rule too, so that every node torch makes the host stays the host (a name that
    # resolves only later, a CNAME that torch matches by its canonical name).
    return bool(addresses.holds(host)) or torch_internals.matches_machine_hostname(host), False


def create_tcp_store(params: RendezvousParameters) -> TCPStore:
    """The rendezvous TCPStore at `--rdzv_endpoint`, hosted here if this node hosts it (module
    docstring). Raises ValueError for a bad `is_host` or `read_timeout`, RendezvousConnectionError
    (one line) when the endpoint cannot be reached or the store not started or joined."""
    host, port = endpoint_of(params)
    timeout_s = read_timeout_s(params)
    is_host, forced = hosts_store(params)
    if not is_host:
        wait_until_reachable(host, port, timeout_s)
    for is_server in dict.fromkeys((is_host, False)):
        try:
            store = TCPStore(host, port, is_master=is_server, multi_tenant=True, timeout=timedelta(seconds=timeout_s))
        except (ValueError, RuntimeError, TimeoutError) as exc:
            if is_server and not forced:
                logger.info("could not host the c10d store on %s:%d (%s): joining it as a client", host, port,
                            _first_line(exc))
                continue
            role = "host" if is_server else "reach"
            raise RendezvousConnectionError(f"could not {role} the c10d rendezvous store at --rdzv_endpoint "
                                            f"{host}:{port}: {_first_line(exc)}") from exc
        if is_server:
            logger.info("this node hosts the c10d rendezvous store on %s:%d (%s)", host, port,
                        "--rdzv_conf is_host=1" if forced else "an interface of this machine holds the address")
        return store
    raise AssertionError("unreachable: the last attempt returns or raises")


def wait_until_reachable(host: str, port: int, timeout_s: float) -> None:
    """Return once the endpoint's machine answers at `host:port` (accepts, or refuses because the
    store is not up yet); warn in one line at the first attempt that gets no answer, and raise
    RendezvousConnectionError (one line) after `timeout_s` without one."""
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        reason = unanswered(host, port)
        if reason is None:
            if warned:
                logger.warning("the rendezvous endpoint %s:%d answers now", host, port)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousConnectionError(
                f"cannot reach the rendezvous endpoint --rdzv_endpoint={host}:{port} from this node ({reason}, for "
                f"{timeout_s:g} s): check the address and that this node's network reaches it")
        if not warned:
            logger.warning("cannot reach the rendezvous endpoint --rdzv_endpoint=%s:%d from this node (%s): trying "
                           "for %.0f s more; check the address and that this node's network reaches it",
                           host, port, reason, left)
            warned = True
        time.sleep(min(PROBE_INTERVAL_S, left))


def unanswered(host: str, port: int) -> str | None:
    """Why `host:port` gave no answer to a TCP connect for `PROBE_TIMEOUT_S`, or None as soon as one
    is accepted or refused.

    A connect that fails early with no route (EHOSTUNREACH, ENETUNREACH, ...) is made again, every
    `NO_ROUTE_RETRY_S`, until that deadline: the kernel fails every packet it queued on an address
    resolution (ARP, NDP) whose last request went out before a link came back, up to a second after
    the link is back, and a new connect resolves afresh. Taken at once, that failure makes a node
    whose partition has just healed read the endpoint as cut off while its peers answer, and stop
    (`c10d.watch`; tests/cluster/test_network_faults.py replays it).
    """
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while True:
        try:
            socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.01)).close()
            return None
        except ConnectionRefusedError:
            return None
        except socket.gaierror as exc:
            return f"{host!r} does not resolve: {exc.strerror}"
        except TimeoutError:
            return f"no answer within {PROBE_TIMEOUT_S:g} s"
        except OSError as exc:
            if deadline - time.monotonic() <= NO_ROUTE_RETRY_S:
                return exc.strerror or type(exc).__name__
        time.sleep(NO_ROUTE_RETRY_S)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
