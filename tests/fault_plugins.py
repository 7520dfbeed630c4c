"""Plug-ins for fault-tolerance tests (importable because tests/ is on PYTHONPATH in helpers.cli_env)."""

from __future__ import annotations

import time

import torch
from torch import nn

from ddptrain.data.pipeline import SyntheticImages


class AugmentedImages(SyntheticImages):
    """Random flips and noise drawn from the global torch RNG: exact resume must reproduce them."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image + 0.1 * torch.randn_like(image), label


def _splits(cfg, train_class: type[SyntheticImages]):
    shape = dict(num_classes=cfg.num_classes, channels=cfg.in_channels, image_size=cfg.image_size, seed=cfg.seed)
    return train_class(cfg.dataset_size, **shape), SyntheticImages(cfg.eval_size, offset=cfg.dataset_size, **shape)


def augmented_synthetic(cfg):
    return _splits(cfg, AugmentedImages)


class SlowAugmentedImages(AugmentedImages):
    """Slowed down so that a signal or a kill lands mid-run without timing games."""

    def __getitem__(self, index: int):
        time.sleep(0.01)
        return super().__getitem__(index)


def slow_augmented_synthetic(cfg):
    return _splits(cfg, SlowAugmentedImages)


def dropout_mlp(cfg):
    """A BatchNorm-free model with dropout: exact resume must restore each rank's RNG stream."""
    features = cfg.in_channels * cfg.image_size ** 2
    return nn.Sequential(nn.Flatten(), nn.Linear(features, cfg.width), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(cfg.width, cfg.num_classes))
