"""Trainer: fit / train_step / evaluate.

`fit` reads top to bottom; the dense numerics (autocast, skipped gradient sync on accumulation
micro-steps, unscale, clip, non-finite guard, optimizer) live in `train_step`. What varies sits behind
small objects: the task (what a step computes), the parallel wrapper (how the model is replicated), the
metric window and RNG state (what a checkpoint restores besides weights), the evaluator. Nothing in a step
waits for the device except at log steps: metrics accumulate in device tensors and are read once per
`--log_interval`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import IterableDataset

from ddptrain.batch import collate, to_device
from ddptrain.checkpoint import CheckpointManager, Loaded, Position, Snapshot, safetensors_bytes, write_atomic
from ddptrain.config import TrainConfig
from ddptrain.data import (BatchLayout, GlobalOrderSampler, ShardedEvalSampler, build_datasets, epoch_batches,
                           make_loader, mix_seed)
from ddptrain.distributed import DistributedContext, LaggedVote
from ddptrain.errors import Preempted, TrainingError, UsageError
from ddptrain.evaluator import Evaluator
from ddptrain.faults import FaultInjector
from ddptrain.models import build_model
from ddptrain.observe import perf
from ddptrain.observe.log import rank_log_path
from ddptrain.observe.metrics import MetricSinks, ProgressBar
from ddptrain.observe.profiler import StepProfiler
from ddptrain.observe.train_log import Clock, TrainLog
from ddptrain.observe.watchdog import Watchdog
from ddptrain.optim import build_optimizer, build_scheduler, peak_lr
from ddptrain.parallel import DataParallel
from ddptrain.state import MetricWindow, rng_state, seed_rank_rngs, set_rng_state
from ddptrain.streams import StreamPosition, StreamShard, readers_per_rank, stream_batches, stream_loader
from ddptrain.tasks import Task, build_task

__all__ = ["Trainer", "build_optimizer"]
log = logging.getLogger("ddptrain")
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_MARKER = "PREEMPTED"


class StopSignals:
    """SIGTERM / SIGUSR1 only set a flag; the loop acts on it at the next step boundary, on all ranks."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """One process's part of a job. `model` (a module, or fn(cfg) -> module), `datasets` ((train, eval or
    None)) and `task` default to what the config names; the Python API passes its own."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, run_dir: Path, *,
                 model: nn.Module | Callable[[TrainConfig], nn.Module] | None = None,
                 datasets: tuple[Any, Any] | None = None, task: Task | None = None):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        device = ctx.device
        self.task = task if task is not None else build_task(cfg)

        # Data first: its size decides the schedule. Global batch = micro batch x world x accumulation.
        train_ds, eval_ds = datasets if datasets is not None else build_datasets(cfg)
        self.layout = BatchLayout(cfg.batch_size, ctx.world_size, cfg.grad_accum_steps)
        self.stream: StreamShard | None = None  # an IterableDataset: no length, read as a partitioned stream
        if isinstance(train_ds, IterableDataset):
            if not cfg.max_steps:
                raise UsageError("the training dataset is an IterableDataset (a stream without a length): pass "
                                 "--max_steps to say how long to train")
            self.stream = StreamShard(train_ds, cfg.seed, ctx.rank, ctx.world_size)
            self.stream_position = StreamPosition(ctx.world_size * readers_per_rank(cfg.num_workers), ctx.rank,
                                                  cfg.num_workers)
            self.num_train, self.steps_per_epoch, self.sampler = None, None, None
            self.train_loader = stream_loader(self.stream, cfg, device, drop_last=True,
                                              seed=mix_seed(cfg.seed, 4, ctx.rank))
        else:
            self.num_train = len(train_ds)
            self.steps_per_epoch = self.layout.steps_per_epoch(self.num_train)
            if self.steps_per_epoch == 0:
                raise UsageError(f"--batch_size {cfg.batch_size} x {ctx.world_size} processes x --grad_accum_steps "
                                 f"{cfg.grad_accum_steps} = {self.layout.global_batch_size} exceeds the "
                                 f"{self.num_train} training samples; lower one of them")
            self.sampler = GlobalOrderSampler(self.num_train, self.layout, ctx.rank, cfg.seed)
            self.train_loader = make_loader(train_ds, self.sampler, cfg, device,
                                            seed=mix_seed(cfg.seed, 4, ctx.rank))
        # With loader workers on CPU, a thread takes their batches off the training thread (on CUDA, torch's
        # pin-memory thread does). Without workers, reading a sample seeds the global RNGs: no thread then.
        self._background_batches = device.type == "cpu" and self.train_loader.num_workers > 0
        self.eval_loader = None
        if isinstance(eval_ds, IterableDataset):
            self.eval_loader = stream_loader(StreamShard(eval_ds, cfg.seed, ctx.rank, ctx.world_size), cfg, device,
                                             drop_last=False, seed=mix_seed(cfg.seed, 5, ctx.rank))
        elif eval_ds is not None and len(eval_ds) > 0:
            eval_sampler = ShardedEvalSampler(len(eval_ds), cfg.batch_size, ctx.rank, ctx.world_size)
            self.eval_loader = make_loader(eval_ds, eval_sampler, cfg, device, seed=mix_seed(cfg.seed, 5, ctx.rank))

        # Model: identical init on every rank (DDP would broadcast rank 0's anyway), then the wrapper.
        torch.manual_seed(cfg.seed)
        if model is None:
            model = build_model(cfg)
        elif not isinstance(model, nn.Module):
            model = model(cfg)
        module = model.to(device)
        if cfg.sync_batchnorm:
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        if cfg.channels_last:
            module = module.to(memory_format=torch.channels_last)
        self.module = module
        fp16 = cfg.use_amp and cfg.amp_dtype == "fp16"
        self.autocast = lambda: torch.autocast(device.type, torch.float16 if fp16 else torch.bfloat16,  # noqa: E731
                                               enabled=cfg.use_amp)
        # Counted before the per-rank RNG streams start: reading a sample may draw augmentation randomness.
        self.flops_per_sample = self._count_flops(train_ds) if ctx.is_main else 0.0
        self.parallel = DataParallel(module, cfg, ctx)
        self.model = self.parallel.model
        self.params = [p for p in module.parameters() if p.requires_grad]

        # Optimizer and schedule. The linear scaling rule is opt-in: lr * global batch / base batch.
        self.peak_lr = peak_lr(cfg, self.layout.global_batch_size)
        if ctx.is_main and not cfg.scale_lr and self.layout.global_batch_size != cfg.base_batch_size:
            factor = self.layout.global_batch_size / cfg.base_batch_size
            log.warning("global batch %d differs from --base_batch_size %d, the batch --lr %g was tuned for: the "
                        "linear scaling rule (--scale_lr) would train at lr %g (x%g); training at %g",
                        self.layout.global_batch_size, cfg.base_batch_size, cfg.lr, cfg.lr * factor, factor, cfg.lr)
        self.optimizer = build_optimizer(cfg, self.params, self.peak_lr)
        self._optimizer_stepped = False  # whether the optimizer has state (see train_step)
        self.total_steps = cfg.max_steps if self.stream is not None else cfg.epochs * self.steps_per_epoch
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.peak_lr, self.total_steps)
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None

        # Per-rank RNG streams from here on: data order and augmentation never read them.
        seed_rank_rngs(cfg.seed, ctx.rank)
        self.position = Position(step=0, epoch=0, cursor=0, global_batch_size=self.layout.global_batch_size,
                                 world_size=ctx.world_size)
        self.injector = FaultInjector(cfg.inject_fault, ctx.rank)
        self.checkpoints = CheckpointManager(ctx, cfg.checkpoint_path, cfg.keep_last, cfg.async_checkpoint,
                                             cfg.checkpoint_timeout_s, self.injector)
        self.watchdog = Watchdog(ctx, rank_log_path(run_dir, ctx.rank), cfg.hang_timeout_s,
                                 startup_timeout_s=cfg.init_timeout_s, checkpoint_timeout_s=cfg.checkpoint_timeout_s)
        self.profiler = StepProfiler(cfg.enable_profiling, run_dir, ctx.rank, cfg.profile_wait,
                                     cfg.profile_warmup, cfg.profile_active)
        self.signals = StopSignals()
        self._vote = LaggedVote(ctx)
        self.clock = Clock(device)
        self._module_started: Any = None
        if self.parallel.ddp is not None and not cfg.compile:
            # DDP broadcasts buffers (BatchNorm statistics) before the module runs, which waits for late
            # ranks: the straggler statistic times the module's own forward, from this hook on.
            module.register_forward_pre_hook(self._module_forward_started)
        self.sinks = MetricSinks(run_dir, cfg.tensorboard) if ctx.is_main else None
        self.peak_tflops = cfg.peak_tflops or perf.known_peak_tflops(device)
        self.window = MetricWindow(device, cfg.log_interval)
        self.train_log = TrainLog(ctx, self.sinks, self.clock, self.layout.global_batch_size, self.task.unit,
                                  self.flops_per_sample, self.peak_tflops, cfg.straggler_skew)
        self.evaluator = Evaluator(ctx, self.eval_loader, self.task, self.autocast, cfg.channels_last)
        self._sample_log = None
        if cfg.record_sample_ids:
            (run_dir / "samples").mkdir(parents=True, exist_ok=True)
            self._sample_log = open(run_dir / "samples" / f"rank-{ctx.rank}.jsonl", "a", buffering=1)

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (epochs or --max_steps), evaluating each epoch and checkpointing as asked.

        Must be called on all ranks. Raises Preempted after a preemption checkpoint has committed.
        """
        cfg, pos = self.cfg, self.position
        started = time.perf_counter()
        last_eval: dict[str, Any] = {}
        with self.signals, self.watchdog, self.profiler, self._outputs_closed_at_exit():
            self._resume()
            if pos.step >= self.total_steps or pos.epoch >= cfg.epochs:
                log.info("run already complete at step %d in %s; nothing to train (use another --run_dir, or "
                         "--no-auto_resume to start over)", pos.step, self.run_dir)
            bar = ProgressBar(cfg.progress and self.ctx.is_main, self.total_steps, initial=pos.step)
            if self.stream is not None:
                # A stream has no epochs in common: each rank cycles its own share until --max_steps.
                with stream_batches(self.train_loader, self.stream, self.stream_position,
                                    self._background_batches) as batches:
                    while pos.step < self.total_steps:
                        self._step(batches, bar)
            # Each pass of this loop is (the rest of) one epoch: the sampler resumes at the cursor.
            while self.stream is None and pos.epoch < cfg.epochs and pos.step < self.total_steps:
                self.sampler.set_position(pos.epoch, pos.cursor)
                with epoch_batches(self.train_loader, background=self._background_batches) as batches:
                    while (pos.cursor + self.layout.global_batch_size <= self.num_train
                           and pos.step < self.total_steps):
                        self._step(batches, bar)
                if pos.step >= self.total_steps and pos.cursor + self.layout.global_batch_size <= self.num_train:
                    break  # --max_steps ended the run mid-epoch
                # The epoch is complete: evaluate, move the cursor to the next epoch, maybe save.
                last_eval = self.evaluate()
                pos.epoch, pos.cursor = pos.epoch + 1, 0
                if cfg.save_every and pos.epoch % cfg.save_every == 0:
                    self.save()

            # The end: log the partial window, evaluate if the last epoch ended early, final save.
            if self.window.steps:
                self._log_train(bar)
            if not last_eval or last_eval["step"] != pos.step:
                last_eval = self.evaluate()
            self._vote.drain()  # a preemption flag still in flight is moot: the final save follows
            self.watchdog.phase("replica check")
            self.parallel.check_replicas()
            self.save()
            self.checkpoints.wait()
        bar.close()
        self._export_weights()
        return self._summary(last_eval, time.perf_counter() - started)

    def _step(self, batches: Iterator, bar: ProgressBar) -> None:
        """A training step and what follows it at the step boundary: schedule, logging, flags, saves."""
        cfg, pos = self.cfg, self.position
        self.train_step(batches)
        pos.step += 1
        pos.cursor += self.layout.global_batch_size
        self.scheduler.step()
        self.profiler.step()
        if pos.step == 1 + self._first_step:
            # Tier two: the generous init timeout covered rendezvous and the first step.
            self.ctx.set_collective_timeout(cfg.collective_timeout_s)
        if pos.step % cfg.log_interval == 0:
            self._log_train(bar)
        self._between_steps()

    # ------------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches.

        Non-final micro-batches skip gradient communication, so gradients are reduced once, on the last.
        Each micro-batch loss is divided by the number of micro-batches: with the average over ranks, the
        update equals one process training on the whole global batch. Must be called on all ranks.
        """
        cfg, wd, window = self.cfg, self.watchdog, self.window
        step = self.position.step + 1  # the number of this step: steps done once it completes
        accum = cfg.grad_accum_steps
        self.optimizer.zero_grad(set_to_none=True)
        spans = []
        for micro in range(accum):
            wd.phase("data", step)
            self.injector.at_micro_step(step, micro)  # after the phase: an injected hang reads as a data stall
            waited = time.perf_counter()
            ids, batch = next(batches)
            window.data_wait += time.perf_counter() - waited
            if self._sample_log is not None:
                row = {"step": step, "micro": micro, "ids": ids}
                if self.stream is not None:
                    row["epoch"] = self.stream_position.epoch  # each rank's own epoch of its share
                self._sample_log.write(json.dumps(row) + "\n")
            batch = to_device(batch, self.ctx.device, cfg.channels_last)

            last = micro == accum - 1
            wd.phase(self.parallel.communicating_phase if last and self.ctx.world_size > 1 else "forward/backward")
            start = self.clock.now()
            with self.parallel.accumulating(last):
                with self.profiler.region("forward"), self.autocast():
                    loss, _ = self.task.loss(self.model, batch)
                own_start = self._module_started if self._module_started is not None else start
                spans.append(("forward", own_start, self.clock.now()))  # this rank's own work, no waiting
                if self.injector.poison_loss(step):
                    loss = loss + float("nan")
                finite = window.add_loss(loss)
                # A non-finite loss on one rank must stop the update on every rank. Multiplying by NaN
                # poisons this rank's gradients, and the gradient all-reduce carries that into the global
                # norm checked below: the same decision everywhere, with no extra collective.
                scaled = loss * torch.where(finite, 1.0 / accum, torch.nan)
                with self.profiler.region("backward"):
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            spans.append(("fwd_bwd", start, self.clock.now()))
            window.units += self.task.count(batch)

        wd.phase("optimizer")
        start = self.clock.now()
        with self.profiler.region("optimizer"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.params, cfg.grad_clip, norm, foreach=True)
            # The gradients are averaged over ranks, so `norm` is identical on every rank: the non-finite
            # decision below is the same everywhere without another collective.
            bad = ~torch.isfinite(norm)
            if cfg.on_nonfinite == "stop" and self.scaler is None:
                if bool(bad):  # host sync, the price of stopping at the very step
                    self._stop_nonfinite([step])
                self.optimizer.step()
            elif not self._optimizer_stepped and bool(bad):
                # Before its first update a fused optimizer has no state: asked to skip, it would allocate
                # momentum buffers uninitialised and never write them. So until the first update the skip is
                # decided on the host (one sync per step until then, none after): the step never happened.
                if self.scaler is not None:
                    self.scaler.update()  # lower the fp16 loss scale as after any overflow
            else:
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)  # GradScaler hands found_inf to the fused kernel
                    self.scaler.update()
                else:
                    self.optimizer.found_inf = bad.float()  # the fused kernel skips the update on device
                    self.optimizer.step()
                self._optimizer_stepped = True
        spans.append(("optimizer", start, self.clock.now()))
        window.end_step(step, bad, norm, spans)

    def _module_forward_started(self, module: nn.Module, args: Any) -> None:
        self._module_started = self.clock.now()

    def evaluate(self) -> dict[str, Any]:
        """Exact eval of the task's metrics over the eval set (rank 0's buffers). Must be called on all ranks."""
        self.watchdog.phase("eval")
        self.parallel.sync_buffers()
        result = self.evaluator.evaluate(self.module, heartbeat=lambda: self.watchdog.phase("eval"))
        if not result:
            return {}
        pos = self.position
        shown = " ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float) and k != "tokens_per_sec")
        log.info("eval  step %d epoch %d: %s (%d samples)", pos.step, pos.epoch, shown, result["samples"])
        if self.sinks is not None:
            self.sinks.write({"time": time.time(), "step": pos.step, "epoch": pos.epoch, "split": "eval", **result})
        return {"step": pos.step, **result}

    # --- between steps: control flags, saves -----------------------------------------------------
    def _between_steps(self) -> None:
        """Act on preemption and timed saves at a step boundary, agreed by one tiny CPU all-reduce.

        Signals and clocks differ between ranks; the MAX over ranks makes the decision the same everywhere.
        The vote is read one step after it is cast (see `LaggedVote`), so nothing waits for it.
        """
        cfg, step = self.cfg, self.position.step
        self.watchdog.phase("sync")
        due_by_time = (self.ctx.is_main and cfg.save_every_minutes > 0
                       and time.monotonic() - self._last_save_time >= 60 * cfg.save_every_minutes)
        preempt, timed = self._vote.exchange([self.signals.received is not None, due_by_time])
        if preempt:
            self.save()
            self.checkpoints.wait()
            signal_name = self.signals.received or "a peer's signal"
            if self.ctx.is_main:
                write_atomic(self.run_dir / PREEMPTED_MARKER,
                             json.dumps({"step": step, "signal": signal_name, "time": time.time()}).encode())
            log.warning("preempted (%s): checkpoint of step %d committed; exiting", signal_name, step)
            raise Preempted(step, signal_name)
        if timed or (cfg.save_every_steps and step % cfg.save_every_steps == 0):
            self.save()

    def save(self) -> None:
        """Checkpoint the current position (skipped if this step is already saved). All ranks."""
        if self.position.step == self.checkpoints.last_saved_step:
            return
        self.watchdog.phase("checkpoint")
        self.parallel.sync_buffers()
        self.checkpoints.save(Position(**vars(self.position)), self._snapshot, self._rank_state())
        self._last_save_time = time.monotonic()

    def _rank_state(self) -> dict[str, Any]:
        """What differs between ranks and a checkpoint gathers from each: RNG streams, the unlogged metric window,
        a stream's position."""
        state = {**rng_state(self.ctx.device), "window": self.window.state_dict()}
        if self.stream is not None:
            state["stream"] = self.stream_position.state_dict()
        return state

    def _snapshot(self) -> Snapshot:
        return Snapshot(
            position=Position(**vars(self.position)),
            model=self.parallel.state_dict(),
            optimizer=self.optimizer.state_dict(),
            trainer={"scheduler": self.scheduler.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                     "window": self.window.state_dict()},
            config=self.cfg.to_dict(),
        )

    def _resume(self) -> None:
        """Restore the newest usable checkpoint (or --resume_from). All ranks."""
        self._first_step = 0
        self._last_save_time = time.monotonic()
        if self.ctx.is_main:
            (self.run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        loaded = None
        if self.cfg.resume_from or self.cfg.auto_resume:
            loaded = self.checkpoints.resume(self.cfg.resume_from, self.module.state_dict(),
                                             continue_line=self.cfg.auto_resume)
        if loaded is not None:
            self._apply(loaded)
        self.checkpoints.start_line(loaded)

    def _apply(self, loaded: Loaded) -> None:
        saved, pos = loaded.position, self.position
        saved_optimizer = loaded.manifest["config"].get("optimizer", self.cfg.optimizer)
        if saved_optimizer != self.cfg.optimizer:
            raise UsageError(f"--optimizer {self.cfg.optimizer}: {loaded.path} holds {saved_optimizer} state; "
                             f"resume with --optimizer {saved_optimizer}, or start fresh (--no-auto_resume or "
                             "another --run_dir)")
        self.module.load_state_dict(loaded.model)
        # The config decides the hyperparameters (momentum, betas, weight decay, ...): the checkpoint only
        # supplies the optimizer's state. A changed value is said once.
        configured = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                      for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(loaded.optimizer)
        self._optimizer_stepped = bool(self.optimizer.state)
        for group, wanted in zip(self.optimizer.param_groups, configured):
            changed = {k: (group.get(k), v) for k, v in wanted.items() if group.get(k) != v and k != "initial_lr"}
            if changed and self.ctx.is_main and group is self.optimizer.param_groups[0]:
                log.warning("resume: the config overrides the checkpoint's optimizer settings: %s",
                            ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
            group.update(wanted)
        self.scheduler.load_state_dict(loaded.trainer["scheduler"])
        self.scheduler.base_lrs = [self.peak_lr] * len(self.optimizer.param_groups)  # the config decides
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = self.peak_lr * factor(self.scheduler.last_epoch)
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
            total = {key: sum(w[key] for w in windows) for key in ("loss", "count", "bad_loss")}
            total["bad_steps"] = torch.stack([w["bad_steps"] for w in windows]).any(dim=0)
            self.window.load_state_dict({**total, "steps": windows[0]["steps"]})

    # --- metrics ---------------------------------------------------------------------------------
    def _log_train(self, bar: ProgressBar) -> None:
        self.watchdog.phase("log")
        pos = self.position
        self.train_log.write(self.window, pos.step, pos.epoch, self.total_steps, self.optimizer.param_groups[0]["lr"],
                             bar)
        self.window.reset()

    def _stop_nonfinite(self, steps: list[int]) -> None:
        local_bad = float(self.window.bad_loss)
        ranks = [r for r, (n,) in enumerate(self.ctx.gather_floats([local_bad])) if n > 0]
        raise TrainingError(f"non-finite gradient norm at step {steps[0]} (non-finite loss on rank(s) "
                            f"{ranks or 'none'}); stopping as --on_nonfinite stop asks")

    # --- the end ---------------------------------------------------------------------------------
    def _count_flops(self, dataset: Any) -> float:
        try:
            batch = to_device(collate([dataset[0]]), self.ctx.device)
            flops = perf.train_flops(self.module, lambda: self.task.loss(self.module, batch))
            log.info("model: %.3g parameters, %.3g training FLOPs per sample",
                     sum(p.numel() for p in self.module.parameters()), flops)
            return flops
        except Exception as exc:  # an exotic plug-in model: MFU is a nicety, never a reason to fail
            log.warning("FLOP count unavailable (%s: %s); no MFU will be reported", type(exc).__name__, exc)
            return 0.0

    def _export_weights(self) -> None:
        if self.ctx.is_main:
            write_atomic(self.run_dir / "model.safetensors",
                         safetensors_bytes(self.parallel.state_dict(), metadata={"step": str(self.position.step)}))

    def close(self) -> None:
        """Stop the loaders' worker processes now. Safe to call twice; a later `fit` would start new ones.

        A Trainer sits in reference cycles (forward hooks hold bound methods), so without this it is freed
        by the cyclic garbage collector, which can finalize a loader's queues before the loader's iterator
        asks its workers to stop: the stop message is then never sent and every worker costs a 5 s join
        timeout. Dropping the iterators while everything is alive shuts the workers down in milliseconds.
        """
        for loader in (self.train_loader, self.eval_loader):
            if loader is not None:
                loader._iterator = None  # persistent workers: the iterator's __del__ sends them the stop

    @contextlib.contextmanager
    def _outputs_closed_at_exit(self) -> Iterator[None]:
        """Metric lines and sample ids already produced reach the disk however `fit` ends."""
        try:
            yield
        finally:
            if self._sample_log is not None:
                self._sample_log.close()
            if self.sinks is not None:
                self.sinks.close()

    def _summary(self, last_eval: dict[str, Any], elapsed: float) -> dict[str, Any]:
        metrics = {k: v for k, v in last_eval.items() if k != "step"}
        summary = {"step": self.position.step, "epoch": self.position.epoch, "elapsed_s": elapsed,
                   "eval": metrics, "eval_loss": metrics.get("loss"), "eval_accuracy": metrics.get("accuracy")}
        if self.ctx.is_main:
            shown = "".join(f", eval {k} {v:.4f}" for k, v in metrics.items()
                            if isinstance(v, float) and k != "tokens_per_sec")
            log.info("done: %d steps, %d epochs in %.1f s%s. run dir %s · metrics %s · weights %s",
                     summary["step"], summary["epoch"], elapsed, shown,
                     self.run_dir, self.run_dir / "metrics.jsonl", self.run_dir / "model.safetensors")
        return summary
