"""Rendezvous for torchrun: elastic_ddp's backends and what they share.

torchrun finds the backends through the `torchrun.handlers` entry points (`plugin`), so once
elastic_ddp is installed `--rdzv_backend=etcd-v3` and `--rdzv_backend=elastic-c10d` just work:

    torchrun --nnodes=1:4 --nproc_per_node=8 --rdzv_backend=etcd-v3 \\
        --rdzv_endpoint=etcd1:2379,etcd2:2379,etcd3:2379 --rdzv_id=job42 -m elastic_ddp.train ...

Modules: `plugin` (the entry points; imports nothing heavy), `defaults` (the torchrun settings we
ship), `agent_setup` (what every handler does to its agent before the first round), the keyed
rendezvous (`keyed_handler` the algorithm, `keyed_rounds` its rules, `keyed_state` its nodes and records,
`keyed_probes` and `keyed_silence` who has exited or gone silent, on the beacons of `liveness`),
its two boards (`keyed_c10d` in a TCPStore, hosted as `c10d_store` says and watched by
`store_watch`; `keyed_etcd` in etcd), `addresses` (which interface and address a node uses),
`torch_internals` (the one private torch name used), and for etcd: `etcd_options` (the
--rdzv_conf keys), `etcd_client` (imports etcd3 around its protobuf problem), `etcd_connection`
(failover, retries, TLS, auth, lease), `etcd_store` (the agents' c10d store). See docs/etcd.md.

The names below are imported on first use, so that `import elastic_ddp.agent.rendezvous.plugin` (which
every torchrun agent of the environment does) loads neither etcd3 nor protobuf.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EtcdAuthenticationError": "etcd_connection", "EtcdConnection": "etcd_connection",
    "EtcdTlsError": "etcd_connection", "EtcdUnavailableError": "etcd_connection",
    "EtcdV3Options": "etcd_options", "Secret": "etcd_options", "EtcdV3Store": "etcd_store",
    "KeyedRendezvousHandler": "keyed_handler", "create_keyed_c10d_handler": "keyed_c10d",
    "create_keyed_etcd_v3_handler": "keyed_etcd",
}
__all__ = tuple(sorted(_EXPORTS))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
