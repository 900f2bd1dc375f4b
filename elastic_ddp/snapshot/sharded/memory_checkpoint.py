"""A DCP checkpoint held in memory: each rank's part as bytes, merged and resharded on load.

`save_part` writes this rank's shards of a state dict through `torch.distributed.checkpoint` with
`no_dist=True` into a dict of bytes (`MemoryFileSystem`, torch's `FileSystemBase` extension point):
the part's `.metadata` index (this rank's chunks of each tensor, by their global offsets) and one
data file. No collective runs, so a part can be taken at every committed step and sent to a peer.

`MergedCheckpoint` puts the parts of all the ranks that wrote one step together again: the chunks
of every tensor and the place of each chunk (part P's data file is renamed `part-P.distcp`). DCP's
own planner then reads, into whatever sharding the new group has, the chunks each rank now owns
(`load`); `needed_parts` says which parts' data files a rank reads, so that only those travel.

Security: a part's index is pickled by torch; it is read here by the same restricted unpickler as a
durable snapshot's (`safe_reader.RestrictedUnpickler`: DCP's metadata classes, sizes and dtypes,
nothing else), and the data files are read by DCP as tensors (`torch.load(weights_only=True)`).

Not guaranteed: `load` checks that the parts cover every tensor whole (`missing`); a part's bytes
are checked by whoever moved them (memory_shards.py), not here.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from elastic_ddp.snapshot.sharded.safe_reader import RestrictedUnpickler, UnsafeCheckpointError

METADATA = ".metadata"
ROOT = "memory"  # the path every MemoryFileSystem pretends its files are under


class MemoryFileSystem(FileSystemBase):
    """DCP's file operations over `files` (name -> bytes): no disk, no directory."""

    def __init__(self, files: dict[str, bytes] | None = None):
        self.files: dict[str, bytes] = files if files is not None else {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        name = os.path.basename(str(path))
        if "r" in mode:
            yield io.BytesIO(self.files[name])
            return
        stream = _KeptStream()
        try:
            yield stream
        finally:
            stream.close()  # DCP may have closed it already: what was written is kept either way
            self.files[name] = stream.kept

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}"

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.files[os.path.basename(str(new_path))] = self.files.pop(os.path.basename(str(path)))

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Nothing to create."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id) == ROOT

    def exists(self, path: str | os.PathLike) -> bool:
        return os.path.basename(str(path)) in self.files

    def rm_file(self, path: str | os.PathLike) -> None:
        del self.files[os.path.basename(str(path))]


class _KeptStream(io.BytesIO):
    """A BytesIO whose bytes outlive `close()`."""

    kept = b""

    def close(self) -> None:
        if not self.closed:
            self.kept = self.getvalue()
        super().close()


def save_part(tensors: dict[str, Any]) -> tuple[bytes, bytes]:
    """(index, data) of this rank's shards of `tensors` (tensors and DTensors only; no collective)."""
    writer = FileSystemWriter(ROOT, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
    memory = writer.fs = MemoryFileSystem()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=writer, no_dist=True)
    data = [name for name in memory.files if name != METADATA]
    assert len(data) <= 1, f"one data file per part expected, got {sorted(memory.files)}"
    return memory.files[METADATA], memory.files[data[0]] if data else b""


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
    """torch's FileSystemReader over a `MemoryFileSystem`, its metadata given (already checked)."""

    def __init__(self, metadata: Metadata, files: dict[str, bytes]):
        super().__init__(ROOT)
        self.fs = MemoryFileSystem(files)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self.metadata
