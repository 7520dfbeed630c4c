"""Committed checkpoint directories: write, verify, choose, load, retain.

Layout of one checkpoint, ``checkpoints/step-<N>/``::

    model.safetensors   model weights and buffers (safetensors: no code can hide in it)
    optimizer.pt        optimizer state, loaded with torch.load(weights_only=True)
    trainer.pt          LR scheduler, GradScaler, every rank's RNG states, log window (weights_only)
    manifest.json       written last: step, epoch, data cursor, world size, config, versions,
                        sha256 and size of every file. A directory is committed iff it has one.

Rank 0 writes every file (DDP keeps model and optimizer identical on all ranks; the other ranks' RNG
states are gathered to it), so the commit is one rename on one host. All ranks then agree on the outcome
before anyone moves on: a failure anywhere makes every rank raise the same error.
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
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import safetensors.torch
import torch
import torch.distributed as dist

import ddptrain
from ddptrain.distributed import DistributedContext
from ddptrain.errors import TrainingError, UsageError
from ddptrain.faults import FaultInjector

FORMAT = "ddptrain-checkpoint/1"
MANIFEST = "manifest.json"
ABANDONED = "abandoned"  # checkpoints of lines a run did not continue, moved aside by `start_line`
_STEP_DIR = re.compile(r"^step-(\d+)$")
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
    """Everything a checkpoint holds, as produced by the trainer (tensors may still be live)."""

    position: Position
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]  # scheduler, scaler, log window; "rng" (list by rank) is added here
    config: dict[str, Any]
    origin: str = ""  # see CheckpointManager.origin


@dataclass
class Loaded:
    path: Path
    manifest: dict[str, Any]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]

    @property
    def position(self) -> Position:
        m = self.manifest
        return Position(m["step"], m["epoch"], m["cursor"], m["global_batch_size"], m["world_size"])


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


def _cpu_copy(obj: Any, reuse: Any = None) -> Any:
    """A deep copy with every tensor detached onto the CPU (for async saves: training mutates the originals).

    Tensors of `reuse` (an earlier copy of the same structure, no longer read) that match in shape and dtype
    are copied into instead of allocated: touching fresh memory costs several times the copy itself.
    """
    if isinstance(obj, torch.Tensor):
        if (isinstance(reuse, torch.Tensor) and reuse.device.type == "cpu" and reuse.shape == obj.shape
                and reuse.dtype == obj.dtype):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _cpu_copy(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(_cpu_copy(v, r) for v, r in zip(obj, old))
    return obj


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


def committed_steps(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of committed checkpoints, newest first. Partial directories are not listed."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def versions() -> dict[str, str]:
    return {"torch": torch.__version__, "python": platform.python_version(), "ddptrain": ddptrain.__version__}


def write_checkpoint(directory: Path, snap: Snapshot, injector: FaultInjector | None = None) -> Path:
    """Write and commit `snap` as directory/step-N. Rank 0 only. Raises on any failure, leaving no manifest."""
    step = snap.position.step
    target = directory / f"step-{step}"
    if target.exists():  # a partial leftover of a crash (committed ones are never rewritten)
        shutil.rmtree(target)
    target.mkdir(parents=True)
    payloads = {
        "model.safetensors": safetensors_bytes(snap.model, metadata={"step": str(step)}),
        "optimizer.pt": _torch_bytes(snap.optimizer),
        "trainer.pt": _torch_bytes(snap.trainer),
    }
    files = {}
    for name, data in payloads.items():
        write_atomic(target / name, data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    if injector is not None:
        injector.during_save(step)
    pos = snap.position
    manifest = {
        "format": FORMAT, "step": step, "epoch": pos.epoch, "cursor": pos.cursor,
        "global_batch_size": pos.global_batch_size, "world_size": pos.world_size,
        "created": time.time(), "versions": versions(), "config": snap.config, "files": files,
        "origin": snap.origin,
    }
    write_atomic(target / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _fsync_dir(target)
    _fsync_dir(directory)
    if injector is not None:
        injector.after_commit(step, target)
    return target


def _read_verified(path: Path, entry: dict[str, Any]) -> bytes:
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing")
    data = path.read_bytes()
    if len(data) != entry["size"]:
        raise CheckpointError(f"{path.name} has {len(data)} bytes, manifest says {entry['size']} (truncated?)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path.name} fails its sha256 check (corrupted)")
    return data


def _safe_torch_load(data: bytes, name: str, device: torch.device) -> Any:
    """torch.load restricted to tensors and plain containers: a pickle that names any other callable is
    refused before anything runs."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes from the restricted unpickler are not news
            return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as exc:  # UnpicklingError for a hostile or foreign pickle, and any decode error
        text = str(exc)
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", text)  # torch < 2.13, torch >= 2.13
        why = (f"it references {found.group(1)}, which a checkpoint never needs" if found
               else (text.strip().splitlines() or [type(exc).__name__])[0])
        raise CheckpointError(f"{name} refused by the safe loader: {why}") from None


def read_checkpoint(path: Path, device: torch.device) -> Loaded:
    """Verify every file against the manifest and deserialize without executing code from the files."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError("no manifest.json: the checkpoint never committed")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"manifest.json is not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"manifest format {manifest.get('format')!r} is not {FORMAT!r}")
    files = manifest["files"]
    for name in ("model.safetensors", "optimizer.pt", "trainer.pt"):
        if name not in files:
            raise CheckpointError(f"manifest lists no {name}")
    blobs = {name: _read_verified(path / name, entry) for name, entry in files.items()}
    try:
        model = safetensors.torch.load(blobs["model.safetensors"])
    except Exception as exc:
        raise CheckpointError(f"model.safetensors does not parse: {exc}") from None
    return Loaded(path=path, manifest=manifest, model=model,
                  optimizer=_safe_torch_load(blobs["optimizer.pt"], "optimizer.pt", device),
                  trainer=_safe_torch_load(blobs["trainer.pt"], "trainer.pt", torch.device("cpu")))


# --- the manager: save agreement, async writer, retention, resume choice -------------------------

class CheckpointManager:
    """Saves and resumes through committed directories. Methods marked 'all ranks' are collective."""

    def __init__(self, ctx: DistributedContext, directory: Path, keep_last: int, async_save: bool,
                 timeout_s: float, injector: FaultInjector | None = None):
        self.ctx, self.directory, self.keep_last, self.timeout_s = ctx, directory, keep_last, timeout_s
        self.async_save, self.injector = async_save, injector
        self._thread: threading.Thread | None = None
        self._async_error: str | None = None
        self._staging: Any = None  # the last async save's CPU copy: its memory is reused by the next one
        self.last_saved_step = -1
        self.origin = ""  # the --resume_from checkpoint that started this run's line, recorded in manifests

    def save(self, position: Position, make_snapshot: Callable[[], Snapshot], rng_state: dict[str, Any]) -> None:
        """Gather every rank's RNG state, write and commit on rank 0, agree on the outcome. All ranks.

        `make_snapshot` runs on rank 0 only. With async saves the state is copied to the CPU here, on the
        training thread, and written by a background thread; the next save (or `wait`) reports its fate.
        """
        self.wait()  # one save in flight at most; also surfaces a failed background write
        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, rng_state, group=self.ctx.control_group)
        error = None
        if self.ctx.is_main:
            try:
                snap = make_snapshot()
                snap.trainer = {**snap.trainer, "rng": gathered}
                snap.origin = self.origin
                if self.async_save:
                    # wait() above joined the previous writer, so its staging copy is free to overwrite.
                    self._staging = _cpu_copy((snap.model, snap.optimizer, snap.trainer), self._staging)
                    snap = Snapshot(snap.position, *self._staging, snap.config, snap.origin)
                    self._thread = threading.Thread(target=self._write_in_background, args=(snap,),
                                                    name="ddptrain-checkpoint-writer", daemon=True)
                    self._thread.start()
                else:
                    error = self._write_and_retain(snap)
            except Exception as exc:  # a failure before writing: still every rank's error
                error = f"{type(exc).__name__}: {exc}"
        self.last_saved_step = position.step
        self._agree(error, position.step)

    def wait(self) -> None:
        """Block until a background save has finished; raise its error on every rank. All ranks."""
        if not self.async_save:
            return
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._async_error = self._async_error, None
        self._agree(error, self.last_saved_step)

    def _agree(self, error: str | None, step: int) -> None:
        # The other ranks wait here while rank 0 serialises, hashes and writes: that takes its own limit,
        # not the collective timeout meant for a training step.
        with self.ctx.collective_timeout(self.timeout_s):
            error = self.ctx.broadcast_object(error)
        if error is not None:
            raise TrainingError(f"checkpoint of step {step} failed on rank 0 ({self.ctx.hosts[0]}): {error}")

    def _write_in_background(self, snap: Snapshot) -> None:
        self._async_error = self._write_and_retain(snap)

    def _write_and_retain(self, snap: Snapshot) -> str | None:
        """Rank 0: write, commit, purge. Returns the failure as one line, or None."""
        started = time.perf_counter()
        try:
            path = write_checkpoint(self.directory, snap, self.injector)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.error("checkpoint of step %d not committed: %s", snap.position.step, message)
            return message
        log.info("checkpoint committed: %s (%.2f s)", path, time.perf_counter() - started)
        self.purge(keep_step=snap.position.step)
        return None

    def purge(self, keep_step: int) -> None:
        """Delete committed checkpoints beyond `keep_last` and stale partial dirs. Rank 0; never raises.

        Only this run's line is in the directory (`start_line` moved any other aside), so the newest
        `keep_last` are the ones to keep; the one just committed (`keep_step`) is never deleted.
        """
        if self.keep_last <= 0:
            return
        committed = committed_steps(self.directory)
        doomed = [p for step, p in committed[self.keep_last:] if step != keep_step]
        newest = committed[0][0] if committed else keep_step
        for child in self.directory.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and int(match.group(1)) < newest and not (child / MANIFEST).exists():
                doomed.append(child)
        for path in doomed:
            try:
                shutil.rmtree(path)
            except OSError as exc:
                log.warning("could not delete old checkpoint %s (%s); training continues", path, exc)

    def start_line(self, loaded: Loaded | None) -> None:
        """Move aside the committed checkpoints this run does not continue from. All ranks (rank 0 moves, every
        rank learns the outcome).

        After resuming from step S (or starting fresh, S = 0), checkpoints of steps after S belong to an
        abandoned line: left in place, retention would keep them over the new line's saves and a later
        auto-resume would pick them. They go to `abandoned/<time>-at-step-S/`, never deleted.
        """
        error = None
        if self.ctx.is_main:
            try:
                self._move_aside(loaded)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = self.ctx.broadcast_object(error)
        if error is not None:
            raise TrainingError(f"could not move the checkpoints of an abandoned line aside in {self.directory} "
                                f"on rank 0 ({self.ctx.hosts[0]}): {error}")

    def _move_aside(self, loaded: Loaded | None) -> None:
        start_step, start_path = (loaded.position.step, loaded.path.resolve()) if loaded else (0, None)
        stale = [p for step, p in committed_steps(self.directory)
                 if step > start_step or (step == start_step and p.resolve() != start_path)]
        if not stale:
            return
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-at-step-{start_step}"
        aside = self.directory / ABANDONED / stamp
        for attempt in range(1, 1000):  # two starts in one second: never merge into an earlier line's dir
            if not aside.exists():
                break
            aside = self.directory / ABANDONED / f"{stamp}-{attempt}"
        aside.mkdir(parents=True)
        for path in stale:
            path.rename(aside / path.name)
        log.warning("%s: %s belong to another line of training than this run's start (step %d); "
                    "moved to %s", self.directory, ", ".join(p.name for p in stale), start_step, aside)

    def resume(self, explicit: str, model_state: dict[str, torch.Tensor], continue_line: bool = True) -> Loaded | None:
        """The newest checkpoint that loads on every rank, or None for a fresh start. All ranks.

        `explicit` (--resume_from) chooses where the run's line starts: the first attempt loads it (or
        fails with a UsageError); later attempts of the same run (an elastic restart, a requeue, the same
        command again) find the line's own newer checkpoints first and continue from the newest, unless
        `continue_line` is False (--no-auto_resume: `explicit` then starts a new line). Otherwise
        committed checkpoints in the directory are tried newest first. An unusable one is reported (path,
        reason) and the previous one is tried; committed checkpoints that all fail are an error, never a
        silent fresh start.
        """
        origin = str(Path(explicit).resolve()) if explicit else ""
        listing = None
        if self.ctx.is_main:
            listing = [str(p) for _, p in committed_steps(self.directory)
                       if not explicit or (continue_line and read_origin(p) == origin)]
        candidates = [Path(p) for p in self.ctx.broadcast_object(listing)]  # one view for all ranks
        if explicit:
            if candidates and self.ctx.is_main:
                log.info("--resume_from %s started this run; an earlier attempt committed %s: continuing "
                         "from the newest", explicit, ", ".join(p.name for p in candidates))
            candidates.append(Path(explicit))
        reasons = []
        for path in candidates:
            loaded, reason = None, None
            try:
                loaded = read_checkpoint(path, self.ctx.device)
                _check_fits(loaded.model, model_state)
            except CheckpointError as exc:
                reason = str(exc)
            except Exception as exc:  # I/O errors and the like: still a reason, not a crash
                reason = f"{type(exc).__name__}: {exc}"
            failures: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(failures, reason, group=self.ctx.control_group)
            bad = [(r, why) for r, why in enumerate(failures) if why is not None]
            if not bad:
                log.info("resuming from %s (step %d)", path, loaded.manifest["step"])
                self.origin = origin or loaded.manifest.get("origin", "")
                return loaded
            rank, why = bad[0]
            reasons.append(f"{path}: {why} (rank {rank})")
            if self.ctx.is_main:
                log.warning("checkpoint %s unusable on rank %d: %s; falling back to the previous committed one",
                            path, rank, why)
        if explicit:
            raise UsageError(f"--resume_from {explicit}: {reasons[-1].split(': ', 1)[1]}")
        if reasons:
            raise UsageError(f"no usable checkpoint in {self.directory}: {'; '.join(reasons)}. Move them away, "
                             "or start fresh with --no-auto_resume or another --run_dir")
        return None


def read_origin(path: Path) -> str | None:
    """The `--resume_from` checkpoint that started the line `path` belongs to ("" for none; None if unreadable)."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("origin", "")
    except (OSError, ValueError):
        return None


def continues_line(directory: Path, explicit: str) -> bool:
    """Whether `directory` holds a committed checkpoint of the line that `--resume_from explicit` started."""
    origin = str(Path(explicit).resolve())
    return any(read_origin(p) == origin for _, p in committed_steps(directory))


def _check_fits(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    if missing or extra:
        raise CheckpointError(f"model weights do not match this --model (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
    for key, tensor in current.items():
        if tuple(saved[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"model weight {key} has shape {tuple(saved[key].shape)}, this model "
                                  f"needs {tuple(tensor.shape)}")
