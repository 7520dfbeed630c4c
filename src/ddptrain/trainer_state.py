"""What a checkpoint holds of a Trainer, and how a verified checkpoint is put back under what the config
says now."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ddptrain import shards
from ddptrain.checkpoint import Loaded, Position, Snapshot
from ddptrain.data import mix_seed
from ddptrain.errors import UsageError
from ddptrain.state import rng_state, seed_rank_rngs, set_rng_state

if TYPE_CHECKING:
    from ddptrain.trainer import Trainer

log = logging.getLogger("ddptrain")


def rank_state(t: Trainer) -> dict[str, Any]:
    """What differs between ranks and a checkpoint gathers from each: RNG streams, the unlogged metric window,
    a stream's position."""
    state = {**rng_state(t.ctx.device), "window": t.window.state_dict()}
    if t.stream is not None:
        state["stream"] = t.stream_position.state_dict()
    return state


def snapshot(t: Trainer) -> Snapshot:
    """Everything a checkpoint holds: position, model, optimizer, schedule, scaler, config. Rank 0 only, or
    all ranks when sharded: each then contributes its shards of model and optimizer."""
    trainer = {"scheduler": t.scheduler.state_dict(), "scaler": t.scaler.state_dict() if t.scaler is not None else None,
               "log": t.train_log.state_dict()}
    position, config = Position(**vars(t.position)), t.cfg.to_dict()
    if t.parallel.sharded:
        state, trainer["param_groups"] = shards.state_to_save(t.module, t.optimizer)
        return Snapshot(position, None, None, trainer, config, shards=state)
    return Snapshot(position, t.parallel.state_dict(), t.optimizer.state_dict(), trainer, config)


# Settings of how an update is computed, not of what it computes (the strategy chooses fused or foreach).
_IMPLEMENTATION = ("initial_lr", "foreach", "fused", "capturable", "differentiable")


def restore(t: Trainer, loaded: Loaded) -> None:
    """Put `loaded`'s state into the trainer `t`: model, optimizer state under the config's settings, schedule,
    scaler, metric window, position, this rank's RNG streams and stream position. All ranks."""
    saved, pos = loaded.position, t.position
    saved_optimizer = loaded.manifest["config"].get("optimizer", t.cfg.optimizer)
    if saved_optimizer != t.cfg.optimizer:
        raise UsageError(f"--optimizer {t.cfg.optimizer}: {loaded.path} holds {saved_optimizer} state; "
                         f"resume with --optimizer {saved_optimizer}, or start fresh (--no-auto_resume or "
                         "another --run_dir)")
    # The config decides the hyperparameters (momentum, betas, weight decay, ...): the checkpoint only
    # supplies the optimizer's state. A changed value is said once.
    configured = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                  for group in t.optimizer.param_groups]
    shards.load_into(t.module, t.optimizer, loaded, t.parallel.sharded, t.checkpoints.group)
    t._optimizer_stepped = bool(t.optimizer.state)
    for group, wanted in zip(t.optimizer.param_groups, configured):
        changed = {k: (group.get(k), v) for k, v in wanted.items()
                   if group.get(k) != v and k not in _IMPLEMENTATION}
        if changed and t.ctx.is_main and group is t.optimizer.param_groups[0]:
            log.warning("resume: the config overrides the checkpoint's optimizer settings: %s",
                        ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        group.update(wanted)
    t.scheduler.load_state_dict(loaded.trainer["scheduler"])
    if t._own_schedule:  # the config decides the peak lr; a user's scheduler restores its own state
        t.scheduler.base_lrs = [t.peak_lr] * len(t.optimizer.param_groups)
        for group, factor in zip(t.optimizer.param_groups, t.scheduler.lr_lambdas):
            group["lr"] = t.peak_lr * factor(t.scheduler.last_epoch)
    t.train_log.load_state_dict(loaded.trainer.get("log", {}))
    if t.scaler is not None and loaded.trainer["scaler"] is not None:
        t.scaler.load_state_dict(loaded.trainer["scaler"])
    _restore_window(t, loaded.trainer["rng"], saved.world_size)
    pos.step, pos.epoch, pos.cursor = saved.step, saved.epoch, saved.cursor
    t._first_step = saved.step
    t.checkpoints.last_saved_step = saved.step
    if saved.global_batch_size != pos.global_batch_size:
        log.warning("global batch changed on resume: %d -> %d; the data order continues at sample %d of "
                    "epoch %d, but steps are no longer comparable with the original run",
                    saved.global_batch_size, pos.global_batch_size, saved.cursor, saved.epoch)
    rngs = loaded.trainer["rng"]
    saved_stream = rngs[min(t.ctx.rank, len(rngs) - 1)].get("stream")
    if (saved_stream is None) != (t.stream is None):
        kinds = ("an IterableDataset", "a map-style dataset")
        saved_kind, this_kind = (kinds[1], kinds[0]) if saved_stream is None else kinds
        raise UsageError(f"{loaded.path} was saved from {saved_kind}; this run's is {this_kind}: start fresh "
                         "(--no-auto_resume or another --run_dir)")
    if t.stream is not None:
        t.stream_position.load_state_dict(saved_stream, t.ctx.world_size, t.cfg.num_workers)
    if saved.world_size == t.ctx.world_size:
        set_rng_state(rngs[t.ctx.rank], t.ctx.device)
    else:
        log.warning("world size changed on resume: %d -> %d; data order continues sample-exactly, per-rank "
                    "RNG streams (dropout) are reseeded", saved.world_size, t.ctx.world_size)
        seed_rank_rngs(mix_seed(t.cfg.seed, saved.step), t.ctx.rank)


def _restore_window(t: Trainer, ranks: list[dict[str, Any]], saved_world: int) -> None:
    """Each rank's own unlogged sums; on another world size rank 0 takes them all (the totals stay right)."""
    windows = [r["window"] for r in ranks if "window" in r]
    if len(windows) != len(ranks):
        return  # a checkpoint from before per-rank windows: its one window was rank 0's
    if saved_world == t.ctx.world_size:
        t.window.load_state_dict(windows[t.ctx.rank])
    elif t.ctx.is_main:
        total = {key: sum(w[key] for w in windows) for key in ("loss", "count", "bad_loss")}
        total["bad_steps"] = torch.stack([w["bad_steps"] for w in windows]).any(dim=0)
        t.window.load_state_dict({**total, "steps": windows[0]["steps"]})
