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
  process, their torch agents take no part, so `handler` does their part (`RankAssignment`):
  the keys and the JSON are torch's, written here.

Nothing else in the package touches a private name of torch's (elastic_ddp's rendezvous names its
nodes with `state.NodeDesc`, its own); tests/unit/test_torch_internals.py pins the first one and
tests/unit/test_rendezvous_in_process.py runs torch's own barrier over the second and torch's own
rank assignment against the third, so that a torch upgrade that moves any of them fails there
first, with the name.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import timedelta

from torch.distributed import Store
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID, _RoleInstanceInfo
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
_ROLE_INFO_PREFIX = "torchelastic/role_info/"  # the two key prefixes of `_assign_worker_ranks`
_ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"


class RankAssignment:
    """An agent's part in torch's rank assignment over a round's `store` (its slow path), for an
    agent whose torch agent takes no part in the round (an in-process one)."""

    def __init__(self, store: Store):
        self._store = store

    def publish_role(self, group_rank: int, local_world_size: int) -> None:
        """This node's role info, as every agent writes it."""
        info = _RoleInstanceInfo(TORCHRUN_ROLE, group_rank, local_world_size)
        self._store.set(f"{_ROLE_INFO_PREFIX}{group_rank}", info.serialize())

    def assign(self, group_world_size: int, timeout: timedelta) -> None:
        """What group rank 0's agent computes: once every node's role info is in (within `timeout`,
        else the store's timeout error), each node's [base global rank, global world size, base
        role rank, role world size], by torch's rule: the local world sizes summed in group rank order."""
        keys = [f"{_ROLE_INFO_PREFIX}{rank}" for rank in range(group_world_size)]
        self._store.wait(keys, timeout)
        infos = [_RoleInstanceInfo.deserialize(bytes(value)) for value in self._store.multi_get(keys)]
        role_sizes: dict[str, int] = defaultdict(int)
        for info in infos:
            role_sizes[info.role] += info.local_world_size
        global_size = sum(info.local_world_size for info in infos)
        base_global_rank, role_ranks, values = 0, defaultdict(int), []
        for info in infos:
            values.append(json.dumps([base_global_rank, global_size, role_ranks[info.role], role_sizes[info.role]]))
            base_global_rank += info.local_world_size
            role_ranks[info.role] += info.local_world_size
        self._store.multi_set([f"{_ASSIGNED_RANKS_PREFIX}{rank}" for rank in range(group_world_size)], values)
