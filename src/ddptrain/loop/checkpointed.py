"""What a checkpoint holds of a run: a dict of parts, each saving and restoring its own state.

`RunState` holds the parts and speaks the checkpoint format (`checkpoints.format.Snapshot` / `Loaded`); the
checkpoint manager asks it for a snapshot at each save. A part keeps state every rank shares (saved once, in
trainer.pt), state of its own rank (gathered from every rank), or both:

    part        state shared by the ranks                        state of each rank
    model       weights; the optimizer's state over them         -
    optim       schedule, fp16 scaler                            -
    trainer     agreed stop, last eval, log, tokenizer digest    unlogged metric window, a stop asked here
    data        (the position: Snapshot.position)                a stream's position
    callbacks   -                                                each callback's state_dict
    rng         -                                                torch / numpy / python RNG streams

A part's shared state is keys of trainer.pt (`state_dict`), its rank's state keys of that rank's dict
(`rank_state_dict`); `settle()`, where a part has it, makes that state final before a snapshot reads it (all
ranks: the model's buffers agreed, the log's last line written, the vote in flight read); `load(loaded, ranks)`
puts both back from a verified checkpoint and every rank's dict
(`RankStates`). The model part is the one whose state also lies outside trainer.pt (`weights`: the shards,
which DCP writes under every strategy). The keys are those of the checkpoints ddptrain has always written: the
parts split the dicts, not the format. Parts restore in the order of the dict (RNG streams last: nothing
restored after them may draw).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ddptrain.checkpoints import shards
from ddptrain.checkpoints.format import Loaded, Position, Snapshot, changed_settings_error
from ddptrain.config import CheckpointSettings, setting_changes
from ddptrain.data.pipeline import mix_seed
from ddptrain.errors import UsageError
from ddptrain.loop.state import MetricWindow, rng_state, seed_rank_rngs, set_rng_state
from ddptrain.models import lora

log = logging.getLogger("ddptrain")

# The flags of the control vote (`Trainer._between_steps`), in the order it casts them.
VOTE_FLAGS = ("preempt", "timed", "time_up", "stop")

# Settings of how an update is computed, not of what it computes (the strategy chooses fused or foreach).
_IMPLEMENTATION = ("initial_lr", "foreach", "fused", "capturable", "differentiable")


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


class ModelState:
    """"model": the weights (less LoRA's frozen base, which the model's source holds) and the optimizer's
    state over them. One part: DCP writes the two as one state dict, and loads them together. On
    resume the config decides the optimizer's hyperparameters (momentum, betas, weight decay, ...): the
    checkpoint supplies its state only, and a changed value is said once. `group`: the checkpoint manager's
    group, which sharded loads plan over."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, parallel: Any, ctx: Any,
                 group: Callable[[], Any], optimizer_name: str, model_name: str, lora_rank: int):
        self.module, self.optimizer, self.parallel, self.ctx, self.group = module, optimizer, parallel, ctx, group
        self.optimizer_name, self.model_name, self.lora_rank = optimizer_name, model_name, lora_rank  # for errors
        self.frozen = lora.frozen_names(module) if lora.is_lora(module) else []
        self._fingerprint: list[list[float]] | None = None

    def settle(self) -> None:
        """Every rank holds rank 0's buffers, which the checkpoint saves. All ranks."""
        self.parallel.sync_buffers()

    def weights(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this rank's shards of the model and optimizer state, as DCP writes them; trainer.pt keys). All
        ranks."""
        extra: dict[str, Any] = {}
        if self.frozen:
            extra["frozen"] = {"names": self.frozen, "fingerprint": self.fingerprint()}
        replicas = None if self.parallel.sharded else (self.ctx.rank, self.ctx.world_size)
        state, optimizer = shards.state_to_save(self.module, self.optimizer, self.frozen, replicas)
        return state, {**extra, **optimizer}

    def checkpointed(self, state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint holds of the model's `state`: all of it, less the frozen weights under LoRA."""
        if not self.frozen:
            return state
        frozen = set(self.frozen)
        return {name: value for name, value in state.items() if name not in frozen}

    def fingerprint(self) -> list[list[float]]:
        """The frozen weights' fingerprint (lora.fingerprint), taken once: they never change. Sharded: every
        rank's part summed (all ranks, at their first snapshot or restore alike)."""
        if self._fingerprint is None:
            mine = lora.fingerprint(self.module, self.frozen)
            if self.parallel.sharded:
                parts = self.ctx.gather_floats([x for pair in mine for x in pair])
                summed = [sum(column) for column in zip(*parts)]
                mine = [summed[i:i + 2] for i in range(0, len(summed), 2)]
            self._fingerprint = mine
        return self._fingerprint

    def load(self, loaded: Loaded, ranks: RankStates) -> None:
        """The checkpoint's weights and optimizer state, refused if they are another optimizer's or trained
        on other frozen weights; then the config's hyperparameters over the checkpoint's. All ranks."""
        saved_optimizer = loaded.manifest["config"].get("optimizer", self.optimizer_name)
        if saved_optimizer != self.optimizer_name:
            raise UsageError(f"--optimizer {self.optimizer_name}: {loaded.path} holds {saved_optimizer} state; "
                             f"resume with --optimizer {saved_optimizer}, or start fresh (--no-auto_resume or "
                             "another --run_dir)")
        configured = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                      for group in self.optimizer.param_groups]
        if self.frozen:
            self._check_frozen(loaded)
        self.load_weights(loaded)
        groups = self.optimizer.param_groups  # the checkpoint's, as loading made them
        for group, wanted in zip(groups, configured):
            changed = {k: (group.get(k), v) for k, v in wanted.items()
                       if group.get(k) != v and k not in _IMPLEMENTATION}
            if changed and self.ctx.is_main and group is groups[0]:
                log.warning("resume: the config overrides the checkpoint's optimizer settings: %s",
                            ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
            group.update(wanted)

    def _check_frozen(self, loaded: Loaded) -> None:
        """A checkpoint of adapters continues only on the weights it was trained on (rebuilt from the model's
        source): a changed base is refused like a changed setting."""
        saved = loaded.trainer.get("frozen")
        if saved is None:
            raise UsageError(f"{loaded.path} holds the whole model, this run trains LoRA adapters (--lora_rank "
                             f"{self.lora_rank}); start fresh (--no-auto_resume or another --run_dir)")
        if saved["names"] != self.frozen or not lora.same_weights(saved["fingerprint"], self.fingerprint()):
            raise UsageError(f"{loaded.path} was trained on other frozen weights than --model {self.model_name} "
                             "gives now (its fingerprint differs); resume with the model it was trained on, or "
                             "start fresh (--no-auto_resume or another --run_dir)")

    def load_weights(self, loaded: Loaded) -> None:
        """`loaded`'s model and optimizer state into the model and optimizer, whatever the layouts. All ranks."""
        if loaded.shards is None and not self.parallel.sharded:  # an earlier full checkpoint -> ddp: whole tensors
            self.module.load_state_dict(loaded.model, strict=not self.frozen)  # the frozen part: as built
            self.optimizer.load_state_dict(loaded.optimizer)
        else:
            shards.load_into(self.module, self.optimizer, loaded, self.group(), self.frozen)


class OptimState:
    """"optim": the learning-rate schedule and the fp16 loss scaler. ddptrain's own schedule takes its peak lr
    from the config, not the checkpoint."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, peak_lr: float,
                 own_schedule: bool):
        self.optimizer, self.scheduler, self.scaler, self.peak_lr = optimizer, scheduler, scaler, peak_lr
        self.own_schedule = own_schedule

    def step_schedule(self, first: bool) -> None:
        """The schedule advances with each step. torch warns at a scheduler's first step when the optimizer has
        not stepped: quiet at this run's `first` step, whose update may have been skipped as non-finite (logged
        as such)."""
        if not first:
            self.scheduler.step()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load(self, loaded: Loaded, ranks: RankStates) -> None:
        state, groups = loaded.trainer, self.optimizer.param_groups
        self.scheduler.load_state_dict(state["scheduler"])
        if self.own_schedule:  # the config decides the peak lr; a user's scheduler restores its own state
            self.scheduler.base_lrs = [self.peak_lr] * len(groups)
            for group, factor in zip(groups, self.scheduler.lr_lambdas):
                group["lr"] = self.peak_lr * factor(self.scheduler.last_epoch)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])


class LoopState:
    """"trainer": what the loop decided and logged. Shared: a stop every rank agreed on (no step follows it,
    and a rerun stops at the same step), one voted but not yet read, the last eval (a resumed run neither
    repeats it nor reports none at the end), the log's state, the tokenizer the run learnt on. Each rank's:
    its unlogged metric window and a stop asked on it, not yet voted on. The sample-id record (or None) is
    flushed with each checkpoint."""

    def __init__(self, train_log: Any, window: MetricWindow, vote: Any, run_view: Any, ctx: Any,
                 tokenizer_digest: str | None, sample_log: Any):
        self.train_log, self.window, self.vote, self.run_view, self.ctx = train_log, window, vote, run_view, ctx
        self.tokenizer_digest, self.sample_log = tokenizer_digest, sample_log
        self.stopped: dict[str, Any] | None = None  # {"step", "reason"} once every rank agreed to stop early
        self.last_eval: dict[str, Any] = {}

    def agree_to_stop(self, step: int, reason: str) -> None:
        """Record the stop every rank agreed on at this step: no step follows, and every later checkpoint holds
        it, so a run killed or preempted after the decision makes it again at the same step. All ranks."""
        if self.stopped is None:
            self.stopped = {"step": step, "reason": reason}
            log.info("stopping at step %d: %s", step, reason)

    def settle(self) -> None:
        """The log's last line written (a checkpoint's window starts after it), the sample ids on disk, the vote
        cast at this boundary read: its outcome rides in the checkpoint. All ranks."""
        self.train_log.finish()
        if self.sample_log is not None:
            self.sample_log.flush()
        self.vote.settle()

    def state_dict(self) -> dict[str, Any]:
        settled = self.vote.settled  # a stop in the vote read at the next boundary: a decision already taken
        return {"log": self.train_log.state_dict(), "stopped": self.stopped, "last_eval": self.last_eval,
                "stop_voted": bool(settled and settled[VOTE_FLAGS.index("stop")]),
                "tokenizer_digest": self.tokenizer_digest}

    def load(self, loaded: Loaded, ranks: RankStates) -> None:
        state = loaded.trainer
        self.train_log.load_state_dict(state.get("log", {}))
        self.stopped = state.get("stopped")
        if state.get("stop_voted"):
            # Of the vote in flight at the save, only the stop outlives that process (its signals and clock do not).
            self.vote.settled = [float(flag == "stop") for flag in VOTE_FLAGS]
        self.last_eval = state.get("last_eval", {})
        self._load_rank_state(ranks)

    def rank_state_dict(self) -> dict[str, Any]:
        return {"window": self.window.state_dict(), "stop_request": self.run_view.stop_reason}

    def _load_rank_state(self, saved: RankStates) -> None:
        windows = [r["window"] for r in saved.ranks if "window" in r]
        if len(windows) == len(saved.ranks):  # (before per-rank windows a checkpoint held rank 0's one)
            if saved.same_world:  # each rank's own unlogged sums; on another world size rank 0 takes them all
                self.window.load_state_dict(windows[saved.rank])
            elif self.ctx.is_main:
                self.window.load_state_dict(MetricWindow.merged(windows))
        # A request not yet agreed on is cast again at the next vote; on another world size by rank 0.
        requests = [rank.get("stop_request") for rank in saved.ranks]
        self.run_view.stop_reason = (saved.own.get("stop_request") if saved.same_world
                                     else next((r for r in requests if r), None) if self.ctx.is_main else None)


class StreamState:
    """"data" of an IterableDataset: each rank's position in its share of the stream. (A map-style dataset's
    position is the checkpoint's Position: one global order, the same on every rank.)"""

    def __init__(self, position: Any, num_workers: int):
        self.position, self.num_workers = position, num_workers

    def rank_state_dict(self) -> dict[str, Any]:
        return {"stream": self.position.state_dict()} if self.position is not None else {}

    def load(self, loaded: Loaded, saved: RankStates) -> None:
        path = loaded.path
        saved_stream = saved.ranks[min(saved.rank, len(saved.ranks) - 1)].get("stream")
        if (saved_stream is None) != (self.position is None):
            kinds = ("an IterableDataset", "a map-style dataset")
            saved_kind, this_kind = (kinds[1], kinds[0]) if saved_stream is None else kinds
            raise UsageError(f"{path} was saved from {saved_kind}; this run's is {this_kind}: start fresh "
                             "(--no-auto_resume or another --run_dir)")
        if self.position is not None:
            self.position.load_state_dict(saved_stream, saved.world_size_now, self.num_workers)


class CallbackState:
    """"callbacks": each callback's `state_dict`, per rank (a callback may save SAME_AS_RANK_0); and which
    committed checkpoint they last heard of (not saved: a resumed run's callbacks hold the state of the
    snapshot, taken before its commit, so they hear of that commit again, as in the run that saved it)."""

    def __init__(self, callbacks: Any, run_view: Any):
        self.callbacks, self.run_view = callbacks, run_view
        self.announced = -1

    def announce(self, committed_step: int) -> None:
        """`on_checkpoint` for `committed_step`, once."""
        if committed_step > self.announced:
            self.announced = committed_step
            self.callbacks.call("on_checkpoint", self.run_view, committed_step)

    def take_best(self) -> dict[str, Any] | None:
        """A callback's request to keep this step's checkpoint as best/ (its best.json), taken; or None."""
        best, self.run_view.best_wanted = self.run_view.best_wanted, None
        return best

    def rank_state_dict(self) -> dict[str, Any]:
        return {"callbacks": self.callbacks.state_dict()} if self.callbacks else {}

    def load(self, loaded: Loaded, saved: RankStates) -> None:
        self.callbacks.load_state_dict(saved.own.get("callbacks", {}), saved.ranks[0].get("callbacks", {}))


class RngState:
    """"rng": this rank's RNG streams (dropout and the like). On another world size they are reseeded from the
    seed and the step: the data order never reads them, so it stays sample-exact."""

    def __init__(self, device: torch.device, seed: int):
        self.device, self.seed = device, seed

    def rank_state_dict(self) -> dict[str, Any]:
        return rng_state(self.device)

    def load(self, loaded: Loaded, saved: RankStates) -> None:
        if saved.same_world:
            set_rng_state(saved.own, self.device)
        else:
            log.warning("world size changed on resume: %d -> %d; data order continues sample-exactly, per-rank "
                        "RNG streams (dropout) are reseeded", len(saved.ranks), saved.world_size_now)
            seed_rank_rngs(mix_seed(self.seed, loaded.position.step), saved.rank)


class RunState:
    """The parts of a run a checkpoint holds, and the position they are at; what the checkpoint manager saves
    and a resume restores."""

    def __init__(self, position: Position, config: dict[str, Any], model: ModelState, optim: OptimState,
                 trainer: LoopState, data: StreamState, callbacks: CallbackState, rng: RngState):
        self.position, self.config = position, config
        self.parts = {"model": model, "optim": optim, "trainer": trainer, "data": data, "callbacks": callbacks,
                      "rng": rng}

    def settle(self) -> None:
        """Each part's state made final for a snapshot, in the order of the parts. All ranks."""
        for part in self.parts.values():
            if hasattr(part, "settle"):
                part.settle()

    def take_best(self) -> dict[str, Any] | None:
        return self.parts["callbacks"].take_best()

    def snapshot(self) -> Snapshot:
        """This rank's shards and the shared state (rank 0's is written). All ranks."""
        weights, trainer = self.parts["model"].weights()
        for part in self.parts.values():
            if hasattr(part, "state_dict"):
                trainer.update(part.state_dict())
        return Snapshot(Position(**vars(self.position)), weights, trainer, self.config)

    def rank_state(self) -> dict[str, Any]:
        """This rank's state, gathered from every rank at a save."""
        state: dict[str, Any] = {}
        for part in self.parts.values():
            if hasattr(part, "rank_state_dict"):
                state.update(part.rank_state_dict())
        return state

    def resume(self, checkpoints: Any, checkpoint: CheckpointSettings, ctx: Any) -> Loaded | None:
        """Restore the newest usable checkpoint (or --resume_from: the [checkpoint] section), refused if it was
        trained under other settings (unless --accept_config_change) or on another tokenizer; the checkpoint, or
        None. All ranks."""
        model = self.parts["model"]
        if model.frozen:
            model.fingerprint()  # now, on every rank (sharded: a collective), not inside a later save
        if not (checkpoint.resume_from or checkpoint.auto_resume):
            return None
        loaded = checkpoints.resume(checkpoint.resume_from, model.checkpointed(model.module.state_dict()),
                                    continue_line=checkpoint.auto_resume)
        if loaded is None:
            return None
        changes = setting_changes(loaded.manifest["config"], self.config)
        saved_digest, digest = loaded.trainer.get("tokenizer_digest"), self.parts["trainer"].tokenizer_digest
        if saved_digest and digest and saved_digest != digest:  # the same path, retrained: other token ids
            template = self.config.get("chat_template")
            changes.append(f"tokenizer {self.config['tokenizer']}{f' or --chat_template {template}' if template else ''}: "
                           f"its files changed (sha256 {saved_digest[:12]} -> {digest[:12]})")
        if changes and not checkpoint.accept_config_change:
            raise UsageError(changed_settings_error(loaded.path, changes))
        if changes and ctx.is_main:
            log.warning("continuing %s with changed training settings (--accept_config_change): %s",
                        loaded.path, "; ".join(changes))
        self.restore(loaded, ctx.rank, ctx.world_size)
        return loaded

    def restore(self, loaded: Loaded, rank: int, world_size: int) -> None:
        """Every part's state from `loaded`, in the order of the parts, then the position. All ranks."""
        saved, pos = loaded.position, self.position
        ranks = RankStates(loaded.trainer["rng"], rank, world_size)
        for part in self.parts.values():
            part.load(loaded, ranks)
        if saved.global_batch_size != pos.global_batch_size:
            log.warning("global batch changed on resume: %d -> %d; the data order continues at sample %d of "
                        "epoch %d, but steps are no longer comparable with the original run",
                        saved.global_batch_size, pos.global_batch_size, saved.cursor, saved.epoch)
        pos.step, pos.epoch, pos.cursor = saved.step, saved.epoch, saved.cursor
