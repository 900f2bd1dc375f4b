"""What to train, from the config: the model, the data, the held-out data, the loss, the augmentation.

`build_workload(config)` builds the built-ins (`--model mini_resnet|mlp|gpt`, `--dataset
synthetic|tokens`, `--loss cross_entropy|mse|token_cross_entropy`) or imports yours
(`package.module:callable`, also `--collate`: elastic_ddp/workload/user_code.py).
Call it before the process group starts: a bad import path, a model that is not an nn.Module, an
empty dataset or one too small for `--drop_last` raises `UserCodeError` (a ValueError) with one line,
and no peer waits for this rank in a collective meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.utils.data import Dataset

from elastic_ddp.config import MODELS, SYNTHETIC, TOKENS, TrainingConfig
from elastic_ddp.workload.collate import Collate
from elastic_ddp.workload.data import SampleTransform, SyntheticImageDataset, random_horizontal_flip
from elastic_ddp.workload.losses import LossFn, per_sample_cross_entropy, per_sample_mse, token_cross_entropy
from elastic_ddp.workload.models import build_model
from elastic_ddp.workload.tokens import TokenWindows
from elastic_ddp.workload.user_code import UserCodeError, build_user_dataset, build_user_model, resolve

BUILTIN_LOSSES: dict[str, LossFn] = {"cross_entropy": per_sample_cross_entropy, "mse": per_sample_mse,
                                     "token_cross_entropy": token_cross_entropy}
HELD_OUT_FRACTION = 4  # the built-in held-out set is a quarter of the training set's length


@dataclass
class Workload:
    """Everything `Trainer` needs besides the config (its constructor's arguments of the same names)."""

    model: nn.Module
    dataset: Dataset
    eval_dataset: Dataset | None
    loss_fn: LossFn
    sample_transform: SampleTransform | None
    collate_fn: Collate | None


def build_workload(config: TrainingConfig) -> Workload:
    """The workload `config` names (see the module docstring); UserCodeError when it cannot be built."""
    dataset = _dataset("--dataset", config.dataset, config, held_out=False)
    if config.drop_last and config.global_batch_size > len(dataset):
        raise UserCodeError(f"--global_batch_size: got {config.global_batch_size} with --drop_last; expected at most "
                            f"the length of --dataset {config.dataset} ({len(dataset)}), or no step would run")
    eval_dataset = (None if config.eval_dataset is None
                    else _dataset("--eval_dataset", config.eval_dataset, config, held_out=True))
    return Workload(
        model=_model(config),
        dataset=dataset,
        eval_dataset=eval_dataset,
        loss_fn=BUILTIN_LOSSES[config.loss] if config.loss in BUILTIN_LOSSES else resolve("--loss", config.loss),
        sample_transform=random_horizontal_flip if config.dataset == SYNTHETIC and config.augment else None,
        collate_fn=None if config.collate is None else resolve("--collate", config.collate),
    )


def _model(config: TrainingConfig) -> nn.Module:
    if config.model == "gpt":
        return build_model("gpt", config.seed, vocab_size=config.vocab_size, block_size=config.block_size,
                           layers=config.gpt_layers, heads=config.gpt_heads, embed=config.gpt_embed)
    if config.model in MODELS:
        return build_model(config.model, config.seed)
    return build_user_model("--model", config.model, config.seed)


def _dataset(flag: str, value: str, config: TrainingConfig, held_out: bool) -> Dataset:
    if value == TOKENS:
        # Without --model gpt nothing bounds the ids but their type (uint16).
        try:
            return TokenWindows(config.token_file, config.block_size, config.vocab_size or 1 << 16)
        except ValueError as exc:
            raise UserCodeError(str(exc)) from None
    if value != SYNTHETIC:
        return build_user_dataset(flag, value)
    if not held_out:
        return SyntheticImageDataset(config.dataset_size, config.seed)
    size = max(1, (config.dataset_size or 0) // HELD_OUT_FRACTION)
    return SyntheticImageDataset(size, config.seed, held_out=True)
