"""`TrainingConfig`: every setting of a run, and the command line generated from it.

The CLI is derived from the dataclass fields, so a field, its type, its default and its help text
live in one place (docs/configuration.md is generated from the same fields). Booleans become
`--flag/--no-flag`; a `tuple[float, float]` field takes two numbers. A subclass with fields of its
own gets flags for them from `from_args`. `--config FILE.toml` supplies values for any of them
(elastic_ddp/run_files/config_file.py); the command line wins over the file. Flags are never abbreviated:
`--dataset x` is `--dataset`, never a prefix of `--dataset_size`.

Validation happens in `__post_init__`, before any process group exists, and raises `ValueError`
with one line naming the flag, the value and what is accepted; the checks of more than a few lines
are the `check_*` functions after the class. Import paths (`--model`, `--dataset`, `--eval_dataset`,
`--loss`, `--collate`) are checked for their form here and imported by elastic_ddp/workload/user_code.py, also
before any process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import ipaddress
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastic_ddp.run_files.config_file import ConfigFileError, load_config_file
from elastic_ddp.run_files.locations import check_usable_url, local_path
from elastic_ddp.workload.sampler import steps_per_epoch
from elastic_ddp.workload.user_code import has_import_path_form

MODELS = ("mini_resnet", "mlp", "gpt")
SYNTHETIC = "synthetic"  # the built-in dataset (elastic_ddp/workload/data.py)
TOKENS = "tokens"  # windows of --token_file (elastic_ddp/workload/tokens.py)
# --model gpt's sizes (elastic_ddp/workload/gpt.py), by flag; --block_size also sizes --dataset tokens' windows.
GPT_SIZE_DEFAULTS = {"vocab_size": 256, "block_size": 64, "gpt_layers": 2, "gpt_heads": 2, "gpt_embed": 64}
SYNTHETIC_SIZE = 4096  # its default length
OPTIMIZERS = ("sgd", "adamw")
LOSSES = ("cross_entropy", "mse", "token_cross_entropy")
# timedelta's limit is far above this; a collective that may block for more than a week is a mistake.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# The peer watchdog's bound (elastic_ddp/runtime/watchdog.py) and the least it may be. Heartbeats every
# bound / 8 stayed unchanged for at most 0.77 s (two heartbeat periods) on a 2-core machine running
# 4 workers and 12 busy loops (docs/failure-semantics.md, "The watchdog"): 3 s is 4x that.
WATCHDOG_TIMEOUT_S = 3.0
MIN_WATCHDOG_TIMEOUT_S = 1.0
MAX_SNAPSHOT_BUDGET = 0.5  # beyond half the time, snapshots would be the job
PROGRESS_MODES = ("auto", "bar", "log", "off")  # see elastic_ddp/runlog/progress.py
DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("auto", "bf16", "fp16")
DIST_BACKENDS = ("auto", "nccl", "gloo")
IMPORT_PATH_FORM = "package.module:callable"
# torch.manual_seed's range, the first place a seed goes (the model's initialisation).
MAX_SEED = 2**64 - 1


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
    lr: float = _help("Peak learning rate (linear warm-up, then cosine decay to zero).", default=0.05)
    optimizer: str = _help(f"Optimizer: {' or '.join(OPTIMIZERS)}.", default="sgd")
    momentum: float = _help("SGD momentum (--optimizer sgd).", default=0.9)
    betas: tuple[float, float] = _help("AdamW's two betas (--optimizer adamw), e.g. --betas 0.9 0.95.",
                                       default=(0.9, 0.999))
    weight_decay: float = _help("Weight decay: SGD adds it to the gradient, AdamW decouples it.", default=0.0)
    decay_norms_and_biases: bool = _help(
        "Apply --weight_decay to every parameter (torch's default). --no-decay_norms_and_biases: only to parameters "
        "of two or more dimensions (the weights of linear layers, convolutions and embeddings), not to biases and "
        "norm scales, as nanoGPT and most language-model recipes do. Keep it for the whole run: it sets the "
        "optimizer's parameter groups, which a restore must match.", default=True)
    max_grad_norm: float = _help(
        "Clip the gradient's global norm (over every parameter of every rank) to this before each optimizer step, "
        "after AMP unscales it; 0: no clipping.", default=0.0)
    warmup_steps: int = _help("Optimizer steps of linear learning-rate warm-up.", default=0)
    seed: int = _help("Seed of the model initialisation, the data order and the augmentation.", default=0)
    model: str = _help(
        f"A built-in model ({' or '.join(MODELS)}; mlp and gpt have no batch-dependent layers; gpt: a small "
        f"decoder-only transformer for --dataset {TOKENS}, sized by --gpt_*) or {IMPORT_PATH_FORM}: a "
        "callable with no arguments that returns a torch.nn.Module (torch is seeded from --seed first).",
        default="mini_resnet")
    dataset: str = _help(
        f"Training data: {SYNTHETIC} (built-in images), {TOKENS} (windows of --token_file, for language models) or "
        f"{IMPORT_PATH_FORM}: a callable with no arguments that returns a map-style dataset of (input, target) "
        "samples.", default=SYNTHETIC)
    token_file: str | None = _help(
        f"With --dataset {TOKENS}: a flat file of token ids, little-endian uint16 (nanoGPT's train.bin), memory-"
        "mapped; each sample is a window of --block_size tokens, the target the same window one token later.",
        default=None)
    block_size: int | None = _help(
        f"Tokens per sample of --dataset {TOKENS}, and the context of --model gpt (default "
        f"{GPT_SIZE_DEFAULTS['block_size']}).", default=None)
    vocab_size: int | None = _help(
        f"--model gpt's vocabulary (default {GPT_SIZE_DEFAULTS['vocab_size']}: bytes); every id in --token_file "
        "must be below it.", default=None)
    gpt_layers: int | None = _help(f"--model gpt's blocks (default {GPT_SIZE_DEFAULTS['gpt_layers']}).", default=None)
    gpt_heads: int | None = _help(f"--model gpt's attention heads (default {GPT_SIZE_DEFAULTS['gpt_heads']}).",
                                  default=None)
    gpt_embed: int | None = _help(
        f"--model gpt's width, a multiple of --gpt_heads (default {GPT_SIZE_DEFAULTS['gpt_embed']}).", default=None)
    dataset_size: int | None = _help(
        f"Length of the built-in {SYNTHETIC} dataset (default {SYNTHETIC_SIZE}); built-in only: an error with "
        "--dataset of your own.", default=None)
    drop_last: bool = _help("Drop the last global batch of an epoch when it is not full.", default=False)
    augment: bool | None = _help(
        "Random flips of the built-in images, drawn from (seed, epoch, sample index) (default on); built-in "
        "only: an error with --dataset of your own.", default=None)
    eval_dataset: str | None = _help(
        f"Held-out data, evaluated every --eval_every_steps and at each epoch end: {SYNTHETIC} (held-out "
        f"images of the built-in data, a quarter of --dataset_size) or {IMPORT_PATH_FORM}, as --dataset.",
        default=None)
    eval_every_steps: int = _help("Evaluate every N optimizer steps as well; 0: at each epoch end only.", default=0)
    loss: str = _help(
        f"Per-sample loss: {' or '.join(LOSSES)} or {IMPORT_PATH_FORM}: loss(outputs, targets) returning one "
        "loss per sample (reduction='none'), or a pair (losses, weights) for the mean weighted by them. "
        "token_cross_entropy weighs each sample by its target tokens (labels not -100): the mean over every "
        "target token of the global batch.", default="cross_entropy")
    collate: str | None = _help(
        f"How a micro-batch's samples become a batch: {IMPORT_PATH_FORM}, collate(samples) -> batch, run in the "
        "DataLoader workers (default: torch's default_collate). A dict batch holds the targets under 'labels' and "
        "the model's keyword arguments under its other keys. elastic_ddp.workload.collate:pad_token_sequences "
        "pads dict samples of input_ids and labels to the longest of the micro-batch.", default=None)
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
    snapshot_every_steps: int | None = _help(
        "Snapshot every N optimizer steps and at every epoch end (0: only at epoch ends). Unset: on the overhead "
        "budget below (docs/snapshots.md, \"When snapshots are taken\").", default=None)
    snapshot_budget: float = _help(
        "Without --snapshot_every_steps: the share of training time durable snapshots may cost the training "
        "thread; they are spaced to stay under it (measured at every snapshot).", default=0.01)
    snapshot_max_interval_s: float = _help(
        "Without --snapshot_every_steps: the longest time between two durable snapshots, whatever the budget.",
        default=600.0)
    keep_last: int = _help("Snapshots kept on disk (at least 2, so a good one survives a torn write).", default=3)
    memory_copies: bool = _help(
        "When a worker group stops (a peer failed, torchrun re-forms the group), every rank keeps the state of its "
        "last committed step in node-local memory, and the restart resumes from it: a failure costs no "
        "committed step (docs/failure-semantics.md).", default=True)
    memory_dir: str = _help(
        "Node-local directory for those copies; it should be in memory (tmpfs). A copy takes as much room as "
        "the state.", default="/dev/shm")
    snapshot_timeout_s: float = _help(
        "Seconds a snapshot write may run before the run stops waiting for it (hung storage): the end of "
        "training and a drain's final snapshot wait no longer. A snapshot point waits at most 30 s (or 4x the last "
        "write's time) and skips its snapshot, reported, while a write hangs (docs/snapshots.md).", default=600.0)
    use_amp: bool = _help("Mixed precision: fp16 with GradScaler on CUDA, bf16 autocast on CPU.", default=False)
    compile: bool = _help(
        "torch.compile the model's training forward and backward (inductor). Each new worker compiles again before "
        "its first step (docs/custom-model.md has the cost); snapshots hold the model's own state dict.",
        default=False)
    amp_dtype: str = _help(
        f"With --use_amp, the autocast dtype: {' or '.join(AMP_DTYPES)}. auto: fp16 with a GradScaler on CUDA, bf16 on "
        "the CPU; bf16: on CUDA too, with no GradScaler (fp32's range: nothing overflows); fp16: CUDA only.",
        default="auto")
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
    metrics_port: int | None = _help(
        "Serve the run's live Prometheus metrics at http://METRICS_ADDR:PORT/metrics on every node, through "
        "worker-group restarts (0: a free port, logged; docs/operations.md, \"Live metrics\"); needs "
        "pip install 'elastic_ddp[metrics]'. Off by default.", default=None)
    metrics_addr: str = _help(
        "The address the metrics endpoint listens on. The default serves this machine only; 0.0.0.0 or another "
        "address of the machine exposes it to the network, and is your explicit choice (read-only: GET "
        "/metrics, no secrets).", default="127.0.0.1")
    collective_timeout_s: float = _help(
        "Seconds a collective may block before the rank gives up: the last resort when the watchdog "
        "is off (it bounds a step, a snapshot broadcast or a restore, so keep it well above the slowest).",
        default=60.0)
    watchdog_timeout_s: float = _help(
        "Seconds without a heartbeat from a peer (frozen, partitioned, or dead under NCCL) before the group is "
        "re-formed without it (in process with our rendezvous, else this worker stops and torchrun restarts "
        "it); 0 turns the watchdog off. A live peer "
        "heartbeats from a thread of its own, however slow its steps (docs/failure-semantics.md).",
        default=WATCHDOG_TIMEOUT_S)
    straggler_threshold: float = _help(
        "A rank whose own time per sample (a step's time outside the run's collectives) is this fraction of the "
        "fastest rank's speed or less, for --straggler_patience_s, is named slow: a straggler event, a metric, a log "
        "line (docs/failure-semantics.md, \"A node slows down\"); 0 turns the detection off.", default=0.6)
    straggler_patience_s: float = _help(
        "Seconds a rank must stay below --straggler_threshold to be named, and back above it to be reported "
        "recovered.", default=15.0)
    device: str = _help("auto (CUDA when available), cpu or cuda.", default="auto")
    dist_backend: str = _help(
        "Process-group backend: auto (nccl on CUDA, gloo on the CPU), nccl or gloo. gloo on CUDA lets several "
        "ranks share one GPU (nccl refuses that), at gloo's speed.", default="auto")
    sharding: str = _help("none (DDP: every rank holds the whole state) or fsdp (FSDP2: parameters, gradients and "
                          "optimizer state sharded over the ranks; snapshots through DCP; docs/sharding.md).",
                          default="none")
    shard_blocks: str = _help("With --sharding fsdp: comma-separated globs over submodule names (e.g. 'layers.*') "
                              "that are sharded as units; default: the model's sharding_blocks(), else every "
                              "submodule with parameters of its own.", default="")

    def __post_init__(self) -> None:
        self._check_workload()
        check_finite(self)
        check_positive(self, "epochs", "global_batch_size", "micro_batch_size", "dataset_size", "log_interval",
                       *GPT_SIZE_DEFAULTS)
        check_non_negative(self, "snapshot_every_steps", "num_workers", "warmup_steps", "weight_decay",
                            "snapshot_replicas", "min_step_time_s", "eval_every_steps", "max_grad_norm")
        if not self.lr > 0:
            raise ValueError(f"--lr: got {self.lr}; expected a positive number")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum: got {self.momentum}; expected a number in [0, 1)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer: got {self.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
        if not (len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas)):
            raise ValueError(f"--betas: got {' '.join(map(str, self.betas))}; expected two numbers in [0, 1)")
        if self.eval_every_steps and self.eval_dataset is None:
            raise ValueError(f"--eval_every_steps: got {self.eval_every_steps} without --eval_dataset; expected "
                             "--eval_dataset too (or 0)")
        if self.keep_last < 2:
            raise ValueError(f"--keep_last: got {self.keep_last}; expected at least 2 (the previous good "
                             "snapshot must survive a torn write)")
        if self.micro_batch_size > self.global_batch_size:
            raise ValueError(f"--micro_batch_size: got {self.micro_batch_size}; expected at most "
                             f"--global_batch_size ({self.global_batch_size})")
        if self.drop_last and self.dataset_size is not None and self.global_batch_size > self.dataset_size:
            raise ValueError(f"--global_batch_size: got {self.global_batch_size} with --drop_last; expected at "
                             f"most --dataset_size ({self.dataset_size}), or no step would run")
        if not 0 < self.snapshot_budget <= MAX_SNAPSHOT_BUDGET:
            raise ValueError(f"--snapshot_budget: got {self.snapshot_budget}; expected a share of training time "
                             f"above 0 and at most {MAX_SNAPSHOT_BUDGET} (0.01: 1 %)")
        for name in ("collective_timeout_s", "snapshot_timeout_s", "snapshot_max_interval_s"):
            value = getattr(self, name)
            if not 0 < value <= MAX_TIMEOUT_S:
                raise ValueError(f"--{name}: got {value}; expected a positive number of seconds, at most "
                                 f"{MAX_TIMEOUT_S:.0f} (a week)")
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"--progress: got {self.progress!r}; expected one of {', '.join(PROGRESS_MODES)}")
        check_device(self.device, self.dist_backend, torch.cuda.is_available())
        check_amp_dtype(self.amp_dtype, self.use_amp, self.device, torch.cuda.is_available())
        if not (self.watchdog_timeout_s == 0 or MIN_WATCHDOG_TIMEOUT_S <= self.watchdog_timeout_s
                < self.collective_timeout_s):
            raise ValueError(f"--watchdog_timeout_s: got {self.watchdog_timeout_s}; expected 0 (off) or at least "
                             f"{MIN_WATCHDOG_TIMEOUT_S:g} s and below --collective_timeout_s "
                             f"({self.collective_timeout_s:g} s)")
        if not (self.straggler_threshold == 0 or 0 < self.straggler_threshold < 1):
            raise ValueError(f"--straggler_threshold: got {self.straggler_threshold}; expected 0 (off) or a fraction "
                             "of the fastest rank's speed between 0 and 1, such as 0.6")
        if not 0 < self.straggler_patience_s <= MAX_TIMEOUT_S:
            raise ValueError(f"--straggler_patience_s: got {self.straggler_patience_s}; expected a positive number of "
                             f"seconds, at most {MAX_TIMEOUT_S:.0f}")
        check_seed(self.seed)
        check_metrics_endpoint(self.metrics_port, self.metrics_addr, self.memory_dir)
        check_sharding(self, torch.cuda.is_available())
        check_checkpoint_dir(self.checkpoint_dir)
        check_local_location("--event_log", self.event_log, directory=False)
        for name in ("audit_log", "tensorboard_dir"):
            check_local_location(f"--{name}", getattr(self, name), directory=True)
        if self.memory_copies and not self.memory_dir:
            raise ValueError("--memory_dir: got an empty path; expected a directory (or --no-memory_copies)")

    def _check_workload(self) -> None:
        """The form of the workload flags; fills in the built-in dataset's defaults."""
        self.betas = tuple(self.betas)  # a list from a config file or the library
        check_choice_or_import_path("model", self.model, MODELS)
        check_choice_or_import_path("dataset", self.dataset, (SYNTHETIC, TOKENS))
        self._check_language_model()
        check_choice_or_import_path("loss", self.loss, LOSSES)
        if self.collate is not None:
            check_choice_or_import_path("collate", self.collate, ())
        if self.eval_dataset is not None:
            check_choice_or_import_path("eval_dataset", self.eval_dataset, (SYNTHETIC,))
            if self.eval_dataset == SYNTHETIC != self.dataset:
                raise ValueError(f"--eval_dataset: got {SYNTHETIC} with --dataset {self.dataset}; the built-in "
                                 "held-out set goes with the built-in data: expected an import path")
        if self.dataset == SYNTHETIC:
            self.dataset_size = SYNTHETIC_SIZE if self.dataset_size is None else self.dataset_size
            self.augment = True if self.augment is None else self.augment
            return
        for name in ("dataset_size", "augment"):
            if getattr(self, name) is not None:
                raise ValueError(f"--{name}: got {getattr(self, name)} with --dataset {self.dataset}; it applies to "
                                 f"the built-in {SYNTHETIC} dataset only: leave it out")

    def _check_language_model(self) -> None:
        """--token_file with --dataset tokens and only then; the sizes with the model or data they size,
        filled with GPT_SIZE_DEFAULTS there; --gpt_embed a multiple of --gpt_heads."""
        if (self.dataset == TOKENS) != (self.token_file is not None):
            raise ValueError(f"--token_file: got {self.token_file!r} with --dataset {self.dataset}; expected both "
                             f"(--dataset {TOKENS} --token_file PATH) or neither")
        for name, default in GPT_SIZE_DEFAULTS.items():
            used = self.model == "gpt" or (name == "block_size" and self.dataset == TOKENS)
            if getattr(self, name) is not None and not used:
                sized = "--model gpt and --dataset tokens" if name == "block_size" else "--model gpt"
                raise ValueError(f"--{name}: got {getattr(self, name)} with --model {self.model} and --dataset "
                                 f"{self.dataset}; it sizes {sized} only: leave it out")
            if used and getattr(self, name) is None:
                setattr(self, name, default)
        if self.model == "gpt" and self.gpt_heads > 0 and self.gpt_embed % self.gpt_heads:
            raise ValueError(f"--gpt_embed: got {self.gpt_embed}; expected a multiple of --gpt_heads ({self.gpt_heads})")

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch of the built-in dataset (a dataset of yours: `ElasticSampler`'s);
        depends on the dataset and global batch, never on the world size."""
        if self.dataset_size is None:
            raise ValueError(f"steps_per_epoch: --dataset {self.dataset} is not the built-in one; its length "
                             "is known once it is built (ElasticSampler.steps_per_epoch)")
        return steps_per_epoch(self.dataset_size, self.global_batch_size, self.drop_last)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> TrainingConfig:
        """Parse a command line (with `--config FILE.toml` under it): a config of this class, whose
        own fields have flags too. Bad values exit with argparse's usage line and our one-line reason."""
        config, _ = cls._parse(argv, known_only=False)
        return config

    @classmethod
    def from_known_args(cls, argv: Sequence[str]) -> tuple[TrainingConfig, list[str]]:
        """As `from_args`, for a command line that also carries flags of others: (config, the rest)."""
        return cls._parse(argv, known_only=True)

    @classmethod
    def _parse(cls, argv: Sequence[str] | None, known_only: bool) -> tuple[TrainingConfig, list[str]]:
        parser = build_parser(cls)
        file_values = _config_file_values(parser, cls, argv)
        parser.set_defaults(**file_values)
        namespace, rest = parser.parse_known_args(argv) if known_only else (parser.parse_args(argv), [])
        values = vars(namespace)
        values.pop(CONFIG_FILE_FLAG[2:])
        try:
            return cls(**values), rest
        except ValueError as exc:
            parser.error(str(exc))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_finite(config: TrainingConfig) -> None:
    """Every float setting is a finite number (argparse takes 'nan' and 'inf' for a float)."""
    for config_field in dataclasses.fields(config):
        value = getattr(config, config_field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{config_field.name}: got {value}; expected a finite number")


def check_choice_or_import_path(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices and not has_import_path_form(value):
        named = f"{' or '.join(choices)}, or " if choices else ""
        raise ValueError(f"--{name}: got {value!r}; expected {named}an import path {IMPORT_PATH_FORM}")


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


def check_positive(config: TrainingConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name}: got {value}; expected a positive integer")


def check_non_negative(config: TrainingConfig, *names: str) -> None:
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


def check_sharding(config: TrainingConfig, cuda_available: bool) -> None:
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


CONFIG_FILE_FLAG = "--config"
PAIR = "tuple[float, float]"


def _field_type(config_field: dataclasses.Field) -> type:
    """The flag's type: bool, int, float, str, or tuple (for `tuple[float, float]`)."""
    # Annotations are strings under `from __future__ import annotations`.
    annotation = str(config_field.type)
    if annotation == PAIR:
        return tuple
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if annotation.startswith(name):
            return kind
    raise TypeError(f"{config_field.name}: unsupported field type {annotation} for a flag; expected bool, int, "
                    f"float, str (optionally `| None`) or {PAIR}")


def build_parser(config_class: type[TrainingConfig] | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `config_class` (TrainingConfig or a subclass),
    and `--config FILE.toml`. Prefix matching is off: an unknown flag is an error, never another flag."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_ddp.train",
        description="Elastic DDP training; launch it with torchrun (see README.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(CONFIG_FILE_FLAG, metavar="FILE.toml", default=None,
                        help="Values for any flag below from a TOML file (keys are flag names without the dashes: "
                             "epochs = 3); flags given on the command line win.")
    for config_field in dataclasses.fields(config_class or TrainingConfig):
        kind = _field_type(config_field)
        flag = f"--{config_field.name}"
        help_text = config_field.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=config_field.default, help=help_text)
        elif kind is tuple:
            parser.add_argument(flag, type=float, nargs=2, default=config_field.default, help=help_text,
                                metavar=(f"{config_field.name.upper()}1", f"{config_field.name.upper()}2"))
        else:
            parser.add_argument(flag, type=kind, default=config_field.default, help=help_text,
                                metavar=config_field.name.upper())
    return parser


def _config_file_values(parser: argparse.ArgumentParser, config_class: type[TrainingConfig],
                        argv: Sequence[str] | None) -> dict[str, Any]:
    """The values of the `--config` file named on the command line, checked against the fields."""
    finder = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    finder.add_argument(CONFIG_FILE_FLAG, default=None)
    path = finder.parse_known_args(argv)[0].config
    if path is None:
        return {}
    kinds = {config_field.name: _field_type(config_field) for config_field in dataclasses.fields(config_class)}
    try:
        return load_config_file(path, kinds)
    except ConfigFileError as exc:
        parser.error(str(exc))
