"""Sending a memory part to its ring buddy (memory_shards.py): point to point over the default group.

A part goes as it was taken: its head (header, index, unsharded rest) and its data, two frames
after their sizes, with no joined copy of its bytes; the part received lands in a buffer given
(a dropped part's, of the same size) or a new one. What arrives is only bytes here: the receiver
checks it (memory_shards.ShardCopy.from_head_and_data: header, sizes, checksum).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.files.errors import SnapshotError


def exchange_part(head: bytes, data: bytes | memoryview, send_to: int, receive_from: int, device: torch.device,
              spare: memoryview | None = None) -> tuple[memoryview, memoryview]:
    """Send a part (`head`, then `data`, as taken: no joined copy) to `send_to` and receive
    `receive_from`'s (point to point, over the default group); its data lands in `spare` when that
    has its size (on the CPU), else in a new buffer."""
    sizes_out = torch.tensor([len(head), len(data)], dtype=torch.int64, device=device)
    sizes_in = torch.zeros(2, dtype=torch.int64, device=device)
    _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, sizes_out, send_to),
                                  dist.P2POp(dist.irecv, sizes_in, receive_from)]))
    head_size, data_size = (int(size) for size in sizes_in.tolist())
    if not (0 < head_size <= 4 * len(head) + 2**26 and 0 <= data_size <= 4 * len(data) + 2**26):
        raise SnapshotError(f"rank {receive_from} announced a part of {head_size} + {data_size} bytes; this rank's is "
                            f"{len(head)} + {len(data)}")
    head_in = _receive_pair(_as_tensor(head, device), send_to, torch.empty(head_size, dtype=torch.uint8, device=device),
                            receive_from)
    reuse = spare is not None and device.type == "cpu" and spare.nbytes == data_size and data_size > 0
    data_in = torch.frombuffer(spare, dtype=torch.uint8) if reuse else torch.empty(data_size, dtype=torch.uint8,
                                                                                   device=device)
    data_in = _receive_pair(_as_tensor(data, device), send_to, data_in, receive_from)
    # `spare` itself, not a view made anew: views of views would chain step after step
    return memoryview(head_in.cpu().numpy()), spare if reuse else memoryview(data_in.cpu().numpy())


def _as_tensor(raw: bytes | memoryview, device: torch.device) -> torch.Tensor:
    if not len(raw):
        return torch.empty(0, dtype=torch.uint8, device=device)
    with warnings.catch_warnings():  # "the given buffer is not writable": it is only read (sent)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=torch.uint8).to(device)


def _receive_pair(out: torch.Tensor, send_to: int, into: torch.Tensor, receive_from: int) -> torch.Tensor:
    """Send `out` and receive `into` (empty tensors are neither sent nor received)."""
    operations = ([dist.P2POp(dist.isend, out, send_to)] if out.numel() else []) + \
                 ([dist.P2POp(dist.irecv, into, receive_from)] if into.numel() else [])
    if operations:
        _wait(dist.batch_isend_irecv(operations))
    return into


def every_rank(flag: bool, context: DistributedContext) -> bool:
    """Whether `flag` holds on every rank (collective: an all-reduce, a barrier too)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=context.collective_device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()
