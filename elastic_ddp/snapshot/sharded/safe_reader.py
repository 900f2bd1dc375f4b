"""Reading DCP checkpoints without running code from them.

torch's `FileSystemReader` unpickles the checkpoint's `.metadata` file with plain `pickle.load`,
and its planner unpickles any non-tensor value with `torch.load(weights_only=False)`: whoever can
write a checkpoint directory can run code on every rank that restores from it (as with torch's
rendezvous state, findings.md 10). Here:

- `.metadata` is unpickled by `RestrictedUnpickler`, which resolves only the classes a DCP index
  is made of (DCP's metadata dataclasses, `torch.Size`, dtypes, layouts, memory formats, paths);
  anything else raises `UnsafeCheckpointError` before it is called;
- the snapshots hold tensors only (the rest goes to a format-2 file loaded with weights_only), and
  restores ask DCP for tensors only, so no value is ever read through the planner's unpickling;
- the shards themselves are read by DCP as raw bytes into the tensors it was given.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

_METADATA_CLASSES = ("BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
                     "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")
_ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict")}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(Exception):
    """A checkpoint file refers to something a DCP index never holds; it was not loaded."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of a DCP `.metadata` file."""

    def __init__(self, file: Any, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{self.source}: refers to {module}.{name}, which a DCP index never holds; "
                                    "not loaded (written by something other than torch.distributed.checkpoint?)")


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader, with `.metadata` read through `RestrictedUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as handle:
            metadata = RestrictedUnpickler(handle, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP checkpoint in `directory`, whole, on the CPU, by its flattened name
    (`model.net.1.weight`, `optimizer.state.net.1.weight.momentum_buffer`). No process group is
    needed: for tools and tests that read a sharded snapshot offline."""
    metadata = SafeFileSystemReader(directory).read_metadata()
    tensors = {name: torch.empty(entry.size, dtype=entry.properties.dtype)
               for name, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}
    with warnings.catch_warnings():  # no process group is what this reader is for, not news to its caller
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(tensors, storage_reader=SafeFileSystemReader(directory), no_dist=True)
    return tensors
