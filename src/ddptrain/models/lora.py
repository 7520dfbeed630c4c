"""LoRA adapters through peft (`--lora_rank`): the model's weights frozen, a low-rank update trained beside
chosen layers (linear layers, embeddings), with peft's options: modules trained in full beside them
(`modules_to_save`), rsLoRA's scale, DoRA's magnitude, the adapters' init. A classifier's head (`heads`: what
peft puts in modules_to_save for a sequence classifier) is initialised fresh for the task: it trains in full.

`apply` injects the adapters into the module in place (peft's `inject_adapter_in_model`: no wrapper class, so
the loop, the strategies and the task see the same module); peft marks what trains (the adapters and the
copies of `modules_to_save`; a head trains in place, its own parameters unfrozen, so that a model built on the
meta device fills it as it fills every weight), and `apply` checks that PEFT's layout saves every tensor that
trains. What leaves a run is PEFT's own layout (`save_adapter`: adapter_config.json +
adapter_model.safetensors, the tensors and names `PeftModel.save_pretrained` writes, which
`PeftModel.from_pretrained(base, DIR)` and, for a transformers model, `AutoPeftModelFor...from_pretrained(DIR)`
load) and the base weights with the adapters merged in by peft's own layers (`merged`), under the base model's
own names.

Under --tp the adapters are split with their base layers, not replicated (`tp_plan`, TP_SPLIT_ADAPTER): the
parallel styles then apply to peft's `base_layer` and to the adapter on the split side, so each rank's adapter
output lies as its base output does and the whole computation is the one-process one. What leaves a run is
gathered whole as any split tensor is.

May import: the contracts at the top (config, errors). Nothing else in ddptrain.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from ddptrain.config import FinetuneSettings
from ddptrain.errors import TrainingError, UsageError

ADAPTER_NAME = "default"  # peft's name for a model's one adapter
ADAPTER_DIR = "adapter"  # RUN_DIR/adapter: the trained adapter in PEFT's layout
# What peft's saved keys carry before a module's own names (its PeftModel wraps the model as base_model.model).
SAVED_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head
# What peft's PeftModelForSequenceClassification adds to modules_to_save (a sequence classifier's head, by its
# common names; peft.utils.constants.SEQ_CLS_HEAD_NAMES): trained in full, saved with the adapters.
SEQ_CLS_HEADS = ("classifier", "score")
# The built-in models whose output layer is a head of num_classes outputs, as fresh as a transformers classifier's.
_BUILT_IN_CLASSIFIERS = ("MLP", "MiniResNet")


def _peft(flag: str = "--lora_rank") -> Any:
    try:
        import peft
    except ImportError:
        raise UsageError(f"{flag}: LoRA needs peft; pip install 'ddptrain[peft]'") from None
    return peft


def default_targets(module: nn.Module) -> list[str]:
    """The linear layers inside the model's repeated blocks (attention and MLP projections); every linear layer
    but the output layer where the model has no blocks; none of a classifier's `heads`, which train in full. Each
    is named as peft matches a target (the end of a module's dotted name), by the fewest trailing components that
    name these linear layers only and do not end at a bare position: `q_proj` in a transformers model, `mlp.0` in
    a block whose `0` would also name the first block."""
    block_classes = set(getattr(module, "_no_split_modules", None) or ())
    blocks = [sub for sub in module.modules()
              if type(sub).__name__ in block_classes or isinstance(sub, tuple(getattr(module, "fsdp_blocks", ())))]
    chosen = {id(sub) for block in blocks for name, sub in block.named_modules() if isinstance(sub, nn.Linear) and name}
    if not chosen:
        chosen = {id(sub) for _, sub in _linears_but_the_output(module)}
    head_names = heads(module)
    chosen -= {id(sub) for name, sub in module.named_modules() if _within(name, head_names)}
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


def _linears_but_the_output(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every linear layer of a model but its output layer: the last one registered, which writes the outputs."""
    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, nn.Linear)][:-1]


def matches(name: str, target: str) -> bool:
    """Whether peft adapts the module `name` for an entry `target` of a LoRA config's target_modules."""
    return name == target or name.endswith("." + target)


def _names(flag_value: str) -> list[str]:
    return [t.strip() for t in flag_value.split(",") if t.strip()]


def _transformers_model(module: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # not imported: no transformers model can be in it
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def task_type(module: nn.Module) -> str | None:
    """peft's task type of a transformers model, by the class --task built it as: CAUSAL_LM (--task
    language_model: AutoModelForCausalLM), SEQ_CLS (classification: AutoModelForSequenceClassification); what
    `AutoPeftModel` reads to rebuild the base. None for another model, which only `PeftModel` loads."""
    if not _transformers_model(module):
        return None
    from transformers.models.auto import modeling_auto

    for task, mapping in (("CAUSAL_LM", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("SEQ_CLS", modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)):
        if type(module).__name__ in mapping.values():
            return task
    return None


def heads(module: nn.Module) -> list[str]:
    """The head(s) of a classifier, trained in full beside the adapters and saved with them (peft's
    modules_to_save): of a transformers sequence classifier (SEQ_CLS), the modules peft puts there, each module
    whose name ends with `classifier` or `score`, as peft matches them (`score` of a Llama, `classifier` of a
    BERT); of the built-in mlp and mini_resnet, their output layer (which `default_targets` leaves out). None of
    another model: a plug-in names its head with --lora_modules_to_save."""
    if task_type(module) == "SEQ_CLS":
        found = [name for name, sub in module.named_modules()
                 if name.endswith(SEQ_CLS_HEADS) and any(True for _ in sub.parameters())]
        return [name for name in found if not any(name.startswith(outer + ".") for outer in found)]
    if type(module).__module__ == "ddptrain.models" and type(module).__name__ in _BUILT_IN_CLASSIFIERS:
        return [name for name, sub in module.named_modules() if isinstance(sub, nn.Linear)][-1:]
    return []


def _within(name: str, modules: list[str]) -> bool:
    return any(name == outer or name.startswith(outer + ".") for outer in modules)


def base_model_path(model: str) -> str | None:
    """What adapter_config.json names as the base (`base_model_name_or_path`, where AutoPeftModel finds it): an
    `hf:` directory as an absolute path, a hub name as it is; None for a built-in or plug-in model."""
    if not model.startswith("hf:"):
        return None
    source = model[len("hf:"):]
    return str(Path(source).resolve()) if Path(source).is_dir() else source


def lora_config(finetune: FinetuneSettings, model: str, module: nn.Module) -> Any:
    """peft's LoraConfig for the [finetune] section's flags (targets: --lora_targets, else `default_targets`) on
    `module`, which --model `model` built."""
    peft = _peft()
    targets: list[str] | str = _names(finetune.lora_targets) or default_targets(module)
    if targets == [ALL_LINEAR]:
        # peft leaves out a transformers model's output head itself; of another model it would adapt every one.
        targets = ALL_LINEAR if _transformers_model(module) else [n for n, _ in _linears_but_the_output(module)]
    if not targets:
        raise UsageError(f"--lora_rank {finetune.lora_rank}: the model has no linear layer to adapt; name the layers "
                         "with --lora_targets")
    init = {"true": True, "false": False}.get(finetune.lora_init, finetune.lora_init)
    # A head is named as peft names it in a classifier's adapter_config.json (both of its names).
    to_save = _names(finetune.lora_modules_to_save)
    to_save += [name for name in (SEQ_CLS_HEADS if task_type(module) == "SEQ_CLS" else heads(module))
                if name not in to_save]
    return peft.LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.lora_alpha, lora_dropout=finetune.lora_dropout,
                           target_modules=targets, modules_to_save=to_save or None,
                           use_rslora=finetune.lora_rslora, use_dora=finetune.lora_dora, init_lora_weights=init,
                           base_model_name_or_path=base_model_path(model), task_type=task_type(module), bias="none")


def apply(module: nn.Module, finetune: FinetuneSettings, model: str) -> nn.Module:
    """Freeze every weight of `module` and inject LoRA adapters into the layers `lora_config` names (in place;
    returns `module`); what trains is what peft marks, the adapters and the copies of --lora_modules_to_save,
    and a classifier's `heads`, in place. The adapters' init draws from torch's global RNG: call it right after
    building the model, under the same seed on every rank, as the model's own init."""
    peft = _peft()
    config = lora_config(finetune, model, module)
    names = [name for name, _ in module.named_modules()]
    targets = [] if config.target_modules == ALL_LINEAR else sorted(config.target_modules)
    to_save = _names(finetune.lora_modules_to_save)
    for flag, wanted in (("--lora_targets", targets), ("--lora_modules_to_save", to_save)):
        missing = sorted(t for t in wanted if not any(matches(name, t) for name in names))
        if missing:
            raise UsageError(f"{flag}: the model has no layer named {', '.join(missing)}; its linear layers "
                             f"are named {', '.join(default_targets(module)) or 'nothing'}")
    both = sorted(set(to_save) & set(targets))
    if both:
        raise UsageError(f"--lora_targets and --lora_modules_to_save both name {', '.join(both)}: a layer is adapted "
                         "or trained in full, not both; drop it from one of them")
    head_names = heads(module)
    # peft adapts nothing inside a module it trains in full; a target that names nothing else adapts nothing.
    in_head = [t for t in targets if all(_within(name, head_names) for name in names if matches(name, t))]
    if in_head:
        raise UsageError(f"--lora_targets {', '.join(in_head)}: names the classifier's head "
                         f"({', '.join(head_names)}), which trains in full beside the adapters, as peft's "
                         "modules_to_save of a classifier; drop it from --lora_targets")
    # The heads train in place: peft wraps only the other modules to save, and adapts no layer of a head.
    wrapped = [name for name in to_save if not any(matches(head, name) for head in head_names)]
    written, config.modules_to_save = config.modules_to_save, wrapped or None
    config.exclude_modules = "|".join(rf"{re.escape(head)}(\..*)?" for head in head_names) or None
    try:
        module = peft.inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
    finally:  # what adapter_config.json says: the heads among the modules to save, as peft writes a classifier's
        config.modules_to_save, config.exclude_modules = written, None
    for head in head_names:
        module.get_submodule(head).requires_grad_(True)  # no value written: a meta build's record is unchanged
    module.lora_config = config  # what save_adapter writes; an attribute of the module travels with it
    module.lora_heads = head_names  # what trains in place and saved_names adds to peft's layout
    if any(param.is_meta for param in module.parameters()):
        # Built on the meta device (fsdp), each rank replays the recorded in-place init of its shards; peft draws
        # an embedding adapter's first values with torch.randn, which is not in place: the draws after it would
        # differ from the whole build's.
        embeddings = [name for name, sub in module.named_modules()
                      if isinstance(sub, peft.tuners.lora.LoraLayer) and isinstance(sub.get_base_layer(), nn.Embedding)]
        if embeddings:
            raise UsageError(f"--lora_targets: adapting the embedding {embeddings[0]} works with --strategy ddp only "
                             "(a sharded run builds the model on the meta device, where peft's init of an "
                             "embedding adapter cannot be replayed); pass --strategy ddp, or adapt linear layers")
    saved = saved_names(module)
    unsaved = [name for name, param in module.named_parameters() if param.requires_grad and name not in saved]
    if unsaved:
        raise UsageError(f"--lora_targets {finetune.lora_targets}: PEFT's layout would not save what trains of "
                         f"{', '.join(unsaved[:3])}{' ...' if len(unsaved) > 3 else ''}; adapt other layers")
    return module


def is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_config")


# --tp: which adapter of a LoRA layer splits with its base layer, by the base's style (parallel/tensor.py's
# names), the other adapter whole on every rank of the group. A colwise base computes its share of the outputs
# from the whole input: lora_A (rank x in) stays whole and computes the same on every rank, lora_B splits by
# outputs as the base does (colwise_fused3: its share of q, of k and of v), so each rank's adapter output is the
# slice its base output is. A rowwise base holds its share of the inputs and sums its partial product over the
# group: lora_A splits by inputs as the base does and its partial products are summed (one all-reduce of
# tokens x rank), lora_B stays whole on the whole sum. Each piece is then the one-process product's, summed in
# another order only: exact where replicating the adapters over a split layer would need a gather of the
# layer's input or output and a sum of the adapters' gradients by hand.
TP_SPLIT_ADAPTER = {"colwise": "lora_B", "colwise_fused3": "lora_B", "rowwise": "lora_A"}


def tp_plan(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` (a tensor-parallel plan: module names, `*` one level's any child, to style names) for the LoRA
    module `module`: a name that matches LoRA layers names each one's base layer (peft moved the layer there, and
    the style splits an nn.Linear) and its adapter on the split side (TP_SPLIT_ADAPTER) with the same style; a
    name that matches none stays as it is. Refused (exit 2), before any group is made: a layer the plan splits
    that trains in full (--lora_modules_to_save: its copy would be whole beside a split original), or adapted by
    another kind of layer than a linear one."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import AuxiliaryTrainingWrapper

    named = list(module.named_modules())
    out: dict[str, str] = {}
    for key, style in plan.items():
        matched = [(name, sub) for name, sub in named if plan_names(key, name)]
        if not any(isinstance(sub, (LoraLayer, AuxiliaryTrainingWrapper)) for _, sub in matched):
            out[key] = style
            continue
        for name, sub in matched:
            if isinstance(sub, AuxiliaryTrainingWrapper):
                raise UsageError(f"--lora_modules_to_save: {name} is a layer --tp splits ({style}), and its copy "
                                 "trained in full would not be split with it; drop it from --lora_modules_to_save, "
                                 "or pass --tp 1")
            if not isinstance(sub, LoraLayer):
                out[name] = style
            elif not isinstance(sub.get_base_layer(), nn.Linear):
                raise UsageError(f"--lora_targets: {name} is a {type(sub.get_base_layer()).__name__} that --tp "
                                 f"splits ({style}); ddptrain splits adapters with linear layers only: leave it out "
                                 "of --lora_targets, or pass --tp 1")
            elif style not in TP_SPLIT_ADAPTER:
                raise UsageError(f"--lora_targets: {name} is split by --tp as {style}, beside which no adapter is "
                                 "split yet: leave it out of --lora_targets, or pass --tp 1")
            else:
                out[f"{name}.base_layer"] = style
                out[f"{name}.{TP_SPLIT_ADAPTER[style]}.{ADAPTER_NAME}"] = style
    return out


def plan_names(key: str, name: str) -> bool:
    """Whether a tensor-parallel plan's `key` names the module `name`, as torch's parallelize_module matches it:
    one pattern per level (fnmatch), as many levels. (Here, below parallel/: `tp_plan` and plan's memplan use it.)"""
    keys, names = key.split("."), name.split(".")
    return len(keys) == len(names) and all(fnmatch.fnmatchcase(part, pattern) for part, pattern in zip(names, keys))


def frozen_names(module: nn.Module) -> list[str]:
    """The state-dict names of the frozen parameters (a tied one under each of its names): what a checkpoint
    of adapters leaves out. Buffers are not among them: they may change in training."""
    return [name for name, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, nn.Parameter) and not value.requires_grad]


def saved_names(module: nn.Module) -> dict[str, str]:
    """The tensors of a LoRA module's PEFT layout: each one's name in `module.state_dict()` -> its key in
    adapter_model.safetensors. peft chooses and names them (`get_peft_model_state_dict`, as
    `PeftModel.save_pretrained`): the adapters (`lora_A`/`lora_B`, an embedding's `lora_embedding_A`/`_B`,
    DoRA's `lora_magnitude_vector`), each --lora_modules_to_save copy under the module's own name, and an
    adapted embedding layer's base weights; and each of the classifier's `heads`, which trains in place,
    under the keys peft saves a modules_to_save copy under (the module's own names). Reads names only: a
    sharded module's tensors are not gathered."""
    peft = _peft()
    state = module.state_dict()  # each value its own object (a tie too): the object says which name it was
    names = {id(value): name for name, value in state.items()}
    config = module.peft_config[ADAPTER_NAME]
    # peft's "auto" asks the base's config (or the Hub) whether the vocabulary was resized, which ddptrain
    # never does: without a base to ask, it saves embedding layers where they are adapted, as it does then.
    base, config.base_model_name_or_path = config.base_model_name_or_path, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Setting save_embedding_layers to True": that is the layout
            saved = peft.get_peft_model_state_dict(module, state_dict=state, adapter_name=ADAPTER_NAME)
    finally:
        config.base_model_name_or_path = base
    out = {names[id(value)]: SAVED_PREFIX + key for key, value in saved.items()}
    out.update({name: SAVED_PREFIX + name for name in state if _within(name, getattr(module, "lora_heads", []))})
    return out


def adapter_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of PEFT's layout of the LoRA module `module` (`saved_names`), taken from `state` (its state
    dict, or the part of it `saved_names` names). A tensor that trains and would not be saved, or one missing
    from `state`, is a TrainingError: an adapter file never lacks what was trained."""
    saved = saved_names(module)
    unsaved = [name for name, param in module.named_parameters() if param.requires_grad and name not in saved]
    absent = [name for name in saved if name not in state]
    if unsaved or absent:
        raise TrainingError(f"the adapter in PEFT's layout would lack {', '.join((unsaved + absent)[:3])}"
                            f"{' ...' if len(unsaved + absent) > 3 else ''}: not written")
    return {key: state[name] for name, key in saved.items()}


def save_adapter(module: nn.Module, state: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """`state` (the LoRA module's whole state dict, or the part `saved_names` names) in PEFT's layout in
    `out_dir`: adapter_config.json (its task type and base model, for AutoPeftModel) and
    adapter_model.safetensors."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_state(module, state).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    module.lora_config.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


@torch.no_grad()
def merged(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the LoRA module `module`'s base model with its adapters merged in, under the names the
    model had before `apply` (a plain `save_pretrained`/`load_state_dict` of the base model): what peft's
    `merge_and_unload` leaves, by its own layers' merge (LoRA, rsLoRA's scale, DoRA's magnitude, an
    embedding's adapter) and each --lora_modules_to_save copy in place of its module. `module` is left as it
    is: each adapted layer is merged in a copy of itself, one at a time, so the merged layers are the one copy
    held beside it. Call on a module whose tensors are whole (not sharded)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    unloaded: dict[str, dict[str, torch.Tensor]] = {}
    for name, sub in module.named_modules():
        if any(name.startswith(done + ".") for done in unloaded):
            continue
        if isinstance(sub, AuxiliaryTrainingWrapper):  # a modules_to_save copy (merged too, if it holds adapters)
            holds_adapters = any(isinstance(inner, BaseTunerLayer) for inner in sub.modules())
            sub = (copy.deepcopy(sub) if holds_adapters else sub).unload_and_optionally_merge_module(
                merge=True, safe_merge=False, adapter_names=[ADAPTER_NAME])
        elif isinstance(sub, BaseTunerLayer):
            sub = copy.deepcopy(sub)
            sub.merge(adapter_names=[ADAPTER_NAME])
            sub = sub.get_base_layer()
        else:
            continue
        unloaded[name] = sub.state_dict()
    out: dict[str, torch.Tensor] = {}
    owners = list(unloaded)
    for name, value in module.state_dict().items():
        owner = next((layer for layer in owners if name.startswith(layer + ".")), None)
        if owner is None:
            out[name] = value
        elif owner in unloaded:  # the layer's first tensor: the unloaded layer's tensors, under its own name
            out.update({f"{owner}.{key}": tensor for key, tensor in unloaded.pop(owner).items()})
    return out


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
    shard, weighed by its place in the whole (`_place`; under --tp a tensor-parallel split too); the caller adds
    the ranks' parts); under hsdp only the first replica's ranks count their shards (the others hold copies), and
    under --tp only the first rank of a group counts a tensor the group does not split, so the sum is the same on
    every layout.
    Checkpoints written before the positional sums hold the first half only (`same_weights`)."""
    state = module.state_dict()
    # A module with split tensors is summed over its ranks: a plain tensor in it (ddp x --tp: one the group does not
    # split, whole on every rank) counts on the first rank only.
    split = any(isinstance(value, DTensor) for value in state.values())
    first = not split or not dist.is_initialized() or dist.get_rank() == 0
    sums = [_sums(state[name]) if (_first_replica(state[name]) if isinstance(state[name], DTensor) else first)
            else [0.0] * 4 for name in names]
    return [four[:2] for four in sums] + [four[2:] for four in sums]


def _sums(tensor: torch.Tensor) -> list[float]:
    """[sum x, sum x², sum x·w, sum x²·w] over this rank's part of `tensor` (`fingerprint`)."""
    local = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach()
    if local.numel() == 0:  # an uneven split leaves the last ranks no rows
        return [0.0] * 4
    shape = list(tensor.shape)
    if local.dim() == 0:
        local, shape = local.reshape(1), [1]
    whole_rows, offsets = _place(tensor)
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
        rows = whole_rows[start:start + x.shape[0]].to(device)
        index = rows.unsqueeze(1) * strides[0] + within_row
        weight = 1.0 + (index % _MODULUS * _MULTIPLIER % _MODULUS).to(torch.float64) / _MODULUS
        squares = x * x
        totals += torch.stack([x.sum(), squares.sum(), (x * weight).sum(), (squares * weight).sum()])
    return totals.tolist()


def _place(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Where this rank's part of `tensor` lies in the whole: the whole's row (dim 0) of each of its rows, and per
    other dim the offset its part starts at (a plain tensor: every row, at 0). A DTensor's parts are taken as
    they were made, each as torch.chunk splits: first a tensor-parallel split (the mesh dim named "tp": a run of
    rows or of columns, or `_StridedShard`'s share of each of its runs, a fused qkv's q, k and v), then FSDP2's
    chunks of the rows that split left (its `_StridedShard` over a tp split is that), over the other dims in mesh
    order (hsdp's replicas hold all)."""
    rows = torch.arange(tensor.shape[0] if tensor.dim() else 1)
    offsets, extents = [0] * tensor.dim(), list(tensor.shape)
    placements = list(getattr(tensor, "placements", ()))
    names = (tensor.device_mesh.mesh_dim_names or ()) if placements else ()
    tp = names.index("tp") if "tp" in names else None
    for mesh_dim in sorted(range(len(placements)), key=lambda d: d != tp):
        placement, mesh = placements[mesh_dim], tensor.device_mesh
        dim = getattr(placement, "dim", None)  # (Replicate and Partial have none: all of it)
        if dim is None:
            continue
        parts, index = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        if dim == 0:
            runs = placement.split_factor if isinstance(placement, _StridedShard) and mesh_dim == tp else 1
            rows = torch.cat([run[_chunk(len(run), parts, index)] for run in rows.chunk(runs)])
        else:
            cut = _chunk(extents[dim], parts, index)
            offsets[dim] += cut.start
            extents[dim] = cut.stop - cut.start
    return rows, offsets


def _chunk(size: int, parts: int, index: int) -> slice:
    """Part `index` of `size` split in `parts` as torch.chunk splits it: ceil(size / parts) each, the last short."""
    most = -(-size // parts)
    return slice(min(index * most, size), min((index + 1) * most, size))


def _first_replica(tensor: torch.Tensor) -> bool:
    """Whether this rank holds `tensor`'s part in the first of its replicas (a plain tensor: yes)."""
    placements = getattr(tensor, "placements", ())
    if not placements:
        return True
    mesh = tensor.device_mesh
    # A tensor on part of the job's mesh (under FSDP2 x TP, one the group does not split lies on the dp dims
    # alone) is held whole by every rank along the other dims: the first of them counts it.
    root = mesh._get_root_mesh()
    others = [name for name in (root.mesh_dim_names or ()) if name not in (mesh.mesh_dim_names or ())]
    return all(not isinstance(p, Replicate) or mesh.get_local_rank(dim) == 0 for dim, p in enumerate(placements)) \
        and all(root.get_local_rank(name) == 0 for name in others)


def same_weights(saved: list[list[float]], now: list[list[float]]) -> bool:
    """Whether two fingerprints are of the same weights (the sums may round differently over other shards). A
    `saved` of a checkpoint written before the positional sums (half as long) is compared on the sums it has."""
    if 2 * len(saved) == len(now):
        now = now[:len(saved)]
    return len(saved) == len(now) and all(
        abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b)) for pair_a, pair_b in zip(saved, now)
        for a, b in zip(pair_a, pair_b))
