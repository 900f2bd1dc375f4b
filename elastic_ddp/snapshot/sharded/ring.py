"""Where each rank's memory copy of its part goes: its *buddy*, on another node whenever there is one.

Every rank says which node it is on (torchrun's GROUP_RANK; without torchrun, `rank //
local_world_size`), once per worker group. The ranks are put in a ring ordered by (node, rank) and
each one sends its part `shift` places along it, where `shift` is the size of the largest node:
with nodes of equal sizes that is the rank of the same local rank on the next node, and in general
no rank's buddy is on its own node as long as no node holds more than half the ranks. Each rank
sends one part and receives one (a permutation), so the exchange is one send and one receive.

Not guaranteed: with a single node (or a node holding more than half of the ranks) some copies
stay on the node of their part; the loss of that node then loses them, and the restart takes the
newest durable snapshot. This is said once per worker group, as a warning.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import torch.distributed as dist

from elastic_ddp.runtime.distributed import DistributedContext

logger = logging.getLogger(__name__)


def node_of_each_rank(context: DistributedContext) -> list[int]:
    """The node of every rank of the group (collective when in a process group)."""
    mine = int(os.environ.get("GROUP_RANK", context.rank // max(context.local_world_size, 1)))
    if not context.in_process_group or context.world_size < 2:
        return [mine] * max(context.world_size, 1)
    nodes: list[int] = [0] * context.world_size
    dist.all_gather_object(nodes, mine)
    return nodes


def ring_partners(rank: int, nodes: list[int]) -> tuple[int, int] | None:
    """(buddy, the rank whose buddy `rank` is) given the node of every rank, or None alone."""
    world = len(nodes)
    if world < 2:
        return None
    order = sorted(range(world), key=lambda other: (nodes[other], other))
    largest = max(Counter(nodes).values())
    shift = largest if 2 * largest <= world else max(world - largest, 1)
    position = order.index(rank)
    return order[(position + shift) % world], order[(position - shift) % world]


def copies_on_their_own_node(nodes: list[int]) -> int:
    """How many ranks' buddies are on the rank's own node (0 with two nodes or more of equal sizes)."""
    partners = [ring_partners(rank, nodes) for rank in range(len(nodes))]
    return sum(1 for rank, pair in enumerate(partners) if pair is None or nodes[pair[0]] == nodes[rank])


def warn_if_not_spread(nodes: list[int]) -> None:
    """The warning, once per worker group (the caller's rank 0), when some copies cannot leave their node."""
    exposed = copies_on_their_own_node(nodes)
    if not exposed:
        return
    if len(nodes) == 1:
        logger.warning("memory copies of shards: one rank alone keeps its part in this node's memory only (there "
                       "is no other rank to copy it to): a lost worker costs no step, the loss of the node falls "
                       "back to the newest durable snapshot")
    elif len(set(nodes)) == 1:
        logger.warning("memory copies of shards: all %d rank(s) are on one node, so each part's copy is on that "
                       "node too: a lost worker costs no step, the loss of the node falls back to the newest "
                       "durable snapshot", len(nodes))
    else:
        logger.warning("memory copies of shards: %d of %d parts have their copy on their own node (one node holds "
                       "more than half of the ranks: %s); the loss of that node falls back to the newest durable "
                       "snapshot", exposed, len(nodes), dict(sorted(Counter(nodes).items())))
