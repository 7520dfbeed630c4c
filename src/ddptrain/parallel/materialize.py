"""Filling a model built on the meta device after FSDP2 sharded it: each rank writes its own shards, and no
rank ever holds the whole model (DESIGN.md, "Big models"). No collective: each rank computes or reads its own part.

Two sources:

- the seeded init: `models.meta.replay` runs the construction's recorded init again on full-size CPU tensors,
  one tensor (or, for transformers' post_init, one module) at a time, so the global RNG makes the draws the
  whole build makes; each rank keeps its rows and drops the rest. Bitwise equal to the whole build.
- a `save_pretrained` directory (`fill_from_pretrained`): each rank reads only the part of each tensor that
  its shard covers (`safe_open(...).get_slice(name)[rows, columns]`), from one file or the files an
  `model.safetensors.index.json` names; a tied tensor is read once. What the files lack (non-persistent
  buffers such as rotary frequencies, a new classification head) is initialised as from_pretrained does.
  A model adapted after it was built (LoRA) has its own tensors read under the names they had before (peft
  moves a layer's weight to `....base_layer.weight`), then the adaptation's seeded init replayed alone.

Under --tp a rank's part is its tensor-parallel split (rows, columns, or a stride of each of q, k and v) and FSDP2's
chunk of that (`local_index`): the same two sources fill it, so a model split over a (dp, tp) mesh is never whole
on any rank either.

The whole-model path stays for what cannot be replayed this way (a plug-in `pkg.mod:fn` model, a hub name,
.bin weights): see `models.meta_buildable`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ddptrain.errors import UsageError, first_line
from ddptrain.models import meta
from ddptrain.parallel import tensor as tensor_parallel

log = logging.getLogger("ddptrain")


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize(module: nn.Module, device: torch.device, seed: int, source: Path | None) -> None:
    """`to_empty` on `device`, then every rank's shards filled from `source` (a save_pretrained directory)
    or from the init seeded with `seed`. Needs no collective: each rank computes or reads its own part."""
    to_empty(module, device)
    put = put_local_part
    if source is None:
        torch.manual_seed(seed)  # as `models.instantiate` seeds the whole-model build
        meta.replay(module, put)
        return
    fill_from_pretrained(module, source, put, meta.stored_names(module))
    if meta.adapted(module):
        torch.manual_seed(seed)  # from_pretrained draws nothing: the adapters' init starts from the seed
        meta.replay(module, put, adapted_only=True)


def to_empty(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)`, ties kept: nn.Module's gives each holder of a tied tensor its own copy."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((sub, name))
    module.to_empty(device=device)
    for tied in holders.values():
        (first, first_name), *others = tied
        for sub, name in others:
            if sub._parameters[name] is not first._parameters[first_name]:
                sub._parameters[name] = first._parameters[first_name]


# --- where a rank's part lies ------------------------------------------------------------------------

def chunk_rows(rows: int, parts: int, index: int) -> slice:
    """The rows of part `index` when `rows` are split in `parts` as torch.chunk splits them (and DTensor's
    Shard(0), FSDP2's): ceil(rows / parts) each, the last parts short or empty."""
    chunk = -(-rows // parts)
    return slice(min(index * chunk, rows), min((index + 1) * chunk, rows))


Index = tuple[Any, ...]  # one block of a full tensor: a slice per dimension (dim 0's with concrete bounds)


def local_index(tensor: torch.Tensor) -> list[Index]:
    """Where this rank's part of `tensor` lies in the full tensor: blocks whose values, concatenated along dim 0,
    are the part. A plain or 0-d tensor is one block, whole.

    Applied in the order they were made: first the tensor-parallel split (the mesh dimension named "tp":
    `parallel.tensor`'s rows, columns, or one stride of rows from each of q, k and v), then FSDP2's chunks of
    dim 0 of what that left (of a tp shard: its local tensor), over the other dimensions in mesh order
    (hsdp's replicas take all of it)."""
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return [(slice(None),) * tensor.dim()]
    mesh, shape = tensor.device_mesh, tensor.shape
    names = mesh.mesh_dim_names or ()
    tp = names.index("tp") if "tp" in names else None
    blocks: list[Index] = [(slice(0, shape[0]), *(slice(None),) * (tensor.dim() - 1))]
    if tp is not None:
        blocks = _split_tp(blocks[0], tensor.placements[tp], shape, mesh.size(tp), mesh.get_local_rank(tp))
    for dim, placement in enumerate(tensor.placements):
        if dim == tp or isinstance(placement, Replicate):
            continue
        if getattr(placement, "dim", None) != 0:
            raise ValueError(f"placed {placement} on mesh dimension {dim}: only FSDP2's dim-0 shards are filled here")
        total = sum(block[0].stop - block[0].start for block in blocks)
        blocks = _narrow_rows(blocks, chunk_rows(total, mesh.size(dim), mesh.get_local_rank(dim)))
    return blocks


def _split_tp(block: Index, placement: Any, shape: torch.Size, parts: int, index: int) -> list[Index]:
    """`block` (the whole tensor) split as `placement` splits it over a tensor-parallel group: part `index`."""
    if isinstance(placement, Replicate):
        return [block]
    if isinstance(placement, _StridedShard):  # FusedColwise: each of `split_factor` runs of rows torch.chunk'ed
        if placement.dim != 0:
            raise ValueError(f"placed {placement}: only strides of rows are filled here")
        run = chunk_rows(shape[0], placement.split_factor, 0).stop
        starts = range(0, shape[0], run) if run else ()
        return _narrow_each([(slice(start, min(start + run, shape[0])), *block[1:]) for start in starts], parts, index)
    if isinstance(placement, Shard):
        if placement.dim == 0:
            return _narrow_each([block], parts, index)
        cut = chunk_rows(shape[placement.dim], parts, index)
        return [(*block[:placement.dim], cut, *block[placement.dim + 1:])]
    raise ValueError(f"placed {placement} over the tensor-parallel group: not a split filled here")


def _narrow_each(blocks: list[Index], parts: int, index: int) -> list[Index]:
    """Of each block, its torch.chunk part `index` of `parts` by rows."""
    narrowed = []
    for block in blocks:
        rows = chunk_rows(block[0].stop - block[0].start, parts, index)
        narrowed.append((slice(block[0].start + rows.start, block[0].start + rows.stop), *block[1:]))
    return narrowed


def _narrow_rows(blocks: list[Index], rows: slice) -> list[Index]:
    """Rows `rows` of the blocks concatenated along dim 0, as blocks again (one, empty, if `rows` is)."""
    narrowed, offset = [], 0
    for block in blocks:
        start, stop = block[0].start, block[0].stop
        lo, hi = max(rows.start - offset, 0), min(rows.stop - offset, stop - start)
        if lo < hi:
            narrowed.append((slice(start + lo, start + hi), *block[1:]))
        offset += stop - start
    return narrowed or [(slice(blocks[0][0].start, blocks[0][0].start), *blocks[0][1:])]


def shard_rows(tensor: torch.Tensor) -> slice:
    """The rows (dim 0) of a full tensor this rank's part of `tensor` holds: FSDP2's Shard(0) is torch.chunk
    of dim 0 over the mesh's shard dimension (replicated across hsdp's other one); a plain tensor is whole.
    A part that is not one run of whole rows (a tensor-parallel split) is a ValueError: see `local_index`."""
    blocks = local_index(tensor)
    if len(blocks) != 1 or any(cut != slice(None) for cut in blocks[0][1:]):
        raise ValueError(f"a part placed {tensor.placements} is not one run of rows: read it by local_index")
    return blocks[0][0] if blocks[0] else slice(None)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard; a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def whole_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of `tensor` on this rank's CPU: a DTensor gathered (a collective: every rank calls it, in the
    same order), a plain tensor itself (not copied if it is there already)."""
    if tensor_parallel.strided(tensor):  # --tp's fused qkv under FSDP2: DTensor's full_tensor gets its rows wrong
        return tensor_parallel.whole(tensor).cpu()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()


def read_rows(part: Any, rows: slice) -> torch.Tensor:
    """Rows `rows` (dim 0) of a safetensors slice (`safe_open(...).get_slice(name)`), read alone; a 0-d tensor
    whole (a slice of rows cannot be applied to it)."""
    return part[rows] if part.get_shape() else part[...]


def read_local(part: Any, blocks: list[Index]) -> torch.Tensor:
    """The blocks (`local_index`'s) of a safetensors slice, each read alone, concatenated along dim 0."""
    if not part.get_shape():
        return part[...]
    values = [part[block] for block in blocks]
    return values[0] if len(values) == 1 else torch.cat(values)


@torch.no_grad()
def put_local_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """This rank's part of `target` copied from `full`, the whole tensor (block by block: no copy of the part
    is made first)."""
    local = local_part(target)
    if not full.dim():
        local.copy_(full)
        return
    offset = 0
    for block in local_index(target):
        value = full[block]
        local[offset:offset + value.shape[0]].copy_(value)
        offset += value.shape[0]
    if offset != local.shape[0]:  # a layout local_index does not know: rows would be left unfilled
        raise ValueError(f"a part placed {target.placements} has {local.shape[0]} rows, local_index finds {offset}")


# --- from a save_pretrained directory ----------------------------------------------------------------

def weight_files(directory: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, for a save_pretrained directory (one file, or the
    files its index names); None where it has no safetensors weights. A damaged index or file is a UsageError
    naming it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: directory / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"{index}: not a weights index ({type(exc).__name__}: {first_line(exc)}); save the "
                             "model again with save_pretrained") from None
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    with _opened(single) as fh:
        return {name: single for name in fh.keys()}


def _opened(path: Path) -> Any:
    """`safe_open(path)`; a file safetensors cannot read (cut short, not safetensors) is a UsageError naming it."""
    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # safetensors' SafetensorError, or an OSError
        raise UsageError(f"{path}: cannot read it as safetensors ({first_line(exc)}): the file is damaged or "
                         "incomplete; copy or save it again") from None


# safetensors' dtype names of what is not a floating-point number: such a value is no weight of a float tensor.
_NOT_FLOAT = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def check_stored(tensors: list[tuple[str, torch.Tensor]], stored_as: dict[str, str], files: dict[str, Path],
                 handles: dict[Path, Any]) -> None:
    """Every stored tensor the model will read has the model's whole shape, and a floating-point dtype where the
    model's is one: else a UsageError naming the tensor, both shapes and the file, before anything is copied.
    (A rank copies only its rows of each tensor, which broadcasting would fill from a tensor of the wrong
    shape: a 32 x 1 matrix into every column of a 32 x 32 one, 80 rows cut to 64, without a word.)"""
    for name, tensor in tensors:
        stored = stored_as.get(name)
        if stored not in files:
            continue
        path = files[stored]
        if path not in handles:
            handles[path] = _opened(path)
        part = handles[path].get_slice(stored)
        shape, dtype = tuple(part.get_shape()), part.get_dtype()
        if shape != tuple(tensor.shape):
            raise UsageError(f"{path}: {stored} has shape {list(shape)}, the model's {name} {list(tensor.shape)}: "
                             "these weights are not of the model's config.json (a resized vocabulary, another "
                             "size); load them into a model of their own shape")
        if tensor.is_floating_point() and dtype in _NOT_FLOAT:
            raise UsageError(f"{path}: {stored} holds {dtype} values, the model's {name} is {tensor.dtype}: not "
                             "weights of this model")


@torch.no_grad()
def fill_from_pretrained(model: nn.Module, directory: Path, put: meta.Put, stored_as: dict[str, str]) -> None:
    """Each rank reads the rows of each tensor its shards hold; then transformers' init of what the files
    lack (as from_pretrained does: modules whose tensors were all read are skipped). `stored_as`: the tensors
    to fill (name -> its name in the files); the rest are left to the caller."""
    files = weight_files(directory) or {}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    filled = {id(tensor) for name, tensor in tensors if name in stored_as}
    read: set[int] = set()
    handles: dict[Path, Any] = {}
    try:
        check_stored(tensors, stored_as, files, handles)
        for name, tensor in tensors:
            stored = stored_as.get(name)
            if stored not in files or id(tensor) in read:
                continue
            try:
                value = read_local(handles[files[stored]].get_slice(stored), local_index(tensor))
            except Exception as exc:  # the header was whole; its data was not
                raise UsageError(f"{files[stored]}: cannot read {stored} ({first_line(exc)}): the file is damaged; "
                                 "copy or save it again") from None
            local_part(tensor).copy_(value.to(tensor.dtype))
            read.add(id(tensor))
    finally:
        handles.clear()  # safe_open's handles close when dropped
    missing = [stored_as[n] for n, t in model.named_parameters() if id(t) in filled and id(t) not in read]
    if missing:
        log.warning("%s holds no %s: initialised fresh, as from_pretrained does", directory, ", ".join(missing))
    # from_pretrained marks what it read as initialised: transformers' guarded init skips it.
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in read:
            tensor._is_hf_initialized = True
    unread = filled - read
    pending = {id(sub) for sub in model.modules()
               if any(t is not None and id(t) in unread for t in [*sub._parameters.values(), *sub._buffers.values()])}
    meta.post_init(model, lambda sub: id(sub) in pending, put, keep=lambda tensor: id(tensor) in unread)
    for tensor in [*model.parameters(), *model.buffers()]:
        if hasattr(tensor, "_is_hf_initialized"):
            del tensor._is_hf_initialized

