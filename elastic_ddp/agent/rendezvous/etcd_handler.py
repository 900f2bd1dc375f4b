"""`create_etcd_v3_handler`: what torchrun calls for `--rdzv_backend=etcd-v3 --rdzv_conf algorithm=dynamic`
(etcd-v3's default is the keyed rendezvous, `keyed_etcd`).

It builds torch's own dynamic rendezvous (the algorithm behind `c10d`) on top of
`EtcdV3RendezvousBackend` and `EtcdV3Store`, so every `--rdzv_conf` setting of torch's dynamic
rendezvous (join_timeout, last_call_timeout, close_timeout, keep_alive_interval,
keep_alive_max_attempt, ...) works as documented by torch, next to the etcd keys of docs/etcd.md.
It adds what `rendezvous.handler` adds for both our backends: the shipped timing for the keys you
leave out, dead-node probes, prompt completion, a last call that arrivals restart and faster
polling (slower with more than `NODES_PER_POLL` nodes); and each node's heartbeat in a key of its
own (`EtcdV3Heartbeats`) instead of in the state, so that heartbeats never compete with joins for
the state's compare-and-set.

Workers never share the agent's store with etcd-v3: they would read stale addresses after a
re-rendezvous (pytorch/pytorch#135712). Rank 0's agent instead publishes its own address
(`--local_addr`, else its FQDN) and a free port through the etcd store, and the workers' rank 0
starts a fresh TCPStore there for every round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic_ddp.agent.rendezvous.agent_setup import warn_if_loopback_published
from elastic_ddp.agent.rendezvous.etcd_backend import EtcdV3Heartbeats, EtcdV3RendezvousBackend
from elastic_ddp.agent.rendezvous.etcd_connection import EtcdConnection
from elastic_ddp.agent.rendezvous.etcd_options import EtcdV3Options
from elastic_ddp.agent.rendezvous.etcd_store import EtcdV3Store
from elastic_ddp.agent.rendezvous.handler import check_options, elastic_handler
from elastic_ddp.agent.rendezvous.heartbeats import HeartbeatChannel

logger = logging.getLogger(__name__)

# A waiting agent reads the state every 0.1 s per this many nodes in it (see `ElasticStateHolder`):
# an etcd read costs the client about 0.6 ms of CPU (gRPC and pure-Python protobuf), 3 to 5 times
# a TCPStore get, and every agent reads ten times a second at 0.1 s.
NODES_PER_POLL = 16

Instrument = Callable[[RendezvousBackend, HeartbeatChannel], tuple[RendezvousBackend, HeartbeatChannel]]


def create_etcd_v3_handler(params: RendezvousParameters, instrument: Instrument | None = None) -> RendezvousHandler:
    """A dynamic rendezvous handler whose state and store live in etcd, through the v3 API.

    `instrument` (for measurements, e.g. benchmarks/rendezvous_agents.py) gets the backend and the
    heartbeat channel and returns what the handler uses instead: wrappers that count operations.

    Raises ValueError for a bad `--rdzv_endpoint` or `--rdzv_conf` value before connecting, and a
    `RendezvousConnectionError` (see `connection`) if etcd cannot be reached, refuses the
    credentials or the TLS handshake, or denies access to the run's keys.
    """
    options = EtcdV3Options.from_params(params)
    check_options(params)
    warn_if_loopback_published(params.local_addr, options.endpoints)
    connection = EtcdConnection(options)
    try:
        backend = EtcdV3RendezvousBackend(connection, params.run_id)
        connection.call(f"read {backend.key}", lambda client: client.get(backend.key))
        heartbeats: HeartbeatChannel = EtcdV3Heartbeats(connection, params.run_id)
        if instrument is not None:
            backend, heartbeats = instrument(backend, heartbeats)
        handler = elastic_handler(params, EtcdV3Store(connection, params.run_id), backend, heartbeats,
                                  NODES_PER_POLL)
    except BaseException:
        connection.close()
        raise
    assert not handler.use_agent_store, "workers must not share the agent's store"
    logger.info("etcd-v3 rendezvous '%s' on %s (%s), keys under %s/%s, ttl %d s", params.run_id,
                ", ".join(options.endpoint_names), options.protocol, options.key_prefix, params.run_id,
                options.ttl)
    return handler
