"""The private parts of torch's dynamic rendezvous that elastic_ddp relies on, named in one place.

torch offers no public hook to drop a peer from a rendezvous before its heartbeat expires, to
complete a round before its last call, or to poll the state more often than once a second, which
is what our state holder (`state_holder`) and handler (`handler`) do. They therefore subclass
torch's state holder, rebuild a handler around it, shorten one delay and replace one slow helper,
using the names below (torch 2.4 to 2.13). Nothing else in the package touches a private name of torch's rendezvous;
tests/unit/test_torch_internals.py pins each one (it exists, with the shape used here) so that a
torch upgrade that moves one fails there first, with the name.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous
from torch.distributed import Store
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _remove_participant_epilogue,
)
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

# Subclassed by `state_holder.ElasticStateHolder`; its `_sanitize()` drops expired nodes, and `_state`
# (round, participants, wait_list, redundancy_list, last_heartbeats, complete, deadline) and
# `_settings` are read; its `cache_duration` argument is how long a read state is reused.
BackendStateHolder = _BackendRendezvousStateHolder
# A node of the rendezvous (addr, pid, local_id); hashable, printable.
NodeDesc = _NodeDesc


def remove_participant_epilogue(state: Any, settings: RendezvousSettings) -> None:
    """What torch does after removing a participant: reopen or close the round as it must."""
    _remove_participant_epilogue(state, settings)


def matches_machine_hostname(host: str) -> bool:
    """torch's rule for whether this machine hosts the c10d store at `host` (its host name or an
    address it resolves to); `c10d_store` hosts where this or its own interface rule says so."""
    return _matches_machine_hostname(host)


def handler_node(handler: DynamicRendezvousHandler) -> NodeDesc:
    """The node this agent is in `handler`'s rendezvous."""
    return handler._this_node


def handler_settings(handler: DynamicRendezvousHandler) -> RendezvousSettings:
    return handler._settings


def handler_store(handler: DynamicRendezvousHandler) -> Store:
    """The store the handler gives torchrun's agent (the rendezvous store)."""
    return handler._store


def with_state_holder(handler: DynamicRendezvousHandler, holder: BackendStateHolder) -> DynamicRendezvousHandler:
    """A handler like `handler` (node, settings, backend, store) whose state goes through `holder`."""
    return DynamicRendezvousHandler(handler._this_node, handler._settings, handler.get_backend(), handler._store,
                                    holder)


def new_state_holder(holder_class: type, backend: RendezvousBackend, handler: DynamicRendezvousHandler,
                     **extra: Any) -> BackendStateHolder:
    """An instance of `holder_class` (a BackendStateHolder subclass) for `handler`'s settings."""
    return holder_class(backend, handler._settings, **extra)


# torch's rendezvous loop sleeps `_delay(seconds=1)` between two looks at the state while it waits
# (`_DistributedRendezvousOpExecutor.run`, action SYNC); `_delay` is a global of its module.
SYNC_DELAY_S = 1


def poll_rendezvous_every(poll_s: float) -> None:
    """Make a waiting agent of this process look at the rendezvous state every `poll_s` seconds
    instead of every `SYNC_DELAY_S`. Every other delay of torch's rendezvous (the random start-up
    skew) is kept.

    Process-wide: called by our backends only, in the agent that uses one (it runs one rendezvous).
    """
    original = getattr(dynamic_rendezvous._delay, "elastic_ddp_original", dynamic_rendezvous._delay)

    def delay(seconds: float | tuple[float, float]) -> None:  # torch calls it as _delay(seconds=...)
        original(poll_s if seconds == SYNC_DELAY_S else seconds)

    delay.elastic_ddp_original = original  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = delay


# torch's own, kept before `name_methods_cheaply` replaces it (this module is imported first).
TORCH_GET_METHOD_NAME = dynamic_rendezvous.get_method_name


def name_methods_cheaply() -> None:
    """Replace `dynamic_rendezvous.get_method_name` with an equivalent that reads one frame.

    torch's version calls `inspect.stack()` twice, which builds every frame's source context (it
    stats and reads the source files), for the event it records at every rendezvous action: in the
    rendezvous-at-scale benchmark that was most of all the agents' time at 32 agents
    (docs/benchmarks-history.md). `sys._getframe(depth)` names the same frame: depth 0 is this function,
    as `inspect.stack()[0]` is torch's. Process-wide, idempotent; called by our backends only.
    """
    dynamic_rendezvous.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"
