"""What a checkpoint holds of a Trainer, and how a verified checkpoint is put back under what the config
says now: `CheckpointedState`, the part of the Trainer that speaks to checkpoints."""

from __future__ import annotations

import logging
from typing import Any

from ddptrain.checkpoints.format import Loaded, Position, Snapshot
from ddptrain.data.pipeline import mix_seed
from ddptrain.errors import UsageError
from ddptrain.loop.state import MetricWindow, rng_state, seed_rank_rngs, set_rng_state
from ddptrain.models import lora

log = logging.getLogger("ddptrain")

# The flags of the control vote (`Trainer._between_steps`), in the order it casts them.
VOTE_FLAGS = ("preempt", "timed", "time_up", "stop")

# Settings of how an update is computed, not of what it computes (the strategy chooses fused or foreach).
_IMPLEMENTATION = ("initial_lr", "foreach", "fused", "capturable", "differentiable")


class CheckpointedState:
    """The Trainer's checkpoint side (a base class of `loop.trainer.Trainer`, which sets every attribute it
    reads: the model, optimizer, schedule, scaler, position, metric window, stream position, callbacks, an
    agreed early stop, config and process group)."""

    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks and a checkpoint gathers from each: RNG streams, the unlogged metric window,
        a stream's position."""
        state = {**rng_state(self.ctx.device), "window": self.window.state_dict(),
                 "stop_request": self.run_view.stop_reason}  # asked on this rank, perhaps not yet voted on
        if self.stream is not None:
            state["stream"] = self.stream_position.state_dict()
        if self.callbacks:
            state["callbacks"] = self.callbacks.state_dict()
        return state

    def snapshot(self) -> Snapshot:
        """Everything a checkpoint holds: position, model, optimizer, schedule, scaler, config. Rank 0 only, or
        all ranks when sharded: each then contributes its shards of model and optimizer."""
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        # The last eval: a resumed run neither repeats it at the same step nor reports none at the end.
        # A stop in the vote read at the next boundary (settled before the save) is a decision already taken.
        settled = self._vote.settled
        trainer = {"scheduler": self.scheduler.state_dict(), "scaler": scaler, "log": self.train_log.state_dict(),
                   "stopped": self.stopped, "last_eval": self._last_eval,
                   "stop_voted": bool(settled and settled[VOTE_FLAGS.index("stop")]),
                   "tokenizer_digest": self.tokenizer_digest}
        if self.frozen:
            trainer["frozen"] = {"names": self.frozen, "fingerprint": self.frozen_fingerprint()}
        position, config = Position(**vars(self.position)), self.cfg.to_dict()
        if self.parallel.sharded:
            from ddptrain.checkpoints import shards  # DCP: imported by sharded runs only

            state, trainer["param_groups"] = shards.state_to_save(self.module, self.optimizer, self.frozen)
            return Snapshot(position, None, None, trainer, config, shards=state)
        return Snapshot(position, self.parallel.state_dict(self.frozen), self.optimizer.state_dict(), trainer, config)

    def checkpointed(self, state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint holds of the model's `state`: all of it, less the frozen weights under LoRA."""
        if not self.frozen:
            return state
        frozen = set(self.frozen)
        return {name: value for name, value in state.items() if name not in frozen}

    def frozen_fingerprint(self) -> list[list[float]]:
        """The frozen weights' fingerprint (lora.fingerprint), taken once: they never change. Sharded: every
        rank's part summed (all ranks, at their first snapshot or restore alike)."""
        if self._frozen_fingerprint is None:
            mine = lora.fingerprint(self.module, self.frozen)
            if self.parallel.sharded:
                parts = self.ctx.gather_floats([x for pair in mine for x in pair])
                summed = [sum(column) for column in zip(*parts)]
                mine = [summed[i:i + 2] for i in range(0, len(summed), 2)]
            self._frozen_fingerprint = mine
        return self._frozen_fingerprint

    def _check_frozen(self, loaded: Loaded) -> None:
        """A checkpoint of adapters continues only on the weights it was trained on (rebuilt from the model's
        source): a changed base is refused like a changed setting."""
        saved = loaded.trainer.get("frozen")
        if saved is None:
            raise UsageError(f"{loaded.path} holds the whole model, this run trains LoRA adapters (--lora_rank "
                             f"{self.cfg.lora_rank}); start fresh (--no-auto_resume or another --run_dir)")
        if saved["names"] != self.frozen or not lora.same_weights(saved["fingerprint"], self.frozen_fingerprint()):
            raise UsageError(f"{loaded.path} was trained on other frozen weights than --model {self.cfg.model} "
                             "gives now (its fingerprint differs); resume with the model it was trained on, or "
                             "start fresh (--no-auto_resume or another --run_dir)")

    def load_weights(self, loaded: Loaded) -> None:
        """`loaded`'s model and optimizer state into the model and optimizer, whatever the layouts. All ranks."""
        if loaded.shards is None and not self.parallel.sharded:  # full -> ddp: whole tensors, no DCP
            self.module.load_state_dict(loaded.model, strict=not self.frozen)  # the frozen part: as built
            self.optimizer.load_state_dict(loaded.optimizer)
        else:
            from ddptrain.checkpoints import shards

            shards.load_into(self.module, self.optimizer, loaded, self.checkpoints.group, self.frozen)

    def restore(self, loaded: Loaded) -> None:
        """Put `loaded`'s state into the trainer: model, optimizer state under the config's settings, schedule,
        scaler, metric window, position, this rank's RNG streams and stream position. All ranks."""
        saved, pos = loaded.position, self.position
        saved_optimizer = loaded.manifest["config"].get("optimizer", self.cfg.optimizer)
        if saved_optimizer != self.cfg.optimizer:
            raise UsageError(f"--optimizer {self.cfg.optimizer}: {loaded.path} holds {saved_optimizer} state; "
                             f"resume with --optimizer {saved_optimizer}, or start fresh (--no-auto_resume or "
                             "another --run_dir)")
        # The config decides the hyperparameters (momentum, betas, weight decay, ...): the checkpoint only
        # supplies the optimizer's state. A changed value is said once.
        configured = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                      for group in self.optimizer.param_groups]
        if self.frozen:
            self._check_frozen(loaded)
        self.load_weights(loaded)
        self._optimizer_stepped = bool(self.optimizer.state)
        for group, wanted in zip(self.optimizer.param_groups, configured):
            changed = {k: (group.get(k), v) for k, v in wanted.items()
                       if group.get(k) != v and k not in _IMPLEMENTATION}
            if changed and self.ctx.is_main and group is self.optimizer.param_groups[0]:
                log.warning("resume: the config overrides the checkpoint's optimizer settings: %s",
                            ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
            group.update(wanted)
        self.scheduler.load_state_dict(loaded.trainer["scheduler"])
        if self._own_schedule:  # the config decides the peak lr; a user's scheduler restores its own state
            self.scheduler.base_lrs = [self.peak_lr] * len(self.optimizer.param_groups)
            for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
                group["lr"] = self.peak_lr * factor(self.scheduler.last_epoch)
        self.train_log.load_state_dict(loaded.trainer.get("log", {}))
        if self.scaler is not None and loaded.trainer["scaler"] is not None:
            self.scaler.load_state_dict(loaded.trainer["scaler"])
        self._restore_window(loaded.trainer["rng"], saved.world_size)
        pos.step, pos.epoch, pos.cursor = saved.step, saved.epoch, saved.cursor
        self._first_step = saved.step
        self.checkpoints.last_saved_step = saved.step
        if saved.global_batch_size != pos.global_batch_size:
            log.warning("global batch changed on resume: %d -> %d; the data order continues at sample %d of "
                        "epoch %d, but steps are no longer comparable with the original run",
                        saved.global_batch_size, pos.global_batch_size, saved.cursor, saved.epoch)
        rngs = loaded.trainer["rng"]
        saved_stream = rngs[min(self.ctx.rank, len(rngs) - 1)].get("stream")
        if (saved_stream is None) != (self.stream is None):
            kinds = ("an IterableDataset", "a map-style dataset")
            saved_kind, this_kind = (kinds[1], kinds[0]) if saved_stream is None else kinds
            raise UsageError(f"{loaded.path} was saved from {saved_kind}; this run's is {this_kind}: start fresh "
                             "(--no-auto_resume or another --run_dir)")
        if self.stream is not None:
            self.stream_position.load_state_dict(saved_stream, self.ctx.world_size, self.cfg.num_workers)
        self.stopped = loaded.trainer.get("stopped")
        if loaded.trainer.get("stop_voted"):
            # Of the vote in flight at the save, only the stop outlives that process (its signals and clock do not).
            self._vote.settled = [float(flag == "stop") for flag in VOTE_FLAGS]
        self._last_eval = loaded.trainer.get("last_eval", {})
        own = rngs[self.ctx.rank] if saved.world_size == self.ctx.world_size else rngs[0]
        requests = [rank.get("stop_request") for rank in rngs]
        # A request not yet agreed on is cast again at the next vote; on another world size by rank 0.
        self.run_view.stop_reason = (own.get("stop_request") if saved.world_size == self.ctx.world_size
                                     else next((r for r in requests if r), None) if self.ctx.is_main else None)
        self.callbacks.load_state_dict(own.get("callbacks", {}), rngs[0].get("callbacks", {}))  # another world: 0's
        if saved.world_size == self.ctx.world_size:
            set_rng_state(rngs[self.ctx.rank], self.ctx.device)
        else:
            log.warning("world size changed on resume: %d -> %d; data order continues sample-exactly, per-rank "
                        "RNG streams (dropout) are reseeded", saved.world_size, self.ctx.world_size)
            seed_rank_rngs(mix_seed(self.cfg.seed, saved.step), self.ctx.rank)

    def _restore_window(self, ranks: list[dict[str, Any]], saved_world: int) -> None:
        """Each rank's own unlogged sums; on another world size rank 0 takes them all (the totals stay right)."""
        windows = [r["window"] for r in ranks if "window" in r]
        if len(windows) != len(ranks):
            return  # a checkpoint from before per-rank windows: its one window was rank 0's
        if saved_world == self.ctx.world_size:
            self.window.load_state_dict(windows[self.ctx.rank])
        elif self.ctx.is_main:
            self.window.load_state_dict(MetricWindow.merged(windows))
