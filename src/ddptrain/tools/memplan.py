"""What one rank holds at its peak, predicted from the model built on the meta device: the memory table of
`ddptrain plan --model ... --strategy fsdp --nproc N`.

Bytes per rank, with S the ranks that share one copy of the model (ddp: 1, each rank a whole replica; fsdp:
the world; hsdp: the ranks of a node, so give plan the ranks per node):

* state at rest: parameters (every element, at --param_dtype), gradients and optimizer state (the trainable
  elements; SGD with momentum keeps one tensor per parameter, AdamW two), 1/S of each;
* the unit being computed (fsdp/hsdp): FSDP2 all-gathers it into a flat buffer that it keeps until the next
  unit's all-gather, and copies the parameters out of it; in backward autograd makes the unit's whole
  gradients and the reduce-scatter copies them into a flat input in --reduce_dtype (and, where that differs
  from the weights' dtype, writes an output in it before the cast into the shard), while the next unit of
  backward is gathered ahead (FSDP2's prefetch). Parameters are gathered at the compute dtype: bf16 under
  --use_amp or --param_dtype bf16. The root unit (what no block holds) stays gathered from its forward to its
  backward; with --no-reshard_after_forward every unit does. The input embedding and output head split by
  vocabulary rows under fsdp (parallel/vocab.py) are units never gathered: in backward each holds its rows'
  gradient, computed and then averaged. With --grad_accum_steps > 1 (and not
  --fsdp_reduce_every_micro_step) the whole model's unsharded gradients wait between micro-steps;
* activations: the tensors one micro-batch's forward saves for backward, counted on fake tensors (parameters
  excluded, each storage once, the largest twice for the gradient flowing back through it) and attributed to
  the unit that saved them: each moment of the step holds the activations of the units not yet through
  backward. With --activation_checkpointing a recomputed block keeps only its inputs from its forward to its
  backward, where it saves its activations again while its backward runs: one block's at a time.

Under --tp N a rank computes with its group's share (`ModelShape.per_tp_rank`): 1/N of the parameters of the
layers the model's tp_plan splits (a rowwise layer's bias stays whole) and of the activations computed from a
colwise layer's output up to a rowwise layer's (followed through the meta forward, `_TensorParallelTrace`); the
rest whole. The strategy then shares that among the ranks/N data-parallel ranks, but for the vocabulary rows,
split over all the ranks (parallel/vocab.py).

The moments are each unit's forward and each unit's backward; the peak is the fullest. --cpu_offload keeps
the state at rest on the host: the device holds the rest.

Not modelled: the framework's own memory (CUDA context, torch's libraries: measure a tiny model's run and add
it), the allocator's slack (CUDA's caching allocator reserves more than it hands out; on CPU a sharded run
returns freed blocks at once, `parallel/hostmem.py`), and DDP's communication beyond its gradient buckets.
`make bench`, section big_model, holds the prediction against measured peaks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ddptrain.config import TrainConfig
from ddptrain.errors import UsageError
from ddptrain.loop.plugins import model_of, task_of
from ddptrain.models import lora
from ddptrain.observe.perf import values_unknown
from ddptrain.parallel import tensor, vocab
from ddptrain.parallel.strategies import fsdp_blocks, recomputed_blocks

MIB = 1 << 20


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: its name, how many elements it holds (all and trainable), and the bytes the forward of one
    micro-batch saves for backward while it runs (at fp32); for a block that --activation_checkpointing
    recomputes, the bytes of its inputs, all it keeps until its backward (None: not recomputed)."""

    name: str
    elements: int
    trainable: int
    activations: int = 0
    inputs: int | None = None
    vocabulary: int = 0  # the rows of the vocabulary matrix this unit computes with, split (parallel/vocab.py)
    in_root: bool = False  # a vocabulary unit that, where the ranks cannot split its rows, is part of the root
    tp_elements: int = 0  # of `elements`, those of the layers the model's tp_plan splits (--tp)
    tp_trainable: int = 0
    tp_activations: int = 0  # of `activations`, those computed from a split layer's output up to a rowwise layer


@dataclass(frozen=True)
class Collective:
    """One all-reduce over a tensor-parallel group per micro-batch (--tp): after a rowwise layer's forward (its
    partial outputs summed) or in a colwise layer's backward (its input gradient summed), of `size` bytes at
    fp32; `recomputed`: in a block --activation_checkpointing runs forward twice."""

    layer: str  # as the tp_plan names it: "blocks.*.proj"
    direction: str  # "forward" or "backward"
    size: int
    recomputed: bool = False


@dataclass(frozen=True)
class ModelShape:
    """The units in the order their forward runs, the root (what no block holds, and what runs outside every
    block: the loss) last."""

    units: tuple[Unit, ...]
    activations_known: bool  # False: a task whose batch cannot be made up, and no --activation_mib
    collectives: tuple[Collective, ...] = ()  # --tp: one micro-batch's all-reduces, in the order they run

    @property
    def elements(self) -> int:
        return sum(u.elements for u in self.units)

    @property
    def trainable(self) -> int:
        return sum(u.trainable for u in self.units)

    @property
    def activations(self) -> int:
        return sum(u.activations for u in self.units)

    @property
    def tp_elements(self) -> int:
        return sum(u.tp_elements for u in self.units)

    def per_tp_rank(self, tp: int) -> ModelShape:
        """What one rank of a tensor-parallel group of `tp` computes with: 1/tp of the split layers' parameters
        and of the activations between a split layer and a rowwise one, the rest whole."""
        part = lambda whole, split: whole - split + -(-split // tp)  # noqa: E731
        return dataclasses.replace(self, units=tuple(dataclasses.replace(
            u, elements=part(u.elements, u.tp_elements), trainable=part(u.trainable, u.tp_trainable),
            activations=part(u.activations, u.tp_activations), tp_elements=-(-u.tp_elements // tp),
            tp_trainable=-(-u.tp_trainable // tp), tp_activations=-(-u.tp_activations // tp)) for u in self.units))


@dataclass(frozen=True)
class Footprint:
    """Bytes one rank holds at its peak, by kind, and the moment of the peak."""

    ranks: int
    params: int  # this rank's parameter shards
    grads: int  # its gradient shards once backward is done
    optimizer: int  # its optimizer state
    grads_at_peak: int  # the gradient shards already written at the peak (backward fills them unit by unit)
    gathered: int  # whole parameters, their gradients and FSDP2's buffers, at the peak
    activations: int  # saved for backward and still alive at the peak
    offloaded: bool  # params, grads and optimizer state on the host (--cpu_offload)
    moment: str

    @property
    def held(self) -> int:
        """What the rank keeps between steps: its shards of parameters, gradients and optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def state_at_peak(self) -> int:
        return self.params + self.grads_at_peak + self.optimizer

    @property
    def device_peak(self) -> int:
        return self.gathered + self.activations + (0 if self.offloaded else self.state_at_peak)

    @property
    def total(self) -> int:
        """Host and device together at the peak (a CPU run's one memory)."""
        return self.gathered + self.activations + self.state_at_peak


def optimizer_states(optimizer: str, momentum: float) -> int:
    """Tensors of a parameter's shape the optimizer keeps per parameter: AdamW's two moments, SGD's momentum."""
    if optimizer == "adamw":
        return 2
    return 1 if momentum else 0


def compute_bytes(cfg: TrainConfig) -> int:
    """Bytes of an element the forward computes in: 2 under --use_amp or bf16 weights, else 4."""
    return 2 if cfg.use_amp or (cfg.strategy != "ddp" and cfg.param_dtype == "bf16") else 4


def footprint(shape: ModelShape, cfg: TrainConfig, ranks: int) -> Footprint:
    """What a rank of `ranks` holds at its peak under cfg's strategy and precision (see the module's text).
    Under --tp N a rank computes with its group's share of the split layers (`per_tp_rank`), and the sharded
    strategies divide that among the ranks/N data-parallel ranks."""
    if cfg.tp > 1:
        shape, sharers = shape.per_tp_rank(cfg.tp), ranks // cfg.tp
    else:
        sharers = ranks
    sharded = cfg.strategy != "ddp"
    weight = 2 if sharded and cfg.param_dtype == "bf16" else 4
    compute = compute_bytes(cfg)
    reduce = 2 if sharded and cfg.reduce_dtype == "bf16" else 4
    states = optimizer_states(cfg.optimizer, cfg.momentum) * weight
    units, root = shape.units, shape.units[-1]
    share = (lambda n: math.ceil(n / sharers)) if sharded else (lambda n: n)
    # The vocabulary rows split over every rank: under --tp the group's ranks hold different rows (parallel/vocab.py).
    split = {u.name for u in units if u.vocabulary and ranks > 1 and vocab.splits(u.vocabulary, ranks)}
    # Where the rows do not split (one rank, too few rows), the run leaves the matrix where it was: a tied one
    # in the root unit.
    rooted = [u for u in units[:-1] if u.in_root and u.name not in split]
    if rooted:
        root = dataclasses.replace(root, elements=root.elements + sum(u.elements for u in rooted),
                                   trainable=root.trainable + sum(u.trainable for u in rooted),
                                   activations=root.activations + sum(u.activations for u in rooted))
        units = tuple(u for u in units[:-1] if u not in rooted) + (root,)
    of_rows = lambda n: math.ceil(n / ranks)  # noqa: E731 - a split vocabulary unit's share of its rows
    if cfg.tp > 1:  # the vocabulary rows split over every rank, the rest (the group's share) over the dp ranks
        rows = [u for u in units if u.name in split]
        mine = lambda attr: (share(getattr(shape, attr) - sum(getattr(u, attr) for u in rows))  # noqa: E731
                             + sum(of_rows(getattr(u, attr)) for u in rows))
        elements, trainable = mine("elements"), mine("trainable")
    else:
        elements, trainable = share(shape.elements), share(shape.trainable)
    params = elements * weight
    grads = trainable * weight
    optimizer = trainable * states
    acts = [int(u.activations * compute / 4) for u in units]
    # What each unit's forward leaves saved until its backward, and what its backward saves again (recomputed).
    kept = [a if u.inputs is None else int(u.inputs * compute / 4) for u, a in zip(units, acts)]
    again = [0 if u.inputs is None else a for u, a in zip(units, acts)]
    if not sharded:  # DDP's gradient buckets are allocated once and hold every gradient
        alive, moment = max([(sum(kept), "end of forward")]
                            + [(sum(kept[:i + 1]) + again[i], f"backward of {units[i].name}")
                               for i in range(len(units)) if again[i]], key=lambda m: m[0])
        return Footprint(ranks, params, grads, optimizer, grads, 0, alive, False, moment)
    held = ({root.name} if cfg.reshard_after_forward else {u.name for u in units}) - split  # forward to backward
    held_bytes = sum(u.elements for u in units if u.name in held) * compute
    # With accumulation the whole model's unsharded gradients wait between micro-steps, in --reduce_dtype.
    # (Split rows are no FSDP parameters: their gradient accumulates in its rows, counted with the shards.)
    unsharded = shape.trainable - sum(u.trainable for u in units if u.name in split)
    accumulated = unsharded * reduce if cfg.grad_accum_steps > 1 and not cfg.fsdp_reduce_every_micro_step else 0

    def gathered(unit: Unit) -> int:  # FSDP2's flat all-gather buffer and the copy-out of a unit not held
        return 0 if unit.name in held or unit.name in split else 2 * unit.elements * compute

    def in_forward(unit: Unit) -> int:  # a held unit's copy-out is in held_bytes; its flat buffer lives on
        return unit.elements * compute if unit.name in held else gathered(unit)

    moments = []  # (moment, gradient shards, gathered, activations)
    for i, unit in enumerate(units):
        moments.append((f"forward of {unit.name}", 0, held_bytes + in_forward(unit), sum(kept[:i + 1])))
    done = 0
    for i in reversed(range(len(units))):  # backward: unit i's whole gradients and reduce-scatter input, and the
        unit = units[i]                      # next unit of backward gathered ahead (FSDP2's prefetch)
        done += (of_rows if unit.name in split else share)(unit.trainable) * weight
        if unit.name in split:  # its rows' gradient, computed and then averaged: no whole gradient, no reduction
            working = held_bytes + 2 * of_rows(unit.trainable) * compute + accumulated
        else:
            working = held_bytes + gathered(unit) + unit.trainable * (compute + reduce) + accumulated
            if reduce != weight:  # the reduce-scatter's output in --reduce_dtype, before its cast into the shards
                working += share(unit.trainable) * reduce
        working += gathered(units[i - 1]) if i > 0 else 0
        moments.append((f"backward of {unit.name}", done, working, sum(kept[:i + 1]) + again[i]))
    moment, grads_at_peak, working, alive = max(moments, key=lambda m: m[1] + m[2] + m[3])
    return Footprint(ranks, params, grads, optimizer, grads_at_peak, working, alive, cfg.cpu_offload, moment)


def model_shape(cfg: TrainConfig, activation_mib: float | None = None) -> ModelShape:
    """cfg's model (LoRA adapters included) built on the meta device: its FSDP units in the order of their
    forward, each with the activations one micro-batch of --batch_size saves while it runs (language_model and
    classification; other tasks take `activation_mib`, counted as the root's)."""
    with torch.device("meta"):
        model = model_of(cfg, on_meta=True)
        if cfg.lora_rank:
            model = lora.apply(model, cfg.section("finetune"), cfg.model)
    # ddp's replica is one unit, but for the blocks --activation_checkpointing recomputes
    blocks = fsdp_blocks(model, cfg.fsdp_blocks) if cfg.strategy != "ddp" or cfg.activation_checkpointing else []
    # The vocabulary matrices split by rows: each module computing with one is a unit of its own, never gathered.
    vocabulary = set(vocab.vocab_weights(model)) if vocab.wanted(cfg.section("parallel")) else set()
    own = {id(b) for b in blocks}  # the units the vocabulary's modules are part of when not split
    if vocabulary:
        blocks = [b for b in blocks if not vocab.only_vocabulary(b, vocabulary)]
        blocks += [m for m in model.modules() if m._parameters.get("weight") in vocabulary]
    names = {id(b): next(n for n, m in model.named_modules() if m is b) for b in blocks}
    recomputed = ({id(b) for b in recomputed_blocks(model, cfg.fsdp_blocks)} if cfg.activation_checkpointing
                  else set())
    layers = tp_layers(model, cfg.tp) if cfg.tp > 1 else {}
    saved = None if activation_mib is not None else saved_by_unit(model, blocks, cfg, layers)
    order = sorted(blocks, key=lambda b: saved["order"].index(id(b)) if saved and id(b) in saved["order"] else 1 << 30)
    seen: set[int] = set()
    units = []
    for key, module in [*((id(b), b) for b in order), ("root", model)]:
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        activations = saved["bytes"].get(key, 0) if saved else 0
        if key == "root" and activation_mib is not None:
            activations = int(activation_mib * MIB)
        inputs = saved["inputs"].get(key, 0) if saved and key in recomputed else None
        rows = module.weight.shape[0] if key != "root" and module._parameters.get("weight") in vocabulary else 0
        split = [p for p in params if id(p) in layers]
        units.append(Unit(names.get(key, "root"), sum(p.numel() for p in params),
                          sum(p.numel() for p in params if p.requires_grad), activations, inputs, rows,
                          in_root=bool(rows) and key not in own, tp_elements=sum(p.numel() for p in split),
                          tp_trainable=sum(p.numel() for p in split if p.requires_grad),
                          tp_activations=saved["split"].get(key, 0) if saved else 0))
    collectives = tuple(Collective(layer, direction, size, owner in recomputed)
                        for owner, layer, direction, size in (saved["collectives"] if saved else ()))
    return ModelShape(tuple(units), activation_mib is not None or saved is not None, collectives)


def tp_layers(model: nn.Module, tp: int) -> dict[int, tuple[str, str]]:
    """The parameters --tp splits, by id: (their layer as the tp_plan names it, "rowwise" or "colwise"), from the
    plan training applies (parallel/tensor.py's `plan_for`: the model's tp_plan, a LoRA model's adapters beside
    their base layers), matched as torch's `parallelize_module` matches it (fnmatch per dotted part); a rowwise
    layer's bias stays whole and is not among them. A plan's name for one block's layer (a LoRA model's) is
    read with its block number as `*`. What training refuses (no plan, heads the group cannot share out) is
    refused here the same way, exit 2."""
    plan = tensor.plan_for(model, tp)
    found = {}
    for name, module in model.named_modules():
        key = next((key for key in plan if lora.plan_names(key, name)), None)
        if key is None:
            continue
        style = "rowwise" if isinstance(plan[key], RowwiseParallel) else "colwise"
        layer = key if "*" in key else re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", key, count=1)
        for pname, param in module.named_parameters(recurse=False):
            if not (style == "rowwise" and pname == "bias"):
                found[id(param)] = (layer, style)
    return found


class _TensorParallelTrace(TorchFunctionMode):
    """A meta forward followed through the layers --tp splits (`tp_layers`): which tensors a rank of a group
    holds a part of (a colwise layer's output and what is computed from it, until a rowwise layer's output,
    summed over the group, is whole again) and the all-reduces that costs: a rowwise layer's output in forward,
    a colwise layer's input gradient in backward (the size of its input)."""

    def __init__(self, layers: dict[int, tuple[str, str]], running: list[object]):
        super().__init__()
        self.layers, self.running = layers, running
        self.split: dict[int, bool] = {}  # storage -> whether it is split
        self.pending: list[int] = []  # storages saved for backward by the op running
        self.saved_split: dict[int, bool] = {}
        self.collectives: list[tuple[object, str, str, int]] = []  # (unit key, layer, direction, fp32 bytes)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        styles = [self.layers[id(t)] for t in tensors if id(t) in self.layers]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if styles and len(styles) < len(tensors):  # a split layer's product (not a look at its weight)
            layer, style = styles[0]
            split = style != "rowwise"
            summed = outputs if style == "rowwise" else [next(t for t in tensors if id(t) not in self.layers)]
            self.collectives.append((self.running[-1], layer, "backward" if split else "forward",
                                     sum(t.numel() * t.element_size() for t in summed)))
        else:
            split = any(self.split.get(_storage(t), False) for t in tensors)
        for t in outputs:
            self.split[_storage(t)] = split
        # What the op saved: an input as it came, anything the op made (its outputs, its own intermediates) as its
        # outputs are. (A storage's number is reused once it is freed: only the inputs' are known to be current.)
        inputs = {_storage(t) for t in tensors}
        for key in self.pending:
            self.saved_split[key] = self.split.get(key, False) if key in inputs else split
        self.pending.clear()
        return out


def synthetic_batch(cfg: TrainConfig) -> object | None:
    """A batch of --batch_size in the form the built-in tasks read, on the meta device; None for other tasks."""
    size = cfg.batch_size
    if cfg.task == "language_model":
        return torch.zeros(size, cfg.seq_len + 1, dtype=torch.long, device="meta")
    if cfg.task == "classification" and cfg.model in ("mlp", "mini_resnet"):
        images = torch.zeros(size, cfg.in_channels, cfg.image_size, cfg.image_size, device="meta")
        return images, torch.zeros(size, dtype=torch.long, device="meta")
    return None


def saved_by_unit(model: nn.Module, blocks: list[nn.Module], cfg: TrainConfig,
                  layers: dict[int, tuple[str, str]] | None = None) -> dict | None:
    """One micro-batch's forward and loss on fake tensors: {"order": the blocks' ids in the order their forward
    ran, "bytes": {block id or "root": the bytes saved for backward while it ran}, "inputs": {block id: the
    bytes of the tensors it was called with, what a recomputed block keeps}}, parameters excluded and each
    storage counted once, the largest saved tensor twice (the gradient flowing back through it); None where the
    task's batch cannot be made up. With the layers --tp splits (`tp_layers`) also "split": {unit: the part of
    its bytes a tensor-parallel rank holds 1/tp of} and "collectives": the group's all-reduces, (unit, layer,
    "forward" or "backward", fp32 bytes), in the order of the forward."""
    batch = synthetic_batch(cfg)
    if batch is None:
        return None
    running: list[object] = ["root"]
    order: list[int] = []
    saved: dict[int, tuple[object, int]] = {}
    inputs: dict[int, int] = {}
    passed: set[int] = set()  # the storages some block was called with: each counted once

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        running.append(id(module))
        if id(module) not in order:
            order.append(id(module))
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        fresh = {_storage(t): t.untyped_storage().nbytes() for t in tensors} if tensors else {}
        inputs[id(module)] = sum(size for key, size in fresh.items() if key not in params and key not in passed)
        passed.update(fresh)

    def leave(module: nn.Module, args: object, output: object) -> None:
        running.pop()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in params and key not in saved:
            saved[key] = (running[-1], tensor.untyped_storage().nbytes())
            if layers:
                trace.pending.append(key)
        return tensor

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter, with_kwargs=True),
                                         b.register_forward_hook(leave))]
    task = task_of(cfg)
    trace = _TensorParallelTrace(layers or {}, running)
    try:
        with values_unknown(torch.device("meta")) as as_fake, torch.autograd.graph.saved_tensors_hooks(pack, _same):
            # The forward sees each parameter as the fake tensor the mode remembers for it while it lives: kept
            # alive here, known by its storage.
            fakes = [as_fake(p) for p in model.parameters()]
            params = {_storage(f) for f in fakes}
            fake_batch = type(batch)(map(as_fake, batch)) if isinstance(batch, tuple) else as_fake(batch)
            model.train()
            with trace if layers else contextlib.nullcontext():
                task.loss(model, fake_batch)
    except Exception as exc:  # a model whose forward needs values: the user gives the figure instead
        raise UsageError(f"--model {cfg.model}: its forward on the meta device failed ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}); pass --activation_mib") from None
    finally:
        for hook in hooks:
            hook.remove()
    by_unit: dict[object, int] = {}
    split: dict[object, int] = {}
    for key, (owner, size) in saved.items():
        by_unit[owner] = by_unit.get(owner, 0) + size
        split[owner] = split.get(owner, 0) + size * trace.saved_split.get(key, False)
    largest = max(saved, key=lambda key: saved[key][1], default=None)
    if largest is not None:
        owner, size = saved[largest]
        by_unit[owner] += size
        split[owner] += size * trace.saved_split.get(largest, False)
    return {"order": order, "bytes": by_unit, "inputs": inputs, "split": split, "collectives": trace.collectives}


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
