"""The memory copies of a sharded run, as the snapshot session uses them (`--memory_copies`).

`take` is called at each committed step (from inside the commit, right after the optimizer step)
and after a restore: the exchange of the step before is waited for (that step then counts), this
rank's part of the model and optimizer state is copied into a reused buffer
(memory_checkpoint.PartWriter: DCP's plan made once and reused while the state keeps its
structure), and its exchange with the ring partners starts on a thread of its own
(memory_shards.py), which checks it for NaNs and infinities first (a diverged part is not kept:
the parts of the step before stay the newest).

`restore` tries the newest complete memory state that is at least as new as the newest durable
step (memory_restore.py). A state that cannot be loaded on some rank (a part damaged, a data file
shorter than its index, a diverged state) is refused on every rank with its reason, and the next
complete memory state is tried, then the durable snapshot; when there is no durable snapshot the
model and optimizer are put back as they were (a start from scratch). Each refusal is listed in
the `restore` event (`refused`: source, step, reason).

`keep` writes the parts held into the node's memory directory when the worker stops early, after
waiting at most SETTLE_S for the exchange in flight.
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
from elastic_ddp.snapshot.sharded.memory_checkpoint import PartWriter, non_finite_chunks
from elastic_ddp.snapshot.sharded.memory_restore import (
    MemoryRestoreError,
    MemoryState,
    agree_on_memory_state,
    load_memory_state,
)
from elastic_ddp.snapshot.sharded.memory_shards import ShardMemory
from elastic_ddp.snapshot.training_state import TrainingState

logger = logging.getLogger(__name__)

# How long a worker that stops waits for the exchange in flight (one step's parts: milliseconds,
# unless a peer is gone or silent, and then its step does not count).
SETTLE_S = 2.0

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

    def take(self, state: TrainingState, step: int, committed_in: int) -> list[list[str]]:
        """Take this rank's part of `step` and start its exchange (memory_shards.py: on a thread of
        its own; the exchange of the step before is waited for first, and the first one sets up the
        ring, collectives). On the training thread, before the state changes again: the part is
        copied here, hashed and sent on the thread. Returns the parameter names of each optimizer
        group."""
        self.memory.wait()
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
        tensors = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
        index, data = self.writer.save(tensors, self.memory.take_spare())
        copied, layout = self.writer.copied, self.writer.layout

        def check() -> bool:  # on the exchange's thread
            if copied is not None:
                copied.synchronize()
            return self._finite(step, non_finite_chunks(layout, data))

        self.memory.exchange(step, committed_in, index, data, check)
        return [group["params"] for group in optimizer_state["param_groups"]]

    def _finite(self, step: int, diverged: list[str]) -> bool:
        if diverged and self._diverged_step is None:
            self._diverged_step = step
            logger.error("the state of step %d holds non-finite values (NaN or infinity) in %s: this rank's part is "
                         "not kept in memory from now on (a restart resumes from the last finite state)", step,
                         ", ".join(diverged[:3]))
        return not diverged

    def add_rest(self, step: int, rest: Callable[[], bytes]) -> None:
        self.memory.add_rest(step, rest)

    def wait(self) -> None:
        """Wait for the exchange in flight (memory_shards.ShardMemory.wait): its step then counts."""
        self.memory.wait()

    def before_update(self) -> None:
        """Before the optimizer changes the state in place (a copy from a GPU may still read it)."""
        self.writer.before_update()

    @property
    def uncounted(self) -> int | None:
        """The step whose exchange began and has not ended whole, if any."""
        return self.memory.uncounted

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

    def keep(self, reason: str, settle: bool = True) -> None:
        """Write the parts this rank holds into its node's memory directory (no collective). An
        exchange in flight is waited for SETTLE_S at most first (`ShardMemory.settle`); without
        `settle` (a peer has been silent for seconds: an exchange that could end has ended by then)
        not at all."""
        started = time.monotonic()
        self.memory.settle(SETTLE_S if settle else 0.0)
        written, size = self.memory.keep()
        step = self.memory.counted
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

    def close(self) -> None:
        """An exchange still in flight (training raised) is waited for a moment; its error is logged."""
        self.memory.settle(SETTLE_S)
        self.memory.stop()

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
