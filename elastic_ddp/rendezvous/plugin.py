"""What torchrun loads from elastic_ddp at start-up, through the `torchrun.handlers` entry points.

torch's registry imports every `torchrun.handlers` entry point when an agent starts, calls it, and
registers the returned factory under the entry point's name (`etcd-v3`, `elastic-c10d`). A plugin
that fails to load is only logged as a warning by torch, so keep this module tiny and free of
heavy imports: a backend's modules (the etcd client, the probes) are imported only when its
rendezvous is actually created.

Loading the plugin also turns off torch's agent-shared TCPStore for this agent (unless the user set
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE` explicitly): with the shared store, workers restarted after a
re-rendezvous read stale gloo addresses and hang or loop on "Connection refused"
(pytorch/pytorch#135712). See docs/failure-semantics.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from elastic_ddp.rendezvous.defaults import SHARED_STORE_OPT_OUT


def disable_shared_tcp_store_by_default() -> None:
    """Make torchrun give each worker group its own store, unless the user decided otherwise."""
    os.environ.setdefault(SHARED_STORE_OPT_OUT, "1")


def etcd_v3_handler_factory() -> Callable:
    """Entry point `etcd-v3`: the factory torchrun calls with its `RendezvousParameters`."""
    disable_shared_tcp_store_by_default()

    def create_etcd_v3_handler(params):
        from elastic_ddp.rendezvous.etcd_handler import create_etcd_v3_handler as create

        return create(params)

    return create_etcd_v3_handler


def elastic_c10d_handler_factory() -> Callable:
    """Entry point `elastic-c10d`: torch's c10d with dead-node probes (`rendezvous.c10d`)."""
    disable_shared_tcp_store_by_default()

    def create_elastic_c10d_handler(params):
        from elastic_ddp.rendezvous.c10d import create_c10d_handler

        return create_c10d_handler(params)

    return create_elastic_c10d_handler
