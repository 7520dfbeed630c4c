"""A worked plug-in: your own model and dataset, trained by ddptrain without touching the package.

From the repository root (the current directory is importable, so `examples.custom_plugin` is found):

    ddptrain train --model examples.custom_plugin:model --dataset examples.custom_plugin:dataset \\
        --num_classes 4 --dataset_size 2048 --eval_size 512 --epochs 3 --nproc 2

The contract:
  * `model(cfg) -> torch.nn.Module` and `dataset(cfg) -> (train_dataset, eval_dataset or None)`, where
    `cfg` is the resolved `ddptrain.config.TrainConfig` (every `--flag` is an attribute).
  * Datasets are map-style (`__len__`, `__getitem__`); item i is `(input, target)`, target a class index.
    The default loss is cross-entropy over `model(inputs)`.
  * Every rank calls both functions: build the same data everywhere (derive randomness from `cfg.seed`),
    and let ddptrain shard it. Model init is seeded by ddptrain, so no seeding is needed in `model`.
  * Random augmentation may use torch / numpy / random freely: ddptrain seeds them per (epoch, sample)
    before each `__getitem__`, so a sample looks the same whichever rank or loader worker reads it.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

SIGNAL_LENGTH = 64


class Waveforms(Dataset):
    """Noisy 1-D signals; the class is the frequency of the sine wave hidden in the noise.

    The clean signals live in memory (small); noise and a random time shift are drawn on every read,
    which makes them augmentation: new in every epoch, yet reproducible.
    """

    def __init__(self, size: int, num_classes: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(num_classes, (size,), generator=gen)
        self.phases = torch.rand(size, generator=gen) * 2 * math.pi
        self.time = torch.arange(SIGNAL_LENGTH) / SIGNAL_LENGTH

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        target = int(self.targets[index])
        cycles = 2 + 2 * target  # class k: 2 + 2k periods over the window
        shift = float(torch.rand(()))
        wave = torch.sin(2 * math.pi * cycles * (self.time + shift) + self.phases[index])
        noisy = wave + 0.5 * torch.randn(SIGNAL_LENGTH)
        return noisy.unsqueeze(0), target  # (channels=1, length)


class WaveClassifier(nn.Module):
    """A small 1-D convolutional network: two conv layers, global pooling, a linear head."""

    def __init__(self, num_classes: int, width: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, width, kernel_size=9, padding=4), nn.ReLU(),
            nn.Conv1d(width, width, kernel_size=9, padding=4), nn.ReLU(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=-1))


def model(cfg) -> nn.Module:
    """`--model examples.custom_plugin:model`: sized by the usual --num_classes and --width flags."""
    return WaveClassifier(cfg.num_classes, cfg.width)


def dataset(cfg) -> tuple[Dataset, Dataset | None]:
    """`--dataset examples.custom_plugin:dataset`: --dataset_size / --eval_size samples, from --seed."""
    train = Waveforms(cfg.dataset_size, cfg.num_classes, seed=cfg.seed)
    held_out = Waveforms(cfg.eval_size, cfg.num_classes, seed=cfg.seed + 1) if cfg.eval_size else None
    return train, held_out
