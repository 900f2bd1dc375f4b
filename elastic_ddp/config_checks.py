"""The checks behind `TrainingConfig.__post_init__`: each raises ValueError with one line naming
the flag, the value and what is accepted. Kept apart so that config.py stays the list of settings."""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import math
from pathlib import Path
from typing import Any

from elastic_ddp.locations import check_usable_url, local_path
from elastic_ddp.workload.user_code import has_import_path_form

IMPORT_PATH_FORM = "package.module:callable"
# torch.manual_seed's range, the first place a seed goes (the model's initialisation).
MAX_SEED = 2**64 - 1


def check_finite(config: Any) -> None:
    """Every float setting is a finite number (argparse takes 'nan' and 'inf' for a float)."""
    for config_field in dataclasses.fields(config):
        value = getattr(config, config_field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{config_field.name}: got {value}; expected a finite number")


def check_choice_or_import_path(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices and not has_import_path_form(value):
        raise ValueError(f"--{name}: got {value!r}; expected {' or '.join(choices)}, or an import path "
                         f"{IMPORT_PATH_FORM}")


def check_checkpoint_dir(location: str) -> None:
    """A URL whose storage can be used here, or a local path (or file:// URL) that is or can become a directory."""
    if not location:
        raise ValueError("--checkpoint_dir: got an empty path; expected a directory")
    path = local_path(location)
    if path is None:
        check_usable_url(location, "--checkpoint_dir")
        return
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"--checkpoint_dir: got {location!r}, but {str(blocker)!r} is a file; expected a "
                         "directory, or a path where one can be created")


def check_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name}: got {value}; expected a positive integer")


def check_non_negative(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 0:
            raise ValueError(f"--{name}: got {value}; expected 0 or more")


def check_seed(seed: int) -> None:
    """A seed torch can take: an integer in [0, 2**64 - 1]."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"--seed: got {seed}; expected an integer from 0 to {MAX_SEED} (2**64 - 1)")


def check_local_location(flag: str, location: str | None, directory: bool) -> None:
    """A local path where a file (or, with `directory`, a directory) is or can be created: no part
    of it is a file that is in the way, and a file's path is not a directory. None: not asked for."""
    if location is None:
        return
    if not location:
        raise ValueError(f"{flag}: got an empty path; expected a {'directory' if directory else 'file'} path")
    path = Path(location)
    candidates = (path, *path.parents) if directory else path.parents
    blocker = next((p for p in candidates if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag}: got {location!r}, but {str(blocker)!r} is a file; expected a "
                         f"{'directory' if directory else 'file'} path under directories only")
    if not directory and path.is_dir():
        raise ValueError(f"{flag}: got {location!r}, which is a directory; expected a file path")


def check_metrics_endpoint(port: int | None, addr: str, memory_dir: str) -> None:
    """--metrics_addr is an IP address; --metrics_port (None: off) a TCP port or 0, with
    prometheus_client installed and a --memory_dir for the metrics files."""
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise ValueError(f"--metrics_addr: got {addr!r}; expected an IP address: 127.0.0.1 (this machine only), "
                         "0.0.0.0 or :: (every interface), or one of this machine's addresses") from None
    if port is None:
        return
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics_port: got {port}; expected a TCP port from 1 to 65535, or 0 for a free one")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ValueError(f"--metrics_port: got {port}, but prometheus_client is not installed; expected "
                         "pip install 'elastic_ddp[metrics]' first")
    if not memory_dir:
        raise ValueError("--memory_dir: got an empty path; expected a directory (the metrics files of "
                         "--metrics_port live there)")


DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("auto", "bf16", "fp16")
DIST_BACKENDS = ("auto", "nccl", "gloo")


def runs_on_cpu(device: str, cuda_available: bool) -> bool:
    """Whether --device puts the run on the CPU on this machine (auto: when CUDA is not available)."""
    return device == "cpu" or (device == "auto" and not cuda_available)


def check_device(device: str, dist_backend: str, cuda_available: bool) -> None:
    """--device and --dist_backend name known values that this machine can run together."""
    if device not in DEVICES:
        raise ValueError(f"--device: got {device!r}; expected auto, cpu or cuda")
    if device == "cuda" and not cuda_available:
        raise ValueError("--device: got 'cuda', but CUDA is not available here; expected auto or cpu")
    if dist_backend not in DIST_BACKENDS:
        raise ValueError(f"--dist_backend: got {dist_backend!r}; expected auto, nccl or gloo")
    if dist_backend == "nccl" and runs_on_cpu(device, cuda_available):
        raise ValueError(f"--dist_backend: got 'nccl' with --device {device} (the CPU here); expected auto or "
                         "gloo (nccl needs CUDA devices)")


def check_amp_dtype(amp_dtype: str, use_amp: bool, device: str, cuda_available: bool) -> None:
    """--amp_dtype names a dtype this machine can autocast to, and only with --use_amp."""
    if amp_dtype not in AMP_DTYPES:
        raise ValueError(f"--amp_dtype: got {amp_dtype!r}; expected one of {', '.join(AMP_DTYPES)}")
    if amp_dtype != "auto" and not use_amp:
        raise ValueError(f"--amp_dtype: got {amp_dtype!r} without --use_amp; expected --use_amp too (or auto)")
    if amp_dtype == "fp16" and runs_on_cpu(device, cuda_available):
        raise ValueError(f"--amp_dtype: got 'fp16' with --device {device} (the CPU here); expected auto or bf16 "
                         "(fp16 autocast and its GradScaler need CUDA)")


def check_sharding(config: Any, cuda_available: bool) -> None:
    """--sharding and what it cannot be combined with yet (docs/sharding.md)."""
    if config.sharding not in ("none", "fsdp"):
        raise ValueError(f"--sharding: got {config.sharding!r}; expected none or fsdp")
    if config.sharding != "fsdp":
        if config.shard_blocks:
            raise ValueError(f"--shard_blocks: got {config.shard_blocks!r} with --sharding {config.sharding}; "
                             "expected --sharding fsdp too (or no --shard_blocks)")
        return
    on_cuda = config.device == "cuda" or (config.device == "auto" and cuda_available)
    if config.use_amp and on_cuda:
        raise ValueError("--use_amp: fp16 with a GradScaler on CUDA is not supported with --sharding fsdp yet; "
                         "expected no --use_amp there (bf16 autocast on the CPU works)")
    if local_path(config.checkpoint_dir) is None:
        raise ValueError(f"--checkpoint_dir: got {config.checkpoint_dir!r}; with --sharding fsdp expected a "
                         "local directory (each node's own disk, or a shared filesystem): sharded snapshots are not "
                         "written to object stores yet")
