"""The checkpoint manager: every rank agrees on each save's outcome, one save in flight (async writer),
retention of the run's own line, and which checkpoint a run resumes from.

Methods marked "all ranks" are collective. The files themselves are checkpoint.py's.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddptrain import shards
from ddptrain.checkpoint import (ABANDONED, MANIFEST, STEP_DIR, CheckpointError, Loaded, Position, Snapshot,
                                 _torch_bytes, commit, committed_steps, cpu_copy, file_digest, prepare_step_dir,
                                 read_checkpoint, read_origin, write_atomic, write_checkpoint)
from ddptrain.distributed import DistributedContext
from ddptrain.errors import TrainingError, UsageError
from ddptrain.faults import FaultInjector

log = logging.getLogger("ddptrain")


class CheckpointManager:
    """Saves and resumes through committed directories. Methods marked 'all ranks' are collective."""

    def __init__(self, ctx: DistributedContext, directory: Path, keep_last: int, async_save: bool,
                 timeout_s: float, injector: FaultInjector | None = None, sharded: bool = False):
        self.ctx, self.directory, self.keep_last, self.timeout_s = ctx, directory, keep_last, timeout_s
        self.async_save, self.injector, self.sharded = async_save, injector, sharded
        self._group: dist.ProcessGroup | None = None
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
        if self.sharded:
            return self._save_sharded(position, make_snapshot, gathered)
        error = None
        if self.ctx.is_main:
            try:
                snap = make_snapshot()
                snap.trainer = {**snap.trainer, "rng": gathered}
                snap.origin = self.origin
                if self.async_save:
                    # wait() above joined the previous writer, so its staging copy is free to overwrite.
                    self._staging = cpu_copy((snap.model, snap.optimizer, snap.trainer), self._staging)
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

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group sharded saves and loads plan over, apart from the training thread's groups (an async
        save's collectives run in the background). Created on first use, which is on all ranks."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._group

    def _save_sharded(self, position: Position, make_snapshot: Callable[[], Snapshot], rng: list[Any]) -> None:
        """Every rank writes its shards (DCP); rank 0 commits once all reported theirs written. All ranks."""
        error = None
        if self.ctx.is_main:
            try:
                prepare_step_dir(self.directory, position.step)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        self._agree(error, position.step)  # rank 0's verdict; also: nobody writes into a dir being cleaned
        snap = make_snapshot()
        snap.trainer = {**snap.trainer, "rng": rng}
        snap.origin = self.origin
        target = self.directory / f"step-{position.step}"
        error = None
        try:
            written = shards.save(target, snap.shards, self.group, self.async_save)
        except Exception as exc:  # DCP's collective save raises the same error on every rank
            written, error = None, f"{type(exc).__name__}: {exc}"
        if written is not None and self.async_save:
            def commit_in_background() -> None:
                self._async_error = self._commit_shards(written, snap, target)

            self._thread = threading.Thread(target=commit_in_background, name="ddptrain-checkpoint-commit",
                                            daemon=True)
            self._thread.start()
        elif written is not None:
            error = self._commit_shards(written, snap, target)
        self.last_saved_step = position.step
        self._agree(error, position.step)

    def _commit_shards(self, written: Any, snap: Snapshot, target: Path) -> str | None:
        """Each rank hashes its own files once written and reports to rank 0, which writes trainer.pt and the
        manifest only if every rank succeeded. All ranks; returns rank 0's verdict (None on the others)."""
        started = time.perf_counter()
        try:
            written.result()
            report: Any = shards.own_files(target, self.ctx.rank)
        except Exception as exc:
            report = f"{type(exc).__name__}: {exc}"
        reports: list[Any] = [None] * self.ctx.world_size
        dist.gather_object(report, reports if self.ctx.is_main else None, dst=0, group=self.group)
        if not self.ctx.is_main:
            return None
        failed = [f"rank {r} ({self.ctx.hosts[r]}): {why}" for r, why in enumerate(reports) if isinstance(why, str)]
        try:
            if failed:
                raise RuntimeError(failed[0])
            files = {name: digest for report in reports for name, digest in report.items()}
            write_atomic(target / "trainer.pt", _torch_bytes(snap.trainer))
            files["trainer.pt"] = file_digest(target / "trainer.pt")
            commit(self.directory, snap, files, self.injector, layout="sharded")
        except Exception as exc:
            message = str(exc) if failed else f"{type(exc).__name__}: {exc}"
            log.error("checkpoint of step %d not committed: %s", snap.position.step, message)
            return message
        log.info("checkpoint committed: %s (%d shard files, %.2f s)", target, len(files) - 1,
                 time.perf_counter() - started)
        self.purge(keep_step=snap.position.step)
        return None

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
            match = STEP_DIR.match(child.name)
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
                loaded = read_checkpoint(path, self.ctx.device, share=(self.ctx.rank, self.ctx.world_size))
                _check_fits(loaded.weight_shapes(), model_state)
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


def _check_fits(saved: dict[str, tuple[int, ...]], current: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    if missing or extra:
        raise CheckpointError(f"model weights do not match this --model (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
    for key, tensor in current.items():
        if saved[key] != tuple(tensor.shape):
            raise CheckpointError(f"model weight {key} has shape {saved[key]}, this model "
                                  f"needs {tuple(tensor.shape)}")
