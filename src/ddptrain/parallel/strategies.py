"""How the model is spread over the job's ranks: DistributedDataParallel (a full replica per rank) or FSDP2
(parameters, gradients and optimizer state sharded; `hsdp` shards within a node and replicates across nodes).
Under --tp N either first splits each block's layers over a group of N ranks of a node (parallel/tensor.py): DDP
then replicates a group's split model over the data-parallel ranks, FSDP2 shards it over them.

The loop asks this object a few things — the module to call, a context that skips gradient communication
on accumulation micro-steps, one model's state for eval and export, the memory it holds (gradients between
micro-steps included) — so a strategy is an object with the same methods, not branches in the loop.
`build_parallel` picks it from --strategy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any, Collection, Iterator

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import load_plugin
from ddptrain.errors import TrainingError, UsageError
from ddptrain.models import hf
from ddptrain.parallel import hostmem, materialize, tensor, vocab
from ddptrain.parallel.distributed import DistributedContext

log = logging.getLogger("ddptrain")


class DataParallel:
    """DDP at world size > 1 (a plain module at 1): every rank holds the whole model; gradients are averaged
    by bucketed all-reduces during backward.

    Under --tp N the mesh is (dp, tp): each block's layers are split over the N ranks of a tp group (their
    parameters DTensors on mesh["tp"]), and a group's ranks hold those parts only, so the run is `sharded` (its
    checkpoints, eval and export go the way FSDP2's do). DDP averages the parameters that are not split over the
    data-parallel group (mesh["dp"]); it cannot hold DTensors (its bucket and broadcast ops refuse to mix them
    with plain tensors on torch 2.13), so it ignores the split ones, whose gradients one all-reduce over the same
    group averages after the last micro-step's backward (`_average_split_grads`). torch's own route, DDP's
    `device_mesh` (`_pre_dp_module_transform`), turns them into plain attributes after the first forward: they
    left `named_parameters` and the state dict on torch 2.13.
    """

    name = "ddp"
    sharded = False  # True under --tp (see above)
    communicating_phase = "backward+all-reduce"  # the watchdog's name for the last micro-step's backward

    def __init__(self, module: nn.Module, ctx: DistributedContext, parallel: Any, compile: bool):
        self.module, self.ctx = module, ctx
        self.ddp: DDP | None = None
        self.model: nn.Module = module
        self.mesh, self.split = None, []
        if parallel.tp > 1:  # tp inside a node: a group is tp consecutive ranks (DistributedContext.dp_rank)
            plan = tensor.plan_for(module, parallel.tp)  # (refused before any group is made)
            self.mesh = init_device_mesh(ctx.device.type, (ctx.dp_size, parallel.tp), mesh_dim_names=("dp", "tp"))
            tensor.parallelize(module, self.mesh["tp"], plan)
            self.sharded = True
            self.split = [(name, p) for name, p in module.named_parameters() if isinstance(p, DTensor)]
            log.debug("ddp over mesh %s: %d split parameters averaged apart from DDP's buckets",
                      (ctx.dp_size, parallel.tp), len(self.split))
        if ctx.dp_size > 1:
            device = ctx.device
            if self.split:
                DDP._set_params_and_buffers_to_ignore_for_model(module, [name for name, _ in self.split])
            self.ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                           bucket_cap_mb=parallel.bucket_cap_mb, static_graph=parallel.static_graph,
                           find_unused_parameters=parallel.find_unused_parameters,
                           gradient_as_bucket_view=parallel.gradient_as_bucket_view,
                           process_group=self.mesh.get_group("dp") if self.mesh is not None else None)
            self.model = self.ddp
        if compile:
            self.model = torch.compile(self.model)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-step's forward and backward: no gradient all-reduce unless it is the `last`."""
        if self.ddp is None:
            return contextlib.nullcontext()
        if not last:
            return self.ddp.no_sync()
        return self._average_split_grads() if self.split else contextlib.nullcontext()

    @contextlib.contextmanager
    def _average_split_grads(self) -> Iterator[None]:
        """After the last micro-step's backward (DDP has averaged the rest by then): the split parameters' local
        gradients averaged over the data-parallel group as DDP averages (divided by its size, then summed), in one
        all-reduce per dtype. All ranks: a tp group's ranks each average their own parts with their dp peers."""
        yield
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for _, param in self.split:
                if param.grad is not None:
                    grad = param.grad.to_local()
                    by_dtype.setdefault(grad.dtype, []).append(grad)
            for grads in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.ctx.dp_size)
                dist.all_reduce(flat, group=self.mesh.get_group("dp"))
                for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                    grad.copy_(part.view_as(grad))

    def communicates(self, last: bool) -> bool:
        """Whether a micro-step's backward reduces gradients (the `last` only)."""
        return last

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm running statistics). All ranks.

        DDP broadcasts them at the start of each forward, so after the last forward every rank holds the
        statistics of its own batches. Evaluating, checkpointing and exporting must all see one model: the
        one rank 0 saves. Training is unchanged, since the next forward would broadcast the same values.
        """
        if self.ddp is not None:
            _broadcast_buffers(self.module)

    def state_dict(self, leave_out: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """The model's state less the tensors named in `leave_out`, as rank 0 checkpoints and exports it (call
        `sync_buffers` first); under --tp the split tensors gathered whole, one at a time. All ranks."""
        return {name: materialize.whole_on_cpu(value) if isinstance(value, DTensor) else value
                for name, value in self.module.state_dict().items() if name not in leave_out}

    def export(self, path: Path, metadata: dict[str, str], hf_dir: Path | None = None) -> None:
        """Under --tp (`sharded`): the whole model's weights into `path` (and HF's layout into `hf_dir`), a split
        tensor gathered at a time and written by rank 0 (checkpoints.shards.write_streamed). All ranks."""
        from ddptrain.checkpoints import shards

        shards.write_streamed(self.module, path, metadata, self.ctx.is_main, hf_dir)

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state."""
        return _memory(self.module, optimizer)

    def grad_bytes_held(self) -> int:
        """Bytes of gradients this rank holds now: between micro-steps, the whole model's (a replica)."""
        return _memory(self.module, None)["grad_bytes"]

    def release(self) -> None:
        """Under --tp, the mesh's process groups (see ShardedParallel.release); else nothing: DDP's reference to
        its group goes with the Trainer."""
        if self.mesh is not None:
            _release_mesh(self.mesh)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Prove that DDP kept the ranks' parameters bitwise identical (a silent divergence is the worst bug).

        A fingerprint per parameter (sum and sum of squares in float64) is gathered on the control group; under
        --tp the replicas of a part are the ranks of the same place in their groups. Must be called on all ranks.
        """
        if self.ctx.world_size > 1:
            _check_replicas(self.module, self.ctx, [rank % self.ctx.tp_size for rank in range(self.ctx.world_size)])


class ShardedParallel:
    """FSDP2 (`fully_shard`): each rank keeps 1/N of every parameter, its gradient and its optimizer state.

    Every block (--fsdp_blocks, else the model's `fsdp_blocks` classes) is one unit: its parameters are
    all-gathered before its forward and backward and freed after; its gradients are reduce-scattered. The
    root unit holds what no block does (embeddings, heads). Under `hsdp` the mesh is (nodes, ranks per node):
    shards live within a node and each node holds a replica, so only an all-reduce of shards crosses nodes.
    Under --tp N the mesh is (dp, tp), under hsdp (replicate, shard, tp): each block's layers are first split over
    the N ranks of a tp group inside a node (parallel/tensor.py), then FSDP2 shards every parameter over the dp
    dimension (hsdp: over `shard`, replicated over `replicate`, the nodes).
    Parameters are DTensors: the optimizer is the foreach one (the fused kernels have no sharded form).

    With accumulation, gradients are reduce-scattered on the last micro-step only: until then every rank holds
    the whole model's unsharded fp32 gradients (see `grad_bytes_held`). --fsdp_reduce_every_micro_step
    reduce-scatters on every micro-step instead, so a rank holds only its shard of them between micro-steps.
    """

    sharded = True
    communicating_phase = "backward+reduce-scatter"

    def __init__(self, module: nn.Module, ctx: DistributedContext, parallel: Any, compile: bool, use_amp: bool,
                 fill: tuple[int, Path | None]):
        self.module, self.ctx, self.name = module, ctx, parallel.strategy
        if ctx.device.type == "cpu" and hostmem.return_freed_blocks():  # before the first unit is gathered
            log.debug("%s on CPU: freed blocks of >= %d bytes go back to the system (glibc mmap threshold)",
                      parallel.strategy, hostmem.THRESHOLD_BYTES)
        self.reduce_every_micro_step = parallel.fsdp_reduce_every_micro_step
        nodes = ctx.world_size // ctx.local_world_size if parallel.strategy == "hsdp" else 1
        if parallel.strategy == "hsdp" and (ctx.world_size % ctx.local_world_size or nodes < 2):
            raise UsageError(f"--strategy hsdp needs several nodes with the same number of ranks each (world "
                             f"size {ctx.world_size}, {ctx.local_world_size} per node); use --strategy fsdp on "
                             "one node")
        shape = (nodes, ctx.dp_size // nodes) if nodes > 1 else (ctx.dp_size,)
        names = ("replicate", "shard") if nodes > 1 else ("shard",)
        if parallel.tp > 1:  # tp inside a node: a group is tp consecutive ranks (DistributedContext.dp_rank)
            shape, names = (*shape, parallel.tp), ("replicate", "shard", "tp") if nodes > 1 else ("dp", "tp")
        plan = tensor.plan_for(module, parallel.tp) if parallel.tp > 1 else {}  # (refused before any group is made)
        self.mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
        data_mesh = self.mesh
        if plan:
            tensor.parallelize(module, self.mesh["tp"], plan)
            data_mesh = self.mesh["replicate", "shard"] if nodes > 1 else self.mesh["dp"]
        policy = precision_policy(parallel, use_amp)
        self.cpu_offload = parallel.cpu_offload
        if parallel.param_dtype == "bf16":
            module.to(torch.bfloat16)  # the shards, their gradients and optimizer state: bf16 (meta: filled rounded)
        # Pinned host memory needs an accelerator; on CPU the shards already live on the host.
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if parallel.cpu_offload else OffloadPolicy()
        # The embedding and head split by vocabulary rows, never gathered (parallel/vocab.py); FSDP2 leaves them.
        # Offloaded shards live on the host from the start (as FSDP2 moves a built model's there).
        home = torch.device("cpu") if parallel.cpu_offload else ctx.device
        # Under --tp over every rank, a tp group's ranks holding different rows (vocab.py): a 1-D mesh of its own
        # root, as without --tp (lora's fingerprint counts each rank's part of a tensor on it).
        split_rows = vocab.wanted(parallel)
        self.rows_mesh = (init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
                          if plan and split_rows else self.mesh)
        replicas = self.mesh["tp"] if plan else None
        self.vocabulary = (vocab.shard(module, self.rows_mesh, home, policy.param_dtype, replicas) if split_rows
                           else set())
        shard = functools.partial(fully_shard, mesh=data_mesh, mp_policy=policy, offload_policy=offload,
                                  reshard_after_forward=parallel.reshard_after_forward,
                                  ignored_params=self.vocabulary or None)
        blocks = [b for b in fsdp_blocks(module, parallel.fsdp_blocks) if not vocab.only_vocabulary(b, self.vocabulary)]
        if self.vocabulary:
            log.info("%s: the input embedding and output head split by vocabulary rows over %d ranks, never "
                     "gathered", parallel.strategy, ctx.world_size)
        if not blocks and ctx.is_main:
            log.warning("--strategy %s: the model names no blocks (an `fsdp_blocks` attribute or --fsdp_blocks), "
                        "so it is one unit: memory is sharded at rest but gathered whole for every forward",
                        parallel.strategy)
        for block in blocks:
            if compile:  # each unit compiled in place (names unchanged); FSDP2's hooks stay outside its graphs
                block.compile()
            shard(block)
        shard(module, mp_policy=precision_policy(parallel, use_amp, root=True))
        if materialize.is_meta(module):  # built on the meta device (models.meta_buildable): each rank fills its shards
            seed, source = fill
            materialize.materialize(module, home, seed, source)
            log.info("%s: built on the meta device, each rank's shards filled from %s", parallel.strategy,
                     source or f"the init of seed {seed}")
        self.units = len(blocks) + 1
        # --compile: per block, as above (whole-model compile over FSDP2's units is slower); a model without
        # blocks is compiled whole.
        self.model: nn.Module = torch.compile(module) if compile and not blocks else module
        if compile and blocks:
            log.info("%s: --compile per block: %d blocks compiled, each before it was sharded", parallel.strategy,
                     len(blocks))
        log.debug("%s over mesh %s: %d units, %d split by vocabulary rows", parallel.strategy, tuple(shape), self.units,
                  len(self.vocabulary))

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients reduce-scatter on the `last` micro-step only, before it they accumulate unsharded; or,
        with --fsdp_reduce_every_micro_step, on every micro-step, into the shards."""
        self.module.set_requires_gradient_sync(self.communicates(last))
        return contextlib.nullcontext()

    def communicates(self, last: bool) -> bool:
        """Whether a micro-step's backward reduce-scatters its gradients."""
        return last or self.reduce_every_micro_step

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Rank 0's buffers on every rank (FSDP shards parameters only: each rank's BatchNorm statistics are
        its own batches'). All ranks."""
        if self.ctx.world_size > 1:
            _broadcast_buffers(self.module)

    def state_dict(self, leave_out: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """The model less the tensors named in `leave_out`, gathered onto rank 0's CPU (other ranks get {}). All
        ranks. With `leave_out` (LoRA's frozen base) only the rest is gathered, a tensor at a time, so that
        exporting adapters never brings the whole base to one rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not leave_out:
            return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        gathered, leave_out = {}, set(leave_out)
        for name, value in self.module.state_dict().items():  # the same order on every rank: one gather each
            if name in leave_out:
                continue
            whole = materialize.whole_on_cpu(value)
            if self.ctx.is_main:
                gathered[name] = whole.clone()  # (a plain tensor's is itself)
        return gathered

    def export(self, path: Path, metadata: dict[str, str], hf_dir: Path | None = None) -> None:
        """The whole model's weights into `path` (and HF's sharded layout into `hf_dir`), gathered one tensor at
        a time and written by rank 0 as they come: no rank holds the whole model. All ranks."""
        from ddptrain.checkpoints import shards

        shards.write_streamed(self.module, path, metadata, self.ctx.is_main, hf_dir)

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds of parameter shards, gradients and optimizer state; `offloaded_bytes`: how many
        of them --cpu_offload keeps in host memory instead of the device (all of them; 0 without it)."""
        held = _memory(self.module, optimizer)
        held["offloaded_bytes"] = sum(held.values()) if self.cpu_offload else 0
        return held

    def grad_bytes_held(self) -> int:
        """Bytes of gradients this rank holds now: its gradient shards, plus the unsharded gradients FSDP2
        accumulates while gradient sync is off, which no parameter's `.grad` shows.

        torch 2.13 keeps those on each unit's `FSDPParam` (`_fsdp_param.py`): as `_unsharded_param.grad`, or
        as `unsharded_accumulated_grad` when the gradient is upcast to the reduce dtype (--use_amp: bf16
        compute, fp32 reduction) — the whole model's fp32 gradients on every rank until the reduce-scatter.
        """
        held = _memory(self.module, None)["grad_bytes"]
        for unit in self.module.modules():
            if isinstance(unit, FSDPModule):
                for group in unit._get_fsdp_state()._fsdp_param_groups:
                    for param in group.fsdp_params:
                        unsharded = getattr(param, "_unsharded_param", None)  # made by the first all-gather
                        for grad in (param.unsharded_accumulated_grad, getattr(unsharded, "grad", None)):
                            if grad is not None:
                                held += materialize.local_part(grad).numel() * grad.element_size()
        return held

    def release(self) -> None:
        """Let go of the mesh's process groups once training is over (before they are destroyed).

        torch's DTensor caches keep every mesh they saw for the life of the interpreter, and a mesh holds its
        groups: their gloo threads would run on into interpreter finalization (see distributed._teardown;
        without this, a 2-process fsdp run's world group outlives its destruction).
        """
        _release_mesh(self.mesh)
        _release_mesh(self.rows_mesh)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Under hsdp each node holds a replica of the shards: prove they are identical. (fsdp has none; under --tp
        the ranks of a group hold different parts of the split layers: a node's ranks replicate another node's.)"""
        if self.mesh.mesh_dim_names[0] == "replicate":
            per_node = self.ctx.world_size // self.mesh.size(0)
            _check_replicas(self.module, self.ctx, [r % per_node for r in range(self.ctx.world_size)])


def precision_policy(parallel: Any, use_amp: bool, root: bool = False) -> Any:
    """FSDP2's MixedPrecisionPolicy from --use_amp, --param_dtype and --reduce_dtype (the [parallel] section),
    for a block or the `root`.

    --use_amp computes in bf16 (parameters gathered as bf16) over the fp32 shards; bf16 weights compute in bf16
    anyway. Either way the inputs of each unit are cast to bf16, and the root's output (the model's) back to
    fp32, so the loss is taken in fp32. A block's output stays bf16: FSDP2 casts every unit's output to the
    policy's output dtype, and an fp32 block output met the root's own bf16 parameters after the blocks (a
    GPT's final LayerNorm refused the mix). Gradients are reduced in --reduce_dtype and written to the shards
    in the weights' dtype.
    """
    reduce = torch.bfloat16 if parallel.reduce_dtype == "bf16" else torch.float32
    if use_amp or parallel.param_dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce,
                                    output_dtype=torch.float32 if root else None)
    return MixedPrecisionPolicy(reduce_dtype=reduce)


def build_parallel(module: nn.Module, ctx: DistributedContext, parallel: Any, performance: Any, use_amp: bool,
                   fill: tuple[int, Path | None]) -> DataParallel | ShardedParallel:
    """--strategy's wrapper of `module`, from the [parallel] and [performance] sections (--compile,
    --activation_checkpointing); `use_amp`: fsdp's compute dtype; `fill`: (seed, save_pretrained directory or
    None), what a model built on the meta device is filled from."""
    if performance.activation_checkpointing:
        recompute_blocks(module, parallel.fsdp_blocks)
    if parallel.strategy == "ddp":
        return DataParallel(module, ctx, parallel, performance.compile)
    return ShardedParallel(module, ctx, parallel, performance.compile, use_amp, fill)


def unsynced_batchnorm(module: nn.Module) -> list[str]:
    """The BatchNorm layers that normalise a training batch with that batch's own statistics, computed in each
    process alone: not SyncBatchNorm, and not frozen (a layer put in eval mode uses its running statistics,
    unless it keeps none)."""
    return [name for name, sub in module.named_modules()
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and not isinstance(sub, nn.SyncBatchNorm)
            and (sub.training or sub.running_mean is None)]


def warn_unsynced_batchnorm(module: nn.Module, strategy: str, batch_size: int, ctx: DistributedContext) -> None:
    """Say once, on rank 0, that BatchNorm breaks what every other part keeps: N processes learn what one
    process learns on the same global batch."""
    layers = unsynced_batchnorm(module)
    if ctx.world_size == 1 or not ctx.is_main or not layers:
        return
    sync = "--sync_batchnorm (CUDA) shares them, " if strategy == "ddp" else ""
    log.warning("the model has %d BatchNorm layers without sync (first: %s): batch statistics are per process "
                "(batches of %d), so %d processes do not learn exactly what 1 process learns; %s--norm group "
                "(mini_resnet) or GroupNorm needs none", len(layers), layers[0] or "the model itself",
                batch_size, ctx.world_size, sync)


def recompute_blocks(module: nn.Module, spec: str) -> None:
    """--activation_checkpointing: each block keeps only its inputs in forward and recomputes the rest in its
    backward (torch.utils.checkpoint, non-reentrant, RNG state preserved: dropout draws the same twice). The
    blocks are the FSDP units (`fsdp_blocks`); a transformers model uses its own gradient checkpointing.
    Applied before DDP or FSDP wraps the model, and without renaming a parameter (checkpoints stay the same)."""
    if hf.recomputes_itself(module):
        hf.enable_activation_checkpointing(module)
        return
    blocks = recomputed_blocks(module, spec)
    if not blocks:
        raise UsageError("--activation_checkpointing recomputes the model's blocks, and this model names none: give "
                         "it an `fsdp_blocks` attribute, or pass --fsdp_blocks CLASS")
    for block in blocks:
        block.forward = _recomputed(block.forward)


def recomputed_blocks(module: nn.Module, spec: str) -> list[nn.Module]:
    """The blocks --activation_checkpointing recomputes: a transformers model's own (its `_no_split_modules`
    classes, which its gradient checkpointing covers), else the FSDP blocks (`spec` is --fsdp_blocks)."""
    if hf.recomputes_itself(module):
        names = set(getattr(module, "_no_split_modules", None) or ())
        return [m for m in module.modules() if type(m).__name__ in names]
    return fsdp_blocks(module, spec)


def _recomputed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def fsdp_blocks(module: nn.Module, spec: str) -> list[nn.Module]:
    """The modules sharded as one unit each, outermost first and never one inside another.

    `spec` is --fsdp_blocks: class names ("Block,Expert"), or 'pkg.mod:fn' with fn(model) -> modules. Empty:
    the model's own `fsdp_blocks` (classes, or a method returning the modules), else a transformers model's
    `_no_split_modules` (the block classes it says must stay whole) and its untied input and output
    embeddings (hf.embedding_units).
    """
    if ":" in spec:
        chosen = list(load_plugin(spec, "--fsdp_blocks")(module))
    else:
        names = {n.strip() for n in spec.split(",") if n.strip()}
        declared = getattr(module, "fsdp_blocks", ())
        if not names and not declared:
            names = set(getattr(module, "_no_split_modules", None) or ())
            if hf.is_transformers(module):
                blocks = [m for m in module.modules() if type(m).__name__ in names]
                return _outermost(blocks + hf.embedding_units(module))
        if callable(declared) and not names:
            chosen = list(declared())
        else:
            wanted = (lambda m: type(m).__name__ in names) if names else (lambda m: isinstance(m, tuple(declared)))
            chosen = [m for m in module.modules() if m is not module and wanted(m)]
            if spec and not chosen:
                present = sorted({type(m).__name__ for m in module.modules()})
                raise UsageError(f"--fsdp_blocks {spec}: the model has no module of that class; it has "
                                 f"{', '.join(present)}")
    return _outermost(chosen)


def _outermost(chosen: list[nn.Module]) -> list[nn.Module]:
    inside = {id(sub) for block in chosen for sub in block.modules() if sub is not block}
    return [block for block in chosen if id(block) not in inside]


def _release_mesh(mesh: DeviceMesh) -> None:
    registry = getattr(mesh, "_pg_registry", None)  # shared by the mesh's sub-meshes
    if isinstance(registry, dict):
        registry.clear()


def _broadcast_buffers(module: nn.Module) -> None:
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)


def _memory(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    def size(t: torch.Tensor) -> int:
        return materialize.local_part(t).numel() * t.element_size()

    params = list(module.parameters())
    states = optimizer.state.values() if optimizer is not None else ()
    return {"param_bytes": sum(size(p) for p in params),
            "grad_bytes": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": sum(size(v) for state in states for v in state.values() if isinstance(v, torch.Tensor))}


def _check_replicas(module: nn.Module, ctx: DistributedContext, replica_of: list[int]) -> None:
    """Ranks holding the same part of the model (`replica_of[rank]` equal) hold it bitwise identically.

    A fingerprint per local parameter (sum and sum of squares in float64) is gathered on the control group.
    Must be called on all ranks.
    """
    named = [(n, materialize.local_part(p)) for n, p in module.named_parameters() if p.requires_grad]
    prints = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()])
                          for _, p in named]).flatten().cpu()
    gathered = ctx.gather_floats(prints.tolist())
    for rank, theirs in enumerate(gathered):
        reference = replica_of.index(replica_of[rank])  # the lowest rank with the same part
        if theirs != gathered[reference]:
            first = next(i for i, (a, b) in enumerate(zip(theirs, gathered[reference])) if a != b) // 2
            raise TrainingError(f"replicas diverged: rank {rank} ({ctx.hosts[rank]}) differs from rank {reference} "
                                f"in parameter {named[first][0]}")
    log.info("replicas identical across %d ranks (%d parameter tensors)", ctx.world_size, len(named))
