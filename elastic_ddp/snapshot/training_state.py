"""What a snapshot holds: the training state, which captures and restores itself.

`TrainingState` names every piece of state a restart must carry over, each a `Stateful` (torch's
`state_dict` / `load_state_dict` protocol): the model, the optimizer, the LR schedule, the grad
scaler, the sampler's world-size-free position, the step counter and the user's own extra state.
Capturing and restoring go over its fields, so a new piece of state is one new field there and
nothing else: the snapshot, the restore and the on-disk format (`snapshot.serialization`) follow.

Next to the components a `Snapshot` carries the RNG state of every rank, the run's fingerprint
(which model and data set-up wrote it) and where it came from (world size, incarnation, time).
It contains only tensors and plain Python values, so it serialises with `torch.save` and loads
with `torch.load(weights_only=True)`: loading a snapshot never runs code from the file.

Not guaranteed: the global RNG streams carry over only when the world size is the same; restored
into another world size (or from a single rank's memory copy) every rank's stream is derived
afresh from (seed, global step, rank). Per-sample randomness (augmentation) never depends on it.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from elastic_ddp.snapshot.files.errors import IncompatibleSnapshotError, NonFiniteStateError
from elastic_ddp.workload.sampler import ElasticSampler, derive_seed


class Stateful(Protocol):
    """torch.distributed.checkpoint.stateful.Stateful: saves and loads itself as plain data."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class StepCounter:
    """The number of optimizer steps committed so far (the run's global step)."""

    def __init__(self) -> None:
        self.global_step = 0

    def state_dict(self) -> dict[str, int]:
        return {"global_step": self.global_step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.global_step = int(state_dict["global_step"])


class ScalerState:
    """A GradScaler's state, kept only while the scaler is enabled (fp16 on CUDA).

    A disabled scaler saves None and ignores what it is given, so that runs with and without AMP
    read each other's snapshots (the fingerprint decides compatibility, not the scaler).
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.skipped_steps = 0  # this process's optimizer updates the scaler skipped (not saved)
        self._optimizer_stepped = False
        self._watched: set[int] = set()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """`scaler.step(optimizer)` then `scaler.update()`; whether the scaler skipped the update
        (inf or NaN gradients). Adds no device sync: the scaler's step already waited for its
        inf check, and an optimizer step post-hook (torch's public hook) tells whether it ran."""
        if id(optimizer) not in self._watched:
            optimizer.register_step_post_hook(self._note_optimizer_step)
            self._watched.add(id(optimizer))
        self._optimizer_stepped = False
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler.is_enabled() and not self._optimizer_stepped
        self.skipped_steps += skipped
        return skipped

    def _note_optimizer_step(self, *_: Any) -> None:
        self._optimizer_stepped = True

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state_dict: dict[str, Any] | None) -> None:
        if state_dict is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(state_dict)


class ExtraState:
    """State of the user's own that a run saves and restores with each step (`ElasticRun`'s
    `extra_state`): named `Stateful` objects, an EMA of the weights, a curriculum, a counter.

    Saved as `{name: obj.state_dict()}`, so it must be plain data (tensors, numbers, strings, lists,
    dicts) that `torch.load(weights_only=True)` reads back. A snapshot written without extra state
    (before it existed, or by a run without any) holds `ABSENT_STATE`: it restores into a run that
    has none; one that lacks a name this run has is incompatible.
    """

    ABSENT_STATE: ClassVar[Mapping[str, Any]] = MappingProxyType({})  # a snapshot without this component holds it

    def __init__(self, objects: dict[str, Stateful] | None = None) -> None:
        self.objects = dict(objects or {})

    def __bool__(self) -> bool:
        return bool(self.objects)

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.objects.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = sorted(self.objects.keys() - state_dict.keys())
        if missing:
            raise IncompatibleSnapshotError(f"the snapshot holds no extra state named {', '.join(missing)}")
        for name, obj in self.objects.items():
            obj.load_state_dict(state_dict[name])


@dataclass
class TrainingState:
    """Everything of a run that a restart carries over; every field is a `Stateful` component.

    `updating()` brackets every change of the state (an optimizer step and its bookkeeping, a
    restore): if it is left by an exception, the state may be half changed and `consistent` stays
    False, so that no copy of it is ever kept (an optimizer step half applied is no state to resume).
    It holds `lock`, which whoever copies the state from another thread holds too.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_scaler: ScalerState
    sampler: ElasticSampler
    progress: StepCounter
    extra_state: ExtraState = field(default_factory=ExtraState)

    def __post_init__(self) -> None:
        # Not fields: the fields are the components.
        self.consistent = True
        self.lock = threading.RLock()

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        with self.lock:
            self.consistent = False
            yield
            self.consistent = True

    def components(self) -> dict[str, Stateful]:
        return {component.name: getattr(self, component.name) for component in fields(self)}

    def state_dicts(self) -> dict[str, Any]:
        """Every component's state, by field name (references to live tensors: copy before use)."""
        return {name: component.state_dict() for name, component in self.components().items()}

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        """Load every component; a component the snapshot lacks, or whose state does not fit this
        run's (torch's ValueError: another number of parameter groups), is an IncompatibleSnapshotError."""
        # A component that a snapshot may lack says what that means (`ABSENT_STATE`); the others must be there.
        components = self.components()
        missing = sorted(name for name, component in components.items()
                         if name not in states and not hasattr(component, "ABSENT_STATE"))
        if missing:
            raise IncompatibleSnapshotError(f"the snapshot holds no state for {', '.join(missing)}")
        for name, component in components.items():
            try:
                component.load_state_dict(states.get(name, getattr(component, "ABSENT_STATE", None)))
            except ValueError as exc:
                hint = (" (its parameter groups come from --decay_norms_and_biases, or from the optimizer you "
                        "passed: keep them as the run started)") if name == "optimizer" else ""
                raise IncompatibleSnapshotError(f"the snapshot's {name} state does not fit this run's: {exc}"
                                                f"{hint}") from exc


@dataclass
class Snapshot:
    """The complete state of a run at an optimizer-step boundary, as plain data."""

    states: dict[str, Any]  # TrainingState.state_dicts(), copied
    rng_per_rank: list[dict[str, Any]]  # capture_rng_state() of every rank, by rank
    fingerprint: dict[str, Any]  # run_fingerprint() of the run that wrote it
    world_size: int
    incarnation: int
    wall_time: float

    @property
    def global_step(self) -> int:
        return int(self.states["progress"]["global_step"])

    @property
    def epoch(self) -> int:
        return int(self.states["sampler"]["epoch"])

    @property
    def samples_consumed(self) -> int:
        return int(self.states["sampler"]["samples_consumed"])

    def restore_into(self, state: TrainingState, rank: int, world_size: int, seed: int) -> None:
        """Load every component and this rank's RNG stream (derived afresh in another world)."""
        state.load_state_dicts(self.states)
        if len(self.rng_per_rank) == world_size:
            restore_rng_state(self.rng_per_rank[rank])
        else:
            seed_rng_for_step(seed, self.global_step, rank)


def non_finite_tensors(states: Any, path: str = "") -> list[str]:
    """Where `states` holds a floating-point tensor with a NaN or an infinity (dotted paths, such
    as `model.net.1.weight`); [] when every value is finite. One pass over the floating tensors."""
    if isinstance(states, torch.Tensor):
        return [] if _finite(states) else [path or "a tensor"]
    if isinstance(states, float):
        return [] if math.isfinite(states) else [path or "a number"]
    items = (states.items() if isinstance(states, dict)
             else enumerate(states) if isinstance(states, (list, tuple)) else ())
    found = []
    for key, value in items:
        found += non_finite_tensors(value, f"{path}.{key}" if path else str(key))
    return found


def _finite(tensor: torch.Tensor) -> bool:
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return True
    if tensor.is_complex():
        return bool(torch.isfinite(tensor).all())
    # The extremes are finite only if every value is (aminmax propagates NaN): a reduction without
    # a temporary the size of the tensor, measured 25x faster than isfinite().all() on the CPU.
    low, high = torch.aminmax(tensor.detach())
    return math.isfinite(low.item()) and math.isfinite(high.item())


def check_finite(states: Any, what: str, named_at_most: int = 3) -> None:
    """Raise NonFiniteStateError, naming `what` and the first tensors, when `states` holds a NaN or
    an infinity: the state of a diverged run, which is never kept, restored or made durable."""
    bad = non_finite_tensors(states)
    if bad:
        named = bad[:named_at_most]
        more = f" and {len(bad) - len(named)} more" if len(bad) > len(named) else ""
        raise NonFiniteStateError(f"{what} holds non-finite values (NaN or infinity) in {', '.join(named)}{more}: "
                                  "the run had diverged", named)


def model_signature(model: nn.Module) -> str:
    """Parameter and buffer names with shapes: two models with the same signature share snapshots."""
    return ";".join(f"{name}:{tuple(tensor.shape)}" for name, tensor in model.state_dict().items())


def run_fingerprint(model: nn.Module, dataset_size: int, global_batch_size: int, seed: int,
                    drop_last: bool) -> dict[str, Any]:
    """What must match for a snapshot to continue this run: the model's shape and the data order."""
    return {"model": model_signature(model), "dataset_size": dataset_size, "global_batch_size": global_batch_size,
            "seed": seed, "drop_last": drop_last}


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as plain values (torch CPU and CUDA, Python's `random`)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rng_for_step(seed: int, global_step: int, rank: int) -> None:
    """Derive this rank's global RNG streams from (seed, step, rank): a start from scratch, or a
    restore whose snapshot carries no stream for this rank."""
    derived = derive_seed("rng", seed, global_step, rank)
    torch.manual_seed(derived)
    random.seed(derived)
