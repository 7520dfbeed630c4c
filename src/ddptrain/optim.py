"""The optimizer and its learning-rate schedule, chosen once from the config."""

from __future__ import annotations

import math

import torch
from torch import nn

from ddptrain.config import TrainConfig


def build_optimizer(cfg: TrainConfig, params: list[nn.Parameter], lr: float,
                    fused: bool = True) -> torch.optim.Optimizer:
    """SGD (the seed's default) or AdamW. Fused: one kernel per step and an on-device skip (`found_inf`);
    sharded (DTensor) parameters take the foreach implementation, which has a sharded form."""
    kernel = {"fused": True} if fused else {"foreach": True}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kernel)
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay, **kernel)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, then constant or cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, peak_lr: float,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    min_ratio = cfg.min_lr / peak_lr if peak_lr > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.lr_schedule, min_ratio))


def peak_lr(cfg: TrainConfig, global_batch_size: int) -> float:
    """--lr, times global batch / --base_batch_size under --scale_lr (the linear scaling rule)."""
    return cfg.lr * (global_batch_size / cfg.base_batch_size if cfg.scale_lr else 1.0)
