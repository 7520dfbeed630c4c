"""What is checked before any process starts, beyond the config alone: the data's files against the flags,
a Hugging Face model's directory, --resume_from, the optional packages a flag needs.

`TrainConfig.validate` checks the config by itself; this module sits above it and the modules that know
files and packages (data, models, checkpoints, observe), so the dependency runs one way. Called once at the
edge: `ddptrain train` (every process, before a launcher starts workers) and `fit`.
"""

from __future__ import annotations

from pathlib import Path

from ddptrain.config import BUILTIN_DATASETS, TEXT_DATASETS, TrainConfig, parse_trackers
from ddptrain.errors import UsageError
from ddptrain.observe.metrics import require_tensorboard
from ddptrain.observe.trackers import require_tracker


def check(cfg: TrainConfig) -> None:
    """UsageError naming the flag and the fix when the files, packages or checkpoints and the flags disagree."""
    if cfg.resume_from and not Path(cfg.resume_from).is_dir():
        from ddptrain.checkpoints.format import continues_line  # a restart may find it purged, its line continued

        if not continues_line(cfg.checkpoint_path, cfg.resume_from):
            raise UsageError(f"--resume_from {cfg.resume_from}: no such directory; pass a checkpoints/step-N dir")
    for name in parse_trackers(cfg.tracker):
        require_tracker(name, cfg)
    if cfg.tensorboard:
        require_tensorboard()
    if cfg.model.startswith("hf:"):
        from ddptrain.models import hf

        hf.check_model(cfg)
    check_data(cfg)


def check_data(cfg: TrainConfig) -> None:
    """UsageError naming the flag and the fix when a built-in dataset and the flags disagree."""
    if cfg.dataset.startswith("hf:"):
        from ddptrain.models import hf

        hf.check_dataset(cfg)
        hf.prepare(cfg)  # tokenized once, here, before the workers start (they find it in the cache)
    elif cfg.dataset in TEXT_DATASETS:
        from ddptrain.data import text  # imports torch and numpy: only when the dataset is asked for

        text.check(cfg)
    elif cfg.dataset in BUILTIN_DATASETS and cfg.dataset != "synthetic":
        from ddptrain.data import images

        images.check(cfg)
