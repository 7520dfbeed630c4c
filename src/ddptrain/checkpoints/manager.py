"""The checkpoint manager: the parts of a run (`Stateful`s, each owned by its component) saved and loaded
back, every rank agreeing on each save's outcome, one save in flight (async writer), retention of the run's own
line, and which checkpoint a run resumes from.

Methods marked "all ranks" are collective. The files themselves are format.py's, the shards shards.py's.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ddptrain.checkpoints.format import (
    ABANDONED,
    BEST,
    MANIFEST,
    PEER_FAILED,
    STEP_DIR,
    CheckpointError,
    Loaded,
    Position,
    Snapshot,
    _torch_bytes,
    changed_settings_error,
    commit,
    committed_steps,
    file_digest,
    keep_as_best,
    manifest_step,
    prepare_step_dir,
    read_origin,
    write_atomic,
)
from ddptrain.checkpoints import shards
from ddptrain.checkpoints.read import read_checkpoint
from ddptrain.config import setting_changes
from ddptrain.errors import TrainingError, UsageError
from ddptrain.faults import FaultInjector
from ddptrain.parallel.distributed import DistributedContext

log = logging.getLogger("ddptrain")
READ_ATTEMPTS = 3  # reads of one checkpoint before an I/O error counts as more than a hiccup
READ_RETRY_S = 1.0  # the wait before the second read; the third waits twice as long


class SaveSchedule:
    """When a boundary saves: at an epoch's end every --save_every epochs, at a step boundary every
    --save_every_steps steps or --save_every_minutes (rank 0's clock, cast in the control vote so that every
    rank saves the same step), and wherever a best checkpoint is wanted. The manager asks `due` at each
    boundary the loop hands it; a preemption, the time limit and the end of training save whatever it says."""

    def __init__(self, every_epochs: int = 0, every_steps: int = 0, every_minutes: float = 0.0):
        self.every_epochs, self.every_steps, self.every_minutes = every_epochs, every_steps, every_minutes
        self.last_save = time.monotonic()

    @classmethod
    def of(cls, settings: Any) -> "SaveSchedule":
        """The schedule of the [checkpoint] section (`TrainConfig.section("checkpoint")`)."""
        return cls(settings.save_every, settings.save_every_steps, settings.save_every_minutes)

    def start_clock(self) -> None:
        """The minutes count from now (a save, or the start of training)."""
        self.last_save = time.monotonic()

    def minutes_up(self) -> bool:
        """Whether --save_every_minutes have passed since the last save, by this process's clock."""
        return self.every_minutes > 0 and time.monotonic() - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, epoch_end: int | None = None, timed: bool = False, best: bool = False) -> bool:
        """Whether to save at the boundary after `step`; `epoch_end`: the number of epochs done, at an epoch's
        end (where only --save_every counts); `timed`: the vote's agreed `minutes_up`; `best`: a callback
        wants this step kept as best/."""
        if epoch_end is not None:
            return best or bool(self.every_epochs and epoch_end % self.every_epochs == 0)
        return best or timed or bool(self.every_steps and step % self.every_steps == 0)


class Stateful(Protocol):
    """A part of what a checkpoint holds: the state of one component, which that component saves and restores
    (torchtitan's and DCP's `Stateful`). The manager calls `state_dict` on every rank at each save and
    `load_state_dict` on every rank at a resume, part by part in the order of its `states` (the RNG streams
    last: nothing restored after them may draw).

    `state_dict()` gives the part's state by where a checkpoint keeps it, each scope optional:
        "shared"  keys of trainer.pt, the same on every rank (rank 0's are written)
        "rank"    keys of this rank's own dict (gathered from every rank: trainer.pt["rng"], by rank)
        "shards"  this rank's shards of the tensors DCP writes (the model's weights and optimizer state)
    It is where a part makes its state final first (the log's last line written, the buffers agreed): all
    ranks, a collective may run in it.

    `load_state_dict(state)` gets them back from a verified checkpoint: "shared" (all of trainer.pt: a part
    reads its own keys), "ranks" (every rank's "rank" dict as `RankStates`: this rank's own, or all of them to
    share out where the world size changed) and "checkpoint" (the `Loaded` checkpoint: its path, position and
    saved settings, and the tensors the shards are read from). All ranks.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RankStates:
    """Every rank's saved dict, as a part restoring its own rank's state reads them."""

    ranks: list[dict[str, Any]]  # one per rank of the run that saved
    rank: int  # this process's, in this run
    world_size_now: int  # this run's

    @property
    def same_world(self) -> bool:
        return len(self.ranks) == self.world_size_now

    @property
    def own(self) -> dict[str, Any]:
        """This rank's dict; on another world size rank 0's."""
        return self.ranks[self.rank] if self.same_world else self.ranks[0]


class CheckpointManager:
    """Saves the run's parts (`states`) at the position they stand at, and loads them back: through committed
    directories, which it keeps and chooses among. Methods marked 'all ranks' are collective."""

    def __init__(self, settings: Any, ctx: DistributedContext, states: dict[str, Stateful], position: Position,
                 directory: Path, timeout_s: float, *, config: dict[str, Any], tokenizer_digest: str | None = None,
                 injector: FaultInjector | None = None, mapped_reads: bool = False,
                 phase: Callable[[str], None] = lambda name: None):
        """`settings`: the [checkpoint] section (when to save, how many to keep, async writes, what to resume
        and whether changed settings may continue). `states`: the parts, saved and restored in this order;
        `position`: where they stand, recorded in each manifest and restored by `load`. `config` (the run's
        settings, as `TrainConfig.to_dict` gives them) and `tokenizer_digest` (its tokenizer's files, or None):
        what the run trains under, saved with every checkpoint; a resume under others is refused unless
        --accept_config_change. `phase`: told "checkpoint" as a save starts (the watchdog's heartbeat).
        `mapped_reads`: a full checkpoint (an earlier version's) is read mapped, each rank reading the rows it
        needs (a sharded run); else whole."""
        self.settings, self.ctx, self.states, self.position = settings, ctx, states, position
        self.config, self.tokenizer_digest = config, tokenizer_digest
        self.schedule, self.phase = SaveSchedule.of(settings), phase
        self.directory, self.keep_last, self.timeout_s = directory, settings.keep_last, timeout_s
        self.async_save, self.injector, self.mapped_reads = settings.async_checkpoint, injector, mapped_reads
        self._group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._async_error: str | None = None
        self._staging = shards.Staging()  # an async save's CPU copy: its memory is reused by the next one
        self._in_flight: int | None = None  # the step of an async save not yet agreed on by `wait`
        self.last_saved_step = -1  # the newest step whose checkpoint every rank agreed committed (or loaded)
        # Rank 0: the committed checkpoint that should be best/ but could not be made so yet. Retention keeps
        # it, each later save tries again, and `confirm_best` fails the run if it never was.
        self._best_owed: tuple[Path, dict[str, Any]] | None = None  # (step dir, its best.json)
        self._best_error = ""
        self.origin = ""  # the --resume_from checkpoint that started this run's line, recorded in manifests

    def save(self, *, now: bool = False, epoch_end: int | None = None, timed: bool = False,
             best: dict[str, Any] | None = None) -> bool:
        """The step boundary the parts stand at: checkpoint them if the schedule says the boundary is due
        (`epoch_end`, `timed`: as `SaveSchedule.due`; `best`: a callback's request to keep this step as best/, its
        best.json) or `now` (a preemption, the time limit, the end). Whether a save began; not for a step saved
        already, which a best request makes best/ instead. The loop hands over every boundary, the same on every
        rank. All ranks."""
        step = self.position.step
        if not (now or self.schedule.due(step, epoch_end=epoch_end, timed=timed, best=best is not None)):
            return False
        if step == self.pending_step:
            if best is not None:
                self.keep_best(step, best)
            return False
        self.phase("checkpoint")
        self._save(best)
        return True

    def _save(self, best: dict[str, Any] | None) -> None:
        """Checkpoint the parts at their position: every rank writes its shards (DCP), rank 0 trainer.pt and the
        manifest once every rank reported its files written; every rank agrees on the outcome. All ranks.

        `best`: once committed, the checkpoint also becomes DIRECTORY/best (before retention runs), with this
        dict as best/best.json. With async saves the state is copied to the CPU here, on the training thread,
        and written and committed by a background thread; the next save (or `wait`) reports its fate.

        Every rank takes every part's state (collectives run in it), then its outcome is agreed on before DCP's
        first collective: a rank that fails before it would leave its peers waiting inside DCP for the whole
        checkpoint limit, with the cause in no log.
        """
        parts = [part.state_dict() for part in self.states.values()]
        self.wait()  # one save in flight at most; also surfaces a failed background write
        started = time.perf_counter()
        rank_states = self.ctx.all_gather_object({k: v for part in parts for k, v in part.get("rank", {}).items()})
        step = self.position.step
        error, snap = self._snapshot_error(step), None
        try:
            if self.ctx.is_main:
                prepare_step_dir(self.directory, step)
            if error is None:
                snap = self._snapshot(parts, rank_states)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        self._agree(error, step)  # also: nobody writes into a directory rank 0 is still clearing
        target = self.directory / f"step-{step}"
        written = None
        try:
            written = shards.save(target, snap.shards, self.group, self._staging if self.async_save else None,
                                  written=lambda: self.injector.during_save(step) if self.injector else None)
        except shards.SAVE_ERRORS as exc:  # DCP's collective save raises on every rank when one rank's write failed
            error = shards.failure(exc, self.ctx.rank)
        if written is not None and self.async_save:
            self._in_background(lambda: self._commit_shards(written, snap, target, best, started),
                                "ddptrain-checkpoint-commit")
        elif written is not None:
            error = self._commit_shards(written, snap, target, best, started)
        self._agree(error, step)
        self._saved(step)
        self.schedule.start_clock()  # --save_every_minutes count from the end of a save

    def _snapshot(self, parts: list[dict[str, Any]], rank_states: list[Any]) -> Snapshot:
        """The checkpoint of this rank's `parts` (their state dicts) and every rank's own state: this rank's
        shards, and trainer.pt (rank 0's is written) with what the run trains under."""
        tensors = {key: value for part in parts for key, value in part.get("shards", {}).items()}
        shared = {key: value for part in parts for key, value in part.get("shared", {}).items()}
        trainer = {**shared, "tokenizer_digest": self.tokenizer_digest, "rng": rank_states}
        return Snapshot(Position(**vars(self.position)), tensors, trainer, self.config, self.origin)

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group sharded saves and loads plan over, apart from the training thread's groups (an async
        save's collectives run in the background). Created on first use, which is on all ranks."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._group

    def _commit_shards(self, written: Any, snap: Snapshot, target: Path, best: dict[str, Any] | None,
                       started: float) -> str | None:
        """Each rank hashes its own files once written and reports to rank 0, which writes trainer.pt and the
        manifest only if every rank succeeded. All ranks; returns this rank's own failure, or None (rank 0:
        also when a peer failed, which that peer reports). `started`: when the save began, for the log."""
        try:
            written.result()
            report: Any = shards.own_files(target, self.ctx.rank)
        except shards.SAVE_ERRORS as exc:
            report = shards.failure(exc, self.ctx.rank)
        reports: list[Any] = [None] * self.ctx.world_size
        try:
            dist.gather_object(report, reports if self.ctx.is_main else None, dst=0, group=self.group)
        except Exception as exc:  # a peer gone: this rank's own failure to report
            return f"{type(exc).__name__}: {exc}"
        if not self.ctx.is_main:
            return report if isinstance(report, str) else None
        failed = [r for r, why in enumerate(reports) if isinstance(why, str)]
        if failed:
            log.error("checkpoint of step %d not committed: rank(s) %s failed to write their shards",
                      snap.position.step, failed)
            return report if isinstance(report, str) else None
        try:
            files = {name: digest for report in reports for name, digest in report.items()}
            write_atomic(target / "trainer.pt", _torch_bytes(snap.trainer))
            files["trainer.pt"] = file_digest(target / "trainer.pt")
            commit(self.directory, snap, files, self.injector)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.error("checkpoint of step %d not committed: %s", snap.position.step, message)
            return message
        log.info("checkpoint committed: %s (%.2f s)", target, time.perf_counter() - started)
        self._retain(target, best)
        return None

    def _in_background(self, work: Callable[[], str | None], name: str) -> None:
        """Run a save's writing and committing on a thread; whatever it raises or returns is this rank's
        verdict, which `wait` agrees on with every rank."""
        def run() -> None:
            try:
                self._async_error = work()
            except BaseException as exc:  # nothing may escape unreported: `wait` must see every failure
                self._async_error = f"{type(exc).__name__}: {exc}"

        self._async_error = None
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until a background save has finished; raise every rank's error on every rank. All ranks.

        A save in flight counts as saved only once this agreed it committed: after a failure the step is
        not saved, so a later save of it (the final one) writes it again.
        """
        if not self.async_save:
            return
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._async_error = self._async_error, None
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._agree(error, step)
            self.last_saved_step = step

    def _saved(self, step: int) -> None:
        if self.async_save:
            self._in_flight = step
        else:
            self.last_saved_step = step

    @property
    def pending_step(self) -> int:
        """The step of the newest save, committed or still in flight (-1 before any)."""
        return self._in_flight if self._in_flight is not None else self.last_saved_step

    def _snapshot_error(self, step: int) -> str | None:
        """The fault injector's `at=snapshot` point, on every rank as it takes its part of a checkpoint."""
        try:
            if self.injector is not None:
                self.injector.at_snapshot(step)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _agree(self, error: str | None, step: int) -> None:
        """Every rank's outcome of the save of `step`; raise on every rank, naming each rank that failed and
        why, if any did. All ranks."""
        # The other ranks wait here while rank 0 serialises, hashes and writes: that takes its own limit,
        # not the collective timeout meant for a training step.
        with self.ctx.collective_timeout(self.timeout_s):
            errors = self.ctx.all_gather_object(error)
        self._agree_on(errors, step)

    def _agree_on(self, errors: list[str | None], step: int) -> None:
        """Raise naming each rank whose entry of `errors` (every rank's, gathered) is a failure."""
        failed = [(rank, why) for rank, why in enumerate(errors) if why is not None]
        causes = [(rank, why) for rank, why in failed if why != PEER_FAILED]  # the ranks that know why
        failed = [f"rank {rank} ({self.ctx.hosts[rank]}): {why}" for rank, why in (causes or failed)]
        if failed:
            raise TrainingError(f"checkpoint of step {step} failed on {'; '.join(failed)}")

    def _retain(self, committed: Path, best: dict[str, Any] | None) -> None:
        """Rank 0, after a commit: best/ (this checkpoint if `best`, else one still owed), then retention."""
        if best is not None or self._best_owed is not None:
            self._keep_best(*((committed, best) if best is not None else self._best_owed))
        self.purge(keep_step=int(STEP_DIR.match(committed.name).group(1)))

    def keep_best(self, step: int, about: dict[str, Any]) -> None:
        """Make the checkpoint of `step`, saved already (perhaps in flight), DIRECTORY/best, described by
        `about` (best/best.json). All ranks."""
        self.wait()
        if self.ctx.is_main and self.last_saved_step == step:
            self._keep_best(self.directory / f"step-{step}", about)

    def _keep_best(self, step_dir: Path, about: dict[str, Any]) -> None:
        """Rank 0. The checkpoint committed, so a failure here does not fail the save: the checkpoint is owed
        to best/, kept from retention and tried again at the next save."""
        try:
            if self.injector is not None:
                self.injector.at_best(int(STEP_DIR.match(step_dir.name).group(1)))
            shown = "".join(f", {k} {v}" for k, v in about.items() if k != "step")
            log.info("best checkpoint: %s (step %d%s)", keep_as_best(self.directory, step_dir, about),
                     about["step"], shown)
            self._best_owed = None
        except Exception as exc:
            self._best_owed, self._best_error = (step_dir, about), f"{type(exc).__name__}: {exc}"
            log.error("best checkpoint: could not keep %s as %s (%s); the checkpoint is committed and kept, and "
                      "the next save tries again", step_dir, self.directory / BEST, self._best_error)

    def owe_best(self, about: dict[str, Any]) -> None:
        """On resume: a best step (`about["step"]`) whose checkpoint is committed but is not best/ (an earlier
        attempt failed to make it so, then died) is owed to best/ again. Rank 0."""
        step_dir = self.directory / f"step-{about['step']}"
        if manifest_step(self.directory / BEST) != about["step"] and (step_dir / MANIFEST).is_file():
            log.warning("best checkpoint: %s is the best (%s) but not %s; the next save makes it so",
                        step_dir, about["metric"], self.directory / BEST)
            self._best_owed, self._best_error = (step_dir, about), "an earlier attempt did not make it best/"

    def confirm_best(self) -> None:
        """At the end of the run: the best checkpoint is best/, or every rank raises naming it. All ranks."""
        self.wait()
        error = None
        if self.ctx.is_main and self._best_owed is not None:
            self._keep_best(*self._best_owed)  # a last try
            if self._best_owed is not None:
                error = (f"could not keep the best checkpoint {self._best_owed[0]} as {self.directory / BEST} "
                         f"({self._best_error}); it is committed and kept: copy it there by hand")
        error = self.ctx.broadcast_object(error)
        if error is not None:
            raise TrainingError(error)

    def read_best(self, model_state: dict[str, torch.Tensor]) -> Loaded | None:
        """best/, read and verified on every rank (None where the run kept none); TrainingError naming it where
        a rank cannot read it. All ranks."""
        path = self.directory / BEST
        if self.ctx.broadcast_object(manifest_step(path) if self.ctx.is_main else None) is None:
            return None
        loaded, bad = self._read_agreed(path, model_state)
        if bad:
            rank, why = bad[0]
            raise TrainingError(f"--load_best_at_end: cannot read {path} on rank {rank}: {why}; the last step's "
                                "weights are in the newest checkpoint (ddptrain export)")
        return loaded

    def purge(self, keep_step: int) -> None:
        """Delete committed checkpoints beyond `keep_last` and stale partial dirs. Rank 0; never raises.

        Only this run's line is in the directory (`start_line` moved any other aside), so the newest
        `keep_last` are the ones to keep; the one just committed (`keep_step`) is never deleted.
        """
        if self.keep_last <= 0:
            return
        committed = committed_steps(self.directory)
        doomed = [p for step, p in committed[self.keep_last:] if step != keep_step
                  and (self._best_owed is None or p != self._best_owed[0])]
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
        """Move aside the committed checkpoints this run does not continue from, and start the schedule's clock
        (--save_every_minutes count from here). All ranks (rank 0 moves, every rank learns the outcome).

        After resuming from step S (or starting fresh, S = 0), checkpoints of steps after S belong to an
        abandoned line: left in place, retention would keep them over the new line's saves and a later
        auto-resume would pick them. They go to `abandoned/<time>-at-step-S/`, never deleted.
        """
        self.schedule.start_clock()
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
        best_step = manifest_step(self.directory / BEST)
        if best_step is not None and best_step > start_step:
            stale.append(self.directory / BEST)  # the best of a line this run does not continue
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

    def load(self, weights: dict[str, torch.Tensor]) -> Loaded | None:
        """Restore every part, and the position, from the newest usable checkpoint (or --resume_from: the
        [checkpoint] section), refused if it was trained under other settings or on another tokenizer (unless
        --accept_config_change); the checkpoint, or None for a fresh start. `weights`: the model's state this run
        holds, which a checkpoint must fit to be usable. All ranks."""
        resume_from, auto_resume = self.settings.resume_from, self.settings.auto_resume
        if not (resume_from or auto_resume):
            return None
        loaded = self._newest_usable(resume_from, weights, continue_line=auto_resume)
        if loaded is None:
            return None
        self._check_trained_under(loaded)
        state = {"shared": loaded.trainer, "ranks": RankStates(loaded.trainer["rng"], self.ctx.rank,
                                                               self.ctx.world_size), "checkpoint": loaded}
        for part in self.states.values():
            part.load_state_dict(state)
        saved, pos = loaded.position, self.position
        if saved.global_batch_size != pos.global_batch_size:
            log.warning("global batch changed on resume: %d -> %d; the data order continues at sample %d of "
                        "epoch %d, but steps are no longer comparable with the original run",
                        saved.global_batch_size, pos.global_batch_size, saved.cursor, saved.epoch)
        pos.step, pos.epoch, pos.cursor = saved.step, saved.epoch, saved.cursor
        self.last_saved_step = saved.step
        return loaded

    def _check_trained_under(self, loaded: Loaded) -> None:
        """UsageError where `loaded` was trained with other settings or on another tokenizer's files, unless
        --accept_config_change (then a warning)."""
        changes = setting_changes(loaded.manifest["config"], self.config)
        saved_digest, digest = loaded.trainer.get("tokenizer_digest"), self.tokenizer_digest
        if saved_digest and digest and saved_digest != digest:  # the same path, retrained: other token ids
            template = self.config.get("chat_template")
            named = f"{self.config['tokenizer']}{f' or --chat_template {template}' if template else ''}"
            changes.append(f"tokenizer {named}: its files changed (sha256 {saved_digest[:12]} -> {digest[:12]})")
        if changes and not self.settings.accept_config_change:
            raise UsageError(changed_settings_error(loaded.path, changes))
        if changes and self.ctx.is_main:
            log.warning("continuing %s with changed training settings (--accept_config_change): %s",
                        loaded.path, "; ".join(changes))

    def _newest_usable(self, explicit: str, model_state: dict[str, torch.Tensor],
                       continue_line: bool = True) -> Loaded | None:
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
            loaded, bad = self._read_agreed(path, model_state)
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

    def _read_agreed(self, path: Path, model_state: dict[str, torch.Tensor]) -> tuple[Loaded | None, list]:
        """Read and verify `path` on every rank: (the checkpoint, []) when all ranks read it, or (None, [(rank,
        reason), ...]) when it is proven bad on some rank (a digest, the format, a model it does not fit). All
        ranks.

        Only proof demotes a checkpoint: an I/O error may be the filesystem's, not the checkpoint's (a
        network filesystem's hiccup), so the read is tried again, READ_ATTEMPTS times in all, and if it still
        fails the run stops with the error and nothing is moved aside. Any other error is a failure too.
        """
        for attempt in range(1, READ_ATTEMPTS + 1):
            loaded, outcome = None, None
            try:
                if self.injector is not None:
                    match = STEP_DIR.match(path.name)
                    self.injector.at_load(int(match.group(1)) if match else -1)
                loaded = read_checkpoint(path, self.ctx.device, share=(self.ctx.rank, self.ctx.world_size),
                                         mapped=self.mapped_reads)
                _check_fits(loaded.weight_shapes(), model_state)
            except CheckpointError as exc:
                outcome = ("bad", str(exc))
            except OSError as exc:
                outcome = ("io", f"{type(exc).__name__}: {exc}")
            except Exception as exc:
                outcome = ("error", f"{type(exc).__name__}: {exc}")
            outcomes = self.ctx.all_gather_object(outcome)
            failed = [(rank, *o) for rank, o in enumerate(outcomes) if o is not None]
            if not failed:
                return loaded, []
            bad = [(rank, why) for rank, kind, why in failed if kind == "bad"]
            if bad:
                return None, bad
            rank, kind, why = failed[0]
            if kind == "io" and attempt < READ_ATTEMPTS:
                if self.ctx.is_main:
                    log.warning("reading checkpoint %s failed on rank %d (%s); trying again (%d of %d)", path,
                                rank, why, attempt + 1, READ_ATTEMPTS)
                time.sleep(READ_RETRY_S * attempt)
                continue
            tries = f" after {READ_ATTEMPTS} tries" if kind == "io" else ""
            raise TrainingError(f"cannot read checkpoint {path} on rank {rank} ({self.ctx.hosts[rank]}){tries}: "
                                f"{why}; nothing was moved or deleted: fix the cause and run the same command again")
        raise AssertionError("unreachable")


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
