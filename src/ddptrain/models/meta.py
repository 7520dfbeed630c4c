"""A model built on the meta device, with a record of its seeded init to replay one tensor at a time.

Building a model whole on the CPU after `torch.manual_seed` draws its init from the global RNG in one order:
each layer's own init as it is constructed (`reset_parameters`, or whatever its __init__ does in place), and,
for a transformers model, `post_init`'s `_init_weights` per module at the end of each PreTrainedModel's
construction. `build` constructs the same model under `torch.device("meta")` and records, in order, every
in-place op on a meta tensor (the draws and fills of construction) and every `post_init` call. `replay` runs
that record again on full-size CPU tensors, one tensor at a time (post_init: one module's tensors at a time),
so the RNG makes the same draws and each tensor ends with the value the whole build gives it; the caller's
`put` keeps what it needs (a rank: its shard) and the rest is freed.

A model may be adapted after it is built (LoRA's adapters injected: `build(construct, adapt)`). The record
keeps the two phases apart: `replay(..., adapted_only=True)` replays the adaptation's draws alone, for a model
whose own weights are read from files (from_pretrained draws nothing), and `stored_names` maps each tensor
the model had before it was adapted to the name it had then (the name its weights are stored under).

A construction that writes a meta tensor from another tensor's values (a `copy_` from a computed meta tensor)
cannot be replayed: `build` returns None and the caller builds the model whole.

May import: the contracts at the top (config, errors). Nothing else in ddptrain.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

log = logging.getLogger("ddptrain")

Put = Callable[[torch.Tensor, torch.Tensor], None]  # (the model's tensor, its full value on the CPU)

_TAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> Tape


@dataclass
class _Op:
    """One in-place op of construction: `func(target, *args, **kwargs)`, target = root[index...]."""

    func: Any
    root: int  # id() of the meta tensor written (a parameter or buffer, or one replaced later, as by a tie)
    shape: tuple[int, ...]
    dtype: torch.dtype
    index: tuple[Any, ...]  # the __getitem__ keys from the root to the target, outermost first
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Tape:
    """What construction did, in order: `_Op`s and post_init markers (the PreTrainedModel whose ran, and the ids
    of its modules then: what is added to it later was not in its init)."""

    steps: list[Any] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # root id -> its name in the built model (if still there)
    built_steps: int = 0  # steps[:built_steps] built the model, the rest adapted it
    stored_names: dict[str, str] = field(default_factory=dict)  # name now -> name before adaptation
    replayable: bool = True
    reason: str = ""
    keep: list[torch.Tensor] = field(default_factory=list)  # the meta tensors whose ids the steps name


# In-place by name, but they write no value (LoRA's `apply` freezes the base with requires_grad_).
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})


class _Recorder(TorchFunctionMode):
    def __init__(self, tape: Tape):
        super().__init__()
        self.tape = tape
        self.views: dict[int, tuple[torch.Tensor, tuple[Any, ...]]] = {}  # id(view) -> (root, index)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if not args and isinstance(kwargs.get("tensor"), torch.Tensor):  # torch.nn.init's: f(tensor=..., ...)
            kwargs = dict(kwargs)
            args = (kwargs.pop("tensor"),)
        target = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_meta else None
        if target is None:
            return out
        if name == "__getitem__" and isinstance(out, torch.Tensor):
            root, index = self.views.get(id(target), (target, ()))
            self.views[id(out)] = (root, (*index, args[1]))
            self.tape.keep.append(out)
        elif name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES:
            rest = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(a.is_meta for a in rest):
                self.tape.replayable = False
                self.tape.reason = f"{name} from a tensor computed on the meta device"
            root, index = self.views.get(id(target), (target, ()))
            self.tape.keep.append(root)
            self.tape.steps.append(_Op(func, id(root), tuple(root.shape), root.dtype, index, args[1:], kwargs))
        return out


@contextlib.contextmanager
def _post_init_marked(tape: Tape, transformers: bool) -> Iterator[None]:
    """Each PreTrainedModel's post_init (on the meta device, a no-op for weights) leaves a marker on the tape:
    where its `_init_weights` pass ran in the whole build. transformers has no hook for this. Only for a
    construction that builds a transformers model: importing transformers costs each rank seconds of CPU
    (docs/performance.md), and a built-in model has no post_init."""
    if not transformers:
        yield
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init

    def marked(model: Any) -> None:
        original(model)
        # A weak reference: the tape lives as long as the model (_TAPES), and must not keep it alive (an FSDP
        # model outliving its run holds the process groups into interpreter finalization).
        tape.steps.append((weakref.ref(model), frozenset(id(sub) for sub in model.modules())))

    PreTrainedModel.post_init = marked
    try:
        yield
    finally:
        PreTrainedModel.post_init = original


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def build(construct: Callable[[], nn.Module], adapt: Callable[[nn.Module], nn.Module] | None = None,
          transformers: bool = False) -> nn.Module | None:
    """`adapt(construct())` (or `construct()`) under the meta device, its init recorded for `replay`; None if it
    cannot be replayed. `transformers`: the construction builds a transformers model, whose post_init calls
    the record must hold."""
    tape = Tape()
    with torch.device("meta"), _post_init_marked(tape, transformers), _Recorder(tape):
        module = construct()
        if not transformers and _holds_transformers_model(module):
            tape.replayable = False  # its post_init ran unrecorded: a replay would miss that init
            tape.reason = "a transformers model built without transformers=True"
        tape.built_steps = len(tape.steps)
        built_as = {id(tensor): name for name, tensor in _tensors(module)}
        if adapt is not None:
            module = adapt(module)
    if not tape.replayable:
        log.info("model built whole: its construction cannot be replayed per shard (%s)", tape.reason)
        return None
    for name, tensor in _tensors(module):
        tape.names.setdefault(id(tensor), name)
        if id(tensor) in built_as:
            tape.stored_names[name] = built_as[id(tensor)]
    _TAPES[module] = tape
    return module


def _holds_transformers_model(module: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # not imported: no transformers model can be in it
    return transformers is not None and any(isinstance(sub, transformers.PreTrainedModel) for sub in module.modules())


def stored_names(module: nn.Module) -> dict[str, str]:
    """Of a model `build` made: each tensor's name -> its name before `adapt` (the name its weights are stored
    under); tensors that adaptation added are not in it."""
    return dict(_TAPES[module].stored_names)


def adapted(module: nn.Module) -> bool:
    """Whether the adaptation of a model `build` made drew or filled anything."""
    tape = _TAPES[module]
    return len(tape.steps) > tape.built_steps


@torch.no_grad()
def replay(module: nn.Module, put: Put, adapted_only: bool = False) -> None:
    """Every tensor of `module` (built by `build`, its tensors since materialized, sharded or not) given the
    value the whole build after the same seed gives it, through `put`. Seed the global RNG first as that
    build was. Tensors are computed whole on the CPU, one at a time. `adapted_only`: the adaptation's steps
    alone, as they run after a construction that draws nothing (the model's own tensors are left alone)."""
    tape = _TAPES[module]
    current = dict(_tensors(module))
    done: set[int] = set()
    scratch_root: int | None = None
    scratch: torch.Tensor | None = None

    def flush() -> None:
        name = tape.names.get(scratch_root) if scratch_root is not None else None
        if name is not None:
            put(current[name], scratch)

    for step in tape.steps[tape.built_steps:] if adapted_only else tape.steps:
        if isinstance(step, _Op):
            if step.root != scratch_root:
                flush()
                scratch_root, scratch = step.root, torch.empty(step.shape, dtype=step.dtype)
            target = scratch
            for key in step.index:
                target = target[key]
            step.func(target, *step.args, **step.kwargs)
            continue
        flush()
        scratch_root = scratch = None
        model, members = step[0](), step[1]
        if model is None:  # a transformers model construction made and dropped: none of the tensors here
            continue
        post_init(model, lambda sub: id(sub) in members and id(sub) not in done, put)
        done.update(members)
    flush()


def owners(module: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(tensor) -> the (module, name) that holds it first in module order (of a tied tensor: its source)."""
    found: dict[int, tuple[nn.Module, str]] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    found.setdefault(id(tensor), (sub, name))
    return found


@contextlib.contextmanager
def on_cpu(sub: nn.Module, holders: dict[int, tuple[nn.Module, str]], put: Put,
           keep: Callable[[torch.Tensor], bool] = lambda tensor: True) -> Iterator[None]:
    """The parameters and buffers of `sub` and its children swapped for full-size CPU tensors while the block
    runs (an init writes them; GPT-2's rescales a child's); then each one written is `put` if `keep` accepts
    it, and the model's own tensors are back. A tensor's version counter says whether the block wrote it.
    The second holder of a tied tensor gets a scratch of its own that is never put: transformers ties after
    the init, so what that holder's init draws is overwritten by the tie. Allocated, not touched: what the
    block leaves alone costs no resident memory."""
    swapped: list[tuple[dict, str, torch.Tensor, torch.Tensor, int, bool]] = []
    for holder in sub.modules():
        for table in (holder._parameters, holder._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                scratch = torch.empty(tensor.shape, dtype=tensor.dtype)
                if isinstance(tensor, nn.Parameter):
                    scratch = nn.Parameter(scratch, requires_grad=tensor.requires_grad)
                if getattr(tensor, "_is_hf_initialized", False):
                    scratch._is_hf_initialized = True
                table[name] = scratch
                owner = holders[id(tensor)] == (holder, name)
                swapped.append((table, name, tensor, scratch, scratch._version, owner))
    try:
        yield
    finally:
        for table, name, tensor, scratch, version, owner in swapped:
            table[name] = tensor
            if owner and scratch._version != version and keep(tensor):
                put(tensor, scratch.detach())


def post_init(model: nn.Module, wanted: Callable[[nn.Module], bool], put: Put,
              keep: Callable[[torch.Tensor], bool] = lambda tensor: True) -> None:
    """transformers' `initialize_weights` of `model` on the modules `wanted` accepts: `_init_weights` per
    module, children first, each with the init of the PreTrainedModel nearest above it (its `smart_apply`)."""
    from transformers import PreTrainedModel, initialization

    holders = owners(model)

    def visit(sub: nn.Module, owner: nn.Module) -> None:
        for child in sub.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        if wanted(sub):
            with on_cpu(sub, holders, put, keep):
                owner._init_weights(sub)

    with initialization.guard_torch_init_functions():
        visit(model, model)
