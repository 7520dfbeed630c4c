"""LoRA adapters through peft (`--lora_rank R`): the model's weights frozen, a low-rank update trained beside
chosen linear layers.

`apply` injects the adapters into the module in place (peft's `inject_adapter_in_model`: no wrapper class, so
the loop, the strategies and the task see the same module), after which only the adapters require grad. What
leaves a run is PEFT's own layout (`save_adapter`: adapter_config.json + adapter_model.safetensors, which
`PeftModel.from_pretrained(base, DIR)` loads) and, on request, the base weights with the update merged in
(`merged`), under the base model's own names.

May import: the contracts at the top (config, errors). Nothing else in ddptrain.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ddptrain.config import FinetuneSettings
from ddptrain.errors import UsageError

ADAPTER_NAME = "default"  # peft's name for a model's one adapter
ADAPTER_DIR = "adapter"  # RUN_DIR/adapter: the trained adapter in PEFT's layout
# What peft's saved keys carry before a module's own names (its PeftModel wraps the model as base_model.model).
SAVED_PREFIX = "base_model.model."


def _peft(flag: str = "--lora_rank") -> Any:
    try:
        import peft
    except ImportError:
        raise UsageError(f"{flag}: LoRA needs peft; pip install 'ddptrain[peft]'") from None
    return peft


def default_targets(module: nn.Module) -> list[str]:
    """The linear layers inside the model's repeated blocks (attention and MLP projections); every linear layer
    but the output layer where the model has no blocks. Each is named as peft matches a target (the end of a
    module's dotted name), by the fewest trailing components that name these linear layers only and do not end
    at a bare position: `q_proj` in a transformers model, `mlp.0` in a block whose `0` would also name the first
    block."""
    block_classes = set(getattr(module, "_no_split_modules", None) or ())
    blocks = [sub for sub in module.modules()
              if type(sub).__name__ in block_classes or isinstance(sub, tuple(getattr(module, "fsdp_blocks", ())))]
    chosen = {id(sub) for block in blocks for name, sub in block.named_modules() if isinstance(sub, nn.Linear) and name}
    if not chosen:
        linears = [sub for sub in module.modules() if isinstance(sub, nn.Linear)]
        chosen = {id(sub) for sub in linears[:-1]}  # the last one registered writes the outputs: it keeps its weights
    named = [(name, id(sub)) for name, sub in module.named_modules()]

    @functools.cache
    def names_chosen_only(target: str) -> bool:
        return all(key in chosen for name, key in named if matches(name, target))

    targets = set()
    for name, key in named:
        if key in chosen:
            parts = name.split(".")
            shortest = 2 if parts[-1].isdigit() and len(parts) > 1 else 1  # a position in a Sequential says nothing
            suffixes = (".".join(parts[-length:]) for length in range(shortest, len(parts) + 1))
            targets.add(next((target for target in suffixes if names_chosen_only(target)), name))
    return sorted(targets)


def matches(name: str, target: str) -> bool:
    """Whether peft adapts the module `name` for an entry `target` of a LoRA config's target_modules."""
    return name == target or name.endswith("." + target)


def lora_config(finetune: FinetuneSettings, model: str, module: nn.Module) -> Any:
    """peft's LoraConfig for the [finetune] section's flags (targets: --lora_targets, else `default_targets`) on
    `module`, which --model `model` built."""
    peft = _peft()
    targets = [t.strip() for t in finetune.lora_targets.split(",") if t.strip()] or default_targets(module)
    if not targets:
        raise UsageError(f"--lora_rank {finetune.lora_rank}: the model has no linear layer to adapt; name the layers "
                         "with --lora_targets")
    base = model[len("hf:"):] if model.startswith("hf:") else model
    return peft.LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.lora_alpha, lora_dropout=finetune.lora_dropout,
                           target_modules=targets, base_model_name_or_path=base, bias="none")


def apply(module: nn.Module, finetune: FinetuneSettings, model: str) -> nn.Module:
    """Freeze every weight of `module` and inject LoRA adapters into the layers `lora_config` names (in place;
    returns `module`). The adapters' init draws from torch's global RNG: call it right after building the model,
    under the same seed on every rank, as the model's own init."""
    peft = _peft()
    config = lora_config(finetune, model, module)
    names = [name for name, _ in module.named_modules()]
    missing = sorted(t for t in config.target_modules if not any(matches(name, t) for name in names))
    if missing:
        raise UsageError(f"--lora_targets: the model has no layer named {', '.join(missing)}; its linear layers "
                         f"are named {', '.join(default_targets(module)) or 'nothing'}")
    module = peft.inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
    module.lora_config = config  # what save_adapter writes; an attribute of the module travels with it
    for name, param in module.named_parameters():
        param.requires_grad_(".lora_" in name)
    return module


def is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_config")


def frozen_names(module: nn.Module) -> list[str]:
    """The state-dict names of the frozen parameters (a tied one under each of its names): what a checkpoint
    of adapters leaves out. Buffers are not among them: they may change in training."""
    return [name for name, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, nn.Parameter) and not value.requires_grad]


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a whole state dict of a LoRA module, under PEFT's saved names."""
    marker = f".{ADAPTER_NAME}."
    return {SAVED_PREFIX + name.replace(marker, "."): value for name, value in state.items()
            if ".lora_A." in name or ".lora_B." in name}


def save_adapter(module: nn.Module, state: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """`state` (the LoRA module's whole state dict, or its adapters) in PEFT's layout in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    module.lora_config.save_pretrained(str(out_dir))
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_state(state).items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


def merged(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter's update merged into its layer: W + (alpha / r) B A, under
    the names the model had before `apply` (a plain `save_pretrained`/`load_state_dict` of the base model).
    `config`: the adapter_config.json's fields."""
    scale = config["lora_alpha"] / config["r"]
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." in name:
            layer, leaf = name.split(".base_layer.")
            if leaf == "weight":
                a = state[f"{layer}.lora_A.{ADAPTER_NAME}.weight"]
                b = state[f"{layer}.lora_B.{ADAPTER_NAME}.weight"]
                value = value + scale * (b.to(torch.float32) @ a.to(torch.float32)).to(value.dtype)
            name = f"{layer}.{leaf}"
        out[name] = value
    return out


def read_adapter_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "adapter_config.json").read_text())


# The weight of an element's position in a fingerprint: a multiplicative hash of its index in the whole tensor
# (row-major) modulo a prime, in [1, 2). Integer arithmetic, exact, so every device and layout weighs alike;
# the multiplier (the modulus over the golden ratio) puts neighbouring indices far apart.
_MODULUS = 2**31 - 1
_MULTIPLIER = 1_327_217_885
_CHUNK_ELEMENTS = 2**20  # weighed at once: the scratch memory stays small whatever the tensor's size


@torch.no_grad()
def fingerprint(module: nn.Module, names: list[str]) -> list[list[float]]:
    """What a checkpoint of adapters records of the frozen weights `names` it was trained on, and a resume or a
    merge checks the rebuilt model against: per tensor of `names` (in that order) [sum x, sum x²], then per
    tensor [sum x·w, sum x²·w], w each element's positional weight (`_MODULUS`), so that a transposed or
    reordered tensor differs. Pairs, in float64, over this rank's part of each tensor (a sharded tensor's local
    shard, weighed by its place in the whole; the caller adds the ranks' parts); under hsdp only the first
    replica's ranks count their shards (the others hold copies), so the sum is the same on every layout.
    Checkpoints written before the positional sums hold the first half only (`same_weights`)."""
    state = module.state_dict()
    sums = [_sums(state[name]) if _first_replica(state[name]) else [0.0] * 4 for name in names]
    return [four[:2] for four in sums] + [four[2:] for four in sums]


def _sums(tensor: torch.Tensor) -> list[float]:
    """[sum x, sum x², sum x·w, sum x²·w] over this rank's part of `tensor` (`fingerprint`)."""
    offsets = _offsets(tensor)
    local = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach()
    if local.numel() == 0:  # an uneven split leaves the last ranks no rows
        return [0.0] * 4
    shape = list(tensor.shape)
    if local.dim() == 0:
        local, shape, offsets = local.reshape(1), [1], [0]
    strides = [math.prod(shape[dim + 1:]) for dim in range(len(shape))]
    device = local.device
    within_row = torch.zeros((), dtype=torch.int64, device=device)  # index in the whole, less the row's start
    for dim in range(1, local.dim()):
        place = (offsets[dim] + torch.arange(local.shape[dim], device=device)) * strides[dim]
        within_row = within_row.unsqueeze(-1) + place
    within_row = within_row.reshape(1, -1)
    rows_at_once = max(1, _CHUNK_ELEMENTS // max(1, within_row.numel()))
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    for start in range(0, local.shape[0], rows_at_once):
        x = local[start:start + rows_at_once].reshape(-1, within_row.numel()).to(torch.float64)
        rows = offsets[0] + start + torch.arange(x.shape[0], device=device)
        index = rows.unsqueeze(1) * strides[0] + within_row
        weight = 1.0 + (index % _MODULUS * _MULTIPLIER % _MODULUS).to(torch.float64) / _MODULUS
        squares = x * x
        totals += torch.stack([x.sum(), squares.sum(), (x * weight).sum(), (squares * weight).sum()])
    return totals.tolist()


def _offsets(tensor: torch.Tensor) -> list[int]:
    """Where this rank's part of `tensor` starts in the whole, per dim: a DTensor's Shard(d) splits dim d as
    torch.chunk does (FSDP2's Shard(0); over several mesh dims, each within the last's part); a plain tensor
    starts at 0."""
    offsets, extents = [0] * tensor.dim(), list(tensor.shape)
    for mesh_dim, placement in enumerate(getattr(tensor, "placements", ())):
        if isinstance(placement, Shard):
            dim, parts = placement.dim, tensor.device_mesh.size(mesh_dim)
            chunk = -(-extents[dim] // parts)
            start = min(tensor.device_mesh.get_local_rank(mesh_dim) * chunk, extents[dim])
            offsets[dim] += start
            extents[dim] = min(start + chunk, extents[dim]) - start
    return offsets


def _first_replica(tensor: torch.Tensor) -> bool:
    """Whether this rank holds `tensor`'s part in the first of its replicas (a plain tensor: yes)."""
    placements = getattr(tensor, "placements", ())
    return all(not isinstance(p, Replicate) or tensor.device_mesh.get_local_rank(dim) == 0
               for dim, p in enumerate(placements))


def same_weights(saved: list[list[float]], now: list[list[float]]) -> bool:
    """Whether two fingerprints are of the same weights (the sums may round differently over other shards). A
    `saved` of a checkpoint written before the positional sums (half as long) is compared on the sums it has."""
    if 2 * len(saved) == len(now):
        now = now[:len(saved)]
    return len(saved) == len(now) and all(
        abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b)) for pair_a, pair_b in zip(saved, now)
        for a, b in zip(pair_a, pair_b))
