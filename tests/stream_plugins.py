"""An iterable (streaming) dataset plug-in: synthetic images with augmentation from the global RNG."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset

from ddptrain.data.pipeline import SyntheticImages


class ImageStream(IterableDataset):
    """`size` elements in stream order; each flipped and jittered with torch's global RNG (which ddptrain seeds
    per element), so exact resume must reproduce the draws."""

    def __init__(self, images: SyntheticImages):
        self.images = images
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for k in range(len(self.images)):
            image, label = self.images[k]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
            yield image + 0.1 * torch.randn_like(image), label


def image_stream(cfg):
    shape = dict(num_classes=cfg.num_classes, channels=cfg.in_channels, image_size=cfg.image_size, seed=cfg.seed)
    return (ImageStream(SyntheticImages(cfg.dataset_size, **shape)),
            ImageStream(SyntheticImages(cfg.eval_size, offset=cfg.dataset_size, **shape)))


class SelfShardingStream(IterableDataset):
    """Elements 0..size-1 as (image, label); splits itself by loader worker the way PyTorch's docs teach."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for k in range(worker, self.size, workers):
            yield torch.full((3, 8, 8), float(k)), k % 10


def self_sharding(cfg):
    return SelfShardingStream(cfg.dataset_size), None
