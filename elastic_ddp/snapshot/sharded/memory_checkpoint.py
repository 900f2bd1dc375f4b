"""A DCP checkpoint held in memory: each rank's part as bytes, merged and resharded on load.

`PartWriter.save` lays out this rank's shards of a state dict as DCP does (its own planner,
`create_default_local_save_plan`, with no collective) into two byte strings: the part's `.metadata`
index (this rank's chunks of each tensor, by their global offsets, and where each chunk's bytes
are) and one data file with the chunks' raw bytes. The index is planned and pickled once and
reused while the state keeps its structure (names, dtypes, shapes, placements, rank); a step then
costs a copy of its bytes. A part can be taken at every committed step and sent to a peer.

`MergedCheckpoint` puts the parts of all the ranks that wrote one step together again: the chunks
of every tensor and the place of each chunk (part P's data file is renamed `part-P.distcp`). DCP's
own planner then reads, into whatever sharding the new group has, the chunks each rank now owns
(`load`); `needed_parts` says which parts' data files a rank reads, so that only those travel.

Security: a part's index is pickled by torch; it is read here by the same restricted unpickler as a
durable snapshot's (`safe_reader.RestrictedUnpickler`: DCP's metadata classes, sizes and dtypes,
nothing else), and the data files are never unpickled: each chunk's place and length are checked
against the part's data and its size and dtype, then its bytes are viewed as a tensor.

Not guaranteed: `load` checks that the parts cover every tensor whole (`missing`) and that every
chunk lies inside its data (`DamagedPartError`); a part's bytes are checked by whoever moved them
(memory_shards.py), not here. The raw bytes are in this machine's byte order: parts never leave
the job.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan, create_default_local_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor
from torch.futures import Future

from elastic_ddp.snapshot.sharded.safe_reader import RestrictedUnpickler, UnsafeCheckpointError
from elastic_ddp.snapshot.training_state import non_finite_tensors

METADATA = ".metadata"
ROOT = "memory"  # the path every MemoryFileSystem pretends its files are under
DATA = "data"  # a part's data file, in its own index (renamed part-P.distcp when parts are merged)
ALIGN = 64  # bytes: every chunk starts at a multiple, so that it can be viewed as any dtype


class DamagedPartError(Exception):
    """A part's data does not hold what its index says (truncated or damaged): it cannot be loaded."""


class PartWriter:
    """Takes this rank's parts, step after step, planning once while the state keeps its structure.

    DCP's own planner (`create_default_local_save_plan`, no collective) lays out the first part: the
    index (`.metadata`: every chunk, by its global offsets, and where its bytes are) is pickled once.
    Each later call only checks the structure (names, types, dtypes, global and local shapes,
    placements, the rank) and copies the chunks' bytes into one buffer: the index is reused as is.
    Any change of structure plans again. The data file holds each chunk's raw bytes (native byte
    order, aligned to `ALIGN`), which `MergedCheckpoint.load` reads back; parts never leave the job.
    """

    def __init__(self) -> None:
        self._signature: tuple[Any, ...] | None = None
        self._index = b""
        self.layout: list[tuple[str, int, int, torch.dtype]] = []  # (name, offset, length, dtype) of each chunk
        self._size = 0
        self.copied: torch.cuda.Event | None = None  # the last copy from a GPU (see `save`)
        self._stream: torch.cuda.Stream | None = None  # the side stream of those copies

    def save(self, tensors: dict[str, Any], into: memoryview | None = None) -> tuple[bytes, memoryview]:
        """(index, data) of this rank's shards of `tensors` (tensors and DTensors only); the data is
        a copy of the shards, not a view of them: in `into` (a buffer nobody holds any more) when it
        is writable and has the part's size, else in a new buffer (pinned when the shards are on a
        GPU). From a GPU the copy runs on a side stream once the current stream's work is done:
        `copied` is then its event (None on the CPU, where the copy is done on return), which the
        reader of the data waits for, and `before_update` makes the current stream wait for it."""
        flat = _flatten(tensors)
        signature = _signature(flat)
        if signature != self._signature:
            self._plan(flat)
            self._signature = signature
        chunks = [(offset, length, _local(flat[name]).detach()) for name, offset, length, _ in self.layout if length]
        on_gpu = any(chunk.is_cuda for _, _, chunk in chunks)
        reuse = into is not None and not into.readonly and into.nbytes == self._size and self._size
        # `into` itself is returned, not a view made anew: views of views would chain step after step
        buffer = (torch.frombuffer(into, dtype=torch.uint8) if reuse
                  else torch.empty(self._size, dtype=torch.uint8, pin_memory=on_gpu))
        self.copied = None
        if on_gpu and self._stream is None:
            self._stream = torch.cuda.Stream()
        with _after_current_stream(self._stream) if on_gpu else contextlib.nullcontext() as stream:
            for offset, length, chunk in chunks:
                buffer[offset:offset + length].copy_(chunk.contiguous().reshape(-1).view(torch.uint8),
                                                     non_blocking=on_gpu)
            if stream is not None:
                self.copied = stream.record_event()
        return self._index, into if reuse else memoryview(buffer.numpy())

    def before_update(self) -> None:
        """Make the current stream wait for the last copy from a GPU (call it before the shards
        change in place: the optimizer's next step). Nothing on the CPU."""
        if self.copied is not None:
            torch.cuda.current_stream().wait_event(self.copied)

    def _plan(self, flat: dict[str, Any]) -> None:
        plan = create_default_local_save_plan(flat, is_coordinator=True)
        metadata = Metadata(state_dict_metadata={}, storage_data={})
        layout, offset = [], 0
        for item in plan.items:
            if item.tensor_data is None:
                raise TypeError(f"{item.index.fqn} is not a tensor; memory parts hold tensors only")
            chunk, properties = item.tensor_data.chunk, item.tensor_data.properties
            length = _numel(chunk.sizes) * properties.dtype.itemsize
            offset = -(-offset // ALIGN) * ALIGN
            metadata.state_dict_metadata.setdefault(item.index.fqn, TensorStorageMetadata(
                properties=properties, size=item.tensor_data.size, chunks=[])).chunks.append(chunk)
            metadata.storage_data[item.index] = _StorageInfo(relative_path=DATA, offset=offset, length=length)
            layout.append((item.index.fqn, offset, length, properties.dtype))
            offset += length
        self._index, self.layout, self._size = pickle.dumps(metadata), layout, offset


@contextlib.contextmanager
def _after_current_stream(stream: torch.cuda.Stream) -> Iterator[torch.cuda.Stream]:
    """`stream` made current, once the current stream's work so far (the optimizer step) is done."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield stream


def non_finite_chunks(layout: list[tuple[str, int, int, torch.dtype]], data: memoryview) -> list[str]:
    """The names of the chunks in `data` (a part's, laid out as `layout`, `PartWriter.layout` when
    it was taken) that hold a NaN or an infinity; [] when every one is finite."""
    raw = torch.frombuffer(data, dtype=torch.uint8) if data.nbytes else torch.empty(0, dtype=torch.uint8)
    return [name for name, offset, length, dtype in layout
            if length and non_finite_tensors(raw[offset:offset + length].view(dtype))]


def save_part(tensors: dict[str, Any]) -> tuple[bytes, memoryview]:
    """(index, data) of this rank's shards of `tensors`, planned afresh (`PartWriter` reuses its plan)."""
    return PartWriter().save(tensors)


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _signature(flat: dict[str, Any]) -> tuple[Any, ...]:
    """What the layout of a part depends on; any change of it plans again."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    items: list[Any] = [rank]
    for name, value in flat.items():
        if isinstance(value, DTensor):
            items.append((name, value.dtype, tuple(value.shape), tuple(value._local_tensor.shape),
                          tuple(value.placements), id(value.device_mesh)))
        elif isinstance(value, torch.Tensor):
            items.append((name, value.dtype, tuple(value.shape)))
        else:
            items.append((name, type(value)))
    return tuple(items)


def read_index(raw: bytes, source: str) -> Metadata:
    """A part's `.metadata`, unpickled by the restricted unpickler (UnsafeCheckpointError otherwise)."""
    metadata = RestrictedUnpickler(io.BytesIO(raw), source).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def data_name(part: int) -> str:
    return f"part-{part}.distcp"


class MergedCheckpoint:
    """The parts of one step (part number -> index bytes) as one DCP checkpoint's metadata."""

    def __init__(self, indexes: dict[int, bytes], source: str):
        self.metadata = Metadata(state_dict_metadata={}, storage_data={})
        self.part_of: dict[MetadataIndex, int] = {}
        for part, raw in sorted(indexes.items()):
            self._add(part, read_index(raw, f"{source} part {part}"))

    def _add(self, part: int, index: Metadata) -> None:
        for fqn, entry in index.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                raise UnsafeCheckpointError(f"part {part}: {fqn} is not a tensor; memory parts hold tensors only")
            merged = self.metadata.state_dict_metadata.setdefault(
                fqn, TensorStorageMetadata(properties=entry.properties, size=entry.size, chunks=[]))
            if merged.size != entry.size:
                raise UnsafeCheckpointError(f"part {part}: {fqn} is {tuple(entry.size)}, another part says "
                                            f"{tuple(merged.size)}")
            known = {tuple(chunk.offsets) for chunk in merged.chunks}
            for chunk in entry.chunks:
                if tuple(chunk.offsets) in known:
                    continue  # a replicated tensor (a step count): every part holds the same one
                key = MetadataIndex(fqn, chunk.offsets)
                info = index.storage_data[key]
                info.relative_path = data_name(part)
                merged.chunks.append(chunk)
                self.metadata.storage_data[key] = info
                self.part_of[key] = part

    def missing(self) -> list[str]:
        """The tensors whose chunks do not cover them whole (a part that no rank holds)."""
        incomplete = []
        for fqn, entry in self.metadata.state_dict_metadata.items():
            covered = sum(_numel(chunk.sizes) for chunk in entry.chunks)
            if covered != _numel(entry.size):
                incomplete.append(fqn)
        return incomplete

    def needed_parts(self, tensors: dict[str, Any]) -> set[int]:
        """The parts whose data files this rank reads to fill `tensors` (its own shards)."""
        plan = create_default_local_load_plan(_flatten(tensors), self.metadata)
        return {self.part_of[item.storage_index] for item in plan.items}

    def load(self, tensors: dict[str, Any], data: dict[int, bytes]) -> None:
        """Fill `tensors` (this rank's shards, in place) from the parts' `data` files (collective:
        DCP agrees on the plan over the default group)."""
        reader = _MemoryReader(self.metadata, {data_name(part): raw for part, raw in data.items()})
        dcp.load(tensors, storage_reader=reader)


def _numel(size: Any) -> int:
    count = 1
    for length in size:
        count *= length
    return count


def _flatten(tensors: dict[str, Any]) -> dict[str, Any]:
    flat, _ = flatten_state_dict(tensors)
    return flat


class _MemoryReader(FileSystemReader):
    """torch's FileSystemReader over the parts' data files (raw chunks, `PartWriter`), its metadata
    given (already checked): each chunk's bytes are checked against its size and dtype, then viewed
    as a tensor (no unpickling)."""

    def __init__(self, metadata: Metadata, files: dict[str, bytes | memoryview]):
        super().__init__(ROOT)
        self.metadata = metadata
        self.files = {name: torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                      for name, raw in files.items()}
        self.chunks = {MetadataIndex(fqn, chunk.offsets): (chunk.sizes, entry.properties.dtype)
                       for fqn, entry in metadata.state_dict_metadata.items() for chunk in entry.chunks}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for request in plan.items:
            target = planner.resolve_tensor(request).detach()
            target.copy_(narrow_tensor_by_index(self._chunk(request.storage_index), request.storage_offsets,
                                                request.lengths))
            planner.commit_tensor(request, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _chunk(self, index: MetadataIndex) -> torch.Tensor:
        info = self.metadata.storage_data[index]
        sizes, dtype = self.chunks[index]
        data = self.files.get(info.relative_path)
        if data is None or info.length != _numel(sizes) * dtype.itemsize or info.offset % ALIGN \
                or not 0 <= info.offset <= info.offset + info.length <= len(data):
            raise DamagedPartError(f"{info.relative_path}: {index.fqn} at {info.offset} ({info.length} bytes) does "
                                   f"not fit the part's data ({0 if data is None else len(data)} bytes)")
        return data[info.offset:info.offset + info.length].view(dtype).reshape(sizes)
