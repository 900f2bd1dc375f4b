"""The private names of torch's elastic agent and rendezvous that elastic_ddp relies on, named in one place.

- The elastic-c10d store is hosted where torch's `c10d` would host it too (`matches_machine_hostname`,
  in `c10d.store`; the same in torch 2.4 to 2.13).
- torch's agent ends a job with a barrier on the store of the last round *it* saw
  (`SimpleElasticAgent._exit_barrier`: `store_util.barrier(store, group_world_size,
  key_prefix=_TERMINAL_STATE_SYNC_ID)`): a counter every agent adds 1 to, and a key the agent that
  brings it to the world size sets. After an in-process round torch still holds the round before,
  so `handler` counts the lost nodes in for it (`exit_barrier_keys`).
- After `next_rendezvous`, torch's agent assigns its workers' ranks over the round's store
  (`SimpleElasticAgent._assign_worker_ranks`, its "slow path": every agent writes its role info,
  group rank 0's computes every node's ranks). When a newcomer joins members that re-form in
  process, their torch agents take no part, so `handler` runs that function for them
  (`take_part_in_rank_assignment`).

Nothing else in the package touches a private name of torch's (elastic_ddp's rendezvous names its
nodes with `state.NodeDesc`, its own); tests/unit/test_torch_internals.py pins the first one and
tests/unit/test_rendezvous_in_process.py runs torch's own barrier over the second and torch's own
rank assignment against the third, so that a torch upgrade that moves any of them fails there
first, with the name.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import Store
from torch.distributed.elastic.agent.server.api import (
    _TERMINAL_STATE_SYNC_ID,
    SimpleElasticAgent,
    WorkerSpec,
    _RoleInstanceInfo,
)
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN, _NUM_MEMBERS


def matches_machine_hostname(host: str) -> bool:
    """torch's rule for whether this machine hosts the c10d store at `host` (its host name or an
    address it resolves to); `c10d.store` hosts where this or its own interface rule says so."""
    return _matches_machine_hostname(host)


def exit_barrier_keys() -> tuple[str, str]:
    """(counter, last member) keys of torch's exit barrier, relative to the round's store that torch's
    agent holds: the counter every agent `add`s 1 to when its workers end, and the key set by the one
    whose add makes the counter the agent's world size (`store_util._barrier_nonblocking`)."""
    return _TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, _TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN


# The role torchrun gives every agent (`--role`, default "default"); a node re-formed in process
# cannot read a newcomer's, and every torchrun agent of one job has the same.
TORCHRUN_ROLE = "default"
_ROLE_INFO_PREFIX = "torchelastic/role_info/"  # the key prefix of `_assign_worker_ranks`'s role infos


def take_part_in_rank_assignment(store: Store, group_rank: int, group_world_size: int, local_world_size: int,
                                 timeout: timedelta) -> tuple[int, int]:
    """This agent's part in torch's rank assignment over a round's `store`, for an agent whose torch
    agent takes no part in the round (an in-process one): torch's own `_assign_worker_ranks` (its
    slow path; it uses nothing of its agent), run here; (the global rank of this node's first
    worker, the world size) it assigned. Group rank 0 first waits at most `timeout` for every
    node's role info (torch's own wait is the store's timeout); the store's timeout error after it."""
    if group_rank == 0:
        store.set(f"{_ROLE_INFO_PREFIX}0", _RoleInstanceInfo(TORCHRUN_ROLE, 0, local_world_size).serialize())
        store.wait([f"{_ROLE_INFO_PREFIX}{rank}" for rank in range(group_world_size)], timeout)
    spec = WorkerSpec(role=TORCHRUN_ROLE, local_world_size=local_world_size, rdzv_handler=None,
                      entrypoint="(re-formed in process)")
    first, *_ = SimpleElasticAgent._assign_worker_ranks(None, store, group_rank, group_world_size, spec)
    return first.global_rank, first.world_size
