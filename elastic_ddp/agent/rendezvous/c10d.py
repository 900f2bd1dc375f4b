"""`--rdzv_backend=elastic-c10d`: torch's c10d rendezvous with what `rendezvous.handler` adds.

The rendezvous is torch's own (`c10d`: a TCPStore on the node at `--rdzv_endpoint`, torch's
dynamic rendezvous algorithm, every `--rdzv_conf` key of it), with our shipped timing for the keys
you leave out, dead-node probes (`probe_dead_nodes=0` turns them off), prompt completion
(`prompt_completion=0`), a last call that arrivals restart (`extend_last_call=0`), a waiting
agent looking at the state ten times a second, and a store of their own for the workers of every
round. A killed node's survivors train again in about a second
instead of after a heartbeat expiry, a last call and torch's once-a-second polling.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
)

from elastic_ddp.agent.rendezvous.handler import check_options, elastic_handler

BACKEND_NAME = "elastic-c10d"


class NamedBackend(RendezvousBackend):
    """torch's c10d backend under our backend name (torchrun checks that the two agree)."""

    def __init__(self, backend: RendezvousBackend, name: str = BACKEND_NAME):
        self._backend = backend
        self._name = name

    @property
    def name(self) -> str:
        """See base class."""
        return self._name

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        return self._backend.get_state()

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        return self._backend.set_state(state, token)


def create_c10d_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's `c10d` rendezvous handler with our additions (ValueError for a bad `--rdzv_conf`
    value, before any connection)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    check_options(params)
    c10d_backend, store = create_backend(params)
    return elastic_handler(params, store, NamedBackend(c10d_backend))
