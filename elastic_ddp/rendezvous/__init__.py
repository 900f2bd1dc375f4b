"""Rendezvous for torchrun on etcd through the v3 API: `--rdzv_backend=etcd-v3`.

torchrun finds it through the `torchrun.handlers` entry point (elastic_ddp.torchrun_plugin), so
once elastic_ddp is installed this is all it takes:

    torchrun --nnodes=1:4 --nproc_per_node=8 --rdzv_backend=etcd-v3 \
        --rdzv_endpoint=etcd1:2379,etcd2:2379,etcd3:2379 --rdzv_id=job42 \
        --rdzv_conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5 \
        -m elastic_ddp.train ...

Modules: `options` (the --rdzv_conf keys), `etcd_client` (imports etcd3 around its protobuf
problem), `connection` (failover, retries, TLS, auth, lease), `etcd_backend` (the rendezvous
state), `etcd_store` (the agents' c10d store), `handler` (puts them together). See docs/etcd.md.
"""

from __future__ import annotations

from elastic_ddp.rendezvous.connection import (
    EtcdAuthenticationError,
    EtcdConnection,
    EtcdTlsError,
    EtcdUnavailableError,
)
from elastic_ddp.rendezvous.etcd_backend import EtcdV3RendezvousBackend
from elastic_ddp.rendezvous.etcd_store import EtcdV3Store
from elastic_ddp.rendezvous.handler import create_etcd_v3_handler
from elastic_ddp.rendezvous.options import EtcdV3Options, Secret

__all__ = [
    "EtcdAuthenticationError",
    "EtcdConnection",
    "EtcdTlsError",
    "EtcdUnavailableError",
    "EtcdV3Options",
    "EtcdV3RendezvousBackend",
    "EtcdV3Store",
    "Secret",
    "create_etcd_v3_handler",
]
