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

The moments are each unit's forward and each unit's backward; the peak is the fullest. --cpu_offload keeps
the state at rest on the host: the device holds the rest.

Not modelled: the framework's own memory (CUDA context, torch's libraries: measure a tiny model's run and add
it), the allocator's slack (CUDA's caching allocator reserves more than it hands out; on CPU a sharded run
returns freed blocks at once, `parallel/hostmem.py`), and DDP's communication beyond its gradient buckets.
`make bench`, section big_model, holds the prediction against measured peaks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from ddptrain.config import TrainConfig
from ddptrain.errors import UsageError
from ddptrain.loop.plugins import model_of, task_of
from ddptrain.models import lora
from ddptrain.observe.perf import values_unknown
from ddptrain.parallel import vocab
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


@dataclass(frozen=True)
class ModelShape:
    """The units in the order their forward runs, the root (what no block holds, and what runs outside every
    block: the loss) last."""

    units: tuple[Unit, ...]
    activations_known: bool  # False: a task whose batch cannot be made up, and no --activation_mib

    @property
    def elements(self) -> int:
        return sum(u.elements for u in self.units)

    @property
    def trainable(self) -> int:
        return sum(u.trainable for u in self.units)

    @property
    def activations(self) -> int:
        return sum(u.activations for u in self.units)


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


def footprint(shape: ModelShape, cfg: TrainConfig, ranks: int) -> Footprint:
    """What a rank of `ranks` holds at its peak under cfg's strategy and precision (see the module's text)."""
    sharded = cfg.strategy != "ddp"
    weight = 2 if sharded and cfg.param_dtype == "bf16" else 4
    compute = 2 if cfg.use_amp or weight == 2 else 4
    reduce = 2 if sharded and cfg.reduce_dtype == "bf16" else 4
    states = optimizer_states(cfg.optimizer, cfg.momentum) * weight
    units, root = shape.units, shape.units[-1]
    share = (lambda n: math.ceil(n / ranks)) if sharded else (lambda n: n)
    split = {u.name for u in units if u.vocabulary and ranks > 1 and vocab.splits(u.vocabulary, ranks)}
    # Where the rows do not split (one rank, too few rows), the run leaves the matrix where it was: a tied one
    # in the root unit.
    rooted = [u for u in units[:-1] if u.in_root and u.name not in split]
    if rooted:
        root = dataclasses.replace(root, elements=root.elements + sum(u.elements for u in rooted),
                                   trainable=root.trainable + sum(u.trainable for u in rooted),
                                   activations=root.activations + sum(u.activations for u in rooted))
        units = tuple(u for u in units[:-1] if u not in rooted) + (root,)
    params = share(shape.elements) * weight
    grads = share(shape.trainable) * weight
    optimizer = share(shape.trainable) * states
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
        done += share(unit.trainable) * weight
        if unit.name in split:  # its rows' gradient, computed and then averaged: no whole gradient, no reduction
            working = held_bytes + 2 * share(unit.trainable) * compute + accumulated
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
    saved = None if activation_mib is not None else saved_by_unit(model, blocks, cfg)
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
        units.append(Unit(names.get(key, "root"), sum(p.numel() for p in params),
                          sum(p.numel() for p in params if p.requires_grad), activations, inputs, rows,
                          in_root=bool(rows) and key not in own))
    return ModelShape(tuple(units), activation_mib is not None or saved is not None)


def synthetic_batch(cfg: TrainConfig) -> object | None:
    """A batch of --batch_size in the form the built-in tasks read, on the meta device; None for other tasks."""
    size = cfg.batch_size
    if cfg.task == "language_model":
        return torch.zeros(size, cfg.seq_len + 1, dtype=torch.long, device="meta")
    if cfg.task == "classification" and cfg.model in ("mlp", "mini_resnet"):
        images = torch.zeros(size, cfg.in_channels, cfg.image_size, cfg.image_size, device="meta")
        return images, torch.zeros(size, dtype=torch.long, device="meta")
    return None


def saved_by_unit(model: nn.Module, blocks: list[nn.Module], cfg: TrainConfig) -> dict | None:
    """One micro-batch's forward and loss on fake tensors: {"order": the blocks' ids in the order their forward
    ran, "bytes": {block id or "root": the bytes saved for backward while it ran}, "inputs": {block id: the
    bytes of the tensors it was called with, what a recomputed block keeps}}, parameters excluded and each
    storage counted once, the largest saved tensor twice (the gradient flowing back through it); None where the
    task's batch cannot be made up."""
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
        return tensor

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter, with_kwargs=True),
                                         b.register_forward_hook(leave))]
    task = task_of(cfg)
    try:
        with values_unknown(torch.device("meta")) as as_fake, torch.autograd.graph.saved_tensors_hooks(pack, _same):
            # The forward sees each parameter as the fake tensor the mode remembers for it while it lives: kept
            # alive here, known by its storage.
            fakes = [as_fake(p) for p in model.parameters()]
            params = {_storage(f) for f in fakes}
            fake_batch = type(batch)(map(as_fake, batch)) if isinstance(batch, tuple) else as_fake(batch)
            model.train()
            task.loss(model, fake_batch)
    except Exception as exc:  # a model whose forward needs values: the user gives the figure instead
        raise UsageError(f"--model {cfg.model}: its forward on the meta device failed ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}); pass --activation_mib") from None
    finally:
        for hook in hooks:
            hook.remove()
    by_unit: dict[object, int] = {}
    for owner, size in saved.values():
        by_unit[owner] = by_unit.get(owner, 0) + size
    largest = max(saved.values(), key=lambda entry: entry[1], default=None)
    if largest is not None:
        by_unit[largest[0]] += largest[1]
    return {"order": order, "bytes": by_unit, "inputs": inputs}


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
