"""The memory copies of a sharded run, as the snapshot session uses them (`--memory_copies`).

`take` is called at each committed step (from inside the commit, right after the optimizer step)
and after a restore: this rank's part of the model and optimizer state is laid out
(memory_checkpoint.PartWriter: DCP's plan made once and reused while the state keeps its
structure), checked for NaNs and infinities (a diverged part is not kept: the parts of the step
before stay the newest) and exchanged with the ring partners (memory_shards.py).

`restore` tries the newest complete memory state that is at least as new as the newest durable
step (memory_restore.py). A state that cannot be loaded on some rank (a part damaged, a data file
shorter than its index, a diverged state) is refused on every rank with its reason, and the next
complete memory state is tried, then the durable snapshot; when there is no durable snapshot the
model and optimizer are put back as they were (a start from scratch). Each refusal is listed in
the `restore` event (`refused`: source, step, reason).

`keep` writes the parts held into the node's memory directory when the worker stops early.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_map

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.memory_copies import MemoryTier
from elastic_ddp.snapshot.sharded.divergence import local_shards
from elastic_ddp.snapshot.sharded.memory_checkpoint import PartWriter
from elastic_ddp.snapshot.sharded.memory_restore import (
    MemoryRestoreError,
    MemoryState,
    agree_on_memory_state,
    load_memory_state,
)
from elastic_ddp.snapshot.sharded.memory_shards import ShardMemory, make_copy
from elastic_ddp.snapshot.training_state import TrainingState, non_finite_tensors

logger = logging.getLogger(__name__)

# load_rest(state, the memory state, bytes received): the unsharded rest loaded, the result returned
LoadRest = Callable[[TrainingState, MemoryState, int], Any]


class MemoryCopies:
    """This rank's memory copies of the sharded state (see the module docstring)."""

    def __init__(self, tier: MemoryTier | None, context: DistributedContext, events: EventLog):
        """`tier`: this node's memory directory (`memory_copies.open_memory_tier`). None: it cannot be
        used, and the parts are still taken and exchanged (collectives that every rank joins), but
        this node writes none of them."""
        self.context, self.events = context, events
        self.memory = ShardMemory(context, None if tier is None else tier.directory)
        self.writer = PartWriter()
        self._diverged_step: int | None = None  # the first step whose part was not kept (logged once)

    def take(self, state: TrainingState, step: int, committed_in: int,
             rest: Callable[[TrainingState, list[list[str]]], bytes] | None) -> list[list[str]]:
        """Take, check and exchange this rank's part of `step` (collectives); `rest(state, parameter
        names of each optimizer group)` gives the unsharded rest, None: added later (`add_rest`).
        Returns the parameter names of each optimizer group."""
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
        tensors = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
        group_names = [group["params"] for group in optimizer_state["param_groups"]]
        diverged = non_finite_tensors(local_shards(tensors))
        if diverged and self._diverged_step is None:
            self._diverged_step = step
            logger.error("the state of step %d holds non-finite values (NaN or infinity) in %s: this rank's part is "
                         "not kept in memory from now on (a restart resumes from the last finite state)", step,
                         ", ".join(diverged[:3]))
        index, data = self.writer.save(tensors, self.memory.take_spare())
        self.memory.commit(make_copy(step, committed_in, self.context, index, rest(state, group_names) if rest else b"",
                                     data, finite=not diverged))
        return group_names

    def add_rest(self, step: int, rest: Callable[[], bytes]) -> None:
        self.memory.add_rest(step, rest)

    def restore(self, state: TrainingState, durable_step: int | None, accept: Callable[[bytes, str], object],
                load_rest: LoadRest) -> tuple[Any, list[dict[str, Any]]]:
        """(what `load_rest` returned, or None: take the durable step or start afresh; the memory
        states refused, newest first). Collective."""
        refused: list[dict[str, Any]] = []
        tried: set[tuple[int, int]] = set()
        backup = None
        while True:
            in_memory, newer, stored = agree_on_memory_state(self.memory, self.context, accept, frozenset(tried))
            refused += [item for item in newer if item not in refused]
            if in_memory is None or (durable_step is not None and in_memory.step < durable_step):
                return None, refused
            if durable_step is None and backup is None:
                backup = _copy_of(state)
            with state.updating():
                try:
                    received = load_memory_state(in_memory, state.model, state.optimizer,
                                                 _param_groups(in_memory, accept), stored, self.context)
                except MemoryRestoreError as exc:
                    reason = str(exc)
                else:
                    in_memory.refused = refused
                    return load_rest(state, in_memory, received), refused
                if backup is not None:
                    _put_back(state, backup)
            logger.warning("the memory state of step %d was refused while loading: %s", in_memory.step, reason)
            refused.append({"source": "memory", "global_step": in_memory.step, "host": "", "reason": f"refused: {reason}"})
            tried.add((in_memory.step, in_memory.incarnation))

    def keep(self, reason: str) -> None:
        """Write the parts this rank holds into its node's memory directory (no collective)."""
        started = time.monotonic()
        written, size = self.memory.keep()
        step = self.memory.own[-1].step if self.memory.own else None
        if not self.context.is_main or step is None:
            return
        if self.memory.directory is None:
            self.events.emit(schema.MEMORY_COPY_FAILED, global_step=step, reason=reason,
                             error="no usable memory directory (see this rank's log)")
            return
        self.events.emit(schema.MEMORY_COPY, global_step=step, reason=reason, size_bytes=size,
                         seconds=round(time.monotonic() - started, 4), written=written > 0)

    def remove_all_but(self, keep: tuple[int, int]) -> None:
        if self.context.local_rank == 0:
            self.memory.remove_all_but(keep)

    def forget(self) -> None:
        self.memory.forget()


def _param_groups(in_memory: MemoryState, accept: Callable[[bytes, str], object]) -> list[dict[str, Any]]:
    """The optimizer's parameter groups as the memory state's unsharded rest holds them."""
    return accept(in_memory.rest, f"the memory state of step {in_memory.step}").states["optimizer"]["param_groups"]


def _copy_of(state: TrainingState) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """The model's and optimizer's state as they are (this rank's shards), to put back after a
    failed load, and whether the optimizer had any state yet."""
    had_state = bool(state.optimizer.state)  # get_state_dict initialises an empty one
    model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
    clone = (lambda value: value.detach().clone() if isinstance(value, torch.Tensor) else value)
    return tree_map(clone, model_state), tree_map(clone, optimizer_state), had_state


def _put_back(state: TrainingState, backup: tuple[dict[str, Any], dict[str, Any], bool]) -> None:
    model_state, optimizer_state, had_state = backup
    set_state_dict(state.model, state.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    if not had_state:
        state.optimizer.state.clear()  # as untouched: the first step creates it (momentum buffers included)
