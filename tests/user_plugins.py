"""Plug-ins for tests/e2e/test_user_paths.py: the ordinary things users bring that once gave silently wrong results."""

from __future__ import annotations

import torch
from torch import nn

from ddptrain.models import MLP


class NanMLP(MLP):
    """An MLP whose output is NaN at every step: a diverged model, or NaNs in the data."""

    def forward(self, x):
        return super().forward(x) * float("nan")


def nan_model(cfg) -> nn.Module:
    return NanMLP(cfg.in_channels * cfg.image_size ** 2, cfg.num_classes, hidden=cfg.width)


class FrozenNormMLP(nn.Module):
    """A classifier whose BatchNorm the user froze with `.eval()` (fine-tuning on top of fixed statistics): its
    running statistics must not move, on any rank, at any point of training."""

    def __init__(self, in_features: int, classes: int, hidden: int):
        super().__init__()
        self.flat = nn.Flatten()
        self.norm = nn.BatchNorm1d(in_features)
        self.head = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.norm.eval()

    def forward(self, x):
        return self.head(self.norm(self.flat(x)))


def frozen_norm_model(cfg) -> nn.Module:
    return FrozenNormMLP(cfg.in_channels * cfg.image_size ** 2, cfg.num_classes, cfg.width)


class TaggedPairs(torch.utils.data.Dataset):
    """(image, label) items whose own `collate_fn` makes a dict batch; the task below reads only dicts."""

    uses_global_rng = False

    def __init__(self, size: int):
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 1, 8, 8, generator=gen), torch.randint(0, 4, (size,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], int(self.y[index])

    @staticmethod
    def collate_fn(items):
        images, labels = zip(*items)
        return {"pixels": torch.stack(images), "labels": torch.tensor(labels), "collated_by": torch.ones(1)}


def tagged_pairs(cfg):
    return TaggedPairs(cfg.dataset_size), TaggedPairs(cfg.eval_size)


class DictOnly:
    """Classification of dict batches that insists on the mark the dataset's collate_fn leaves."""

    def loss(self, model, batch):
        assert "collated_by" in batch, "the dataset's collate_fn was not used"
        logits = model(batch["pixels"])
        total = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
        n = torch.tensor(float(len(batch["labels"])))
        from ddptrain.loop.tasks import LossSum

        return LossSum(total, n), ({} if model.training else {"loss": (total.detach(), n)})

    def count(self, batch):
        return len(batch[1]) if isinstance(batch, (tuple, list)) else len(batch["labels"])


def dict_only(cfg):
    return DictOnly()
