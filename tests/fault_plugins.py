"""Plug-ins for fault-tolerance tests (importable because tests/ is on PYTHONPATH in helpers.cli_env)."""

from __future__ import annotations

import time

import torch
from torch import nn

from ddptrain.data import SyntheticImages


class SlowImages(SyntheticImages):
    """The synthetic dataset, slowed down so a signal can land mid-run without timing games."""

    def __getitem__(self, index: int):
        time.sleep(0.004)
        return super().__getitem__(index)


def slow_synthetic(cfg):
    shape = dict(num_classes=cfg.num_classes, channels=cfg.in_channels, image_size=cfg.image_size, seed=cfg.seed)
    return SlowImages(cfg.dataset_size, **shape), SyntheticImages(cfg.eval_size, offset=cfg.dataset_size, **shape)


class AugmentedImages(SyntheticImages):
    """Random flips and noise drawn from the global torch RNG: exact resume must reproduce them."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image + 0.1 * torch.randn_like(image), label


def augmented_synthetic(cfg):
    shape = dict(num_classes=cfg.num_classes, channels=cfg.in_channels, image_size=cfg.image_size, seed=cfg.seed)
    return AugmentedImages(cfg.dataset_size, **shape), SyntheticImages(cfg.eval_size, offset=cfg.dataset_size, **shape)


class SlowAugmentedImages(AugmentedImages):
    def __getitem__(self, index: int):
        time.sleep(0.01)
        return super().__getitem__(index)


def slow_augmented_synthetic(cfg):
    shape = dict(num_classes=cfg.num_classes, channels=cfg.in_channels, image_size=cfg.image_size, seed=cfg.seed)
    return (SlowAugmentedImages(cfg.dataset_size, **shape),
            SyntheticImages(cfg.eval_size, offset=cfg.dataset_size, **shape))


def dropout_mlp(cfg):
    """A BatchNorm-free model with dropout: exact resume must restore each rank's RNG stream."""
    features = cfg.in_channels * cfg.image_size ** 2
    return nn.Sequential(nn.Flatten(), nn.Linear(features, cfg.width), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(cfg.width, cfg.num_classes))
