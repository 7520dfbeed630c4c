"""Plug-ins for the benchmarks: `--model benchmarks.workloads:deep_mlp`,
`--dataset benchmarks.workloads:cached_synthetic` and `--dataset benchmarks.workloads:tensor_images`."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ddptrain.data.pipeline import SyntheticImages

HIDDEN_LAYERS = 5


def deep_mlp(cfg) -> nn.Module:
    """Flatten, then 5 hidden layers of `--width` units: many large tensors, so DDP fills several buckets.

    At --width 2304 on 32x32x3 images: 28.3M parameters (113 MB of fp32 gradients; 227 MB of weights plus
    SGD momentum in a checkpoint).
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width_in = cfg.in_channels * cfg.image_size ** 2
    for _ in range(HIDDEN_LAYERS):
        layers += [nn.Linear(width_in, cfg.width), nn.ReLU()]
        width_in = cfg.width
    layers.append(nn.Linear(width_in, cfg.num_classes))
    return nn.Sequential(*layers)


class CachedImages(Dataset):
    """`size` samples cycling through `unique` synthetic images made once: reading a sample is a slice.

    For the GPU benchmark, where generating images per sample would make the loader, not the training loop,
    the thing measured.
    """

    def __init__(self, size: int, source: Dataset, unique: int):
        self.size = size
        pairs = [source[i] for i in range(unique)]
        self.images = torch.stack([image for image, _ in pairs])
        self.labels = [label for _, label in pairs]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        slot = index % len(self.labels)
        return self.images[slot], self.labels[slot]


def cached_synthetic(cfg) -> tuple[Dataset, None]:
    """`--dataset benchmarks.workloads:cached_synthetic`: --dataset_size samples over 2048 distinct images."""
    source = SyntheticImages(2048, cfg.num_classes, cfg.in_channels, cfg.image_size, seed=cfg.seed)
    return CachedImages(cfg.dataset_size, source, 2048), None


class MaskedText(Dataset):
    """Padded, masked language-model items over real English text (CPython's pydoc topics, as bytes): item i
    is a sequence of 24..`seq_len` tokens of the text whose first 4..(length - 8) tokens, a prompt, have
    labels -100. Lengths and prompts are drawn from (seed, i), so micro-batches count different numbers of
    tokens, as fine-tuning batches do."""

    uses_global_rng = False

    def __init__(self, size: int, seq_len: int, seed: int):
        from ddptrain.data.text import pydoc_tokens

        self.tokens = torch.from_numpy(pydoc_tokens().astype("int64"))
        self.size, self.seq_len, self.seed = size, seq_len, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        length = int(torch.randint(min(24, self.seq_len), self.seq_len + 1, (), generator=gen))
        start = int(torch.randint(0, len(self.tokens) - length, (), generator=gen))
        prompt = int(torch.randint(min(4, length - 1), max(length - 8, 5), (), generator=gen))
        ids = self.tokens[start:start + length]
        labels = ids.clone()
        labels[:prompt] = -100
        return {"input_ids": ids, "labels": labels}


def masked_text(cfg) -> tuple[Dataset, None]:
    """`--dataset benchmarks.workloads:masked_text`: --dataset_size padded, masked sequences of up to --seq_len."""
    return MaskedText(cfg.dataset_size, cfg.seq_len, cfg.seed), None


def tensor_images(cfg) -> tuple[Dataset, None]:
    """`--dataset benchmarks.workloads:tensor_images`: what a practitioner's own loop reads (issue 39's job), a
    torch TensorDataset of --dataset_size images and labels already in memory."""
    return image_tensors(cfg.dataset_size, cfg.in_channels, cfg.image_size, cfg.num_classes), None


def image_tensors(size: int, channels: int, image_size: int, classes: int, seed: int = 42) -> TensorDataset:
    """Normal images and uniform labels drawn from `seed`: the same on both sides of a comparison."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(size, channels, image_size, image_size, generator=gen)
    return TensorDataset(images, torch.randint(0, classes, (size,), generator=gen))
