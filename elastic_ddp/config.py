"""`TrainingConfig`: every setting of a run, and the command line generated from it.

The CLI is derived from the dataclass fields, so a field, its type, its default and its help text
live in one place (docs/configuration.md is generated from the same fields). Booleans become
`--flag/--no-flag`. Validation happens in `__post_init__`, before any process group exists, and
raises `ValueError` with one line naming the flag, the value and what is accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from elastic_ddp.sampler import steps_per_epoch
from elastic_ddp.snapshot.storage import is_url, open_storage

MODELS = ("mini_resnet", "mlp")
# timedelta's limit is far above this; a collective that may block for more than a week is a mistake.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
PROGRESS_MODES = ("auto", "bar", "log", "off")  # see elastic_ddp/runlog/progress.py


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass
class TrainingConfig:
    """The settings of one training run. Field names are the CLI flags (`--global_batch_size`)."""

    epochs: int = _help("Epochs to train in total (a resumed run finishes the remaining ones).", default=3)
    global_batch_size: int = _help(
        "Samples per optimizer step, summed over all ranks: the invariant across world sizes.", default=64)
    micro_batch_size: int = _help(
        "Most samples one rank pushes through one forward pass; gradient accumulation steps follow "
        "from this, the global batch and the current world size.", default=32)
    lr: float = _help("Peak learning rate (SGD with momentum, linear warm-up then cosine decay).", default=0.05)
    momentum: float = _help("SGD momentum.", default=0.9)
    weight_decay: float = _help("SGD weight decay.", default=0.0)
    warmup_steps: int = _help("Optimizer steps of linear learning-rate warm-up.", default=0)
    seed: int = _help("Seed of the model initialisation, the data order and the augmentation.", default=0)
    model: str = _help(f"Built-in model: {' or '.join(MODELS)} (mlp has no batch-dependent layers).",
                       default="mini_resnet")
    dataset_size: int = _help("Length of the built-in synthetic dataset.", default=4096)
    drop_last: bool = _help("Drop the last global batch of an epoch when it is not full.", default=False)
    augment: bool = _help("Random flips of the built-in images, drawn from (seed, epoch, sample index).",
                          default=True)
    checkpoint_dir: str = _help(
        "Where snapshots go: a local directory (each node's own disk is fine), or an fsspec URL such as "
        "s3://bucket/run (needs the object-store extra; see docs/snapshots.md).", default="checkpoints")
    snapshot_replicas: int = _help(
        "Other nodes whose local --checkpoint_dir receives a copy of each snapshot, so that losing any "
        "node loses no snapshot without shared storage (0: off; nothing is copied to a directory rank 0 "
        "already writes, such as shared storage or a URL).", default=1)
    snapshot_async: bool = _help(
        "Write snapshots on a background thread; training waits only for a memory copy (off: training "
        "waits for every durable write).", default=True)
    snapshot_every_steps: int = _help("Snapshot every N optimizer steps; 0: only at epoch ends.", default=50)
    keep_last: int = _help("Snapshots kept on disk (at least 2, so a good one survives a torn write).", default=3)
    memory_copies: bool = _help(
        "When a worker group stops (a peer failed, torchrun re-forms the group), every rank keeps the state of its "
        "last committed step in node-local memory, and the restart resumes from it: a failure costs no "
        "committed step (docs/failure-semantics.md).", default=True)
    memory_dir: str = _help(
        "Node-local directory for those copies; it should be in memory (tmpfs). A copy takes as much room as "
        "the state.", default="/dev/shm")
    snapshot_timeout_s: float = _help(
        "Seconds a snapshot write may take before the run stops waiting for it (hung storage): the next "
        "snapshot point is skipped and reported, and the end of training waits no longer.", default=600.0)
    use_amp: bool = _help("Mixed precision: fp16 with GradScaler on CUDA, bf16 autocast on CPU.", default=False)
    num_workers: int = _help("DataLoader worker processes per rank (0: load in the training process).",
                             default=0)
    log_interval: int = _help("Log loss and throughput every N optimizer steps (rank 0).", default=10)
    min_step_time_s: float = _help(
        "Each optimizer step takes at least this long (the trainer sleeps the rest): simulates a slower "
        "model, to rehearse failures at a realistic pace (elastic-ddp chaos). 0: off.", default=0.0)
    progress: str = _help(
        f"Progress on rank 0: {', '.join(PROGRESS_MODES)} (auto: a bar per epoch when stderr is a terminal, "
        "log lines otherwise).", default="auto")
    tensorboard_dir: str | None = _help(
        "Write TensorBoard scalars (loss, lr, samples/s, world size) here from rank 0; needs the "
        "tensorboard package (pip install 'elastic_ddp[tensorboard]').", default=None)
    audit_log: str | None = _help(
        "Directory for per-rank JSON-lines audit files: one line per committed step with its sample "
        "indices (for checking exactly-once).", default=None)
    event_log: str | None = _help(
        "JSON-lines event log of the run (restores, snapshots, membership); default: "
        "CHECKPOINT_DIR/events.jsonl.", default=None)
    collective_timeout_s: float = _help(
        "Seconds a collective may block before the rank gives up (a frozen peer is detected within "
        "this time).", default=60.0)
    device: str = _help("auto (CUDA when available), cpu or cuda.", default="auto")

    def __post_init__(self) -> None:
        _check_finite(self)
        _check_positive(self, "epochs", "global_batch_size", "micro_batch_size", "dataset_size", "log_interval")
        _check_non_negative(self, "snapshot_every_steps", "num_workers", "warmup_steps", "weight_decay",
                            "snapshot_replicas", "min_step_time_s")
        if not self.lr > 0:
            raise ValueError(f"--lr: got {self.lr}; expected a positive number")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum: got {self.momentum}; expected a number in [0, 1)")
        if self.model not in MODELS:
            raise ValueError(f"--model: got {self.model!r}; expected one of {', '.join(MODELS)}")
        if self.keep_last < 2:
            raise ValueError(f"--keep_last: got {self.keep_last}; expected at least 2 (the previous good "
                             "snapshot must survive a torn write)")
        if self.micro_batch_size > self.global_batch_size:
            raise ValueError(f"--micro_batch_size: got {self.micro_batch_size}; expected at most "
                             f"--global_batch_size ({self.global_batch_size})")
        if self.drop_last and self.global_batch_size > self.dataset_size:
            raise ValueError(f"--global_batch_size: got {self.global_batch_size} with --drop_last; expected at "
                             f"most --dataset_size ({self.dataset_size}), or no step would run")
        for name in ("collective_timeout_s", "snapshot_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= MAX_TIMEOUT_S:
                raise ValueError(f"--{name}: got {value}; expected a positive number of seconds, at most "
                                 f"{MAX_TIMEOUT_S:.0f} (a week)")
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"--progress: got {self.progress!r}; expected one of {', '.join(PROGRESS_MODES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device: got {self.device!r}; expected auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device: got 'cuda', but CUDA is not available here; expected auto or cpu")
        _check_checkpoint_dir(self.checkpoint_dir)
        if self.memory_copies and not self.memory_dir:
            raise ValueError("--memory_dir: got an empty path; expected a directory (or --no-memory_copies)")

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch; depends on the dataset and global batch, never on the world size."""
        return steps_per_epoch(self.dataset_size, self.global_batch_size, self.drop_last)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> TrainingConfig:
        """Parse a command line; bad values exit with argparse's usage line and our one-line reason."""
        parser = build_parser()
        namespace = parser.parse_args(argv)
        try:
            return cls(**vars(namespace))
        except ValueError as exc:
            parser.error(str(exc))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_finite(config: TrainingConfig) -> None:
    """Every float setting is a finite number (argparse takes 'nan' and 'inf' for a float)."""
    for config_field in dataclasses.fields(config):
        value = getattr(config, config_field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{config_field.name}: got {value}; expected a finite number")


def _check_checkpoint_dir(location: str) -> None:
    """A URL whose storage can be used here, or a local path that is (or can become) a directory."""
    if not location:
        raise ValueError("--checkpoint_dir: got an empty path; expected a directory")
    if is_url(location):
        open_storage(location)  # ValueError naming the flag if the URL cannot be used here
        return
    path = Path(location)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"--checkpoint_dir: got {location!r}, but {str(blocker)!r} is a file; expected a "
                         "directory, or a path where one can be created")


def _check_positive(config: TrainingConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"--{name}: got {value}; expected a positive integer")


def _check_non_negative(config: TrainingConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 0:
            raise ValueError(f"--{name}: got {value}; expected 0 or more")


def _field_type(config_field: dataclasses.Field) -> type:
    # Annotations are strings under `from __future__ import annotations`.
    annotation = str(config_field.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if annotation.startswith(name):
            return kind
    raise TypeError(f"TrainingConfig.{config_field.name}: unsupported type {annotation}")


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one flag per `TrainingConfig` field."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_ddp.train",
        description="Elastic DDP training; launch it with torchrun (see README.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for config_field in dataclasses.fields(TrainingConfig):
        kind = _field_type(config_field)
        flag = f"--{config_field.name}"
        help_text = config_field.metadata["help"]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=config_field.default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=config_field.default, help=help_text,
                                metavar=config_field.name.upper())
    return parser
