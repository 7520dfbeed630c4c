"""A vocabulary-parallel input embedding and output head under fsdp: each rank keeps its rows of the
vocabulary-sized matrices and never gathers them.

Gathered whole like any FSDP unit, a 32000 x 1024 head is a large unit: FSDP2 holds its flat all-gather
buffer and the parameter copied out of it, then in backward its whole gradient and the reduce-scatter's input,
four copies of the matrix on every rank at once (docs/performance.md, "Big models"). Here the rows stay where
FSDP2 would keep them — Shard(0) over the same mesh, so names, checkpoints and the optimizer see the same
DTensors — and the activations travel instead, which for the batches of a big model are smaller:

* embedding: the token ids of every rank are all-gathered; each rank looks up the ids in its rows (zero for the
  rest) and a reduce-scatter sums the parts, giving each rank its own batch's vectors. Exactly one rank adds a
  non-zero row to each vector, so the result is the lookup's, bitwise.
* head: the hidden states of every rank are all-gathered; each rank computes the logits of its vocabulary rows
  for every rank's tokens, and an all-to-all hands each rank its own tokens' logits, all columns. In backward
  the logits' gradients go back the same way, the hidden states' gradients are reduce-scattered.

Each rank's weight gradient is then the sum over every rank's batch, divided by the world size: the average
FSDP2's reduce-scatter makes, summed in another order (rounding may differ in the last bits). Ranks with
batches of different lengths are padded to the longest (one small all-gather of the counts per call).
Every rank must call the embedding and the head as many times as the others, as with any FSDP unit.

Under --tp N the rows split over every rank of the world (a 1-D mesh of them all), not over dp alone:
the ranks of a tp group read the same micro-batch, so each of its tokens is gathered N times and each rank gets
back its own tokens' vectors and logits all the same. Their gradients are whole and alike on the N ranks
(parallel/tensor.py), so a weight gradient sums each dp group's N times: divided by the world size it is the
average over dp that FSDP2 makes of the other parameters. The group's ranks must also hold the same bits of
everything not split, as tensor.py's all-reduces leave them: a vector's lookup is exact, but the hidden states'
gradient is a sum that the reduce-scatter adds up in another order for each rank, so the group averages it.

Used under `--strategy fsdp` at world size > 1 (`--vocab_parallel`, on by default) where the model's input
embedding and output head are a plain `nn.Embedding` and a bias-free `nn.Linear` (tied or not); not under
hsdp (a replicate dimension). Under --cpu_offload the rows live on the host with the other shards and are
copied to the device for each call, as FSDP2 copies a unit's shards.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

from ddptrain.config import ParallelSettings
from ddptrain.parallel.materialize import chunk_rows


NOT_TOKEN_IDS = "an embedding's token ids must be integers"  # the split lookup's error for float inputs


def wanted(parallel: ParallelSettings) -> bool:
    """Whether the [parallel] section asks for the split: --vocab_parallel under fsdp (--tp or not)."""
    return parallel.strategy == "fsdp" and parallel.vocab_parallel


def vocab_weights(model: nn.Module) -> list[nn.Parameter]:
    """The vocabulary-sized matrices this module can split: the input embedding's and the output head's weights
    (one if tied), when every module holding them is a plain `nn.Embedding` (no max_norm, dense gradients) or a
    bias-free `nn.Linear` whose forward is nn's own. [] where the model has no such pair (`get_input_embeddings`
    / `get_output_embeddings`, transformers' convention, which the built-in gpt follows too)."""
    if not hasattr(model, "get_input_embeddings"):
        return []
    found = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        unit = getattr(model, get)() if hasattr(model, get) else None
        weight = getattr(unit, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and all(weight is not w for w in found):
            found.append(weight)
    holders = [_holders(model, w) for w in found]
    if not found or not all(h and all(_splittable(m) for m in h) for h in holders):
        return []
    return found


def only_vocabulary(module: nn.Module, vocabulary: set[nn.Parameter]) -> bool:
    """Whether every parameter of `module` (and it has some) is one of the split `vocabulary` (no FSDP unit)."""
    params = list(module.parameters())
    return bool(params) and all(p in vocabulary for p in params)


def _holders(model: nn.Module, weight: nn.Parameter) -> list[nn.Module]:
    return [m for m in model.modules() if m._parameters.get("weight") is weight]


def _splittable(module: nn.Module) -> bool:
    if "forward" in vars(module):  # already replaced (LoRA's or another wrapper's)
        return False
    if type(module) is nn.Embedding:
        return module.max_norm is None and not module.sparse and not module.scale_grad_by_freq
    return type(module) is nn.Linear and module.bias is None


def splits(rows: int, ranks: int) -> bool:
    """Whether `rows` split over `ranks` the way torch.chunk does (and FSDP2's Shard(0)) leaves every rank some."""
    return all(_widths(rows, ranks))


def shard(model: nn.Module, mesh: DeviceMesh, home: torch.device, compute_dtype: torch.dtype | None,
          replicas: DeviceMesh | None = None) -> set[nn.Parameter]:
    """Replace each vocabulary matrix by this rank's rows as a Shard(0) DTensor over the 1-D `mesh` (every rank of
    the world, --tp's groups too), on `home`
    (no collective: every rank holds the same matrix, or a meta one, left on meta) and route its holders'
    forwards through the vocabulary-parallel functions. `compute_dtype`: the dtype FSDP2 computes the other
    units in (None: the weights' own). `replicas`: under --tp the tensor-parallel mesh, whose ranks read the same
    tokens (see the module's text). Returns the new parameters, for fully_shard to leave alone; empty where
    the model has no vocabulary this can split."""
    ranks, rank = mesh.size(), mesh.get_local_rank()
    weights = vocab_weights(model)
    if mesh.ndim != 1 or ranks < 2 or not all(splits(w.shape[0], ranks) for w in weights):
        return set()
    kept = set()
    for weight in weights:
        rows = chunk_rows(weight.shape[0], ranks, rank)
        local = weight.detach()[rows].to(home if not weight.is_meta else "meta", copy=True)
        split = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=weight.shape,
                                                stride=weight.stride()), requires_grad=weight.requires_grad)
        for holder in _holders(model, weight):
            holder._parameters["weight"] = split
            # The mesh, not its group: ShardedParallel.release lets go of the groups through the mesh.
            if type(holder) is nn.Embedding:
                holder.forward = functools.partial(_embedding, holder, mesh, rows.start, compute_dtype)
            else:
                holder.forward = functools.partial(_head, holder, mesh, rows.start, compute_dtype, replicas)
        kept.add(split)
    return kept


def _local_weight(module: nn.Module, device: torch.device, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """The rank's rows on the compute `device` (from the host under --cpu_offload) in `compute_dtype`, their
    gradient divided by the world size on the way back (FSDP2's average)."""
    weight = module.weight.to_local()
    if weight.requires_grad:
        ranks = module.weight.device_mesh.size()
        weight.register_hook(lambda grad: grad / ranks)
    return weight.to(device=device, dtype=compute_dtype or weight.dtype)


@torch.compiler.disable  # a model compiled whole: its collectives and autograd Functions run as written
def _embedding(module: nn.Embedding, mesh: DeviceMesh, start: int, compute_dtype: torch.dtype | None,
               ids: torch.Tensor) -> torch.Tensor:
    if ids.is_floating_point() or ids.is_complex():  # as a whole lookup refuses them (where() would not)
        raise TypeError(f"{NOT_TOKEN_IDS}, got {ids.dtype}")
    weight = _local_weight(module, ids.device, compute_dtype)
    # A whole lookup fails on an id outside the vocabulary; split, it would find no rank's row: a zero vector.
    torch._assert_async(((ids >= 0) & (ids < module.weight.shape[0])).all(),
                        f"a token id outside the embedding's {module.weight.shape[0]} rows")
    flat = _padded(ids.reshape(-1), mesh, value=-1)
    every = _gather_rows(flat, mesh)  # the ids of every rank's tokens
    local = every - start
    mine = (local >= 0) & (local < weight.shape[0])
    padding = module.padding_idx
    padding = padding - start if padding is not None and 0 <= padding - start < weight.shape[0] else None
    looked = F.embedding(torch.where(mine, local, 0), weight, padding_idx=padding)
    vectors = _Adjoint.apply(torch.where(mine.unsqueeze(-1), looked, 0), mesh, _scatter_rows, _gather_rows)
    return vectors[:ids.numel()].reshape(*ids.shape, weight.shape[1])


@torch.compiler.disable
def _head(module: nn.Linear, mesh: DeviceMesh, start: int, compute_dtype: torch.dtype | None,
          replicas: DeviceMesh | None, hidden: torch.Tensor) -> torch.Tensor:
    weight = _local_weight(module, hidden.device, compute_dtype)
    if compute_dtype is not None:
        hidden = hidden.to(compute_dtype)
    flat = _padded(hidden.reshape(-1, hidden.shape[-1]), mesh, value=0.0)
    back = _scatter_rows if replicas is None else functools.partial(_scatter_rows_alike, replicas=replicas)
    every = _Adjoint.apply(flat, mesh, _gather_rows, back)  # (ranks x longest, hidden): every rank's tokens
    part = F.linear(every, weight)  # their logits over this rank's vocabulary rows
    widths = _widths(module.weight.shape[0], mesh.size())
    return _Exchange.apply(part, mesh, widths, hidden.shape[:-1])  # this rank's tokens, every column


def _widths(rows: int, ranks: int) -> list[int]:
    """How many of `rows` each rank holds under Shard(0)."""
    return [len(range(rows)[chunk_rows(rows, ranks, r)]) for r in range(ranks)]


def _padded(flat: torch.Tensor, mesh: DeviceMesh, value: float) -> torch.Tensor:
    """`flat` padded along dim 0 to the longest of every rank's (one all-gather of the lengths)."""
    lengths = torch.empty(mesh.size(), dtype=torch.int64, device=flat.device)
    _all_gather(lengths, torch.tensor([flat.shape[0]], device=flat.device), group=mesh.get_group())
    longest = int(lengths.max())
    if longest == flat.shape[0]:
        return flat
    pad = [0, 0] * (flat.dim() - 1) + [0, longest - flat.shape[0]]
    return F.pad(flat, pad, value=value)


# torch 2.13 renamed them (the old names warn); torch>=2.6 has the old ones only.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _gather_rows(flat: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    out = flat.new_empty((mesh.size() * flat.shape[0], *flat.shape[1:]))
    _all_gather(out, flat.contiguous(), group=mesh.get_group())
    return out


def _scatter_rows(every: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    out = every.new_empty((every.shape[0] // mesh.size(), *every.shape[1:]))
    _reduce_scatter(out, every.contiguous(), group=mesh.get_group())
    return out


def _scatter_rows_alike(every: torch.Tensor, mesh: DeviceMesh, replicas: DeviceMesh) -> torch.Tensor:
    """`_scatter_rows`, then averaged over `replicas` (ranks whose rows are the same tokens), which then hold the
    same bits: the reduce-scatter adds up each rank's rows in another order."""
    out = _scatter_rows(every, mesh)
    dist.all_reduce(out, group=replicas.get_group())
    return out.div_(replicas.size())


class _Adjoint(torch.autograd.Function):
    """`there` in forward, `back` in backward: an all-gather of rows and a reduce-scatter of rows, each the
    other's adjoint (a rank's rows, gathered to every rank, get back the sum of every rank's gradient of them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, there: Any, back: Any) -> torch.Tensor:
        ctx.mesh, ctx.back = mesh, back
        return there(x, mesh)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.back(grad, ctx.mesh), None, None, None


class _Exchange(torch.autograd.Function):
    """(ranks x longest, this rank's columns) -> (*shape, every column): block r of the rows goes to rank r,
    the blocks received are joined along the columns in rank order (an all-to-all) and cut to this rank's
    tokens, into a tensor of its own (FSDP2 warns of a model output that is a view). Backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, mesh: DeviceMesh, widths: list[int], shape: torch.Size) -> torch.Tensor:
        ranks, rank = len(widths), mesh.get_local_rank()
        longest, tokens = part.shape[0] // ranks, shape.numel()
        ctx.mesh, ctx.widths, ctx.longest = mesh, widths, longest
        received = part.new_empty(longest * sum(widths))
        dist.all_to_all_single(received, part.contiguous().reshape(-1), [longest * w for w in widths],
                               [longest * widths[rank]] * ranks, group=mesh.get_group())
        out = part.new_empty((*shape, sum(widths)))
        columns = out.view(tokens, sum(widths)).split(widths, dim=1)
        for block, width, into in zip(received.split([longest * w for w in widths]), widths, columns):
            into.copy_(block.view(longest, width)[:tokens])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        widths, mesh = ctx.widths, ctx.mesh
        ranks, rank = len(widths), mesh.get_local_rank()
        longest = ctx.longest
        grad = grad.reshape(-1, sum(widths))
        grad = F.pad(grad, (0, 0, 0, longest - grad.shape[0])) if grad.shape[0] < longest else grad
        sent = torch.cat([g.contiguous().reshape(-1) for g in grad.split(widths, dim=1)])
        received = grad.new_empty(ranks * longest * widths[rank])
        dist.all_to_all_single(received, sent, [longest * widths[rank]] * ranks, [longest * w for w in widths],
                               group=mesh.get_group())
        return received.view(ranks * longest, widths[rank]), None, None, None
