"""Structured batches: any nesting of tensors (dict, tuple, list, namedtuple, dataclass) as a dataset's
items give it. Collated item by item and moved to the device recursively; the task reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils.data import default_collate


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _rebuild(value: Any, parts: Callable[[Any], Any]) -> Any:
    """`value` with each child replaced by `parts(child)`, keeping the container type."""
    if _is_dataclass(value):
        return dataclasses.replace(value, **{f.name: parts(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, Mapping):
        return {k: parts(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(parts(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(parts(v) for v in value)
    return value


# What a padded position holds, by key, in the Hugging Face convention: labels that do not count, an
# attention mask that says "padding"; input_ids get the pad token id.
PAD_VALUES = {"labels": -100, "attention_mask": 0}


def collate(items: list[Any], pad_id: int = 0) -> Any:
    """Stack a list of items of one structure into one batch of the same structure.

    Dicts whose values are 1-D sequences (tensors or lists of ints) of different lengths — tokenized text —
    are padded on the right to the longest: `input_ids` with `pad_id`, `labels` with -100, `attention_mask`
    with 0 (and added, all ones on the tokens, if the items have none), anything else with 0.
    """
    first = items[0]
    if _is_dataclass(first):
        return dataclasses.replace(first, **{f.name: collate([getattr(x, f.name) for x in items], pad_id)
                                             for f in dataclasses.fields(first) if f.init})
    if isinstance(first, Mapping):
        return _collate_dict(items, pad_id)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(collate(list(column), pad_id) for column in zip(*items)))
    if isinstance(first, (list, tuple)):
        return type(first)(collate(list(column), pad_id) for column in zip(*items))
    return default_collate(items)


def _sequence(value: Any) -> torch.Tensor | None:
    """`value` as a 1-D tensor if it is a sequence of token-like numbers, else None."""
    if isinstance(value, torch.Tensor):
        return value if value.dim() == 1 else None
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, bool)) for v in value):
        return torch.tensor(value, dtype=torch.long)
    return None


def _collate_dict(items: list[Mapping], pad_id: int) -> dict[str, Any]:
    batch: dict[str, Any] = {}
    lengths = None
    for key in items[0]:
        column = [item[key] for item in items]
        sequences = [_sequence(value) for value in column]
        ragged = all(seq is not None for seq in sequences) and (
            len({len(seq) for seq in sequences}) > 1 or not all(isinstance(v, torch.Tensor) for v in column))
        if not ragged:
            batch[key] = collate(column, pad_id)
            continue
        fill = pad_id if key == "input_ids" else PAD_VALUES.get(key, 0)
        batch[key] = _pad(sequences, fill)
        if key == "input_ids":
            lengths = [len(seq) for seq in sequences]
    if lengths is not None and "attention_mask" not in batch and min(lengths) < max(lengths):
        batch["attention_mask"] = _pad([torch.ones(n, dtype=torch.long) for n in lengths], 0)
    return batch


def _pad(sequences: list[torch.Tensor], fill: int) -> torch.Tensor:
    """1-D sequences as rows of one (len, longest) tensor, padded on the right with `fill`."""
    padded = torch.full((len(sequences), max(len(seq) for seq in sequences)), fill, dtype=sequences[0].dtype)
    for i, seq in enumerate(sequences):
        padded[i, :len(seq)] = seq
    return padded


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Every tensor of `batch` on `device` (non-blocking: pinned on CUDA); 4-D float ones channels_last if asked."""
    if isinstance(batch, torch.Tensor):
        moved = batch.to(device, non_blocking=True)
        if channels_last and moved.dim() == 4 and moved.is_floating_point():
            moved = moved.contiguous(memory_format=torch.channels_last)
        return moved
    return _rebuild(batch, lambda part: to_device(part, device, channels_last))
