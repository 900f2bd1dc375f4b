"""CPU copies of the training state in buffers reused from one snapshot to the next.

A snapshot is written on a background thread while training goes on mutating its parameters, so
the writer needs a copy. `StagingBuffers` makes that copy into CPU buffers kept between snapshots
(pinned memory for CUDA tensors, filled with non-blocking copies): after the first snapshot a
capture costs a memory copy, not page faults, and on CUDA the training thread does not wait for it.
"""

from __future__ import annotations

from typing import Any

import torch


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

