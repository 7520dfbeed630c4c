"""The optimizer and its learning-rate schedule, chosen once from the config."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ddptrain.config import TrainingSettings
from ddptrain.parallel import tensor


def build_optimizer(training: TrainingSettings, params: list[nn.Parameter] | list[dict[str, Any]], lr: float,
                    fused: bool = True) -> torch.optim.Optimizer:
    """SGD (the seed's default) or AdamW over `params` (a list, or parameter groups). Fused: one kernel per step
    and an on-device skip (`found_inf`); sharded (DTensor) parameters take the foreach implementation, which has
    a sharded form."""
    kernel = {"fused": True} if fused else {"foreach": True}
    if training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=training.momentum, weight_decay=training.weight_decay, **kernel)
    return torch.optim.AdamW(params, lr=lr, betas=(training.momentum, 0.999), weight_decay=training.weight_decay,
                             **kernel)


# Modules whose parameters are scales, shifts and lookup tables, not weights to shrink: the transformers
# convention keeps weight decay off them (and off every bias).
_NO_DECAY_MODULES = (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)


def parameter_groups(training: TrainingSettings, module: nn.Module) -> list[nn.Parameter] | list[dict[str, Any]]:
    """The trainable parameters of `module`, in module order; for AdamW (without --decay_all) as two groups:
    weights with --weight_decay, and biases, norm weights and embeddings without. Under ddp x --tp a group's
    split (DTensor) parameters are a group of their own (`tensor.apart_from_plain`)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if training.optimizer != "adamw" or training.decay_all:
        groups = tensor.apart_from_plain([{"params": trainable}])
        return trainable if len(groups) == 1 else groups
    exempt: set[int] = set()
    for owner in module.modules():
        norm_like = isinstance(owner, _NO_DECAY_MODULES) or type(owner).__name__.endswith(("Norm", "Norm2d", "Norm1d"))
        for name, param in owner.named_parameters(recurse=False):
            if norm_like or name.endswith("bias"):
                exempt.add(id(param))
    decay = [p for p in trainable if id(p) not in exempt]
    rest = [p for p in trainable if id(p) in exempt]
    return tensor.apart_from_plain([group for group in ({"params": decay}, {"params": rest, "weight_decay": 0.0})
                                    if group["params"]])


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, then constant, or a cosine or
    linear decay to `min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(training: TrainingSettings, optimizer: torch.optim.Optimizer, peak_lr: float,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    min_ratio = training.min_lr / peak_lr if peak_lr > 0 else 0.0
    warmup = training.warmup_steps or math.ceil(training.warmup_ratio * total_steps)  # (--warmup_ratio: rounded up)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, total_steps, training.lr_schedule, min_ratio))


def peak_lr(training: TrainingSettings, global_batch_size: int) -> float:
    """--lr, times global batch / --base_batch_size under --scale_lr (the linear scaling rule)."""
    return training.lr * (global_batch_size / training.base_batch_size if training.scale_lr else 1.0)
