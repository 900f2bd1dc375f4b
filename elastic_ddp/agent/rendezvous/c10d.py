"""`--rdzv_backend=elastic-c10d --rdzv_conf algorithm=dynamic`: torch's c10d rendezvous with what
`rendezvous.handler` adds (elastic-c10d's default, `keyed_c10d`, is another algorithm in the same store).

The rendezvous is torch's own (`c10d`: a TCPStore on the node at `--rdzv_endpoint`, torch's
dynamic rendezvous algorithm, every `--rdzv_conf` key of it), with our shipped timing for the keys
you leave out, dead-node probes (`probe_dead_nodes=0` turns them off), prompt completion
(`prompt_completion=0`), a last call that arrivals restart (`extend_last_call=0`), a waiting
agent looking at the state ten times a second, and a store of their own for the workers of every
round. A killed node's survivors train again in about a second
instead of after a heartbeat expiry, a last call and torch's once-a-second polling.

Addresses (`addresses`, `c10d_store`): the node whose interface holds the endpoint's address
hosts the store (`is_host` still decides where given), the workers' gloo and NCCL use the
interface that holds this node's published address, and a node that would publish a loopback
address to another machine, or that cannot reach the endpoint, says so in one line. When the
store's node is cut off while other nodes answer, this node stops with one line naming the
endpoint (`store_watch`); when this node itself is cut off, it waits and rejoins.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
)

from elastic_ddp.agent.rendezvous import addresses
from elastic_ddp.agent.rendezvous.c10d_store import create_tcp_store, endpoint_of, hosts_store
from elastic_ddp.agent.rendezvous.handler import check_options, elastic_handler, with_shipped_defaults
from elastic_ddp.agent.rendezvous.store_watch import StoreWatch

logger = logging.getLogger(__name__)

BACKEND_NAME = "elastic-c10d"


class NamedBackend(RendezvousBackend):
    """torch's c10d backend under our backend name (torchrun checks that the two agree), its
    requests run through `watch` where given (a store whose node is cut off: `store_watch`)."""

    def __init__(self, backend: RendezvousBackend, name: str = BACKEND_NAME, watch: StoreWatch | None = None):
        self._backend = backend
        self._name = name
        self._watch = watch

    @property
    def name(self) -> str:
        """See base class."""
        return self._name

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        if self._watch is None:
            return self._backend.get_state()
        return self._watch.call("read the rendezvous state", self._backend.get_state)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if self._watch is None:
            return self._backend.set_state(state, token)
        return self._watch.call("write the rendezvous state", lambda: self._backend.set_state(state, token))


def create_c10d_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's `c10d` rendezvous handler with our additions, its TCPStore hosted by the node that
    holds the endpoint's address (`c10d_store`). Raises ValueError for a bad `--rdzv_conf` value,
    and for a loopback address published to peers on another machine (`addresses.loopback_problem`),
    before any connection; RendezvousConnectionError (one line) when the store cannot be reached."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend

    check_options(params)
    if params.get("store_type", "tcp").strip().lower() != "tcp":
        c10d_backend, store = create_backend(params)  # torch's FileStore: one machine, nothing to decide
        return elastic_handler(params, store, NamedBackend(c10d_backend))
    host, port = endpoint_of(params)
    is_host, _ = hosts_store(params)
    problem = addresses.loopback_problem(params.local_addr, host, port)
    if problem is not None and not is_host:
        raise ValueError(problem)  # the store's node is another machine: the peers are elsewhere
    if problem is not None:
        logger.warning("%s (unless every node of the job runs on this machine)", problem)
    store = create_tcp_store(params)
    watch = StoreWatch(host, port, silence_s=heartbeat_expiry_s(with_shipped_defaults(params)))
    backend = NamedBackend(C10dRendezvousBackend(store, params.run_id), watch=watch)
    return elastic_handler(params, store, backend, store_watch=watch)


def heartbeat_expiry_s(params: RendezvousParameters) -> float:
    """Seconds after its last heartbeat that a node counts as gone: keep_alive_interval x
    keep_alive_max_attempt (torch's keys; 5 s shipped)."""
    return float(params.get_as_int("keep_alive_interval", 5)) * params.get_as_int("keep_alive_max_attempt", 3)
