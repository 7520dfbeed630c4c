"""Callbacks: a user's code at the loop's events, with its state in every checkpoint (docs/callbacks.md).

A callback is any object with some of `Callback`'s methods. The Trainer calls `on_train_start`,
`on_step_end`, `on_eval`, `on_checkpoint` and `on_train_end` on every rank, `on_log` on rank 0; each gets the
`TrainingRun`, the callback's view of the loop. `state_dict`/`load_state_dict` ride in each rank's part of a
checkpoint (the "callbacks" part, `loop.checkpointed.CallbackState`). `TrainingRun.request_stop` travels in the
control vote, so every rank stops at the same step. Built on it: `EarlyStopping` (--early_stop_metric),
`BestCheckpoint` (--keep_best), `EMA` (--ema_decay).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from ddptrain.config import load_plugin
from ddptrain.errors import UsageError

log = logging.getLogger("ddptrain")

SAME_AS_RANK_0 = "same as rank 0"  # a state_dict() of a replicated callback on ranks > 0: restore rank 0's
HOOKS = ("on_train_start", "on_step_end", "on_log", "on_eval", "on_checkpoint", "on_train_end")


class Callback:
    """Base class of callbacks (optional): every hook does nothing."""

    def on_train_start(self, run: TrainingRun) -> None: ...

    def on_step_end(self, run: TrainingRun) -> None: ...

    def on_log(self, run: TrainingRun, record: dict[str, Any]) -> None: ...

    def on_eval(self, run: TrainingRun, metrics: dict[str, Any]) -> None: ...

    def on_checkpoint(self, run: TrainingRun, step: int) -> None: ...

    def on_train_end(self, run: TrainingRun, summary: dict[str, Any]) -> None: ...


class TrainingRun:
    """What a callback sees of the loop (read the attributes; call `request_stop`)."""

    def __init__(self, trainer: Any):
        self._trainer = trainer
        self.stop_reason: str | None = None  # this rank's request, until the vote carries it
        self.stop_now = False  # the request is the same on every rank at this step: no vote needed
        # keep_as_best was called: the next save (at this step) is also best/, described by this dict.
        self.best_wanted: dict[str, Any] | None = None

    step = property(lambda self: self._trainer.position.step, doc="optimizer steps done")
    epoch = property(lambda self: self._trainer.position.epoch)
    rank = property(lambda self: self._trainer.ctx.rank)
    world_size = property(lambda self: self._trainer.ctx.world_size)
    is_main = property(lambda self: self._trainer.ctx.is_main)
    config = property(lambda self: self._trainer.cfg)
    model = property(lambda self: self._trainer.module)
    optimizer = property(lambda self: self._trainer.optimizer)
    run_dir = property(lambda self: Path(self._trainer.run_dir))

    def request_stop(self, reason: str, same_on_every_rank: bool = False) -> None:
        """Stop training at a step every rank agrees on; `reason` goes into the log and the checkpoint.

        `same_on_every_rank=True` promises that every rank makes this request at this same step (a decision
        on eval metrics, which are the same everywhere): the run then stops at this step, without waiting for
        the vote. A promise broken leaves the other ranks waiting in their next collective.
        """
        if self.stop_reason is None:
            self.stop_reason = reason
            self.stop_now = same_on_every_rank

    def keep_as_best(self, about: dict[str, Any] | None = None) -> None:
        """Save a checkpoint at this step (unless one is) and keep it as CHECKPOINT_DIR/best, apart from
        retention. Every rank must call it at the same step (a decision on eval metrics is). `about` is written
        beside it as best/best.json (JSON values); `"weights": "ema"` there makes `ddptrain export` of best/
        give the --ema_decay average, not the trained weights."""
        self.best_wanted = {"step": self.step, **(about or {})}


class Callbacks:
    """The run's callbacks, called in order; their states by name."""

    def __init__(self, callbacks: list[Any]):
        self.items = list(callbacks)
        # The built-ins the flags added (`run_callbacks`), which the loop also asks of: --ema_decay's average
        # (evaluated, exported, restored with best/) and --keep_best's (the best/ a resumed run still owes).
        self.ema: EMA | None = None
        self.best: BestCheckpoint | None = None
        self.names: list[str] = []
        for callback in self.items:
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise UsageError(f"callback {callback!r}: has none of the hooks {', '.join(HOOKS)} "
                                 "(see ddptrain.Callback)")
            base = str(getattr(callback, "name", None) or type(callback).__name__)
            name, n = base, 1
            while name in self.names:
                n += 1
                name = f"{base}-{n}"
            self.names.append(name)

    def __bool__(self) -> bool:
        return bool(self.items)


    def call(self, hook: str, *args: Any) -> None:
        for callback in self.items:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def state_dict(self) -> dict[str, Any]:
        return {name: callback.state_dict() for name, callback in zip(self.names, self.items)
                if callable(getattr(callback, "state_dict", None))}

    def load_state_dict(self, states: dict[str, Any], rank0: dict[str, Any]) -> None:
        """This rank's saved states; `rank0`'s for a callback that saved SAME_AS_RANK_0 here."""
        for name, callback in zip(self.names, self.items):
            state = states.get(name)
            if isinstance(state, str) and state == SAME_AS_RANK_0:
                state = rank0.get(name)
            if state is not None and callable(getattr(callback, "load_state_dict", None)):
                callback.load_state_dict(state)


def load_callbacks(refs: str) -> list[Any]:
    """`--callbacks 'pkg.mod:fn,...'`: each fn() returns a callback (a class is instantiated)."""
    out = []
    for ref in (r.strip() for r in refs.split(",")):
        if ref:
            made = load_plugin(ref, "--callbacks")()
            out.append(made)
    return out


def run_callbacks(settings: Any, given: Any, sharded: bool) -> Callbacks:
    """A run's callbacks, from its [eval] section: `given` (`fit`'s), those --callbacks names, then the
    built-ins the flags ask for: EMA, early stopping, the best checkpoint (in this order)."""
    ema = EMA(settings.ema_decay, sharded) if settings.ema_decay else None
    stop = (EarlyStopping(settings.early_stop_metric, settings.early_stop_patience, settings.early_stop_mode,
                          settings.early_stop_min_delta) if settings.early_stop_metric else None)
    best = BestCheckpoint(settings.keep_best, settings.keep_best_mode) if settings.keep_best else None
    callbacks = Callbacks([*given, *load_callbacks(settings.callbacks), *(c for c in (ema, stop, best) if c)])
    callbacks.ema, callbacks.best = ema, best
    return callbacks


class MetricWatch:
    """The best value so far of one eval metric, lower (`min`) or higher (`max`) being better, for the
    built-ins that watch one; `flag` names the option in errors."""

    def __init__(self, metric: str, mode: str, flag: str, min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise UsageError(f"{flag}: mode {mode!r}: use min or max")
        self.metric, self.mode, self.flag, self.min_delta = metric, mode, flag, min_delta
        self.best: float | None = None
        self.best_step = -1

    def improved(self, metrics: dict[str, Any], step: int) -> bool:
        """Whether this eval's value beats the best by more than min_delta (it then becomes the best)."""
        if self.metric not in metrics:
            shown = ", ".join(k for k, v in metrics.items() if isinstance(v, float))
            raise UsageError(f"{self.flag} {self.metric!r}: the eval reports no such metric; use one of {shown}")
        value = float(metrics[self.metric])
        if self.best is not None and not (value < self.best - self.min_delta if self.mode == "min"
                                          else value > self.best + self.min_delta):
            return False
        self.best, self.best_step = value, step
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]


class EarlyStopping(Callback):
    """Stop when eval `metric` has not improved by more than `min_delta` for `patience` evaluations in a row
    (`--early_stop_metric`, `--early_stop_patience`, `--early_stop_mode`, `--early_stop_min_delta`).

    Its best value and count are saved in checkpoints, so a restarted run keeps its patience. Eval metrics are
    the same on every rank, so every rank asks to stop at the same eval.
    """

    name = "early_stopping"

    def __init__(self, metric: str, patience: int, mode: str = "min", min_delta: float = 0.0):
        self.watch = MetricWatch(metric, mode, "--early_stop_metric", min_delta)
        self.patience = patience
        self.bad_evals = 0

    def on_eval(self, run: TrainingRun, metrics: dict[str, Any]) -> None:
        watch = self.watch
        if watch.improved(metrics, run.step):
            self.bad_evals = 0
            return
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            run.request_stop(f"early stopping: eval {watch.metric} has not improved on {watch.best:.6g} (step "
                             f"{watch.best_step}) for {self.bad_evals} evaluations (--early_stop_patience "
                             f"{self.patience})", same_on_every_rank=True)

    def state_dict(self) -> dict[str, Any]:
        return {**self.watch.state_dict(), "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.watch.load_state_dict(state)
        self.bad_evals = state["bad_evals"]


class BestCheckpoint(Callback):
    """Keep the checkpoint of the best eval `metric` as CHECKPOINT_DIR/best (`--keep_best`, `--keep_best_mode`):
    an eval that improves on the best saves a checkpoint at its step, which becomes best/ once committed. Its
    best value rides in checkpoints, so a restarted run compares with the best before it."""

    name = "best_checkpoint"

    def __init__(self, metric: str, mode: str = "min"):
        self.watch = MetricWatch(metric, mode, "--keep_best")

    def on_eval(self, run: TrainingRun, metrics: dict[str, Any]) -> None:
        if self.watch.improved(metrics, run.step):
            run.keep_as_best(self.about())

    def about(self) -> dict[str, Any]:
        """What best/best.json says of the best so far (the step comes with `keep_as_best`)."""
        # An ema_ metric scored the average (--ema_eval): best/ is the average's.
        weights = "ema" if self.watch.metric.startswith("ema_") else "trained"
        return {"metric": self.watch.metric, "value": self.watch.best, "weights": weights}

    def state_dict(self) -> dict[str, Any]:
        return self.watch.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.watch.load_state_dict(state)


class EMA(Callback):
    """An exponential moving average of the parameters (`--ema_decay`): after every optimizer step,
    ema <- ema + (1 - decay) * (param - ema) (torch.lerp), on the device beside the weights and, under
    fsdp/hsdp, sharded like them (each rank averages its own shards).

    Its state rides in checkpoints: under ddp the average is the same on every rank, so rank 0's is saved
    and every rank restores it; under fsdp each rank saves its shards. Exported at the end as
    RUN_DIR/model_ema.safetensors (`loop.finish.FinalWeights.export`), the model's state dict with the averaged
    parameters (buffers as trained).
    """

    name = "ema"

    def __init__(self, decay: float, sharded: bool):
        self.decay, self.sharded = decay, sharded
        self.shadow: list[Any] | None = None
        self._pending: list[Any] | None = None  # restored before the model's parameters are known

    def _locals(self, tensors: list[Any]) -> list[Any]:
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]

    def on_train_start(self, run: TrainingRun) -> None:
        import torch

        if self.shadow is not None:
            return
        named = list(run.model.named_parameters())
        self.names, params = [n for n, _ in named], [p for _, p in named]
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in params]
        if self._pending is not None:
            saved, self._pending = self._pending, None
            if not self._take(saved):
                log.warning("--ema_decay: the checkpoint's average was sharded for another world size; the "
                            "average starts again from the current weights")

    def on_step_end(self, run: TrainingRun) -> None:
        import torch

        with torch.no_grad():
            torch._foreach_lerp_(self._locals(self.shadow),
                                 self._locals([p.detach() for p in run.model.parameters()]), 1.0 - self.decay)

    def swapped_in(self, module: Any) -> Any:
        """A context in which `module`'s parameters hold the average (its own values back after)."""
        import torch

        @contextlib.contextmanager
        def swap():
            params = self._locals([p.detach() for p in module.parameters()])
            with torch.no_grad():
                kept = [p.clone() for p in params]
                torch._foreach_copy_(params, self._locals(self.shadow))
            try:
                yield
            finally:
                with torch.no_grad():
                    torch._foreach_copy_(params, kept)

        return swap()

    def state_dict(self) -> Any:
        import torch.distributed as dist

        if not self.sharded and dist.is_initialized() and dist.get_rank() != 0:
            return SAME_AS_RANK_0  # a replica: rank 0's average is every rank's
        return {"decay": self.decay, "names": self.names,
                "shadow": [t.detach().cpu().clone() for t in self._locals(self.shadow)]}

    @staticmethod
    def weights_of(trainer_state: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
        """The average saved in a checkpoint (its trainer state) as a whole state dict: `trained` (the
        checkpoint's whole weights) with each parameter replaced by its average. Sharded runs saved each rank's
        shards of dim 0: they are joined in rank order (under hsdp the first replica's ranks make the whole).
        Raises ValueError for a checkpoint without an average, or from before averages had names."""
        import torch

        states = [rank.get("callbacks", {}).get(EMA.name) for rank in trainer_state["rng"]]
        states = [s for s in states if isinstance(s, dict)]
        if not states:
            raise ValueError("it holds no EMA (the run had no --ema_decay)")
        if "names" not in states[0]:
            raise ValueError("its EMA was saved without parameter names (before ddptrain 0.1.0's best/ of EMA "
                             "metrics); use RUN_DIR/model_ema.safetensors")
        out = dict(trained)
        for i, name in enumerate(states[0]["names"]):
            full_rows, parts, rows = trained[name].shape[0] if trained[name].dim() else 0, [], 0
            for state in states:
                if parts and rows >= full_rows:
                    break
                parts.append(state["shadow"][i])
                rows += parts[-1].shape[0] if parts[-1].dim() else 0
            value = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[name] = value.reshape(trained[name].shape).to(trained[name].dtype)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = state["shadow"]

    def restore_now(self, state: Any, rank0_state: Any) -> bool:
        """A checkpoint's average (this rank's saved state; rank 0's where a replica saved SAME_AS_RANK_0) into
        the running one now, mid-run. False, changing nothing, where it has none or its shards are another world
        size's."""
        if isinstance(state, str) and state == SAME_AS_RANK_0:
            state = rank0_state
        return self._take(state.get("shadow") if isinstance(state, dict) else None)

    def _take(self, saved: list[Any] | None) -> bool:
        """`saved` (a checkpoint's shadow tensors) into this rank's average; False, changing nothing, where there
        is none or its shapes are another world size's shards."""
        import torch

        mine = self._locals(self.shadow)
        if saved is None or [tuple(t.shape) for t in saved] != [tuple(t.shape) for t in mine]:
            return False
        with torch.no_grad():
            for target, value in zip(mine, saved):
                target.copy_(value)
        return True

    def copy_to(self, module: Any) -> None:
        """The average into `module`'s parameters, for good."""
        import torch

        with torch.no_grad():
            torch._foreach_copy_(self._locals([p.detach() for p in module.parameters()]), self._locals(self.shadow))
