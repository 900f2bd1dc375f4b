"""CPU copies of the training state in buffers reused from one snapshot to the next, and reading
the state from another thread without waiting on the training thread's stream (`settled_device_work`).

A snapshot is written on a background thread while training goes on mutating its parameters, so
the writer needs a copy. `StagingBuffers` makes that copy into CPU buffers kept between snapshots
(pinned memory for CUDA tensors, filled with non-blocking copies): after the first snapshot a
capture costs a memory copy, not page faults, and on CUDA the training thread does not wait for it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
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



@contextlib.contextmanager
def settled_device_work(value: Any, wait_s: float) -> Iterator[bool]:
    """Whether the device work queued so far on the default stream of each CUDA device that holds a
    tensor of `value` ends within `wait_s` seconds; inside the block, this thread reads those
    devices through streams of its own that wait for that work only.

    For a thread that copies the training state while the training thread may be stuck: under NCCL
    the default stream can wait for ever behind a collective that a silent peer never joins, and
    what the training thread queues after this call must not delay the copy. True at once when
    `value` holds no CUDA tensor.
    """
    devices = {tensor.device for tensor in _tensors(value) if tensor.device.type == "cuda"}
    deadline = time.monotonic() + wait_s
    with contextlib.ExitStack() as streams:
        for device in devices:
            done = torch.cuda.Event()
            done.record(torch.cuda.default_stream(device))
            while not done.query():
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.005)
            own = torch.cuda.Stream(device)
            own.wait_event(done)
            streams.enter_context(torch.cuda.stream(own))
        yield True


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
