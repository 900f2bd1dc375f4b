"""Rendezvous for torchrun: elastic_ddp's backends and what they share.

torchrun finds the backends through the `torchrun.handlers` entry points (`plugin`), so once
elastic_ddp is installed `--rdzv_backend=etcd-v3` and `--rdzv_backend=elastic-c10d` just work:

    torchrun --nnodes=1:4 --nproc_per_node=8 --rdzv_backend=etcd-v3 \\
        --rdzv_endpoint=etcd1:2379,etcd2:2379,etcd3:2379 --rdzv_id=job42 -m elastic_ddp.train ...

Modules and rooms:

- `plugin`: the entry points (imports nothing heavy); `defaults`: the torchrun settings we ship;
  `agent_setup`: what every handler does to its agent before the first round.
- The rendezvous: `handler` (the algorithm), `rounds` (its rules), `state` (its nodes and
  records), `probes` and `silence` (who has exited or gone silent, on the beacons of `liveness`).
- `boards/`: where a round's keys live, one board per holder: `boards.etcd` in etcd,
  `boards.c10d` in a TCPStore.
- `c10d/`: the elastic-c10d TCPStore: `c10d.store` (which node hosts it, reaching it),
  `c10d.watch` (a store that went silent).
- `etcd/`: `etcd.options` (the --rdzv_conf keys), `etcd.client` (imports etcd3 around its
  protobuf problem), `etcd.connection` (failover, retries, TLS, auth, lease), `etcd.store` (the
  agents' c10d store). See docs/etcd.md.
- `addresses`: which interface and address a node uses; `torch_internals`: the one private torch
  name used.

The names below are imported on first use, so that `import elastic_ddp.agent.rendezvous.plugin` (which
every torchrun agent of the environment does) loads neither etcd3 nor protobuf.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EtcdAuthenticationError": "etcd.connection", "EtcdConnection": "etcd.connection",
    "EtcdTlsError": "etcd.connection", "EtcdUnavailableError": "etcd.connection",
    "EtcdV3Options": "etcd.options", "Secret": "etcd.options", "EtcdV3Store": "etcd.store",
    "RoundRendezvousHandler": "handler", "create_elastic_c10d_handler": "boards.c10d",
    "create_etcd_v3_handler": "boards.etcd",
}
__all__ = tuple(sorted(_EXPORTS))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
