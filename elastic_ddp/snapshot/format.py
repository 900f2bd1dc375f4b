"""A snapshot as bytes: the layout written to disk and read back, safely.

Format 1 (every file written so far) is `torch.save` of one plain dict:

    {"format_version": 1, "global_step": S, "epoch": E, "samples_consumed": N,
     "model": ..., "optimizer": ..., "scheduler": ..., "grad_scaler": ... | None,
     "rng_per_rank": [...], "fingerprint": {...}, "world_size": W, "incarnation": I,
     "wall_time": T, "extra": {component name: state, ...}}

The components of `TrainingState` map onto it: `model`, `optimizer`, `scheduler` and
`grad_scaler` by name, the sampler's position onto `epoch` and `samples_consumed`, the step
counter onto `global_step`, and any other component into `extra`. Reading goes through
`torch.load(weights_only=True)` only, so a file can hold tensors and plain values but never code.
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO

import torch

from elastic_ddp.snapshot.errors import IncompatibleSnapshotError, SnapshotError
from elastic_ddp.snapshot.state import Snapshot

FORMAT_VERSION = 1
# Components stored under their own name at the top level of a format-1 file.
_TOP_LEVEL_COMPONENTS = ("model", "optimizer", "scheduler", "grad_scaler")
_HEADER_KEYS = ("global_step", "epoch", "samples_consumed", "rng_per_rank", "fingerprint", "world_size",
                "incarnation", "wall_time")


def layout(snapshot: Snapshot) -> dict[str, Any]:
    """The format-1 dict of `snapshot` (what `load_snapshot` returns). Tensors are not copied."""
    states = snapshot.states
    document: dict[str, Any] = {
        "global_step": snapshot.global_step, "epoch": snapshot.epoch, "samples_consumed": snapshot.samples_consumed,
        **{name: states.get(name) for name in _TOP_LEVEL_COMPONENTS},
        "rng_per_rank": snapshot.rng_per_rank, "fingerprint": snapshot.fingerprint,
        "world_size": snapshot.world_size, "incarnation": snapshot.incarnation, "wall_time": snapshot.wall_time,
        "extra": {name: state for name, state in states.items()
                  if name not in (*_TOP_LEVEL_COMPONENTS, "sampler", "progress")},
        "format_version": FORMAT_VERSION,
    }
    return document


def write_snapshot(snapshot: Snapshot, file: BinaryIO) -> None:
    """Serialise `snapshot` into a writable binary file."""
    torch.save(layout(snapshot), file)


def snapshot_to_bytes(snapshot: Snapshot) -> bytes:
    buffer = io.BytesIO()
    write_snapshot(snapshot, buffer)
    return buffer.getvalue()


def load_layout(data: bytes, source: str) -> dict[str, Any]:
    """The format-1 dict in `data`, loaded safely; `source` names the file in error messages."""
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unsafe or damaged pickles
        raise SnapshotError(f"{source}: cannot be loaded safely with weights_only=True ({exc})") from exc
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(f"{source}: not an elastic_ddp snapshot of format {FORMAT_VERSION}")
    missing = [key for key in (*_HEADER_KEYS, *_TOP_LEVEL_COMPONENTS) if key not in payload]
    if missing:
        raise SnapshotError(f"{source}: snapshot lacks {', '.join(sorted(missing))}")
    return payload


def snapshot_from_bytes(data: bytes, source: str) -> Snapshot:
    """Deserialise safely; raises SnapshotError naming `source` for anything but a valid snapshot."""
    payload = load_layout(data, source)
    extra = payload.get("extra") or {}
    if not isinstance(extra, dict):
        raise SnapshotError(f"{source}: its 'extra' is not a dict")
    try:
        states = {name: payload[name] for name in _TOP_LEVEL_COMPONENTS}
        states["sampler"] = {"epoch": int(payload["epoch"]), "samples_consumed": int(payload["samples_consumed"])}
        states["progress"] = {"global_step": int(payload["global_step"])}
        return Snapshot(states={**states, **extra}, rng_per_rank=list(payload["rng_per_rank"]),
                        fingerprint=dict(payload["fingerprint"]), world_size=int(payload["world_size"]),
                        incarnation=int(payload["incarnation"]), wall_time=float(payload["wall_time"]))
    except (TypeError, ValueError) as exc:
        raise SnapshotError(f"{source}: a header field has the wrong type ({exc})") from exc


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
