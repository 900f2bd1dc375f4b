"""Every rank's RNG state for a snapshot, gathered in one collective of fixed-size tensors.

A snapshot carries each rank's RNG streams (`state.capture_rng_state`), so that a resumed run in
the same world draws what the uninterrupted one would have. `torch.distributed.all_gather_object`
pickles each state (its tensor through torch's reducer), makes two collectives (sizes, then
bytes) and unpickles one object per rank, at every snapshot on every rank. On the CPU the states
have a fixed layout, so `gather_rng_states` packs them into one byte tensor of a known size and
makes a single `all_gather`; the states it returns equal `capture_rng_state()`'s on each rank.

Layout (native byte order, every rank of a job runs the same build): int64 length of the torch
state, int64 Python `random` version, int64 number of words, the words (int64 each), int64 flag
and float64 value of the cached Gaussian, then the torch state bytes. A job on CUDA
(`device="cuda"`) keeps `all_gather_object`: its states include the CUDA ones, which vary with
the devices. A CPU job's states carry no CUDA RNG state (it draws none).
"""

from __future__ import annotations

import random
import struct
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.snapshot.training_state import capture_rng_state

_PYTHON_WORDS = len(random.getstate()[1])  # 625 in CPython: 624 Mersenne Twister words + position
_INTS = struct.Struct(f"=qqq{_PYTHON_WORDS}qqd")


def encode_rng_state(state: dict[str, Any]) -> torch.Tensor:
    """The CPU and Python RNG states of `state` as one uint8 tensor (the same size for every state
    of this build: what lets the ranks gather them without first exchanging sizes)."""
    torch_state = state["torch"]
    version, words, gauss = state["python"]
    if len(words) != _PYTHON_WORDS:
        raise ValueError(f"a Python random state of {len(words)} words; expected {_PYTHON_WORDS}")
    head = _INTS.pack(torch_state.numel(), version, len(words), *words, gauss is not None,
                      0.0 if gauss is None else gauss)
    return torch.cat([torch.frombuffer(bytearray(head), dtype=torch.uint8), torch_state.to(torch.uint8)])


def decode_rng_state(encoded: torch.Tensor) -> dict[str, Any]:
    """The inverse of `encode_rng_state`."""
    raw = encoded.numpy().tobytes()
    fields = _INTS.unpack_from(raw)
    torch_bytes, version, count = fields[0], fields[1], fields[2]
    words = tuple(fields[3:3 + count])
    has_gauss, gauss = fields[3 + count], fields[4 + count]
    torch_state = torch.frombuffer(bytearray(raw[_INTS.size:_INTS.size + torch_bytes]), dtype=torch.uint8)
    return {"torch": torch_state, "python": (version, words, gauss if has_gauss else None)}


def gather_rng_states(world_size: int, device: torch.device) -> list[dict[str, Any]]:
    """Every rank's `capture_rng_state()`, in rank order (a collective: call it on every rank)."""
    mine = capture_rng_state()
    # Decided by the job's device, the same on every rank (a rank-local choice could pair
    # different collectives): a CPU job's snapshot carries no CUDA RNG state.
    if device.type != "cpu":
        states: list[Any] = [None] * world_size
        dist.all_gather_object(states, mine)
        return states
    encoded = encode_rng_state(mine)
    gathered = [torch.empty_like(encoded) for _ in range(world_size)]
    dist.all_gather(gathered, encoded)
    return [decode_rng_state(row) for row in gathered]
