"""Committed checkpoint directories: the files, their manifest, writing, verifying and safe loading.

Layout of one checkpoint, ``checkpoints/step-<N>/``, under every strategy::

    shards/             model and optimizer state, written by DCP (shards.py): each rank writes its part,
                        a tensor every rank holds whole (ddp's replicas) is written once, by one of them
    trainer.pt          LR scheduler, GradScaler, the optimizer's param_groups, each rank's RNG states,
                        metric window and stream position
    manifest.json       written last, by rank 0 once every rank reported its files written: step, epoch, data
                        cursor, world size, config, versions, sha256 and size of every file (``"layout":
                        "sharded"``). A directory is committed iff it has one.

All ranks then agree on the outcome before anyone moves on: a failure anywhere makes every rank raise the same
error (manager.py).

A ddp run's checkpoints written before the single write path (issue 38) have the full layout instead of
shards/: ``model.safetensors`` (safetensors: no code can hide in it) and ``optimizer.pt`` (read with
torch.load(weights_only=True)), both written by rank 0 (manifest ``"layout": "full"``, or none). They are
still read (read.py) under any strategy, and exported.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import safetensors.torch
import torch
from safetensors import safe_open

import ddptrain
from ddptrain.config import setting_changes, to_toml
from ddptrain.errors import UsageError
from ddptrain.faults import FaultInjector
from ddptrain.parallel.materialize import read_rows
from ddptrain.settings import FIELDS

FORMAT = "ddptrain-checkpoint/1"
MANIFEST = "manifest.json"
ABANDONED = "abandoned"  # checkpoints of lines a run did not continue, moved aside by `start_line`
STEP_DIR = re.compile(r"^step-(\d+)$")
BEST = "best"  # --keep_best: the checkpoint with the best eval metric, apart from retention
BEST_ABOUT = "best.json"  # in best/: which step, metric and weights (trained or ema) it is the best of
PEER_FAILED = "a peer's write failed (it says why)"  # a rank's save error when the cause was another rank's
log = logging.getLogger("ddptrain")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the message is one line saying why."""


@dataclass
class Position:
    """Where training stands: optimizer steps done, epoch, samples of this epoch's order consumed."""

    step: int
    epoch: int
    cursor: int
    global_batch_size: int
    world_size: int


@dataclass
class Snapshot:
    """Everything a checkpoint holds, as one rank produced it (tensors may still be live)."""

    position: Position
    shards: dict[str, Any]  # this rank's model and optimizer state, as DCP writes it (shards.py)
    trainer: dict[str, Any]  # scheduler, scaler, log window; "rng" (list by rank) is added here
    config: dict[str, Any]
    origin: str = ""  # see CheckpointManager.origin


class MappedWeights(Mapping):
    """The tensors of a verified model.safetensors, read from the file when asked for: a whole tensor by name
    (`weights[name]`, a copy), or only the rows of one (`rows`) — what a rank of a sharded run needs of a full
    checkpoint, so that no rank reads or holds the whole model."""

    def __init__(self, path: Path):
        try:
            self._file = safe_open(str(path), framework="pt")
        except Exception as exc:
            raise CheckpointError(f"{path.name} does not parse: {exc}") from None
        self._names = list(self._file.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._file.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self._file.get_slice(name).get_shape()) for name in self._names}

    def rows(self, name: str, rows: slice) -> torch.Tensor:
        """Rows `rows` (dim 0) of tensor `name`, read alone; a 0-d tensor whole."""
        return read_rows(self._file.get_slice(name), rows)


@dataclass
class Loaded:
    """A verified checkpoint: `shards`, the DCP metadata that `shards.load_into` reads the tensors through onto
    whatever layout the run has, or (an earlier version's full layout) whole `model` and `optimizer` state
    dicts."""

    path: Path
    manifest: dict[str, Any]
    model: dict[str, torch.Tensor] | MappedWeights | None
    optimizer: dict[str, Any] | None
    trainer: dict[str, Any]
    shards: Any = None  # torch.distributed.checkpoint.metadata.Metadata of a sharded checkpoint

    @property
    def position(self) -> Position:
        m = self.manifest
        return Position(m["step"], m["epoch"], m["cursor"], m["global_batch_size"], m["world_size"])

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every model tensor, without reading a sharded or mapped checkpoint's tensors."""
        if isinstance(self.model, MappedWeights):
            return self.model.shapes()
        if self.model is not None:
            return {k: tuple(v.shape) for k, v in self.model.items()}
        return {k[len("model."):]: tuple(v.size) for k, v in self.shards.state_dict_metadata.items()
                if k.startswith("model.") and hasattr(v, "size")}


# --- files ---------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """tmp -> fsync -> rename: readers see the old file or the whole new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def safetensors_bytes(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A state dict as safetensors bytes, tensors on the CPU and contiguous.

    safetensors refuses two names for one memory, which is what tied weights are (an embedding shared with
    the output layer): the second name gets its own copy, so any `load_state_dict` reads the file as is.
    """
    seen: set[int] = set()
    tensors = {}
    for name, value in state.items():
        value = value.detach().to("cpu").contiguous()
        memory = value.untyped_storage().data_ptr()
        tensors[name] = value.clone() if memory in seen else value
        seen.add(memory)
    return safetensors.torch.save(tensors, metadata=metadata)


def keep_as_best(directory: Path, step_dir: Path, about: dict[str, Any]) -> Path:
    """Make DIRECTORY/best a copy of the committed checkpoint `step_dir`, by hard links (a committed checkpoint's
    files are never written again; a copy where links are refused), with `about` as best/best.json (which
    metric chose it, its value, whose weights: "trained" or "ema"). Retention deletes step dirs, not best/.
    A reader sees the old best/ or the new one, or, after a crash between the two renames, none and a
    .best.old beside it."""
    tmp, old, best = directory / f".{BEST}.tmp", directory / f".{BEST}.old", directory / BEST
    _remove(tmp)  # an earlier attempt's leftover, whatever it is
    for source in sorted(step_dir.rglob("*")):
        target = tmp / source.relative_to(step_dir)
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
    if not (tmp / MANIFEST).is_file():
        raise CheckpointError(f"{step_dir} is not a committed checkpoint (no {MANIFEST})")
    (tmp / BEST_ABOUT).write_text(json.dumps(about, indent=1) + "\n")
    _remove(old)
    if best.exists():
        best.rename(old)
    tmp.rename(best)
    _remove(old)
    return best


def _remove(path: Path) -> None:
    """Delete `path`, a directory tree or a file, if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def read_json(path: Path) -> Any:
    """The JSON file at `path`, or None where there is none readable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_manifest(path: Path) -> dict[str, Any] | None:
    """`path`'s manifest, or None where it has none readable."""
    return read_json(path / MANIFEST)


def manifest_step(path: Path) -> int | None:
    """The step in `path`'s manifest, or None where it has none readable."""
    manifest = read_manifest(path)
    return manifest.get("step") if isinstance(manifest, dict) else None


def committed_steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of committed checkpoints, newest first. Partial directories are not listed."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def versions() -> dict[str, str]:
    return {"torch": torch.__version__, "python": platform.python_version(), "ddptrain": ddptrain.__version__}


def commit(directory: Path, snap: Snapshot, files: dict[str, dict[str, Any]],
           injector: FaultInjector | None = None) -> None:
    """Write step-N's manifest (the commit) once every file in `files` (name -> sha256, size) is on disk."""
    step, pos = snap.position.step, snap.position
    target = directory / f"step-{step}"
    if injector is not None:
        injector.during_save(step)
    manifest = {
        "format": FORMAT, "step": step, "epoch": pos.epoch, "cursor": pos.cursor,
        "global_batch_size": pos.global_batch_size, "world_size": pos.world_size,
        "created": time.time(), "versions": versions(), "config": snap.config, "files": files,
        "origin": snap.origin, "layout": "sharded",
    }
    write_atomic(target / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _fsync_dir(target)
    _fsync_dir(directory)
    if injector is not None:
        injector.after_commit(step, target)


def prepare_step_dir(directory: Path, step: int) -> Path:
    """An empty step-N directory (a partial leftover of a crash is removed: committed ones never are).

    A committed step-N here is another line's or another job's (this run moved its own later ones aside when
    it started): raise CheckpointError naming it rather than destroy it.
    """
    target = directory / f"step-{step}"
    if (target / MANIFEST).exists():
        raise CheckpointError(f"{target} is a committed checkpoint that this run did not start from; "
                              "refusing to overwrite it (is another job writing into this checkpoint dir?)")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    return target


def file_digest(path: Path) -> dict[str, Any]:
    """sha256 and size of a file, read in chunks (shard files can be large)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "size": size}


def _read_verified(path: Path, entry: dict[str, Any], name: str = "") -> bytes:
    name = name or path.name
    if not path.is_file():
        raise CheckpointError(f"{name} is missing")
    data = path.read_bytes()
    if len(data) != entry["size"]:
        raise CheckpointError(f"{name} has {len(data)} bytes, manifest says {entry['size']} (truncated?)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{name} fails its sha256 check (corrupted)")
    return data


def _verify_file(path: Path, entry: dict[str, Any], name: str) -> None:
    if not path.is_file():
        raise CheckpointError(f"{name} is missing")
    found = file_digest(path)
    if found["size"] != entry["size"]:
        raise CheckpointError(f"{name} has {found['size']} bytes, manifest says {entry['size']} (truncated?)")
    if found["sha256"] != entry["sha256"]:
        raise CheckpointError(f"{name} fails its sha256 check (corrupted)")


def _safe_torch_load(data: bytes | Path, name: str, device: torch.device) -> Any:
    """torch.load restricted to tensors and plain containers: a pickle that names any other callable is
    refused before anything runs. From a path (verified already), the tensors map the file (copy-on-write):
    their bytes are read when touched, so a caller that slices a tensor reads only the slice."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes from the restricted unpickler are not news
            if isinstance(data, Path):
                return torch.load(data, map_location=device, weights_only=True, mmap=True)
            return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as exc:  # UnpicklingError for a hostile or foreign pickle, and any decode error
        text = str(exc)
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", text)  # torch < 2.13, torch >= 2.13
        why = (f"it references {found.group(1)}, which a checkpoint never needs" if found
               else (text.strip().splitlines() or [type(exc).__name__])[0])
        raise CheckpointError(f"{name} refused by the safe loader: {why}") from None


def read_origin(path: Path) -> str | None:
    """The `--resume_from` checkpoint that started the line `path` belongs to ("" for none; None if unreadable)."""
    manifest = read_manifest(path)
    return manifest.get("origin", "") if isinstance(manifest, dict) else None


def continues_line(directory: Path, explicit: str) -> bool:
    """Whether `directory` holds a committed checkpoint of the line that `--resume_from explicit` started."""
    origin = str(Path(explicit).resolve())
    return any(read_origin(p) == origin for _, p in committed_steps(directory))


def resume_changes(cfg: Any) -> tuple[Path | None, list[str]]:
    """(the checkpoint a start of `cfg` would resume from, the training settings it was saved under that `cfg`
    changes): read from the files alone, before any process writes into the run dir. Auto-resume's newest
    committed checkpoint, or --resume_from's; (None, []) for a fresh start."""
    newest = committed_steps(cfg.checkpoint_path)
    if cfg.resume_from and Path(cfg.resume_from).is_dir():
        origin = str(Path(cfg.resume_from).resolve())
        line = [p for _, p in newest if read_origin(p) == origin] if cfg.auto_resume else []
        path = line[0] if line else Path(cfg.resume_from)  # a later attempt continues the line it started
    elif cfg.auto_resume and newest:
        path = newest[0][1]
    else:
        return None, []
    saved = _saved_config(path)
    return path, setting_changes(saved, cfg.to_dict()) if saved is not None else []


def _saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config a checkpoint was saved under, or None where its manifest cannot be read (resume's own checks
    say why, or fall back)."""
    try:
        return json.loads((checkpoint / MANIFEST).read_text()).get("config", {})
    except (OSError, ValueError):
        return None


def settle_settings(cfg: Any) -> dict[str, Any]:
    """The job's settings, once per job, by the process that outlives its workers' restarts (a local launcher,
    else rank 0): keep what a resumed run trained with where the task's defaults decided (`keep_trained_with`),
    refuse settings that changed since the checkpoint this run resumes, then write config.toml. Returns the
    settings the defaults decided, as kept (for the ranks that did not read them)."""
    keep_trained_with(cfg)
    refuse_changed_settings(cfg)
    write_resolved(cfg, Path(cfg.run_dir))
    return {name: getattr(cfg, name) for name in getattr(cfg, "by_task", ())}


def keep_trained_with(cfg: Any) -> None:
    """A run resumed goes on with what it trained with where no flag, file or argument set it and the task's
    defaults decided (`TrainConfig.by_task`, which a newer ddptrain may decide otherwise): those settings are the
    checkpoint's (a setting it predates, its declared default then)."""
    path, _ = resume_changes(cfg)
    saved = _saved_config(path) if path is not None and getattr(cfg, "by_task", ()) else None
    if saved is None:
        return
    for name in cfg.by_task:
        setattr(cfg, name, saved.get(name, FIELDS[name].default))


def refuse_changed_settings(cfg: Any) -> None:
    """UsageError if `cfg` would resume a checkpoint trained with other training settings and does not say
    --accept_config_change. Before anything is written into the run dir."""
    path, changes = resume_changes(cfg)
    if changes and not cfg.accept_config_change:
        raise UsageError(changed_settings_error(path, changes))


def changed_settings_error(path: Path, changes: list[str]) -> str:
    return (f"{path} was trained with other settings ({'; '.join(changes)}): resume with the settings it was "
            "trained with, start fresh with --no-auto_resume or another --run_dir, or pass "
            "--accept_config_change to continue it with the new ones")


def write_resolved(cfg: Any, run_dir: Path) -> Path:
    """RUN_DIR/config.toml, the resolved config, written atomically; once per run, by one process, after the
    resume check: a run that goes on from a checkpoint with changed training settings (--accept_config_change)
    keeps the config those weights were trained with as config-until-step-N.toml."""
    path = run_dir / "config.toml"
    checkpoint, changes = resume_changes(cfg)
    if changes and path.is_file():
        step = json.loads((checkpoint / "manifest.json").read_text())["step"]
        path.replace(run_dir / f"config-until-step-{step}.toml")
    write_atomic(path, to_toml(cfg).encode())
    return path
