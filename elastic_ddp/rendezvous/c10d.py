"""`--rdzv_backend=elastic-c10d`: torch's c10d rendezvous with dead-node probes.

The rendezvous is torch's own (`c10d`: a TCPStore on the node at `--rdzv_endpoint`, torch's
dynamic rendezvous algorithm, every `--rdzv_conf` key of it), with elastic_ddp's dead-node probes
(`liveness`; `probe_dead_nodes=0` turns them off): a killed node leaves the rendezvous as soon as
a survivor waits for it, instead of when its heartbeat expires.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)

from elastic_ddp.rendezvous.liveness import probes_enabled, with_dead_node_probes

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
    """torch's `c10d` rendezvous handler, with dead-node probes unless `probe_dead_nodes=0`."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    enabled = probes_enabled(params)
    c10d_backend, store = create_backend(params)
    backend = NamedBackend(c10d_backend)
    handler = create_handler(store, backend, params)
    return with_dead_node_probes(handler, backend) if enabled else handler
