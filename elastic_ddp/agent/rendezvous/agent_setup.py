"""What every handler of ours does to its torchrun agent before the first round, in one place.

    settings = prepare_agent(params, BOARD_KEYS)   # both boards (elastic-c10d, etcd-v3)

- the `--rdzv_conf` keys are checked before anything connects: a bad value is one `ValueError`
  naming the key, and a key the rendezvous would not read (`UNREAD_KEYS`, or one that
  neither it nor the board knows) is refused rather than accepted and ignored; the shipped timing
  (`defaults.SHIPPED_RDZV_DEFAULTS`) fills the keys left out;
- the workers get a store of their own for every round (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, set
  in the agent that uses our backend, never at plugin load): the agent-shared store makes restarted
  workers read stale addresses (pytorch/pytorch#135712);
- the workers' gloo and NCCL use the interface that holds this node's published address
  (`--local_addr`, else its FQDN), unless `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` are set
  (`addresses`): set in this agent's environment, which torchrun's workers inherit;
- the workers learn whether they may re-form in process (`in_process` of `--rdzv_conf`, default on):
  `ELASTIC_DDP_IN_PROCESS=1` or `0` in this agent's environment (`round_handoff.IN_PROCESS_ENV`).

What differs per board stays with the board: a loopback address published to other machines stops
an elastic-c10d node that does not host the store (its peers cannot reach it) and is a warning with
etcd-v3 (`warn_if_loopback_published`: etcd is no peer, and every node may run on this machine).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous import addresses
from elastic_ddp.agent.rendezvous.defaults import SHARED_STORE_OPT_OUT
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import NodeDesc
from elastic_ddp.handoff.rounds import IN_PROCESS_ENV

logger = logging.getLogger(__name__)
_local_ids = itertools.count()  # the handlers of this process, numbered as torch numbers its own
_local_ids_lock = threading.Lock()  # next() of a count is atomic only under the GIL

# The --rdzv_conf keys the handler reads on every board, and `timeout`, which torchrun adds to every one (a
# join timeout of torch's etcd-v2 backend; `join_timeout` is the one read here).
HANDLER_KEYS = frozenset({"join_timeout", "last_call_timeout", "keep_alive_interval", "keep_alive_max_attempt",
                        "prompt_completion", "probe_dead_nodes", "in_process", "extend_last_call", "timeout"})
# Keys that the rendezvous does not read, with what it does instead: torch's dynamic
# rendezvous (torch's own `c10d`) reads the first two, and elastic_ddp's former dynamic algorithm read
# `extend_last_call`; `extend_last_call=1` is what the rendezvous does, so only 0 is refused.
UNREAD_KEYS = {
    "close_timeout": "closing a round or the rendezvous is one write",
    "heartbeat_timeout": "a node counts as dead when its lease ends, after keep_alive_interval x "
                         "keep_alive_max_attempt",
    "extend_last_call": "every arrival restarts the last call",
}


def prepare_agent(params: RendezvousParameters, board_keys: frozenset[str]) -> RendezvousSettings:
    """The rendezvous's settings from `params`, after the checks and the set-up of the module
    docstring; `board_keys`: the `--rdzv_conf` keys the board itself reads (its connection, its
    store). Call it before connecting: a bad or unknown key raises ValueError and changes nothing."""
    refuse_unread_keys(params)
    refuse_unknown_keys(params, board_keys)
    settings = RendezvousSettings.from_params(params)
    never_share_agent_store()
    name_the_workers_interface(params.local_addr)
    os.environ[IN_PROCESS_ENV] = "1" if settings.in_process else "0"
    return settings


def local_node(params: RendezvousParameters) -> NodeDesc:
    """A new node of this process, made as torch's dynamic rendezvous makes its own: `--local_addr`
    (else this host's FQDN), this process's id, and the next number of a per-process counter."""
    with _local_ids_lock:
        local_id = next(_local_ids)
    return NodeDesc(params.local_addr or socket.getfqdn(), os.getpid(), local_id)


def refuse_unread_keys(params: RendezvousParameters) -> None:
    """ValueError naming the first key of `UNREAD_KEYS` that `params` sets (but
    `extend_last_call=1`), what the rendezvous does instead, and the fix."""
    for key, instead in UNREAD_KEYS.items():
        value = params.get(key)
        if value in (None, "") or (key == "extend_last_call" and str(value).strip().lower() in ("1", "true", "yes")):
            continue
        raise ValueError(f"--rdzv_conf {key}: got {value!r}, which the rendezvous of {params.backend} does "
                         f"not read: {instead}; remove the key")


def refuse_unknown_keys(params: RendezvousParameters, board_keys: frozenset[str]) -> None:
    """ValueError naming the first `--rdzv_conf` key that neither the rendezvous nor the board
    reads (a typo such as `last_call_timout` would otherwise leave the shipped value in force
    without a word), with the keys accepted."""
    known = HANDLER_KEYS | board_keys
    unknown = sorted(set(params.config) - known - UNREAD_KEYS.keys())
    if unknown:
        raise ValueError(f"--rdzv_conf {unknown[0]}: not a key of {params.backend} (elastic_ddp's rendezvous); expected "
                         f"one of {', '.join(sorted(known - {'timeout'}))}")


def never_share_agent_store() -> None:
    """Make torch's agent give the workers a store of their own (see the module docstring).

    torch reads the variable both for `use_agent_store` and, in `next_rendezvous`, to decide
    whether rank 0's agent hosts a TCPStore for the workers; the two must agree, so the variable
    itself is set rather than one of them overridden.
    """
    chosen = os.environ.get(SHARED_STORE_OPT_OUT)
    if chosen not in (None, "1"):
        logger.warning("%s=%s is ignored: elastic_ddp's backends never let workers share the agent's store, since "
                       "they read stale addresses from it after a re-rendezvous (pytorch/pytorch#135712)",
                       SHARED_STORE_OPT_OUT, chosen)
    os.environ[SHARED_STORE_OPT_OUT] = "1"


def name_the_workers_interface(local_addr: str | None) -> None:
    """Set `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` in this agent's environment (which its
    workers inherit) to the interface that holds this node's published address, each unless set
    (`addresses.worker_interface_environment`)."""
    published = addresses.published_address(local_addr)
    chosen = addresses.worker_interface_environment(published)
    if chosen:
        os.environ.update(chosen)
        logger.info("the workers' gloo and NCCL use interface %s, which holds this node's address %s (%s)",
                    next(iter(chosen.values())), published, ", ".join(f"{name} set" for name in chosen))


def warn_if_loopback_published(local_addr: str | None, endpoints) -> None:
    """Warn in one line when this node would publish a loopback address while etcd is on another
    machine (`addresses.loopback_problem`): a warning, not an error, since etcd is no peer, and the
    training nodes may all run on this machine."""
    for host, port in endpoints:
        problem = addresses.loopback_problem(local_addr, host, port)
        if problem is not None:
            logger.warning("%s (unless every training node of the job runs on this machine)", problem)
            return
