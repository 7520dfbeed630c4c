"""Plug-ins for the task tests: a regression problem, and a model and task that speak in dicts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class LinearProblem(Dataset):
    """y = x . w + 0.1 noise, sample i drawn from its own seed: the same data on every rank and run."""

    uses_global_rng = False

    def __init__(self, size: int, features: int, seed: int, offset: int = 0):
        self.size, self.features, self.seed, self.offset = size, features, seed, offset
        self.w = torch.randn(features, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        gen = torch.Generator().manual_seed(self.seed * 100003 + self.offset + index)
        x = torch.randn(self.features, generator=gen)
        return x, (x @ self.w + 0.1 * torch.randn((), generator=gen)).float()


def regression_data(cfg):
    return (LinearProblem(cfg.dataset_size, cfg.width, cfg.seed),
            LinearProblem(cfg.eval_size, cfg.width, cfg.seed, offset=cfg.dataset_size))


def regressor(cfg):
    return nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.Tanh(), nn.Linear(cfg.width, 1))


@dataclasses.dataclass
class Pair:
    """A structured item: two views of one sample and its label."""

    left: torch.Tensor
    right: torch.Tensor
    label: int


class PairedImages(Dataset):
    uses_global_rng = False

    def __init__(self, size: int, features: int, seed: int, offset: int = 0):
        self.size, self.features, self.seed, self.offset = size, features, seed, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 7919 + self.offset + index)
        label = int(torch.randint(2, (), generator=gen))
        left = torch.randn(self.features, generator=gen) + (1.5 if label else -1.5)
        right = left.flip(0) + 0.1 * torch.randn(self.features, generator=gen)
        # A weight of its own per sample, from 0.1 to 3: a trainer that loses or misaligns them trains and
        # evaluates another loss.
        weight = 0.1 + 2.9 * torch.rand((), generator=gen)
        return {"pair": Pair(left, right, label), "weight": weight}


def paired_data(cfg):
    return PairedImages(cfg.dataset_size, cfg.width, cfg.seed), PairedImages(cfg.eval_size, cfg.width, cfg.seed,
                                                                            offset=cfg.dataset_size)


class DictModel(nn.Module):
    """forward takes the batch's dict and returns one."""

    def __init__(self, features: int):
        super().__init__()
        self.encode = nn.Linear(features, 16)
        self.head = nn.Linear(32, 2)

    def forward(self, batch: dict) -> dict:
        pair = batch["pair"]
        joint = torch.cat([self.encode(pair.left).relu(), self.encode(pair.right).relu()], dim=1)
        return {"logits": self.head(joint)}


def dict_model(cfg):
    return DictModel(cfg.width)


class WeightedPairTask:
    """A task of its own: weighted cross-entropy on the dict model's logits; reports error rate and margin."""

    def loss(self, model, batch):
        logits = model(batch)["logits"]
        labels, weights = batch["pair"].label, batch["weight"]
        per_sample = F.cross_entropy(logits, labels, reduction="none") * weights
        n = torch.full((), float(len(labels)), dtype=torch.float64, device=labels.device)
        wrong = (logits.argmax(1) != labels).sum()
        margin = (logits.gather(1, labels[:, None]) - logits.gather(1, 1 - labels[:, None])).sum()
        return per_sample.mean(), {"loss": (per_sample.detach().sum(), n), "error": (wrong, n), "margin": (margin, n)}

    def count(self, batch):
        return len(batch["weight"])


def weighted_pair_task(cfg):
    return WeightedPairTask()
