"""The parts of a run a checkpoint holds: each a `Stateful` (checkpoints.manager) over the component whose
state it is, handed to the `CheckpointManager` as `states`, which saves them and loads them back in this order:

    part        component                    shared by the ranks (trainer.pt)       each rank's
    model       the module and optimizer     weights, optimizer state (shards)      -
    optim       the schedule, fp16 scaler    schedule, scaler                       -
    log         TrainLog, MetricWindow       skipped-update counts                  unlogged metric window
    trainer     LoopState (the loop's own)   agreed stop, last eval, voted stop     a stop asked here
    data        the loader's stream          (the position: the manager's)          a stream's position
    callbacks   the callbacks                -                                      each callback's state_dict
    rng         this rank's RNG streams      -                                      torch / numpy / python streams

A part's `state_dict` first makes its state final (all ranks: the model's buffers agreed, the log's last line
written, the vote in flight read, the sample ids on disk), then gives it by scope: "shared" (keys of
trainer.pt), "rank" (keys of its rank's dict), "shards" (the model's, which DCP writes under every strategy).
`load_state_dict` puts it back from a verified checkpoint and every rank's dicts (`RankStates`, which knows
whether the world size changed). The keys are those of the checkpoints ddptrain has always written: the parts
split the dicts, not the format. RNG streams restore last: nothing restored after them may draw.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
from torch import nn

from ddptrain.checkpoints import shards
from ddptrain.checkpoints.format import Loaded
from ddptrain.checkpoints.manager import RankStates
from ddptrain.data.pipeline import mix_seed
from ddptrain.errors import UsageError
from ddptrain.loop.state import MetricWindow, rng_state, seed_rank_rngs, set_rng_state
from ddptrain.models import lora

log = logging.getLogger("ddptrain")

# The flags of the control vote (`Trainer._between_steps`), in the order it casts them.
VOTE_FLAGS = ("preempt", "timed", "time_up", "stop")

# Settings of how an update is computed, not of what it computes (the strategy chooses fused or foreach).
_IMPLEMENTATION = ("initial_lr", "foreach", "fused", "capturable", "differentiable")


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

    def state_dict(self) -> dict[str, Any]:
        """Every rank holds rank 0's buffers first, which the checkpoint saves; then this rank's shards and
        trainer.pt's keys (`weights`). All ranks."""
        self.parallel.sync_buffers()
        tensors, shared = self.weights()
        return {"shards": tensors, "shared": shared}

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
        rank's part summed (all ranks: at the first save or load, which every rank makes)."""
        if self._fingerprint is None:
            mine = lora.fingerprint(self.module, self.frozen)
            if self.parallel.sharded:
                parts = self.ctx.gather_floats([x for pair in mine for x in pair])
                summed = [sum(column) for column in zip(*parts)]
                mine = [summed[i:i + 2] for i in range(0, len(summed), 2)]
            self._fingerprint = mine
        return self._fingerprint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's weights and optimizer state, refused if they are another optimizer's or trained
        on other frozen weights; then the config's hyperparameters over the checkpoint's. All ranks."""
        loaded: Loaded = state["checkpoint"]
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
        return {"shared": {"scheduler": self.scheduler.state_dict(),
                           "scaler": self.scaler.state_dict() if self.scaler is not None else None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shared, groups = state["shared"], self.optimizer.param_groups
        self.scheduler.load_state_dict(shared["scheduler"])
        if self.own_schedule:  # the config decides the peak lr; a user's scheduler restores its own state
            self.scheduler.base_lrs = [self.peak_lr] * len(groups)
            for group, factor in zip(groups, self.scheduler.lr_lambdas):
                group["lr"] = self.peak_lr * factor(self.scheduler.last_epoch)
        if self.scaler is not None and shared["scaler"] is not None:
            self.scaler.load_state_dict(shared["scaler"])


class LogState:
    """"log": the train log's counts of skipped updates (shared) and each rank's window of train numbers not
    yet logged. Its state is final once the log's last line is written: a checkpoint's window starts after
    it."""

    def __init__(self, train_log: Any, window: MetricWindow):
        self.train_log, self.window = train_log, window

    def state_dict(self) -> dict[str, Any]:
        self.train_log.finish()  # all ranks: the line's numbers are gathered
        return {"shared": {"log": self.train_log.state_dict()}, "rank": {"window": self.window.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_log.load_state_dict(state["shared"].get("log", {}))
        saved: RankStates = state["ranks"]
        windows = [r["window"] for r in saved.ranks if "window" in r]
        if len(windows) == len(saved.ranks):  # (before per-rank windows a checkpoint held rank 0's one)
            if saved.same_world:  # each rank's own unlogged sums; on another world size rank 0 takes them all
                self.window.load_state_dict(windows[saved.rank])
            elif saved.rank == 0:
                self.window.load_state_dict(MetricWindow.merged(windows))


class LoopState:
    """"trainer": what the loop decided. Shared: a stop every rank agreed on (no step follows it, and a rerun
    stops at the same step), one voted but not yet read (the control vote's), the last eval (a resumed run
    neither repeats it nor reports none at the end). Each rank's: a stop asked on it (a callback's, through
    `run_view`), not yet voted on."""

    def __init__(self, vote: Any, run_view: Any):
        self.vote, self.run_view = vote, run_view
        self.stopped: dict[str, Any] | None = None  # {"step", "reason"} once every rank agreed to stop early
        self.last_eval: dict[str, Any] = {}  # {"step", **metrics} of the last eval (no metrics: no eval set)

    def agree_to_stop(self, step: int, reason: str) -> None:
        """Record the stop every rank agreed on at this step: no step follows, and every later checkpoint holds
        it, so a run killed or preempted after the decision makes it again at the same step. All ranks."""
        if self.stopped is None:
            self.stopped = {"step": step, "reason": reason}
            log.info("stopping at step %d: %s", step, reason)

    def evaluated(self, step: int, metrics: dict[str, Any]) -> None:
        """The eval at `step` is done, with these `metrics` (none: there is no eval set)."""
        self.last_eval = {"step": step, **metrics}

    def state_dict(self) -> dict[str, Any]:
        settled = self.vote.settle()  # all ranks: a stop in the vote read at the next boundary is a decision taken
        return {"shared": {"stopped": self.stopped, "last_eval": self.last_eval,
                           "stop_voted": bool(settled and settled[VOTE_FLAGS.index("stop")])},
                "rank": {"stop_request": self.run_view.stop_reason}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shared, saved = state["shared"], state["ranks"]
        self.stopped = shared.get("stopped")
        if shared.get("stop_voted"):
            # Of the vote in flight at the save, only the stop outlives that process (its signals and clock do not).
            self.vote.settled = [float(flag == "stop") for flag in VOTE_FLAGS]
        self.last_eval = shared.get("last_eval", {})
        # A request not yet agreed on is cast again at the next vote; on another world size by rank 0.
        requests = [rank.get("stop_request") for rank in saved.ranks]
        self.run_view.stop_reason = (saved.own.get("stop_request") if saved.same_world
                                     else next((r for r in requests if r), None) if saved.rank == 0 else None)


class DataState:
    """"data": where this rank stands in the data besides the checkpoint's position (one global order, the same
    on every rank, for a map-style dataset): an IterableDataset's position in its share of the stream; and the
    sample-id record (or None), on disk with each checkpoint."""

    def __init__(self, position: Any, num_workers: int, sample_log: Any):
        self.position, self.num_workers, self.sample_log = position, num_workers, sample_log

    def state_dict(self) -> dict[str, Any]:
        if self.sample_log is not None:
            self.sample_log.flush()
        return {"rank": {"stream": self.position.state_dict()} if self.position is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved: RankStates = state["ranks"]
        saved_stream = saved.ranks[min(saved.rank, len(saved.ranks) - 1)].get("stream")
        if (saved_stream is None) != (self.position is None):
            kinds = ("an IterableDataset", "a map-style dataset")
            saved_kind, this_kind = (kinds[1], kinds[0]) if saved_stream is None else kinds
            raise UsageError(f"{state['checkpoint'].path} was saved from {saved_kind}; this run's is {this_kind}: "
                             "start fresh (--no-auto_resume or another --run_dir)")
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

    def state_dict(self) -> dict[str, Any]:
        return {"rank": {"callbacks": self.callbacks.state_dict()} if self.callbacks else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved: RankStates = state["ranks"]
        self.callbacks.load_state_dict(saved.own.get("callbacks", {}), saved.ranks[0].get("callbacks", {}))


class RngState:
    """"rng": this rank's RNG streams (dropout and the like). On another world size they are reseeded from the
    seed and the step: the data order never reads them, so it stays sample-exact."""

    def __init__(self, device: torch.device, seed: int):
        self.device, self.seed = device, seed

    def state_dict(self) -> dict[str, Any]:
        return {"rank": rng_state(self.device)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved: RankStates = state["ranks"]
        if saved.same_world:
            set_rng_state(saved.own, self.device)
        else:
            log.warning("world size changed on resume: %d -> %d; data order continues sample-exactly, per-rank "
                        "RNG streams (dropout) are reseeded", len(saved.ranks), saved.world_size_now)
            seed_rank_rngs(mix_seed(self.seed, state["checkpoint"].position.step), saved.rank)
