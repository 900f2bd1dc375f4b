"""The next group of a sharded run restores from the parts its nodes kept in memory (memory_shards.py).

A collective, at the start of every worker group:

1. every rank offers the parts its node's memory directory holds (step, incarnation that committed
   it, world size that wrote it, part, checksum, and the part's small DCP index and unsharded rest;
   not its data), and all ranks gather the offers;
2. the newest (step, incarnation) whose parts are all offered, and whose merged index covers every
   tensor whole, is the memory candidate; newer ones with parts missing are reported as refused
   (`reason`: which parts no node of the group holds). The session takes it when it is at least as
   new as the newest durable snapshot, else the durable snapshot (`restore` event: `source: file`,
   and the refused memory states with their reasons);
3. each rank works out which parts' data it reads for the shards it now owns (DCP's own planner on
   the merged index), and the lowest rank holding each part sends it, over the job's process group
   (exchange/transport.py), to the ranks that need it; the others refuse the frame and keep nothing;
   what arrives is checked against the part's checksum;
4. DCP reads the chunks each rank owns from those parts (memory_checkpoint.MergedCheckpoint.load),
   and the state loaded is checked for NaNs and infinities.

A state that fails in 3 or 4 (a part that arrives damaged, a data file shorter than its index says,
a diverged state) fails on every rank alike (`MemoryRestoreError`, agreed before DCP's collectives
or raised by them on every rank): the session then refuses it with the reason and takes the next
complete memory state or the newest durable snapshot. A copy found damaged in a node's memory
directory is removed, and a state that lacks it is refused with what was found.

Security: the offers travel as torch.distributed objects between the job's own ranks, as in the DDP
mode's restore agreement (snapshot/exchange/restore_agreement.py); the index is read by the
restricted unpickler, the unsharded rest with weights_only=True, the data by DCP as tensors.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.exchange.restore_agreement import REASON_CHARS
from elastic_ddp.snapshot.exchange.transport import FrameError, FrameLimits, FrameRefused, ProcessGroupTransport
from elastic_ddp.snapshot.files.errors import SnapshotError
from elastic_ddp.snapshot.sharded.divergence import any_rank_diverged
from elastic_ddp.snapshot.sharded.memory_checkpoint import MergedCheckpoint
from elastic_ddp.snapshot.sharded.memory_shards import ShardCopy, ShardMemory, checksum_of
from elastic_ddp.snapshot.sharded.safe_reader import UnsafeCheckpointError

logger = logging.getLogger(__name__)


class MemoryRestoreError(Exception):
    """The agreed memory state could not be loaded; raised on every rank alike (its message: why)."""


@dataclass(frozen=True)
class PartOffer:
    """What a rank says about one part it holds (all but the data)."""

    step: int
    incarnation: int
    world_size: int
    part: int
    data_bytes: int
    checksum: str
    index: bytes
    plain: bytes


@dataclass
class MemoryState:
    """The memory state the group agreed on."""

    step: int
    incarnation: int
    world_size: int
    holders: dict[int, int]  # part -> the lowest rank that holds it
    offers: dict[int, PartOffer]  # part -> its offer
    merged: MergedCheckpoint
    hosts: list[str]  # of every rank of the group
    refused: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rest_part(self) -> int:
        """A part that carries the unsharded rest (a rank's own part; its buddy's copy has none)."""
        return min(part for part, offer in self.offers.items() if offer.plain)

    @property
    def rest(self) -> bytes:
        return self.offers[self.rest_part].plain

    @property
    def checksum(self) -> str:
        return self.offers[self.rest_part].checksum

    @property
    def source_rank(self) -> int:
        return self.holders[self.rest_part]


def agree_on_memory_state(memory: ShardMemory, context: DistributedContext,
                          accept: Callable[[bytes, str], object] | None = None,
                          exclude: frozenset[tuple[int, int]] = frozenset(),
                          ) -> tuple[MemoryState | None, list[dict[str, Any]], dict[tuple[int, int, int], ShardCopy]]:
    """(the newest complete memory state or None, the newer ones refused with their reasons, this
    rank's stored copies by (step, incarnation, part)). `accept(rest, description)` raises for a
    state's unsharded rest that does not fit this run (it is then refused); the (step, incarnation)
    states in `exclude` (refused already) are passed over. Collective over the group."""
    stored = {(copy.step, copy.incarnation, copy.part): copy for copy in memory.stored()}
    mine = ([PartOffer(copy.step, copy.incarnation, copy.world_size, copy.part, len(copy.data), copy.checksum,
                       copy.index, copy.plain) for copy in stored.values()], socket.gethostname(), memory.damaged)
    gathered: list[Any] = [mine]
    if context.in_process_group:
        gathered = [None] * context.world_size
        dist.all_gather_object(gathered, mine)
    hosts = [host for _, host, _ in gathered]
    by_state: dict[tuple[int, int], dict[int, tuple[int, PartOffer]]] = {}
    damaged: dict[tuple[int, int], list[str]] = {}
    for rank, (offers, _, found_damaged) in enumerate(gathered):
        for offer in offers:
            parts = by_state.setdefault((offer.step, offer.incarnation), {})
            if offer.part not in parts or (offer.plain and not parts[offer.part][1].plain):
                parts[offer.part] = (rank, offer)  # the lowest rank that holds it (with the rest) serves it
        for step, incarnation, part, why in found_damaged:
            by_state.setdefault((step, incarnation), {})
            damaged.setdefault((step, incarnation), []).append(f"part {part} on rank {rank}'s node: {why}")
    refused: list[dict[str, Any]] = []
    for (step, incarnation), parts in sorted(by_state.items(), reverse=True):
        if (step, incarnation) in exclude:
            continue
        world_sizes = {offer.world_size for _, offer in parts.values()}
        reason = _incomplete(parts, world_sizes) if parts else "every copy of its parts was damaged"
        if reason and (step, incarnation) in damaged:
            reason = f"{reason}; copies found damaged and removed: {'; '.join(damaged[(step, incarnation)])}"
        merged = None
        if not reason:
            try:
                merged = MergedCheckpoint({part: offer.index for part, (_, offer) in parts.items()},
                                          f"the memory state of step {step}")
                if merged.missing():
                    reason = f"its parts do not cover {', '.join(merged.missing()[:3])}"
                elif accept is not None:
                    rest = parts[min(part for part, (_, offer) in parts.items() if offer.plain)][1].plain
                    accept(rest, f"the memory state of step {step}")
            except (UnsafeCheckpointError, Exception) as exc:  # noqa: BLE001 - any flaw refuses this state
                reason = f"refused: {str(exc)[:REASON_CHARS]}"
        if reason:
            refused.append({"source": "memory", "global_step": step, "host": "", "reason": reason[:REASON_CHARS]})
            continue
        state = MemoryState(step, incarnation, world_sizes.pop(), {part: rank for part, (rank, _) in parts.items()},
                            {part: offer for part, (_, offer) in parts.items()}, merged, hosts, refused)
        return state, refused, stored
    return None, refused, stored


def _incomplete(parts: dict[int, tuple[int, PartOffer]], world_sizes: set[int]) -> str:
    if len(world_sizes) != 1:
        return f"its parts say different world sizes {sorted(world_sizes)}"
    (world_size,) = world_sizes
    missing = sorted(set(range(world_size)) - set(parts))
    if missing:
        return (f"part(s) {missing} of the {world_size} ranks that committed it are on no node of this group "
                "(a part and its copy were both lost)")
    if not any(offer.plain for _, offer in parts.values()):
        return "no rank of this group committed it (its parts were exchanged, the step never counted)"
    return ""


def load_memory_state(state: MemoryState, model: nn.Module, optimizer: torch.optim.Optimizer,
                      param_groups: list[dict[str, Any]], stored: dict[tuple[int, int, int], ShardCopy],
                      context: DistributedContext) -> int:
    """Load this rank's shards of `model` and `optimizer` (its `param_groups` as given) from the
    agreed memory state; the bytes received from peers (collective). MemoryRestoreError on every
    rank when the state cannot be loaded or holds a NaN or an infinity (`model` and `optimizer`
    may then hold part of it)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    received = _load_parts(state, tensors, stored, context)
    diverged = any_rank_diverged(tensors, context)
    if diverged:
        raise MemoryRestoreError(f"non-finite values in {', '.join(diverged[:3])} (the run had diverged)")
    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optimizer"]["state"], "param_groups": param_groups})
    return received


def _load_parts(state: MemoryState, tensors: dict[str, Any], stored: dict[tuple[int, int, int], ShardCopy],
                context: DistributedContext) -> int:
    """Fill `tensors` (this rank's shards) from the parts, each fetched from its holder if needed."""
    needed = sorted(state.merged.needed_parts(tensors))
    everyone: list[Any] = [needed]
    if context.in_process_group:
        everyone = [None] * context.world_size
        dist.all_gather_object(everyone, needed)
    data: dict[int, bytes] = {}
    received, damaged = 0, ""
    transport = ProcessGroupTransport(device=context.collective_device)
    for part, holder in sorted(state.holders.items()):
        offer = state.offers[part]
        if context.rank == holder:
            data[part] = stored[(state.step, state.incarnation, part)].data
        takers = [rank for rank, wanted in enumerate(everyone) if part in wanted and rank != holder]
        if not takers:
            continue
        if context.rank == holder:
            transport.send(holder, {"global_step": state.step, "part": part, "checksum": offer.checksum}, data[part])
            continue
        limit = offer.data_bytes if context.rank in takers else 0
        try:
            frame = transport.receive(holder, FrameLimits(max_payload_bytes=limit))
        except FrameRefused:
            continue
        except FrameError as exc:
            raise SnapshotError(f"part {part} of step {state.step} from rank {holder} was refused ({exc})") from exc
        payload = bytes(frame.payload)
        if checksum_of(offer.index, payload) != offer.checksum:  # noted; this rank goes on serving its parts
            damaged = damaged or f"part {part} from rank {holder} arrived damaged (its checksum does not match)"
        data[part], received = payload, received + len(payload)
    _agree_nothing_damaged(damaged, context)
    try:  # DCP raises on every rank when any rank fails to read (CheckpointException)
        state.merged.load(tensors, {part: data[part] for part in needed})
    except (Exception, CheckpointException) as exc:  # whatever DCP met (a BaseException), the state is refused
        failures = exc.failures if isinstance(exc, CheckpointException) else {}
        what = "; ".join(f"rank {rank}: {failure[0]}" for rank, failure in failures.items()) or exc
        raise MemoryRestoreError(f"its parts could not be read ({str(what)[:REASON_CHARS]})") from exc
    return received


def _agree_nothing_damaged(damaged: str, context: DistributedContext) -> None:
    """Raise MemoryRestoreError on every rank when any rank received a damaged part (collective)."""
    everyone = [damaged]
    if context.in_process_group:
        everyone = [""] * context.world_size
        dist.all_gather_object(everyone, damaged)
    reasons = [reason for reason in everyone if reason]
    if reasons:
        raise MemoryRestoreError(reasons[0])
