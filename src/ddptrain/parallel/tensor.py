"""Tensor parallel (--tp N): each block's layers split over the N ranks of a group inside a node, the model's
other parameters whole on each of them. The data-parallel strategy comes second, as torchtitan composes them:
under fsdp `fully_shard` shards everything over mesh["dp"] of the 2-D mesh (dp x tp); under hsdp over the
(replicate, shard) dimensions of a 3-D mesh (nodes x dp per node x tp); under ddp each data-parallel rank holds a
group's split model whole and gradients are averaged over mesh["dp"] (parallel/strategies.py, DataParallel).

A model says how it splits with a `tp_plan` (transformers' `base_model_tp_plan` spelling): module names (`*` for
any child) to a style name. "colwise" splits a linear layer's outputs (its weight's rows), "rowwise" its inputs
(its weight's columns: each rank's partial result is summed over the group), and "colwise_fused3" a linear layer
that is three projections in one (a GPT's qkv): each rank keeps its share of each of the three. A group's ranks
compute on the same batch: the activations between the split layers are whole on every rank, and so are the
gradients of the parameters that are not split (the input gradient of a colwise layer is summed over the group).

A transformers model (`--model hf:...`) splits by its own config's `base_model_tp_plan`, names under its base
model (`model.`), where each style it names is one of ours (HF_STYLES); a plan with another style is refused.

Under fsdp the input embedding and output head are split by vocabulary rows over every rank of the mesh
(parallel/vocab.py), never gathered. Not yet: a SequenceParallel split of the norms, transformers' other styles.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn import functional as F

from ddptrain.errors import UsageError
from ddptrain.models import lora


class FusedColwise(ParallelStyle):
    """A linear layer whose outputs are `parts` projections side by side (q, k and v): each rank keeps the
    rank-th slice of each, so its local output is [q_r | k_r | v_r], the heads it attends with.

    The weight is a DTensor placed `_StridedShard(0, split_factor=parts)` on the group, which says exactly that
    layout to DCP, FSDP2 and `full_tensor`. The product itself is computed on the local shards: DTensor's
    sharding rules for that placement gave wrong values in a probe on torch 2.13.
    """

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise UsageError(f"tp_plan: colwise_fused{self.parts} splits an nn.Linear, not a {type(module).__name__}")
        placement = [_StridedShard(0, split_factor=self.parts)]
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, placement),
                                                         requires_grad=param.requires_grad))
        module.forward = functools.partial(_local_linear, module, device_mesh)
        return module


def _local_linear(module: nn.Linear, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    # Each rank's input gradient covers its own outputs only: marked partial, from_local's backward sums it
    # over the group, so the layers before see the whole gradient on every rank.
    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    bias = module.bias.to_local() if module.bias is not None else None
    return F.linear(x, module.weight.to_local(), bias)


STYLES: dict[str, Any] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                          "colwise_fused3": functools.partial(FusedColwise, 3)}


# transformers' style names (a config's `base_model_tp_plan`) that mean one of STYLES, and which.
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise"}


def plan_of(module: nn.Module) -> dict[str, str]:
    """`module`'s plan in STYLES' names: its `tp_plan` (the built-in gpt's), or a transformers model's own
    `config.base_model_tp_plan` under its base model's prefix. Empty: it has none. A transformers style that is
    not in HF_STYLES is refused (exit 2): the model's layers would compute on parts they were not split for."""
    config = getattr(module, "config", None)
    if not hasattr(config, "base_model_tp_plan"):
        return dict(getattr(module, "tp_plan", None) or {})
    plan = dict(config.base_model_tp_plan or {})
    other = sorted(set(plan.values()) - set(HF_STYLES))
    if other:
        raise UsageError(f"--tp: {type(module).__name__}'s base_model_tp_plan uses {', '.join(other)}, which ddptrain "
                         f"does not apply (only {', '.join(HF_STYLES)}); pass --tp 1")
    prefix = "" if getattr(module, "base_model", module) is module else f"{module.base_model_prefix}."
    return {prefix + name: HF_STYLES[style] for name, style in plan.items()}


def _heads(module: nn.Module) -> list[tuple[str, int]]:
    """(where, how many) of each count of attention heads a split must share out: a block's `num_heads`, a
    transformers config's query and key/value heads."""
    found = [(name, sub.num_heads) for name, sub in module.named_modules()
             if isinstance(getattr(sub, "num_heads", None), int)]
    config = getattr(module, "config", None)
    return found + [(key, getattr(config, key)) for key in ("num_attention_heads", "num_key_value_heads")
                    if isinstance(getattr(config, key, None), int)]


def plan_for(module: nn.Module, size: int) -> dict[str, Any]:
    """`module`'s plan (`plan_of`) as the styles that split it over a group of `size` ranks. A model without a
    plan, or whose attention heads the group cannot share out evenly, is refused (exit 2). Asked before the
    mesh's groups are made, so that every rank refuses at the same point, none inside a collective. A LoRA
    model's adapters split with their base layers (`lora.tp_plan`)."""
    plan = plan_of(module)
    if lora.is_lora(module):
        plan = lora.tp_plan(module, plan)
    if not plan:
        raise UsageError(f"--tp {size}: the model ({type(module).__name__}) has no tensor-parallel plan (a `tp_plan` "
                         "attribute, as the built-in gpt's, or a transformers config's base_model_tp_plan); pass "
                         "--tp 1")
    unknown = sorted(set(plan.values()) - set(STYLES))
    if unknown:
        raise UsageError(f"tp_plan of {type(module).__name__}: no style {', '.join(unknown)} (known: "
                         f"{', '.join(STYLES)})")
    for name, heads in _heads(module):
        if heads % size:
            raise UsageError(f"--tp {size} splits the attention heads over a group: {name} has {heads}, not a "
                             f"multiple of {size}; change the model's heads or --tp")
    return {name: STYLES[style]() for name, style in plan.items()}


def parallelize(module: nn.Module, mesh: DeviceMesh, plan: dict[str, Any]) -> None:
    """Split `module`'s layers over the tensor-parallel `mesh` by `plan` (`plan_for`'s), in place (names
    unchanged). All ranks of the group."""
    parallelize_module(module, mesh, plan)


def by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` grouped by the mesh they sit on (DTensors), plain tensors together: the groups `grad_norm` and
    `clip_grads` take. A parameter's gradient sits on its mesh, so a stepper groups its parameters once."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in params:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values()) or [[]]


def apart_from_plain(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer parameter `groups` with each group that mixes DTensors and plain tensors split in two, the
    DTensors second, with the same settings. Under ddp x --tp the split layers' parameters are DTensors and the
    rest plain tensors, and a foreach (or fused) update of one group refuses that mix on torch 2.13 (under FSDP2
    every parameter is a DTensor). Groups without the mix are returned as they are."""
    apart = []
    for group in groups:
        plain = [p for p in group["params"] if not isinstance(p, DTensor)]
        split = [p for p in group["params"] if isinstance(p, DTensor)]
        apart += [{**group, "params": plain}, {**group, "params": split}] if plain and split else [group]
    return apart


def grad_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm of the gradients of all `groups` (`by_mesh`'s) together, whole (a plain tensor), the same on
    every rank. All ranks.

    Under FSDP2 x TP the gradients are DTensors on two meshes — the split layers' on (dp, tp), the rest's on dp
    alone — which one foreach op cannot mix; under DDP x TP the split layers' on tp and the rest plain tensors:
    each group's norm is taken alone, then combined. With a single mesh (or none) this is torch's own
    `get_total_norm`, to the bit.
    """
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_grads(groups: list[list[torch.Tensor]], max_norm: float, norm: torch.Tensor) -> None:
    """torch's `clip_grads_with_norm_` (foreach) of the parameters of `groups` (`by_mesh`'s), one call a mesh."""
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_([p for p in group if p.grad is not None], max_norm, norm, foreach=True)


def gather_strided(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (nested dicts of tensors) with each tensor split in strides (`FusedColwise`'s: a rank holds a
    slice of q, of k and of v) made whole on every rank (a Replicate DTensor), the rest as it is. DCP writes and
    reads a rank's part of a tensor as one chunk, and such a part is several; whole, DCP writes it once and reads
    it onto any layout. Costs one such tensor whole per rank while a checkpoint is saved or loaded. All ranks."""
    return {key: gather_strided(value) if isinstance(value, dict)
            else DTensor.from_local(whole(value), value.device_mesh, [Replicate()] * value.device_mesh.ndim,
                                    run_check=False) if strided(value)
            else value for key, value in state.items()}


def restride(state: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """`gather_strided`'s inverse: each whole tensor of `state` laid out again as its counterpart in `like`."""
    return {key: restride(value, like[key]) if isinstance(value, dict)
            else _local_of(value.to_local(), like[key]) if strided(like[key])
            else value for key, value in state.items()}


def strided(value: Any) -> bool:
    """Whether `value` is split in strides over the tensor-parallel dimension (the last of its mesh)."""
    return isinstance(value, DTensor) and isinstance(value.placements[-1], _StridedShard)


def whole(value: DTensor) -> torch.Tensor:
    """A `strided` tensor whole, on every rank (a plain tensor). All ranks of its mesh.

    By hand, dp then tp: under FSDP2 its placements are (_StridedShard, _StridedShard), which DTensor's own
    redistribution gathered into wrong rows at dp 2 on torch 2.13 (right at dp 1). Under hsdp the mesh has a
    replicate dimension first, over which the parts are alike; under ddp it is the tp mesh alone."""
    mesh, local = value.device_mesh, value.to_local().detach()
    tp, split = mesh.size(mesh.ndim - 1), value.placements[-1].split_factor
    rows = value.shape[0] // tp  # this rank's tp part
    if mesh.ndim >= 2:  # FSDP2's shard of the tp part: torch.chunk's rows over dp, the last ones maybe fewer
        dp = mesh.ndim - 2
        most = -(-rows // mesh.size(dp))
        padded = torch.cat([local, local.new_zeros((most - local.shape[0], *local.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in range(mesh.size(dp))]
        dist.all_gather(parts, padded.contiguous(), group=mesh.get_group(dp))
        local = torch.cat(parts)[:rows]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=mesh.get_group(mesh.ndim - 1))
    return torch.cat([torch.cat([part.chunk(split)[i] for part in parts]) for i in range(split)])


def _local_of(full: torch.Tensor, like: DTensor) -> DTensor:
    """`full` laid out as the `strided` tensor `like`: this rank's slice of each part, then FSDP2's rows of it."""
    mesh = like.device_mesh
    tp, split = mesh.size(mesh.ndim - 1), like.placements[-1].split_factor
    tp_rank = mesh.get_local_rank(mesh.ndim - 1)
    local = torch.cat([part.chunk(tp)[tp_rank] for part in full.chunk(split)])
    if mesh.ndim >= 2:  # FSDP2's rows over dp (hsdp: its `shard` dimension)
        local = local.chunk(mesh.size(mesh.ndim - 2))[mesh.get_local_rank(mesh.ndim - 2)]
    local = local.to(like.to_local().device, copy=True)
    return DTensor.from_local(local, mesh, like.placements, shape=like.shape, stride=like.stride(), run_check=False)
