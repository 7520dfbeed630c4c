"""The data checked against the config before any process starts: files present and well-formed, flags agree.

`TrainConfig.validate` checks the config alone; this module sits above it and the dataset modules (which
import the config), so the dependency runs one way. Called once at the edge: `ddptrain train` and `fit`.
"""

from __future__ import annotations

from ddptrain.config import BUILTIN_DATASETS, TEXT_DATASETS, TrainConfig


def check_data(cfg: TrainConfig) -> None:
    """UsageError naming the flag and the fix when a built-in dataset and the flags disagree."""
    if cfg.dataset.startswith("hf:"):
        from ddptrain import hf

        hf.check_dataset(cfg)
        hf.prepare(cfg)  # tokenized once, here, before the workers start (they find it in the cache)
    elif cfg.dataset in TEXT_DATASETS:
        from ddptrain import text  # imports torch and numpy: only when the dataset is asked for

        text.check(cfg)
    elif cfg.dataset in BUILTIN_DATASETS and cfg.dataset != "synthetic":
        from ddptrain import image_datasets

        image_datasets.check(cfg)
