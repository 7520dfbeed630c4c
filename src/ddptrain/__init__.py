"""ddptrain: take a one-GPU training job to many processes and machines on PyTorch's DDP engine."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from ddptrain.api import fit  # noqa: E402  (light: torch is imported when training starts)
from ddptrain.config import TrainConfig  # noqa: E402
from ddptrain.errors import TrainingError, UsageError  # noqa: E402  (light: no torch)
from ddptrain.loop.callbacks import Callback  # noqa: E402  (light: no torch)

__all__ = ["Callback", "LossSum", "TrainConfig", "TrainingError", "UsageError", "fit", "__version__"]

# Exports whose modules import torch: loaded on first use, so `import ddptrain` stays cheap.
_LAZY = {"LossSum": "ddptrain.loop.tasks"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ddptrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
