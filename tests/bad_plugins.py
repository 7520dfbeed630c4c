"""Plug-ins with the mistakes users make, for tests/test_bad_input.py. Each is otherwise the TINY job: the
synthetic 3x8x8 images, the mlp, classification."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ddptrain.data.pipeline import SyntheticImages


def _images(cfg, size: int, offset: int = 0) -> SyntheticImages:
    return SyntheticImages(size, cfg.num_classes, cfg.in_channels, cfg.image_size, cfg.seed, offset)


class Altered(Dataset):
    """The synthetic images with item `index` (or every item) changed by `change(image, label)`."""

    uses_global_rng = False

    def __init__(self, images: SyntheticImages, change, index: int | None = None):
        self.images, self.change, self.index = images, change, index

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image, label = self.images[i]
        return self.change(image, label) if self.index in (None, i) else (image, label)


def _altered(cfg, change, index: int | None = None):
    return (Altered(_images(cfg, cfg.dataset_size), change, index),
            Altered(_images(cfg, cfg.eval_size, cfg.dataset_size), change, index))


def float64_images(cfg):
    """Images as numpy gives them: float64."""
    return _altered(cfg, lambda image, label: (image.double(), label))


def none_item(cfg):
    """Item 3 is None (a sample that failed to load)."""
    return _altered(cfg, lambda image, label: None, index=3)


def none_item_of_rank_1(cfg):
    """Item 40 is None: at --batch_size 32, in the first batch of rank 1 only."""
    return _altered(cfg, lambda image, label: None, index=40)


def mixed_items(cfg):
    """Dicts of `x` and `labels`, but item 5 spells its label key `label`."""
    train, held_out = _images(cfg, cfg.dataset_size), _images(cfg, cfg.eval_size, cfg.dataset_size)
    return _Dicts(train), _Dicts(held_out)


class _Dicts(Dataset):
    uses_global_rng = False

    def __init__(self, images: SyntheticImages):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image, label = self.images[i]
        return {"x": image, ("label" if i == 5 else "labels"): label}


class _Classify:
    """Classification on (inputs, labels) batches; `loss_of` and `metrics_of` make it wrong in one way."""

    def __init__(self, loss_of, metrics_of):
        self.loss_of, self.metrics_of = loss_of, metrics_of

    def loss(self, model, batch):
        inputs, labels = batch
        logits = model(inputs)
        per_sample = F.cross_entropy(logits, labels, reduction="none")
        if model.training:
            return self.loss_of(per_sample), {}
        hits = (logits.argmax(dim=1) == labels).sum()
        return self.loss_of(per_sample), self.metrics_of(per_sample, hits, len(labels))


def per_sample_loss(cfg):
    """The loss left unreduced: one value per sample."""
    return _Classify(lambda per_sample: per_sample,
                     lambda per_sample, hits, n: {"loss": (per_sample.sum(), n)})


def per_sample_sum(cfg):
    """A LossSum whose total was left unreduced: one value per sample."""
    from ddptrain import LossSum

    return _Classify(lambda per_sample: LossSum(per_sample, len(per_sample)),
                     lambda per_sample, hits, n: {"loss": (per_sample.sum(), n)})


def int_metric(cfg):
    """A metric counted in Python ints: a sum of `int(hits)` over `n` samples."""
    return _Classify(lambda per_sample: per_sample.mean(),
                     lambda per_sample, hits, n: {"loss": (per_sample.sum(), n), "accuracy": (int(hits), n)})


def unpaired_metric(cfg):
    """A metric given as its mean alone, not as a (sum, count) pair."""
    return _Classify(lambda per_sample: per_sample.mean(),
                     lambda per_sample, hits, n: {"loss": (per_sample.sum(), n), "accuracy": hits / n})


class WithUnusedHead(nn.Module):
    """The mlp plus a head that `forward` never uses: its parameters get no gradient."""

    def __init__(self, cfg):
        super().__init__()
        features = cfg.in_channels * cfg.image_size ** 2
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(features, cfg.width), nn.ReLU(),
                                  nn.Linear(cfg.width, cfg.num_classes))
        self.aux_head = nn.Linear(cfg.width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused_head(cfg):
    return WithUnusedHead(cfg)


def fails_at_step_3(cfg):
    """A task whose loss raises a genuine (non-input) error at its third training call."""
    return _FailsLater()


class _FailsLater:
    def __init__(self):
        self.calls = 0

    def loss(self, model, batch):
        inputs, labels = batch
        if model.training:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("the disk went away")
        total = F.cross_entropy(model(inputs), labels, reduction="sum")
        return total / len(labels), {"loss": (total.detach(), len(labels))}


class ShortStream(IterableDataset):
    """The first `length` synthetic images as a stream."""

    def __init__(self, images: SyntheticImages, length: int):
        self.images, self.length = images, length

    def __iter__(self):
        return (self.images[i] for i in range(self.length))


def short_stream(cfg):
    """A stream of one element: fewer than the readers of one process with --num_workers 2."""
    return ShortStream(_images(cfg, 1), 1), None


def not_a_module(cfg):
    """--model whose function returns the model's settings, not the model."""
    return {"width": cfg.width}


def one_dataset(cfg):
    """--dataset whose function returns the training set alone, not (train, eval or None)."""
    return _images(cfg, 64)
