"""What our backends (`elastic-c10d`, `etcd-v3`) add to torch's dynamic rendezvous, in one place.

    handler = elastic_handler(params, store, backend)

- the shipped timing (`defaults.SHIPPED_RDZV_DEFAULTS`) for every `--rdzv_conf` key the user left
  out: a user's value always wins;
- dead-node probes, prompt completion and a last call that waits for arrivals (`state_holder`),
  each with its `--rdzv_conf` switch;
- heartbeats beside the state, where the backend offers a channel for them (`heartbeats`);
- a waiting agent looks at the rendezvous state every `SYNC_POLL_S` instead of every second;
- torch's rendezvous names the method of each event it records from one frame, not from two full
  `inspect.stack()` calls (`torch_internals.name_methods_cheaply`);
- the agent's set-up that every handler of ours shares (`agent_setup`): the workers' interface
  and a store of their own for every round.
"""

from __future__ import annotations

import logging

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    create_handler,
)

from elastic_ddp.agent.rendezvous import torch_internals
from elastic_ddp.agent.rendezvous.agent_setup import name_the_workers_interface, never_share_agent_store
from elastic_ddp.agent.rendezvous.defaults import SHIPPED_RDZV_DEFAULTS, SYNC_POLL_S
from elastic_ddp.agent.rendezvous.heartbeats import HeartbeatChannel
from elastic_ddp.agent.rendezvous.liveness import probes_enabled, start_beacon
from elastic_ddp.agent.rendezvous.state_holder import (
    ElasticStateHolder,
    last_call_extension_enabled,
    prompt_completion_enabled,
)
from elastic_ddp.agent.rendezvous.store_watch import StoreWatch

logger = logging.getLogger(__name__)


def with_shipped_defaults(params: RendezvousParameters) -> RendezvousParameters:
    """`params` with `SHIPPED_RDZV_DEFAULTS` for every key it does not set (changed in place)."""
    for key, value in SHIPPED_RDZV_DEFAULTS.items():
        if params.get(key) in (None, ""):
            params.config[key] = value
    return params


def check_options(params: RendezvousParameters) -> tuple[bool, bool, bool]:
    """(probes, prompt completion, last call extension) from `--rdzv_conf`; ValueError naming a bad value."""
    return probes_enabled(params), prompt_completion_enabled(params), last_call_extension_enabled(params)


def elastic_handler(params: RendezvousParameters, store: Store, backend: RendezvousBackend,
                    heartbeats: HeartbeatChannel | None = None, nodes_per_poll: int = 0,
                    store_watch: StoreWatch | None = None) -> DynamicRendezvousHandler:
    """torch's dynamic rendezvous handler on `store` and `backend`, with our additions (module
    docstring); heartbeats go through `heartbeats` where given, else through the state as in torch;
    `nodes_per_poll`: see `ElasticStateHolder`; `store_watch`, the watch that `backend` runs its
    requests through, learns from the dead-node beacons whether other nodes answer.

    Call it once per agent, before its first `next_rendezvous`, and use only the returned handler.
    """
    probes, prompt, extend = check_options(params)
    never_share_agent_store()
    name_the_workers_interface(params.local_addr)
    handler = create_handler(store, backend, with_shipped_defaults(params))
    node = torch_internals.handler_node(handler)
    beacon, detector = start_beacon(store, node) if probes else (None, None)
    if store_watch is not None and detector is not None:
        store_watch.peers_answer = lambda: detector.any_answers(node)
    holder = torch_internals.new_state_holder(ElasticStateHolder, backend, handler, node=node, detector=detector,
                                              beacon=beacon, prompt_completion=prompt, extend_last_call=extend,
                                              heartbeats=heartbeats, nodes_per_poll=nodes_per_poll)
    torch_internals.poll_rendezvous_every(SYNC_POLL_S)
    torch_internals.name_methods_cheaply()
    settings = torch_internals.handler_settings(handler)
    logger.info("rendezvous '%s' (%s): last call %g s, heartbeat every %g s, expiry after %d missed, join timeout "
                "%g s (%s); dead-node probes %s, prompt completion %s, last call restarted by arrivals %s",
                params.run_id, backend.name, settings.timeout.last_call.total_seconds(), settings.keep_alive_interval.total_seconds(),
                settings.keep_alive_max_attempt, settings.timeout.join.total_seconds(),
                "heartbeats in keys of their own" if heartbeats is not None else "heartbeats in the state",
                "on" if probes else "off",
                "on" if prompt else "off", "on" if extend else "off")
    return torch_internals.with_state_holder(handler, holder)
