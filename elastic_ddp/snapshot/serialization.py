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
(`files.verified_file`), and neither holds the GIL for long. For a restore, the model's tensors can
be left where they lie, views onto a mapped memory copy or the received bytes
(`load_model_as_views`): the restore copies them into the model, one pass. torch.save's own CRC32
of each record is not computed (`_ZipCrc32`).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import torch

from elastic_ddp.snapshot.files.checksum import DEFAULT_ALGORITHM
from elastic_ddp.snapshot.files.errors import IncompatibleSnapshotError, SnapshotError, WriteCancelled
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


def write_snapshot(snapshot: Snapshot, file: BinaryIO, algorithm: str = DEFAULT_ALGORITHM,
                   stopped: Callable[[], bool] | None = None) -> Seal:
    """Write `snapshot` as one format-2 file into `file`, hashing it on the way (one pass).
    `stopped`: asked before each STOP_CHECK_BYTES of the payload; once it says so, nothing more is
    written and WriteCancelled is raised (`file` then holds a part that must not be used)."""
    payload = {"states": snapshot.states, "rng_per_rank": snapshot.rng_per_rank}

    def save(stream: BinaryIO) -> None:
        target = stream if stopped is None else _StoppableStream(stream, stopped)
        with _ZipCrc32.off():
            torch.save(payload, target)
        if stopped is not None and target.stopped_after is not None:
            raise WriteCancelled(f"the snapshot of step {snapshot.global_step} was stopped after "
                                 f"{target.stopped_after} bytes of its payload")

    return write_framed(file, header_of(snapshot), save, algorithm)


STOP_CHECK_BYTES = 16 * 2**20  # how much of a payload may still be written after a stop was asked


class _StoppableStream:
    """What torch.save writes into while `stopped()` says no (asked before each STOP_CHECK_BYTES);
    from then on every write is dropped. A write that raised instead would come out of torch.save
    as another error, its zip writer's own ("unexpected pos"), as it then writes the zip's end."""

    def __init__(self, target: BinaryIO, stopped: Callable[[], bool]):
        self._target = target
        self._stopped = stopped
        self._written = 0
        self.stopped_after: int | None = None  # bytes written when the stop was seen

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), STOP_CHECK_BYTES):
            if self.stopped_after is None and self._stopped():
                self.stopped_after = self._written
            if self.stopped_after is not None:
                break
            self._written += self._target.write(view[start:start + STOP_CHECK_BYTES])
        return len(view)

    def flush(self) -> None:
        self._target.flush()


class _ZipCrc32:
    """torch.save's CRC32 of each record, off while any snapshot is being saved.

    The frame's checksum covers every byte already, torch.load never checks the CRC32 (a flipped
    payload byte loads without error), and computing it was a pass of its own over the state before
    each record is written: 0.24 s per GB on one core here, inside every memory copy a stopping
    worker keeps. The switch is torch's, for the whole process (read as each save starts): it is
    turned off by the first save in flight and back on by the last, so another thread's own
    torch.save meanwhile writes no CRC32 either (which torch.load does not need).
    """

    lock = threading.Lock()
    saving = 0
    previous = True

    @classmethod
    @contextlib.contextmanager
    def off(cls) -> Iterator[None]:
        if not hasattr(torch.serialization, "set_crc32_options"):  # torch < 2.5: always computed
            yield
            return
        with cls.lock:
            if cls.saving == 0:
                cls.previous = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            cls.saving += 1
        try:
            yield
        finally:
            with cls.lock:
                cls.saving -= 1
                if cls.saving == 0:
                    torch.serialization.set_crc32_options(cls.previous)


def snapshot_to_bytes(snapshot: Snapshot, algorithm: str = DEFAULT_ALGORITHM) -> bytes:
    buffer = io.BytesIO()
    write_snapshot(snapshot, buffer, algorithm)
    return buffer.getvalue()


def snapshot_from_bytes(data: bytes | bytearray | memoryview, source: str, verified: Seal | None = None,
                        model_as_views: bool = False) -> Snapshot:
    """Deserialise safely; SnapshotError naming `source` for anything but a valid snapshot.

    A format-2 file is verified against its own checksum first, unless `verified` is the seal that
    `file_layout.verify` returned for these very bytes. A format-1 file has none: the caller must
    have checked it against its manifest entry (`SnapshotStore.read_verified` does).
    `data` is read in place (any bytes-like object, a mapped file included), not copied. With
    `model_as_views` (a restore, which copies the model's state into the model's own tensors), the
    tensors of the `model` component are views onto `data` itself (`load_model_as_views`): `data`
    must then be writable (a bytearray, a private mapping) and left unchanged while they are used.
    """
    version = format_of(bytes(data[:8]))
    if version == FORMAT_VERSION:
        seal = verified or verify(data, source)
        payload_view = memoryview(data)[seal.payload_start:len(data) - TRAILER_BYTES]
        payload = load_model_as_views(payload_view, source) if model_as_views else _load(payload_view, source)
        return _from_v2(seal.header, payload, source)
    if version == 1:
        return _from_v1(_load(data, source), source)
    raise SnapshotError(f"{source}: not an elastic_ddp snapshot (neither format 1 nor {FORMAT_VERSION})")


def snapshot_from_file(path: str | os.PathLike, source: str, check_seal: Callable[[Seal], None] | None = None,
                       model_as_views: bool = False) -> tuple[Snapshot, Seal]:
    """The format-2 file at `path`, verified and loaded in place, and its seal.

    Its checksum is streamed over the file (no copy held); `check_seal(seal)` may then refuse it by
    its header and sizes (raise) before any of its payload is loaded; the payload is loaded from
    the same open file. With `model_as_views` (a memory copy in tmpfs, for a restore) the file is
    mapped privately (copy on write: the file never changes) and the model's tensors are views onto
    the mapping (`load_model_as_views`). SnapshotError naming `source` for anything but a valid
    snapshot; OSError when the file cannot be read.
    """
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if format_of(handle.read(8)) != FORMAT_VERSION:
            raise SnapshotError(f"{source}: not a self-describing (format {FORMAT_VERSION}) snapshot")
        if model_as_views:  # hashed where it lies, on every core: its pages are then mapped for the load
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            seal = verify(mapping, source, all_cores=True)
        else:
            seal = verify_file(handle.fileno(), size, source)
        if check_seal is not None:
            check_seal(seal)
        if model_as_views:
            payload = load_model_as_views(memoryview(mapping)[seal.payload_start:size - TRAILER_BYTES], source)
        else:
            payload = _load(FileWindow(handle.fileno(), seal.payload_start, seal.payload_bytes), source)
    return _from_v2(seal.header, payload, source), seal


VIEWED_COMPONENTS = ("model",)  # whose tensors `load_model_as_views` leaves in the buffer
VIEW_ALIGNMENT = 16  # the largest element (complex128): a record less aligned is copied out instead


def load_model_as_views(payload: memoryview, source: str) -> Any:
    """The payload (`torch.save` of the states) in `payload`, whose `model` tensors are views onto it.

    Restoring a memory copy used to load the whole state into new memory (page faults and a copy:
    0.5-0.6 s per GB here), then copy the model's part into the model's tensors (0.1 s). Here the
    payload's pickle is read alone (`torch.load` onto the meta device, which gives each tensor's
    record offset in the archive), and the model's tensors are built over the buffer where their
    records lie: the restore's `load_state_dict` copies from there, one pass. The other components'
    tensors (the optimizer's state, which the optimizer keeps as it is given) are copied out, a
    storage at a time, so nothing of theirs aliases the buffer. Offsets and sizes are file content:
    each record must lie inside the payload (torch's `set_` checks each view against its storage).
    Read-only bytes, and records not aligned for every dtype (a file of an older version), are
    copied out too. Falls back to a plain load for a payload with a tensor of another kind (a
    Parameter, a sparse tensor) and where this torch gives no record offsets.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # meta tensors: nothing of their data is read
            structure = torch.load(BufferWindow(payload), map_location="meta", weights_only=True)
    except Exception as exc:  # torch raises several types for unsafe or damaged pickles
        raise SnapshotError(f"{source}: cannot be loaded safely with weights_only=True ({exc})") from exc
    storages: dict[tuple[int, bool], torch.UntypedStorage] = {}
    writable = not payload.readonly  # a view onto read-only bytes could be written to by a module: copied

    def storage_of(tensor: torch.Tensor, viewed: bool) -> torch.UntypedStorage:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.requires_grad:
            raise _NoOffsets  # a Parameter, a sparse tensor: the plain load rebuilds them as they were
        meta = tensor.untyped_storage()
        offset, size = getattr(meta, "_checkpoint_offset", None), meta.nbytes()
        if offset is None:
            raise _NoOffsets
        if not 0 <= offset <= offset + size <= len(payload):
            raise SnapshotError(f"{source}: a tensor's record ({size} bytes at {offset}) lies outside the payload")
        key = (offset, viewed)
        if key not in storages:
            view = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset) if size else \
                torch.empty(0, dtype=torch.uint8)
            aligned = view.data_ptr() % VIEW_ALIGNMENT == 0  # a file of an older version may not be
            shared = viewed and aligned and writable
            storages[key] = view.untyped_storage() if shared else view.clone().untyped_storage()
        return storages[key]

    def build(value: Any, viewed: bool) -> Any:
        if isinstance(value, torch.Tensor):
            storage = storage_of(value, viewed)
            try:
                return torch.empty(0, dtype=value.dtype).set_(storage, value.storage_offset(), value.size(),
                                                              value.stride())
            except RuntimeError as exc:
                raise SnapshotError(f"{source}: a tensor does not fit its record ({exc})") from exc
        if isinstance(value, dict):
            return {key: build(item, viewed) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(build(item, viewed) for item in value)
        return value

    if not isinstance(structure, dict) or not isinstance(structure.get("states"), dict):
        return structure  # `_from_v2` refuses it, naming what is wrong
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes, copied at once
            states = {name: build(state, name in VIEWED_COMPONENTS) for name, state in structure["states"].items()}
            return {**structure, "states": states,
                    "rng_per_rank": build(structure.get("rng_per_rank"), False)}
    except _NoOffsets:
        return _load(payload, source)


class _NoOffsets(Exception):
    """A tensor that `load_model_as_views` does not rebuild itself, or no record offsets (torch < 2.5)."""


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
