"""What torchrun loads from elastic_ddp at start-up, through the `torchrun.handlers` entry point.

torch's registry imports every `torchrun.handlers` entry point when an agent starts, calls it, and
registers the returned factory under the entry point's name (`etcd-v3`). A plugin that fails to
load is only logged as a warning by torch, so keep this module tiny and free of heavy imports: the
etcd client is imported only when an `etcd-v3` rendezvous is actually created.

Loading the plugin also turns off torch's agent-shared TCPStore for this agent (unless the user set
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE` explicitly): with the shared store, workers restarted after a
re-rendezvous read stale gloo addresses and hang or loop on "Connection refused"
(pytorch/pytorch#135712). See docs/failure-semantics.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable

SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def disable_shared_tcp_store_by_default() -> None:
    """Make torchrun give each worker group its own store, unless the user decided otherwise."""
    os.environ.setdefault(SHARED_STORE_OPT_OUT, "1")


def etcd_v3_handler_factory() -> Callable:
    """Entry point: return the factory torchrun calls with its `RendezvousParameters`."""
    disable_shared_tcp_store_by_default()

    def create_etcd_v3_handler(params):
        from elastic_ddp.rendezvous import create_etcd_v3_handler as create

        return create(params)

    return create_etcd_v3_handler
