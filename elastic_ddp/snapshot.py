"""`Snapshot`: everything a run needs to continue exactly where it was, as plain data.

A snapshot holds the model, optimizer, LR scheduler and GradScaler state dicts, the sampler's
world-size-free position, the epoch and global step, the RNG states of every rank, and a config
fingerprint. It contains only tensors and plain Python values, so it serialises with `torch.save`
and loads with `torch.load(weights_only=True)`: loading a snapshot never runs code from the file.

`capture_*` copies tensors off the live objects (to CPU) so that training can go on mutating its
parameters while a background thread writes the copy.
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

FORMAT_VERSION = 1


class SnapshotError(Exception):
    """A snapshot that cannot be used."""


class IncompatibleSnapshotError(SnapshotError):
    """A valid snapshot written by a run with another model or data set-up."""


@dataclass
class Snapshot:
    """The complete state of a run at an optimizer-step boundary."""

    global_step: int
    epoch: int
    samples_consumed: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    grad_scaler: dict[str, Any] | None
    rng_per_rank: list[dict[str, Any]]
    fingerprint: dict[str, Any]
    world_size: int
    incarnation: int
    wall_time: float
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(asdict(self), buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> Snapshot:
        """Deserialise safely; `source` names the file in error messages."""
        try:
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for unsafe or damaged pickles
            raise SnapshotError(f"{source}: cannot be loaded safely with weights_only=True ({exc})") from exc
        if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
            raise SnapshotError(f"{source}: not an elastic_ddp snapshot of format {FORMAT_VERSION}")
        known = {f.name for f in fields(cls)}
        missing = known - payload.keys() - {"extra"}
        if missing:
            raise SnapshotError(f"{source}: snapshot lacks {', '.join(sorted(missing))}")
        return cls(**{key: value for key, value in payload.items() if key in known})

    def public_dict(self) -> dict[str, Any]:
        """The view `elastic_ddp.load_snapshot` returns."""
        return asdict(self)


def copy_to_cpu(value: Any) -> Any:
    """Deep-copy `value`, cloning every tensor to CPU memory (a consistent, detached copy)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: copy_to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_to_cpu(item) for item in value]
    if isinstance(value, tuple):
        return tuple(copy_to_cpu(item) for item in value)
    return value


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


def check_compatible(snapshot: Snapshot, expected: dict[str, Any], source: str) -> None:
    """Refuse a snapshot whose fingerprint differs from this run's, naming every difference."""
    differences = [
        f"{key}: snapshot has {snapshot.fingerprint.get(key)!r}, this run has {value!r}"
        for key, value in expected.items()
        if snapshot.fingerprint.get(key) != value
    ]
    if differences:
        raise IncompatibleSnapshotError(
            f"{source} was written by an incompatible run ({'; '.join(differences)}). Use another "
            "--checkpoint_dir, or the settings it was written with.")
