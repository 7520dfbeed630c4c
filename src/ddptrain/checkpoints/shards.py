"""The one write path of checkpoints, every strategy's: model and optimizer state written by every rank with
torch.distributed.checkpoint (DCP) into ``step-N/shards/``, read back onto any number of ranks under any
strategy.

Layout of ``checkpoints/step-<N>/``::

    shards/.metadata       DCP's index: which byte ranges of which file hold which slice of which tensor
    shards/__R_I.distcp    the tensor slices rank R wrote (model under ``model.``, optimizer ``optim.state.``);
                           under ddp every rank holds every tensor whole, and each writes its share of them
    trainer.pt             the run's other state (format.py), with the optimizer's param_groups (no tensors)
    manifest.json          written by rank 0 last, after every rank reported its files written and hashed

Only tensors go into the shards. DCP's index is a pickle, so nothing in it is unpickled before its digest
matched the manifest, and even then only through an unpickler that knows DCP's own metadata classes and
nothing else: a checkpoint cannot run code. A non-tensor entry (which DCP would torch.load without
weights_only) is refused. A parsed index is then checked before DCP reads through it (`check_index`): every
byte range it names lies in a shard file the manifest lists, and every tensor's chunks cover it exactly.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import re
import warnings
from concurrent.futures import Future
from itertools import combinations
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Collection, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from ddptrain.checkpoints.format import (
    PEER_FAILED,
    CheckpointError,
    Loaded,
    MappedWeights,
    _read_verified,
    _safe_torch_load,
    _verify_file,
    file_digest,
)
from ddptrain.parallel import tensor
from ddptrain.parallel.materialize import chunk_rows, local_part, put_local_part, shard_rows, whole_on_cpu

SHARDS = "shards"
METADATA = f"{SHARDS}/.metadata"
log = logging.getLogger("ddptrain")
# DCP raises CheckpointException, a BaseException, on every rank when one rank's part failed; it carries each
# failed rank's own exception.
SAVE_ERRORS = (Exception, CheckpointException)

# What DCP's own .metadata pickle references (torch 2.6 - 2.13), and nothing else.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{METADATA} refused: it references {module}.{name}, which DCP's index never needs")


def parse_metadata(data: bytes) -> Metadata:
    """DCP's index from verified bytes, through the restricted unpickler."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{METADATA} does not parse: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def read_verified(path: Path, manifest: dict[str, Any], share: tuple[int, int]) -> Loaded:
    """checkpoint.read_checkpoint for the sharded layout: trainer.pt and the index on every rank, the shard
    files `rank, world = share` hashes (every world-th), nothing of the tensors read yet."""
    files = manifest["files"]
    for name in ("trainer.pt", METADATA):
        if name not in files:
            raise CheckpointError(f"manifest lists no {name}")
    rank, world = share
    shard_files = sorted(name for name in files if name.startswith(f"{SHARDS}/") and name != METADATA)
    for name in shard_files[rank::world]:
        _verify_file(path / name, files[name], name)
    metadata = parse_metadata(_read_verified(path / METADATA, files[METADATA], METADATA))
    check_index(metadata, path, files)
    trainer = _safe_torch_load(_read_verified(path / "trainer.pt", files["trainer.pt"]), "trainer.pt",
                               torch.device("cpu"))
    return Loaded(path=path, manifest=manifest, model=None, optimizer=None, trainer=trainer, shards=metadata)


def check_index(metadata: Metadata, path: Path, files: dict[str, dict[str, Any]]) -> None:
    """Refuse an index that reads anything but the manifest's shard files, or leaves part of a tensor unread.

    Its digest only says whoever wrote the manifest wrote it too. A re-signed index could otherwise make DCP
    read any file into a weight, or leave elements out (export allocates with torch.empty: they would be
    whatever memory held). `files` is the manifest's name -> sha256, size.
    """
    storage, entries = metadata.storage_data, metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(entries, dict):
        raise CheckpointError(f"{METADATA}: its tables are not DCP's (dicts); refused")
    shards_dir = (path / SHARDS).resolve()
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{METADATA}: storage entry {index!r} is not DCP's; refused")
        _check_storage(index, info, shards_dir, files)
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_chunks(fqn, entry, storage)


def _check_storage(index: MetadataIndex, info: _StorageInfo, shards_dir: Path,
                   files: dict[str, dict[str, Any]]) -> None:
    """One byte range: inside shards/ (no absolute path, `..` or symlink out), in a file the manifest lists and
    so digest-verified, within that file's size, and stored raw (what DCP would decompress, we cannot bound)."""
    where = f"{METADATA}: {index.fqn}'s storage" + ("" if index.offset is None else f" at {_shape(index.offset)}")
    name = info.relative_path
    if not isinstance(name, str):
        raise CheckpointError(f"{where} names a {type(name).__name__}, not a file; refused")
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not (shards_dir / name).resolve().is_relative_to(shards_dir):
        raise CheckpointError(f"{where} points at {name!r}, outside the checkpoint's {SHARDS}/; refused")
    listed = files.get(f"{SHARDS}/{name}")
    if listed is None or f"{SHARDS}/{name}" == METADATA:
        raise CheckpointError(f"{where} points at {name!r}, a file the manifest does not list; refused")
    offset, length = info.offset, info.length
    if (not _is_int(offset) or not _is_int(length) or offset < 0 or length < 0
            or offset + length > listed["size"]):
        raise CheckpointError(f"{where} reads {length} bytes at offset {offset} of {name!r}, which has "
                              f"{listed['size']}; refused")
    if info.transform_descriptors:
        raise CheckpointError(f"{where} is transformed ({list(info.transform_descriptors)}), which ddptrain "
                              "never writes; refused")


def _check_chunks(fqn: str, entry: TensorStorageMetadata, storage: dict[MetadataIndex, _StorageInfo]) -> None:
    """A tensor's chunks lie within it, each has a storage entry holding at least its bytes, no two overlap, and
    together they have its number of elements: they cover it exactly. Chunks are one per writing rank, so
    comparing every pair is cheap."""
    where = f"{METADATA}: {fqn}'s"
    size = _dims(entry.size, f"{where} size")
    if not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
        raise CheckpointError(f"{where} dtype is not a torch dtype; refused")
    dtype = entry.properties.dtype
    if not isinstance(entry.chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks):
        raise CheckpointError(f"{where} chunks are not DCP's; refused")
    boxes = []
    for chunk in entry.chunks:
        offsets, sizes = _dims(chunk.offsets, f"{where} chunk offset"), _dims(chunk.sizes, f"{where} chunk size")
        at = _shape(offsets)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise CheckpointError(f"{where} chunk at {at} of size {_shape(sizes)} lies outside its size "
                                  f"{_shape(size)}; refused")
        info = storage.get(MetadataIndex(fqn, offsets))
        if info is None:
            raise CheckpointError(f"{where} chunk at {at} has no storage entry; refused")
        # Raw torch.save bytes hold at least the elements: a size the bytes cannot hold would only make
        # export allocate it.
        chunk_bytes = math.prod(sizes) * dtype.itemsize
        if chunk_bytes > info.length:
            dtype_name = str(dtype).removeprefix("torch.")
            raise CheckpointError(f"{where} chunk at {at} is {chunk_bytes} bytes of {dtype_name}, its storage "
                                  f"holds {info.length}; refused")
        boxes.append((offsets, sizes))
    for (a, a_sizes), (b, b_sizes) in combinations(boxes, 2):
        if all(max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(a, a_sizes, b, b_sizes)):
            raise CheckpointError(f"{where} chunks at {_shape(a)} and {_shape(b)} overlap; refused")
    covered, numel = sum(math.prod(sizes) for _, sizes in boxes), math.prod(size)
    if covered != numel:
        raise CheckpointError(f"{where} chunks cover {covered} of its {numel} elements; refused")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dims(value: Any, what: str) -> tuple[int, ...]:
    """A shape or offset of the index as ints (torch.Size is a tuple; a pickle could hold anything)."""
    if not isinstance(value, (tuple, list)) or not all(_is_int(d) for d in value):
        raise CheckpointError(f"{what} is {value!r}, not a tuple of ints; refused")
    return tuple(value)


def _shape(dims: Any) -> str:
    return str(tuple(dims)) if isinstance(dims, (tuple, list)) else repr(dims)


class _VerifiedReader(FileSystemReader):
    """Reads shards through an index already verified and parsed: DCP's own reader would pickle.load it."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """Our shards hold tensors only (read with weights_only); an object entry would be a full unpickle."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"{SHARDS}: {read_item.dest_index.fqn} is a pickled object where ddptrain writes "
                              "only tensors; refused")


# --- saving -------------------------------------------------------------------------------------

def state_to_save(module: nn.Module, optimizer: torch.optim.Optimizer, leave_out: Collection[str] = (),
                  replicas: tuple[int, int] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what this rank's shards hold, what trainer.pt holds of the optimizer), less the model tensors named in
    `leave_out` (LoRA's frozen weights). Sharded tensors stay sharded. All ranks.

    The shards hold tensors only. The optimizer's param_groups, and any value of its state that is not a tensor
    (a hand-written optimizer's int step count), go to trainer.pt: DCP would pickle them into the shards, which
    no checkpoint may need unpickled.

    `replicas` = (rank, world size) where every rank holds every tensor whole (ddp): this rank's share only
    (`share_of_replicas`), so that each tensor is copied and written by one rank, an async save's CPU copy
    included.
    """
    model = {name: value for name, value in get_model_state_dict(module).items() if name not in leave_out}
    state: dict[str, Any] = {"model": model}
    extra: dict[str, Any] = {"param_groups": []}
    if optimizer.state:  # else no update yet: DCP's helper would take a zero-gradient step to create state
        optim = get_optimizer_state_dict(module, optimizer)
        tensors, values = _split_values(optim["state"])
        state["optim"], extra["param_groups"] = {"state": tensors}, optim["param_groups"]
        if values:
            extra["optim_values"] = values
    state = tensor.gather_strided(state)  # --tp's fused qkv: whole, as DCP writes one chunk per rank
    return (share_of_replicas(state, *replicas) if replicas else state), extra


def share_of_replicas(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The part of `state` (nested dicts of tensors, the same on every rank) that `rank` writes: each tensor goes
    to the rank with the fewest bytes so far, in the order of the dicts, which every rank walks alike."""
    loads = [0] * world_size

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        mine: dict[str, Any] = {}
        for key, value in node.items():
            if isinstance(value, dict):
                part = walk(value)
                if part:
                    mine[key] = part
                continue
            writer = loads.index(min(loads))
            loads[writer] += max(value.numel() * value.element_size(), 1)
            if writer == rank:
                mine[key] = value
        return mine

    return walk(state)


def _split_values(state: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """An optimizer's state by parameter name, as (its tensors, its other values); a parameter with none of
    either is left out of that one."""
    tensors: dict[str, dict[str, Any]] = {}
    values: dict[str, dict[str, Any]] = {}
    for name, entry in state.items():
        for key, value in entry.items():
            (tensors if isinstance(value, torch.Tensor) else values).setdefault(name, {})[key] = value
    return tensors, values


class _Writer(FileSystemWriter):
    """DCP's file writer, with a hook run once this rank's shard files are written and before DCP gathers
    every rank's results (where the fault injector's `at=save` fires on each rank), and an async save's copy
    staged in the manager's reused memory (`Staging`)."""

    def __init__(self, path: Path, written: Callable[[], None] | None, staging: "Staging | None" = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._written, self._staging = written, staging

    def stage(self, state_dict: Any) -> Any:
        return self._staging.stage(state_dict)

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner)
        if self._written is not None:
            results.wait()
            self._written()
        return results


def save(target: Path, state: dict[str, Any], group: dist.ProcessGroup | None, staging: "Staging | None",
         written: Callable[[], None] | None = None) -> Future:
    """Write this rank's shards of `state` into target/shards. All ranks (DCP plans the save collectively).

    The future completes when this rank's files are written (and, on rank 0, the index). With `staging` (an
    async save) the state is copied into its CPU memory now and written in a background thread. `written` runs
    on this rank once its own shard files are written, inside DCP's save.
    """
    writer = _Writer(target / SHARDS, written, staging)
    if staging is not None:
        return dcp.async_save(state, storage_writer=writer, process_group=group)
    done: Future = Future()
    done.set_result(dcp.save(state, storage_writer=writer, process_group=group))
    return done


class Staging:
    """An async save's copy of the state in CPU memory, which the next save copies into where its tensors match
    (touching fresh memory costs several times the copy itself): one per checkpoint manager, and only one save
    in flight reads it."""

    def __init__(self) -> None:
        self.copy: Any = None

    def stage(self, state: Any) -> Any:
        self.copy = _cpu_copy(state, self.copy)
        return self.copy


def _cpu_copy(obj: Any, reuse: Any) -> Any:
    """`obj` with every tensor detached into CPU memory, `reuse`'s tensor of the same place where it matches in
    shape and dtype; a DTensor keeps its layout (its local part copied)."""
    if isinstance(obj, DTensor):
        local = _cpu_copy(obj.to_local(), reuse.to_local() if isinstance(reuse, DTensor) else None)
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                  stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        if (isinstance(reuse, torch.Tensor) and not isinstance(reuse, DTensor) and reuse.device.type == "cpu"
                and reuse.shape == obj.shape and reuse.dtype == obj.dtype):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _cpu_copy(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(_cpu_copy(v, r) for v, r in zip(obj, old))
    return obj


def own_files(target: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Digests of the shard files `rank` wrote (rank 0: also the index), keyed as the manifest lists them."""
    mine = re.compile(rf"^__{rank}_\d+\.distcp$")
    names = [p.name for p in (target / SHARDS).iterdir() if mine.match(p.name)]
    if rank == 0:
        names.append(".metadata")
    return {f"{SHARDS}/{name}": file_digest(target / SHARDS / name) for name in sorted(names)}


# --- loading ------------------------------------------------------------------------------------

def load_into(module: nn.Module, optimizer: torch.optim.Optimizer, loaded: Loaded,
              group: dist.ProcessGroup | None, leave_out: Collection[str] = ()) -> None:
    """Put a checkpoint's model and optimizer state into this run's where DCP is needed; the model tensors
    named in `leave_out` (LoRA's frozen weights, which it does not hold) keep what they are. All ranks.

    full -> fsdp: each rank reads, of every model and optimizer tensor, the rows its shard holds (the files
    map: `read_checkpoint(mapped=True)`), with no collective. sharded -> any: DCP reads, for each rank, exactly
    the slices its own tensors cover (resharding to any world size; a ddp rank's tensors are whole).
    full -> ddp needs none of it (`loop.checkpointed.ModelState` loads it with load_state_dict).
    """
    if loaded.shards is None:
        _load_full_rows(module, optimizer, loaded, leave_out)
        return
    saved_tensors = any(key.startswith("optim.") for key in loaded.shards.state_dict_metadata)
    saved_values = loaded.trainer.get("optim_values", {})  # the state's other values (state_to_save)
    model_state = {name: value for name, value in get_model_state_dict(module).items() if name not in leave_out}
    state: dict[str, Any] = {"model": model_state}
    if saved_tensors:
        state["optim"] = {"state": _split_values(get_optimizer_state_dict(module, optimizer)["state"])[0]}
    laid_out, state = state, tensor.gather_strided(state)  # (see state_to_save)
    dcp.load(state, storage_reader=_VerifiedReader(loaded.path / SHARDS, loaded.shards),
             planner=_TensorsOnlyPlanner(), process_group=group)
    state = tensor.restride(state, laid_out)
    model_state = state["model"]
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=not leave_out))
    if saved_tensors or saved_values:
        merged = state["optim"]["state"] if saved_tensors else {}
        for name, values in saved_values.items():
            merged.setdefault(name, {}).update(values)
        set_optimizer_state_dict(module, optimizer, {"state": merged, "param_groups": loaded.trainer["param_groups"]})


@torch.no_grad()
def _load_full_rows(module: nn.Module, optimizer: torch.optim.Optimizer, loaded: Loaded,
                    leave_out: Collection[str]) -> None:
    """A full checkpoint into a sharded module: every tensor's local part copied from the rows of the saved
    whole tensor it covers (materialize.shard_rows: FSDP2's dim-0 chunks, hsdp's replicas alike)."""
    model = loaded.model
    # state_dict's values share the parameters' storage: writing a local part writes the parameter.
    for name, target in module.state_dict().items():
        if name in leave_out:
            continue
        if isinstance(model, MappedWeights):
            local_part(target).copy_(model.rows(name, shard_rows(target)))
        else:
            put_local_part(target, model[name])
    saved = loaded.optimizer
    if not saved["state"]:
        return
    # torch numbers an optimizer's state in param_groups order, as it was saved: each tensor the shape of
    # its parameter becomes that parameter's shard; scalars (Adam's step) stay what they are.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: {key: _shard_like(params[index], value) for key, value in entry.items()}
             for index, entry in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _shard_like(param: torch.Tensor, value: Any) -> Any:
    """`value` (a whole tensor of `param`'s shape) as a tensor laid out as `param` is: its rows copied."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape) or not value.dim():
        return value
    local = value[shard_rows(param)].to(local_part(param).device, copy=True)  # a copy: never the mapped file
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def consolidate(loaded: Loaded, part: str = "model") -> dict[str, torch.Tensor]:
    """The whole of one part of a sharded checkpoint, in this one process (for `ddptrain export`): "model" (name
    -> tensor), or "optim" (``state.<parameter name>.<key>`` -> tensor, {} before the first update)."""
    prefix = f"{part}."
    tensors = {name[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
               for name, meta in loaded.shards.state_dict_metadata.items()
               if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not tensors:
        return {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
        dcp.load({part: tensors}, storage_reader=_VerifiedReader(loaded.path / SHARDS, loaded.shards),
                 planner=_TensorsOnlyPlanner(), no_dist=True)
    return tensors


def failure(exc: BaseException, rank: int) -> str:
    """One line for a failed save on `rank`: its own cause, or PEER_FAILED when DCP raised for another rank's."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict) and failures:
        own = failures.get(rank)
        if own is None:
            return PEER_FAILED
        exc = own[0] if isinstance(own, tuple) else own  # DCP keeps (exception, its traceback summary)
    return f"{type(exc).__name__}: {exc}"


# --- the final weights, streamed ------------------------------------------------------------------

HF_SHARD_BYTES = 2 * 2**30  # one file of RUN_DIR/hf/ holds at most this much (HF's own layout: files + index)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsStream:
    """One safetensors file written a piece at a time: the header (every offset known from the `entries`' name,
    dtype and shape) first, then each tensor's bytes as they come, whole or a block of rows at a time, each at
    its place. Written to a temporary name, fsynced and renamed by `close`, which checks that every byte of
    every declared tensor was written once: readers see no file or the whole one."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, dtype, shape in entries:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp")
        start = 8 + len(encoded)
        self.places = {name: (start + header[name]["data_offsets"][0], math.prod(shape[1:]) * dtype.itemsize)
                       for name, dtype, shape in entries}  # name -> (where its bytes start, bytes per row)
        self.missing = {name: header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
                        for name, _, _ in entries}
        self.fh = open(self.tmp, "wb")
        self.fh.write(len(encoded).to_bytes(8, "little") + encoded)

    def write(self, name: str, tensor: torch.Tensor, first_row: int = 0) -> None:
        """`tensor`: the whole of `name`, or its rows from `first_row` on."""
        if name not in self.places:
            raise ValueError(f"{self.path}: {name} was not declared")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.missing[name] -= data.nbytes
        if self.missing[name] < 0:
            raise ValueError(f"{self.path}: more bytes written for {name} than its shape holds")
        start, row_bytes = self.places[name]
        self.fh.seek(start + first_row * row_bytes)
        self.fh.write(memoryview(data))  # (no copy of the bytes)

    def close(self) -> None:
        unwritten = [name for name, left in self.missing.items() if left]
        if unwritten:
            raise ValueError(f"{self.path}: {len(unwritten)} declared tensors not wholly written ({unwritten[0]}, ...)")
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)


def row_blocks(tensor: torch.Tensor, is_main: bool) -> Iterator[tuple[int, torch.Tensor]]:
    """The whole of `tensor` on rank 0 as (first row, rows) blocks, every rank's part of a tensor sharded by rows
    over a 1-D mesh (FSDP2's, parallel/vocab.py's) received from it in turn; anything else gathered whole. Other
    ranks send their part and get nothing. All ranks, in the same order of tensors."""
    if not (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tensor.placements == (Shard(0),)):
        full = whole_on_cpu(tensor)
        if is_main:
            yield 0, full
        return
    mesh = tensor.device_mesh
    group, me, local = mesh.get_group(), mesh.get_local_rank(), tensor.to_local().detach()
    if local.device.type != mesh.device_type:  # offloaded rows (--cpu_offload) travel on the group's device
        local = local.to(mesh.device_type)
    main = dist.get_global_rank(group, 0)
    if main != 0 and not is_main:  # another copy of it: under --tp each rank of a group holds one, rank 0's is written
        return
    for rank in range(mesh.size()):
        rows = chunk_rows(tensor.shape[0], mesh.size(), rank)
        if rows.start == rows.stop:
            continue
        if rank == me and is_main:
            yield rows.start, local
        elif is_main:
            block = local.new_empty((rows.stop - rows.start, *tensor.shape[1:]))
            dist.recv(block, src=dist.get_global_rank(group, rank), group=group)
            yield rows.start, block
        elif rank == me:
            dist.send(local.contiguous(), dst=main, group=group)


def write_streamed(module: nn.Module, path: Path, metadata: dict[str, str], is_main: bool,
                   hf_dir: Path | None = None) -> None:
    """The whole model's state_dict into `path` (one safetensors file, every name; a tied tensor under each of
    its names, as `format.safetensors_bytes` writes it) and, with `hf_dir`, into HF's sharded layout there
    (`model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`; a tied tensor under its first name,
    as save_pretrained writes it). Rank 0 writes each tensor as it comes, a tensor sharded by rows a rank's rows
    at a time (`row_blocks`): no rank holds more than one other rank's part of a tensor. All ranks."""
    state = module.state_dict(keep_vars=True)  # the tensors themselves: a tie is one object under two names
    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}
    by_tensor: dict[int, tuple[list[str], torch.Tensor]] = {}  # a tied tensor: gathered once, all its names
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), ([], tensor))[0].append(name)
    del state
    first_names = [names[0] for names, _ in by_tensor.values()]
    main = hf = None
    hf_files: dict[str, str] = {}
    if is_main:
        main = SafetensorsStream(path, [(n, *shapes[n]) for names, _ in by_tensor.values() for n in names], metadata)
        if hf_dir is not None:
            hf_dir.mkdir(parents=True, exist_ok=True)
            groups, size = [[]], 0
            for name in first_names:
                nbytes = math.prod(shapes[name][1]) * shapes[name][0].itemsize
                if groups[-1] and size + nbytes > HF_SHARD_BYTES:
                    groups.append([])
                    size = 0
                groups[-1].append(name)
                size += nbytes
            total = len(groups)
            files = [f"model-{k + 1:05d}-of-{total:05d}.safetensors" for k in range(total)]
            hf_files = {name: file for group, file in zip(groups, files) for name in group}
            index = {"metadata": {"total_size": sum(math.prod(s) * d.itemsize for d, s in
                                                    (shapes[n] for n in first_names))},
                     "weight_map": dict(sorted(hf_files.items()))}
            for stale in hf_dir.glob("model*.safetensors*"):  # an earlier layout's files would shadow the index
                stale.unlink()
            hf = {file: SafetensorsStream(hf_dir / file, [(n, *shapes[n]) for n in group], {"format": "pt"})
                  for group, file in zip(groups, files)}
    for names, tensor in by_tensor.values():
        for first_row, block in row_blocks(tensor, is_main):
            for name in names:
                main.write(name, block, first_row)
            if hf is not None:
                hf[hf_files[names[0]]].write(names[0], block, first_row)
            del block
    if main is not None:
        main.close()
    if hf is not None:
        for stream in hf.values():
            stream.close()
        write_index = hf_dir / "model.safetensors.index.json"
        tmp = write_index.with_name(f".{write_index.name}.tmp")
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, write_index)
