"""`Snapshot`: everything a run needs to continue exactly where it was, as plain data.

A snapshot holds the model, optimizer, LR scheduler and GradScaler state dicts, the sampler's
world-size-free position, the epoch and global step, the RNG states of every rank, and a config
fingerprint. It contains only tensors and plain Python values, so it serialises with `torch.save`
and loads with `torch.load(weights_only=True)`: loading a snapshot never runs code from the file.

`StagingBuffers` copies tensors off the live objects into CPU buffers that are reused from one
snapshot to the next (pinned memory for CUDA tensors), so that training can go on mutating its
parameters while a background thread writes the copy.
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any, BinaryIO

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
        self.write_to(buffer)
        return buffer.getvalue()

    def write_to(self, file: BinaryIO) -> None:
        """Serialise into a writable binary file (torch.save of a plain dict of the fields)."""
        # Not dataclasses.asdict: it deep-copies every tensor (a second copy of the whole state).
        torch.save({field_.name: getattr(self, field_.name) for field_ in fields(self)}, file)

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


class StagingBuffers:
    """CPU copies of state, in buffers kept from one snapshot to the next.

    `copy(value, key)` rebuilds dicts, lists and tuples and copies every tensor into a CPU buffer
    reserved for its position (`key` and the path inside `value`), allocating only when a shape or
    dtype is new: the second and later snapshots pay a memory copy, not page faults. Buffers for
    CUDA tensors are pinned and filled with non-blocking copies ordered on the current stream, so
    the training thread does not wait for them; `wait_until_copied()` (called by the writer thread
    before it reads the buffers) blocks until they have landed.

    Contract: the buffers of one `copy` are overwritten by the next, so a copy must be written out
    before the next one starts (`SnapshotWriter` guarantees this: it captures only when no write is
    in flight). Not thread-safe: one capturing thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._cuda_devices: set[torch.device] = set()  # sources of copies not yet waited for
        self._pending_copies: list[Any] = []  # CUDA events recorded after non-blocking copies

    def copy(self, value: Any, key: str) -> Any:
        """A structural copy of `value` whose tensors live in this object's CPU buffers."""
        copied = self._copy(value, (key,))
        for device in self._cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._pending_copies.append(event)
        self._cuda_devices.clear()
        return copied

    def _copy(self, value: Any, path: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value.detach(), path)
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key)) for key, item in value.items()}
        if isinstance(value, list):
            return [self._copy(item, (*path, index)) for index, item in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._copy(item, (*path, index)) for index, item in enumerate(value))
        return value

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        on_cuda = tensor.device.type == "cuda"
        buffer = self._buffers.get(path)
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or (on_cuda and not buffer.is_pinned())):
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=on_cuda)
            self._buffers[path] = buffer
        buffer.copy_(tensor, non_blocking=on_cuda)
        if on_cuda:
            self._cuda_devices.add(tensor.device)
        return buffer

    def wait_until_copied(self) -> None:
        """Block until every non-blocking copy of the last `copy` calls has completed."""
        for event in self._pending_copies:
            event.synchronize()
        self._pending_copies.clear()


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
