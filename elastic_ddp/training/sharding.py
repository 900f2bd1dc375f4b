"""Sharded training (`--sharding fsdp`): the model's blocks and its root under FSDP2's `fully_shard`.

Which submodules are blocks, in this order of precedence:

- `--shard_blocks GLOB[,GLOB...]`: every submodule whose qualified name (as in
  `model.named_modules()`, e.g. `layers.0`) matches one of the patterns (`fnmatch`: `layers.*`);
- the model's own `sharding_blocks()` method, returning the submodules to shard (the built-in
  models have one: the MLP's linear layers, the ResNet's stem, residual blocks and head);
- otherwise every submodule that holds parameters of its own (`Linear`, `Conv2d`, norms...).

The root is always sharded last, so that what is left (parameters outside any block) is sharded too.

Memory (CPU): FSDP2 gathers each block's whole parameters (and gradients) for its forward and
backward and frees them right after, every step. glibc's malloc raises its mmap threshold to the
size of the largest block freed so far (up to 32 MiB), so those buffers then come from its heap,
which keeps what is freed and grows step after step. `shard_model` therefore fixes it at
`MMAP_THRESHOLD`, 1 MiB (`mallopt`), unless the user set `MALLOC_MMAP_THRESHOLD_`: a buffer that
large is returned to the system when freed (each new one costs its page faults), about halving a
worker's peak (docs/benchmarks-history.md).
Each rank must build the same initial weights before this runs (the built-in models do, from
`--seed`): `fully_shard` keeps this rank's slice of the weights it is given.

Contract: call it with the default process group up and before the optimizer is built, since
`fully_shard` replaces the module's parameters by sharded ones (`DTensor`s). Gradients are
reduce-scattered and averaged over the ranks at the end of each backward, as DDP averages them, so
the trainer's global-batch maths is unchanged. Limits of this first version: every micro-batch of
a step synchronises its gradients (no `no_sync` yet: same result, more traffic), and buffers
(BatchNorm's running statistics) are not synchronised across ranks as DDP's broadcast does.
"""

from __future__ import annotations

import copy
import ctypes
import fnmatch
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

SHARDING_MODES = ("none", "fsdp")
MMAP_THRESHOLD = 2**20  # bytes: see the module docstring
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class ShardingError(ValueError):
    """The model cannot be sharded as asked; the message names the flag and what is accepted."""


def shard_blocks(model: nn.Module, patterns: tuple[str, ...] = ()) -> list[str]:
    """The qualified names of the submodules `shard_model` shards as blocks, in module order."""
    named = dict(model.named_modules())
    if patterns:
        names = [name for name in named if name and any(fnmatch.fnmatchcase(name, p) for p in patterns)]
        if not names:
            raise ShardingError(f"--shard_blocks: got {','.join(patterns)}, which matches no submodule of "
                                f"{type(model).__name__}; expected globs over names such as "
                                f"{', '.join([name for name in named if name][:4])}")
        return _outermost(names)
    if hasattr(model, "sharding_blocks"):
        wanted = {id(module) for module in model.sharding_blocks()}
        return [name for name, module in named.items() if name and id(module) in wanted]
    return [name for name, module in named.items() if name and any(True for _ in module.parameters(recurse=False))]


def place_model(model: nn.Module, sharding: str, shard_blocks: str, device: torch.device) -> nn.Module:
    """`model` on `device`, sharded when `sharding` is fsdp (`shard_blocks`: comma-separated globs)."""
    model = model.to(device)
    if sharding == "fsdp":
        shard_model(model, tuple(pattern.strip() for pattern in shard_blocks.split(",") if pattern.strip()))
    return model


def shard_model(model: nn.Module, patterns: tuple[str, ...] = ()) -> nn.Module:
    """`fully_shard` every block of `model` (see the module docstring), then the root, over a mesh of
    every rank on the device `model` is on; returns `model`."""
    if not dist.is_initialized():
        raise ShardingError("--sharding fsdp: got no process group; expected a run under torchrun (or "
                            "--sharding none)")
    # Imported here, not at the top: FSDP2 pulls in DTensor, torch._decomp and sympy, about 0.7 s of
    # CPU that every DDP worker (the trainer imports this module) would pay at each (re)start.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # The mesh follows where the model is (--device), not the machine: left to itself, fully_shard
    # builds a CUDA mesh whenever a GPU exists and moves a `--device cpu` model there (seen on an H200).
    device = next(model.parameters()).device
    if device.type == "cpu":
        fix_mmap_threshold()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    modules = dict(model.named_modules())
    names = shard_blocks(model, patterns)
    for name in names:
        fully_shard(modules[name], mesh=mesh)
    fully_shard(model, mesh=mesh)
    logger.info("sharded %d block(s) and the root over %d rank(s)", len(names), dist.get_world_size())
    return model


def parameterless_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` before it is sharded, to shard again in another world (`rebuilt`): its
    classes, attributes and buffers copied, its parameters on the meta device (tied ones stay
    tied), so that it costs the buffers only. TypeError (or whatever `copy.deepcopy` raises) for a
    model that cannot be copied."""
    memo: dict[int, object] = {id(parameter): nn.Parameter(torch.empty_like(parameter, device="meta"),
                                                           requires_grad=parameter.requires_grad)
                               for parameter in model.parameters()}
    return copy.deepcopy(model, memo)


def rebuilt(skeleton: nn.Module, shard_blocks: str, device: torch.device) -> nn.Module:
    """A fresh model from `parameterless_copy`'s `skeleton`, on `device` and sharded over the current
    default group as `place_model` shards (`shard_blocks`). Its parameters are uninitialised: a
    restore must load every one of them (a sharded restore does: model and optimizer whole)."""
    model = copy.deepcopy(skeleton)
    materialised: dict[int, nn.Parameter] = {}  # meta parameter -> its new one (tied parameters: one)
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None:
                if id(parameter) not in materialised:
                    materialised[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device=device),
                                                               requires_grad=parameter.requires_grad)
                module._parameters[name] = materialised[id(parameter)]
    return place_model(model, "fsdp", shard_blocks, device)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (see the module docstring); whether it was
    set. Nothing happens where malloc is not glibc's or the user set `MALLOC_MMAP_THRESHOLD_`."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1


def _outermost(names: list[str]) -> list[str]:
    """`names` without those inside another one (a block's submodules belong to the block)."""
    return [name for name in names if not any(name.startswith(other + ".") for other in names if other != name)]
