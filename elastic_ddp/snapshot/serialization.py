"""A snapshot as bytes: written to disk, read back safely, in either format.

Format 2 (written since 0.2) is a self-describing file (`files.file_layout`): a JSON header
(step, epoch, samples, world size, fingerprint, component names), the payload, and a trailer with
the checksum of everything before it. The payload is `torch.save` of
`{"states": {component: state}, "rng_per_rank": [...]}`.

Format 1 (files written before 0.2) is `torch.save` of one plain dict with the components at its
top level (`model`, `optimizer`, `scheduler`, `grad_scaler`), the sampler's position as `epoch`
and `samples_consumed`, the step as `global_step`, other components under `extra`. It has no
checksum of its own: a format-1 file is trusted only with its manifest entry's sha256
(`SnapshotStore.read_verified` checks it). Both load; only format 2 is written.

Reading never runs code from a file: the payload goes through `torch.load(weights_only=True)`,
and every field is type-checked before use. It holds no copy besides the loaded state: a file is
verified and loaded in place (`snapshot_from_file`), bytes in memory are read through a window
(`files.verified_file`), and neither holds the GIL for long.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from elastic_ddp.snapshot.files.checksum import DEFAULT_ALGORITHM
from elastic_ddp.snapshot.files.errors import IncompatibleSnapshotError, SnapshotError
from elastic_ddp.snapshot.files.file_layout import (
    FORMAT_VERSION,
    TRAILER_BYTES,
    Seal,
    SnapshotHeader,
    format_of,
    verify,
    write_framed,
)
from elastic_ddp.snapshot.files.verified_file import BufferWindow, FileWindow, verify_file
from elastic_ddp.snapshot.training_state import Snapshot

# Format 1: the components stored under their own name at the top level of the dict.
_V1_COMPONENTS = ("model", "optimizer", "scheduler", "grad_scaler")
_V1_KEYS = ("global_step", "epoch", "samples_consumed", "rng_per_rank", "fingerprint", "world_size",
            "incarnation", "wall_time", *_V1_COMPONENTS)


def header_of(snapshot: Snapshot) -> SnapshotHeader:
    return SnapshotHeader(snapshot.global_step, snapshot.epoch, snapshot.samples_consumed, snapshot.world_size,
                          snapshot.incarnation, snapshot.wall_time, snapshot.fingerprint, tuple(snapshot.states))


def write_snapshot(snapshot: Snapshot, file: BinaryIO, algorithm: str = DEFAULT_ALGORITHM) -> Seal:
    """Write `snapshot` as one format-2 file into `file`, hashing it on the way (one pass)."""
    payload = {"states": snapshot.states, "rng_per_rank": snapshot.rng_per_rank}
    return write_framed(file, header_of(snapshot), lambda stream: torch.save(payload, stream), algorithm)


def snapshot_to_bytes(snapshot: Snapshot, algorithm: str = DEFAULT_ALGORITHM) -> bytes:
    buffer = io.BytesIO()
    write_snapshot(snapshot, buffer, algorithm)
    return buffer.getvalue()


def snapshot_from_bytes(data: bytes | bytearray | memoryview, source: str) -> Snapshot:
    """Deserialise safely; SnapshotError naming `source` for anything but a valid snapshot.

    A format-2 file is verified against its own checksum first. A format-1 file has none: the
    caller must have checked it against its manifest entry (`SnapshotStore.read_verified` does).
    `data` is read in place (any bytes-like object, a mapped file included), not copied.
    """
    version = format_of(bytes(data[:8]))
    if version == FORMAT_VERSION:
        seal = verify(data, source)
        payload = _load(memoryview(data)[seal.payload_start:len(data) - TRAILER_BYTES], source)
        return _from_v2(seal.header, payload, source)
    if version == 1:
        return _from_v1(_load(data, source), source)
    raise SnapshotError(f"{source}: not an elastic_ddp snapshot (neither format 1 nor {FORMAT_VERSION})")


def snapshot_from_file(path: str | os.PathLike, source: str, check_seal: Callable[[Seal], None] | None = None,
                       ) -> tuple[Snapshot, Seal]:
    """The format-2 file at `path`, verified and loaded in place, and its seal.

    Its checksum is streamed over the file (no copy held); `check_seal(seal)` may then refuse it by
    its header and sizes (raise) before any of its payload is loaded; the payload is loaded from
    the same open file. SnapshotError naming `source` for anything but a valid snapshot; OSError
    when the file cannot be read.
    """
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if format_of(handle.read(8)) != FORMAT_VERSION:
            raise SnapshotError(f"{source}: not a self-describing (format {FORMAT_VERSION}) snapshot")
        seal = verify_file(handle.fileno(), size, source)
        if check_seal is not None:
            check_seal(seal)
        payload = _load(FileWindow(handle.fileno(), seal.payload_start, seal.payload_bytes), source)
    return _from_v2(seal.header, payload, source), seal


def _load(data: bytes | bytearray | memoryview | FileWindow, source: str) -> Any:
    try:
        window = data if isinstance(data, FileWindow) else BufferWindow(data)
        return torch.load(window, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unsafe or damaged pickles
        raise SnapshotError(f"{source}: cannot be loaded safely with weights_only=True ({exc})") from exc


def _from_v2(header: SnapshotHeader, payload: Any, source: str) -> Snapshot:
    if not isinstance(payload, dict) or not isinstance(payload.get("states"), dict):
        raise SnapshotError(f"{source}: its payload holds no component states")
    states, rng_per_rank = payload["states"], payload.get("rng_per_rank")
    if set(states) != set(header.components) or not isinstance(rng_per_rank, list):
        raise SnapshotError(f"{source}: its payload does not match its header")
    return Snapshot(states=states, rng_per_rank=rng_per_rank, fingerprint=header.fingerprint,
                    world_size=header.world_size, incarnation=header.incarnation, wall_time=header.wall_time)


def _from_v1(payload: Any, source: str) -> Snapshot:
    if not isinstance(payload, dict) or payload.get("format_version") != 1:
        raise SnapshotError(f"{source}: not an elastic_ddp snapshot of format 1")
    missing = [key for key in _V1_KEYS if key not in payload]
    if missing:
        raise SnapshotError(f"{source}: snapshot lacks {', '.join(sorted(missing))}")
    extra = payload.get("extra") or {}
    if not isinstance(extra, dict):
        raise SnapshotError(f"{source}: its 'extra' is not a dict")
    try:
        states = {name: payload[name] for name in _V1_COMPONENTS}
        states["sampler"] = {"epoch": int(payload["epoch"]), "samples_consumed": int(payload["samples_consumed"])}
        states["progress"] = {"global_step": int(payload["global_step"])}
        return Snapshot(states={**states, **extra}, rng_per_rank=list(payload["rng_per_rank"]),
                        fingerprint=dict(payload["fingerprint"]), world_size=int(payload["world_size"]),
                        incarnation=int(payload["incarnation"]), wall_time=float(payload["wall_time"]))
    except (TypeError, ValueError) as exc:
        raise SnapshotError(f"{source}: a field has the wrong type ({exc})") from exc


def public_dict(snapshot: Snapshot) -> dict[str, Any]:
    """What `elastic_ddp.load_snapshot` returns: the components by name (the sampler's position as
    `epoch` and `samples_consumed`, the step as `global_step`, the loop's own under `extra_state`,
    other components under `extra`) and the snapshot's other fields. Tensors are not copied."""
    states = snapshot.states
    return {
        "global_step": snapshot.global_step, "epoch": snapshot.epoch, "samples_consumed": snapshot.samples_consumed,
        **{name: states.get(name) for name in _V1_COMPONENTS},
        "rng_per_rank": snapshot.rng_per_rank, "fingerprint": snapshot.fingerprint,
        "world_size": snapshot.world_size, "incarnation": snapshot.incarnation, "wall_time": snapshot.wall_time,
        "extra_state": states.get("extra_state") or {},
        "extra": {name: state for name, state in states.items()
                  if name not in (*_V1_COMPONENTS, "sampler", "progress", "extra_state")},
    }


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
