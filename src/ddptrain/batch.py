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


def collate(items: list[Any]) -> Any:
    """Stack a list of items of one structure into one batch of the same structure."""
    first = items[0]
    if _is_dataclass(first):
        return dataclasses.replace(first, **{f.name: collate([getattr(x, f.name) for x in items])
                                             for f in dataclasses.fields(first) if f.init})
    if isinstance(first, Mapping):
        return {k: collate([x[k] for x in items]) for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(collate(list(column)) for column in zip(*items)))
    if isinstance(first, (list, tuple)):
        return type(first)(collate(list(column)) for column in zip(*items))
    return default_collate(items)


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Every tensor of `batch` on `device` (non-blocking: pinned on CUDA); 4-D float ones channels_last if asked."""
    if isinstance(batch, torch.Tensor):
        moved = batch.to(device, non_blocking=True)
        if channels_last and moved.dim() == 4 and moved.is_floating_point():
            moved = moved.contiguous(memory_format=torch.channels_last)
        return moved
    return _rebuild(batch, lambda part: to_device(part, device, channels_last))
