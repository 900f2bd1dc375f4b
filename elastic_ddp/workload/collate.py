"""How samples become batches and batches reach the device, for data of any structure.

A *collate* turns the samples of one micro-batch into a batch, as `DataLoader(collate_fn=...)`'s
does; without one, torch's `default_collate`. A batch may be tensors in dicts, lists, tuples, named
tuples and dataclasses, nested, with other leaves (ids, strings, numbers) kept as they are:

- `to_device(batch, device)` moves every tensor leaf (through `torch.utils._pytree`, plus
  dataclasses and mappings that it does not know, such as transformers' `BatchEncoding`);
- `empty_batch(collate, sample)` is the batch of a rank whose share of a step is empty (rule there);
- `pad_token_sequences` is a collate for variable-length token sequences: dict samples
  `{"input_ids": ..., "labels": ...}` in, a padded dict batch with an attention mask out.

Not guaranteed: tensors held inside objects of other kinds (a class of your own that is neither a
dataclass nor a mapping, unless registered with `torch.utils._pytree`) are not moved; a batch with
no tensor the walk can reach is refused (`CollateError`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_is_leaf, tree_map, tree_unflatten
from torch.utils.data import default_collate

Collate = Callable[[list[Any]], Any]
IGNORE_INDEX = -100  # what torch's cross_entropy (and Hugging Face's models) skip in the labels


class CollateError(ValueError):
    """A collate that failed, or made a batch the run cannot place or cannot empty; one line."""


# ------------------------------------------------------------------------------- to the device

def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """`batch` with every tensor leaf on `device` (`non_blocking`: asynchronous from pinned memory,
    on CUDA); containers are rebuilt, other leaves kept. CollateError when it holds no tensor."""
    if type(batch) in (list, tuple) and all(isinstance(item, torch.Tensor) for item in batch) and batch:
        # The default collate's (input, target): the same result without the tree walk (1.5 us, not 7).
        return type(batch)(item.to(device, non_blocking=non_blocking) for item in batch)
    if type(batch) is dict and batch and all(isinstance(item, torch.Tensor) for item in batch.values()):
        # A padding collate's {"input_ids": ..., "labels": ..., "attention_mask": ...}: the walk cost 16-19 us.
        return {key: item.to(device, non_blocking=non_blocking) for key, item in batch.items()}
    moved = 0

    def move(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal moved
        moved += 1
        return tensor.to(device, non_blocking=non_blocking)

    placed = map_tensors(move, batch)
    if not moved:
        raise CollateError(f"collate_fn: made a batch of type {type(batch).__name__} with no tensor the run can "
                           "move to the device; expected tensors in dicts, lists, tuples, named tuples or "
                           "dataclasses (or a type registered with torch.utils._pytree)")
    return placed


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """`tree` with `function` applied to each tensor leaf; containers rebuilt, other leaves kept."""
    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return function(value)
        items = _opaque_items(value)
        if items is None:
            return value
        return _rebuilt(value, {name: map_tensors(function, item) for name, item in items.items()})
    return tree_map(leaf, tree)


def _opaque_items(value: Any) -> dict[Any, Any] | None:
    """The fields of a dataclass, or the items of a mapping, that pytree sees as one leaf (it knows
    dict and its standard kinds, not user dataclasses or a UserDict); None for any other leaf."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return dict(value.items())
    return None


def _rebuilt(value: Any, items: dict[Any, Any]) -> Any:
    """A shallow copy of the dataclass or mapping `value` holding `items` instead (no __init__ or
    __post_init__ runs again: a frozen dataclass and fields with init=False are copied too)."""
    if isinstance(value, Mapping) and not isinstance(value, MutableMapping):
        raise CollateError(f"collate_fn: made a batch holding a read-only mapping of type {type(value).__name__}; "
                           "expected a dict (or another mutable mapping) the run can place on the device")
    rebuilt = copy.copy(value)
    for name, item in items.items():
        if isinstance(value, Mapping):
            rebuilt[name] = item
        else:
            object.__setattr__(rebuilt, name, item)
    return rebuilt


# ------------------------------------------------------------------------------- the empty batch

def empty_batch(collate: Collate, sample: Any) -> Any:
    """The batch of a rank whose share of a step is empty: it still runs the forward and backward
    passes that synchronise the gradients, on a batch of zero samples its model can run.

    The rule, for any structure and any collate: collate `sample` (a real one) once and twice; a
    tensor leaf whose first dimension is 1 once and 2 twice is batched, and is cut to length 0; a
    list that holds 1 item once and 2 twice (default_collate's list of per-sample strings, a
    collate's list of per-sample tensors) becomes empty; every other leaf (a 0-d tensor, a table
    of the batch's own, a string, a number) is kept as the single sample's collate made it.

    Limit: the collate's structure may depend on the number of samples only through such leaves
    and lists; one whose batch has no batched leaf (nothing follows the number of samples) is
    refused with CollateError, as is one whose structure differs otherwise.
    """
    walk = _EmptyingWalk()
    batch = walk(collate([sample]), collate([sample, sample]), "")
    if not walk.emptied:
        raise CollateError("collate_fn: no tensor of its batch has a first dimension that follows the number of "
                           "samples (1 for one sample, 2 for two), so a rank with no sample in a step cannot be "
                           "given an empty batch; expected batch-first tensors")
    return batch


class _EmptyingWalk:
    """`empty_batch`'s walk down the batches of one sample (`one`) and two (`two`) together."""

    def __init__(self):
        self.emptied = 0  # leaves cut and lists emptied

    def __call__(self, one: Any, two: Any, where: str) -> Any:
        if isinstance(one, torch.Tensor):
            batched = (isinstance(two, torch.Tensor) and one.dim() >= 1 and two.dim() == one.dim()
                       and one.shape[0] == 1 and two.shape[0] == 2)
            self.emptied += batched
            return one[:0] if batched else one
        items = _opaque_items(one) if tree_is_leaf(one) else None
        if items is not None:
            others = _opaque_items(two) or {}
            _same_keys(items.keys(), others.keys(), where)
            named = (lambda key: f"{where}[{key!r}]") if isinstance(one, Mapping) else (lambda key: f"{where}.{key}")
            return _rebuilt(one, {key: self(item, others[key], named(key)) for key, item in items.items()})
        return one if tree_is_leaf(one) else self._node(one, two, where)

    def _node(self, one: Any, two: Any, where: str) -> Any:
        """A container pytree knows, one level down (its children as leaves), then each child."""
        paths, spec = tree_flatten_with_path(one, is_leaf=lambda node: node is not one)
        others, other_spec = tree_flatten(two, is_leaf=lambda node: node is not two)
        if spec.type is list and len(paths) == 1 and len(others) == 2:
            self.emptied += 1
            return []
        if spec != other_spec:
            kinds = (f"keys {spec.context} vs {other_spec.context}" if spec.type is other_spec.type is dict else
                     f"{spec.type.__name__} of {len(paths)} vs {other_spec.type.__name__} of {len(others)}")
            raise CollateError(f"collate_fn: its batch of 1 sample and of 2 differ in structure at "
                               f"{where or 'the top'} ({kinds}); expected the same structure, with batch-first tensors")
        return tree_unflatten([self(item, other, where + keystr(path)) for (path, item), other in zip(paths, others)],
                              spec)


def _same_keys(keys: Any, other: Any, where: str) -> None:
    if list(keys) != list(other):
        raise CollateError(f"collate_fn: its batch of 1 sample and of 2 differ in structure at {where or 'the top'} "
                           f"(keys {list(keys)} vs {list(other)}); expected the same keys")


# ------------------------------------------------------------------------------- padding token sequences

class TokenPadding:
    """A collate for variable-length token sequences: pads each micro-batch to its longest sample.

    Samples are mappings with `input_ids` (a 1-d tensor or list of ints) and optionally `labels`
    (as long as `input_ids`) and `attention_mask`. The batch is a dict: `input_ids` padded with
    `pad_id`, `attention_mask` (1 on tokens, 0 on padding; the sample's own padded with 0 when
    given), `labels` padded with `ignore_index` (-100, which cross-entropy skips); any other key is
    collated with torch's default_collate (equal shapes, or non-tensor values kept in a list).
    Padding goes on the right; `pad_to_multiple_of` rounds the length up (tensor cores like 8).
    """

    PADDED = ("input_ids", "attention_mask", "labels")

    def __init__(self, pad_id: int = 0, ignore_index: int = IGNORE_INDEX, pad_to_multiple_of: int = 1):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of: got {pad_to_multiple_of}; expected a positive integer")
        self.pad_id, self.ignore_index, self.pad_to_multiple_of = pad_id, ignore_index, pad_to_multiple_of

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        keys = _sample_keys(samples)
        sequences = {key: [torch.as_tensor(sample[key]) for sample in samples] for key in self.PADDED if key in keys}
        lengths = _check_lengths(sequences)
        longest = -(-int(lengths.max()) // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": _padded(sequences["input_ids"], self.pad_id, longest)}
        if "attention_mask" in sequences:
            batch["attention_mask"] = _padded(sequences["attention_mask"], 0, longest)
        else:
            batch["attention_mask"] = (torch.arange(longest) < lengths[:, None]).to(torch.int64)
        if "labels" in sequences:
            batch["labels"] = _padded(sequences["labels"], self.ignore_index, longest)
        others = [key for key in keys if key not in self.PADDED]
        if others:
            batch.update(default_collate([{key: sample[key] for key in others} for sample in samples]))
        return batch


def _sample_keys(samples: Sequence[Any]) -> list[str]:
    """The keys of the first sample, checked to be those of every sample and to hold input_ids."""
    if not samples:
        raise ValueError("pad_token_sequences: got no samples; expected at least one")
    if not all(isinstance(sample, Mapping) for sample in samples):
        kind = next(type(sample).__name__ for sample in samples if not isinstance(sample, Mapping))
        raise ValueError(f"pad_token_sequences: got a sample of type {kind}; expected dicts with input_ids "
                         "(and labels, attention_mask)")
    keys = list(samples[0])
    if "input_ids" not in keys:
        raise ValueError(f"pad_token_sequences: got samples with keys {keys}; expected input_ids among them")
    for position, sample in enumerate(samples):
        if set(sample) != set(keys):
            raise ValueError(f"pad_token_sequences: sample {position} of the micro-batch has keys {sorted(sample)}; "
                             f"expected those of the first, {sorted(keys)}")
    return keys


def _check_lengths(sequences: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    """Each sample's length (of input_ids), checked: 1-d sequences, labels and mask as long."""
    lengths = []
    for position, ids in enumerate(sequences["input_ids"]):
        if ids.dim() != 1:
            raise ValueError(f"pad_token_sequences: sample {position}'s input_ids has shape {tuple(ids.shape)}; "
                             "expected one dimension (a sequence of token ids)")
        for key in ("labels", "attention_mask"):
            if key in sequences and sequences[key][position].shape != ids.shape:
                raise ValueError(f"pad_token_sequences: sample {position}'s {key} has shape "
                                 f"{tuple(sequences[key][position].shape)}; expected that of its input_ids, "
                                 f"{tuple(ids.shape)}")
        lengths.append(len(ids))
    return torch.tensor(lengths)


def _padded(sequences: list[torch.Tensor], value: int, length: int) -> torch.Tensor:
    padded = pad_sequence(sequences, batch_first=True, padding_value=value)
    if padded.shape[1] < length:  # (pad_to_multiple_of)
        padded = torch.nn.functional.pad(padded, (0, length - padded.shape[1]), value=value)
    return padded


pad_token_sequences = TokenPadding()  # `--collate elastic_ddp.workload.collate:pad_token_sequences`


# ------------------------------------------------------------------------------- the Trainer's reading of a batch

def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of a batch as the built-in Trainer reads it: a mapping's `labels` are the
    targets and its other entries the model's keyword arguments (a dict, for `call_model`); any
    other batch is the pair (inputs, targets)."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ValueError(f"the Trainer: got a batch with keys {list(batch)}; expected 'labels' among them (the "
                             "targets; every other key goes to the model as a keyword argument)")
        return {key: value for key, value in batch.items() if key != "labels"}, batch["labels"]
    if not (isinstance(batch, Sequence) and len(batch) == 2):
        raise ValueError(f"the Trainer: got a batch of type {type(batch).__name__}; expected (inputs, targets), or "
                         "a dict whose 'labels' are the targets and whose other keys are the model's arguments")
    return batch[0], batch[1]


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """`model(**inputs)` for a dict of inputs (`split_batch`), else `model(inputs)`."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)
