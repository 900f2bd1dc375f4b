"""Your model, data and loss from the command line: `package.module:callable` import paths.

    python -m elastic_ddp.train --model my_pkg.models:build --dataset my_pkg.data:train_set \\
        --eval_dataset my_pkg.data:test_set --loss cross_entropy ...

Each of `--model`, `--dataset`, `--eval_dataset` and `--loss` takes a built-in name or an import
path `package.module:callable`, and `--collate` an import path (the module is imported as `import
package.module` would: it must be on `sys.path`, e.g. installed or in `PYTHONPATH`). The contracts:

- `--model`: the callable takes no arguments and returns a `torch.nn.Module`. torch's RNG is
  seeded from `--seed` just before the call, so every rank builds the same initial weights.
- `--dataset`, `--eval_dataset`: the callable takes no arguments and returns a map-style dataset
  (`__len__` and `__getitem__`, not an IterableDataset: exactly once needs samples by index) of
  samples that `--collate` can batch, with at least one sample.
- `--loss`: the callable itself is the loss: `loss(outputs, targets)` returns one loss per sample
  (`reduction="none"`), or a pair (losses, weights), as the Trainer requires.
- `--collate`: the callable itself is the collate: `collate(samples)` returns the batch (a dict
  with `labels` for a model called with keyword arguments; training/trainer.py has the rule).

A bad value fails before any process group starts, with one line naming the flag, the value and
what went wrong (`UserCodeError`, a ValueError). Importing runs the module's code: these flags are
as trusted as the training script itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_ddp.workload.data import check_map_style


class UserCodeError(ValueError):
    """A `--model`/`--dataset`/`--eval_dataset`/`--loss`/`--collate` value that cannot be used; one line."""


def has_import_path_form(value: str) -> bool:
    """Whether `value` reads `package.module:callable` (dotted identifiers on both sides)."""
    module_name, colon, attribute = value.partition(":")
    return bool(colon) and all(part.isidentifier() for part in module_name.split(".")) \
        and all(part.isidentifier() for part in attribute.split("."))


def resolve(flag: str, value: str) -> Callable:
    """The callable that `value` (`package.module:callable`) names; UserCodeError otherwise."""
    if not has_import_path_form(value):
        raise UserCodeError(f"{flag}: got {value!r}; expected package.module:callable")
    module_name, _, attribute = value.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UserCodeError(f"{flag}: got {value!r}, but module {exc.name or module_name!r} was not found; expected a "
                            "module on sys.path (installed, or in PYTHONPATH)") from exc
    except Exception as exc:  # the module's own code raised while being imported
        raise UserCodeError(f"{flag}: got {value!r}, but importing {module_name!r} raised "
                            f"{type(exc).__name__}: {exc}") from exc
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise UserCodeError(f"{flag}: got {value!r}, but {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, name)
    if not callable(target):
        raise UserCodeError(f"{flag}: got {value!r}, but {attribute!r} is a {type(target).__name__}, not callable")
    return target


def _call(flag: str, value: str, factory: Callable) -> Any:
    try:
        return factory()
    except Exception as exc:
        raise UserCodeError(f"{flag}: {value!r} raised {type(exc).__name__}: {exc}") from exc


def build_user_model(flag: str, value: str, seed: int) -> nn.Module:
    """The model `value` builds, with torch's RNG seeded from `seed` first (same weights everywhere)."""
    factory = resolve(flag, value)
    torch.manual_seed(seed)
    model = _call(flag, value, factory)
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"{flag}: {value!r} returned a {type(model).__name__}; expected a torch.nn.Module")
    return model


def build_user_dataset(flag: str, value: str) -> Dataset:
    """The map-style dataset `value` builds; UserCodeError for anything else, or an empty one."""
    dataset = _call(flag, value, resolve(flag, value))
    try:
        check_map_style(dataset, f"{flag}: {value!r} returned")
    except TypeError as exc:
        raise UserCodeError(str(exc)) from None
    if len(dataset) == 0:
        raise UserCodeError(f"{flag}: {value!r} returned an empty dataset; expected at least one sample")
    return dataset
