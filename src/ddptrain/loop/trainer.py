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
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import ddptrain
from ddptrain.checkpoints.format import (BEST_ABOUT, Position, changed_settings_error, read_json, safetensors_bytes,
                                         write_atomic)
from ddptrain.checkpoints.manager import CheckpointManager, SaveSchedule
from ddptrain.config import TrainConfig, parse_duration, parse_trackers, setting_changes
from ddptrain.data.batch import to_device
from ddptrain.data.pipeline import BatchLayout, build_datasets, epoch_batches
from ddptrain.data.streams import stream_batches
from ddptrain.errors import EXIT_PREEMPTED, Preempted, TrainingError, UsageError
from ddptrain.faults import FaultInjector
from ddptrain.loop.callbacks import EMA, BestCheckpoint, Callbacks, EarlyStopping, TrainingRun, load_callbacks
from ddptrain.loop.evaluator import Evaluator
from ddptrain.loop.loaders import build_loaders
from ddptrain.loop.normalise import LossNormaliser
from ddptrain.loop.optim import build_optimizer, build_scheduler, parameter_groups, peak_lr
from ddptrain.loop.preempt import StopSignals
from ddptrain.loop.sanity import check_first_batch
from ddptrain.loop.state import MetricWindow, seed_rank_rngs
from ddptrain.loop.tasks import build_task
from ddptrain.loop.train_log import Clock, TrainLog
from ddptrain.loop.trainer_state import CheckpointedState
from ddptrain.models import hf, instantiate, lora
from ddptrain.observe import perf
from ddptrain.observe.log import rank_log_path
from ddptrain.observe.metrics import MetricSinks, ProgressBar
from ddptrain.observe.profiler import StepProfiler
from ddptrain.observe.trackers import Trackers
from ddptrain.parallel.distributed import DistributedContext, LaggedVote
from ddptrain.parallel.procenv import FINISHED_MARKER, LAUNCH_TIME_ENV, PREEMPTED_MARKER
from ddptrain.parallel.strategies import build_parallel
from ddptrain.parallel.watchdog import Watchdog
from ddptrain.parts import Parts

__all__ = ["Trainer", "build_optimizer"]
log = logging.getLogger("ddptrain")


class Trainer(CheckpointedState):
    """One process's part of a job. What `parts` (api.Parts: the Python API's own model, data, task, collate,
    optimizer and schedule) leaves None is what the config names."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, run_dir: Path, parts: Parts | None = None):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        parts = parts or Parts()
        self.task = parts.task if parts.task is not None else build_task(cfg)
        train_ds = self._build_data(parts)  # first: its size decides the schedule
        self._build_model(parts, train_ds)
        self._build_optimization(parts)
        # One batch through collate, loss and metrics on every rank: a user's mistake is one line now, not a
        # traceback at the first step or eval. Before the RNG streams below, which reseed what it drew.
        check_first_batch(self, parts)
        # Per-rank RNG streams from here on: data order and augmentation never read them.
        seed_rank_rngs(cfg.seed, ctx.rank)
        self.position = Position(step=0, epoch=0, cursor=0, global_batch_size=self.layout.global_batch_size,
                                 world_size=ctx.world_size)
        self._build_services()
        self._build_callbacks(parts)

    def _build_data(self, parts: Parts) -> Any:
        """Loaders, sampler or stream for this rank. Global batch = micro batch x world x accumulation.
        Returns the train dataset."""
        cfg, ctx = self.cfg, self.ctx
        train_ds, eval_ds = parts.datasets if parts.datasets is not None else build_datasets(cfg)
        # The tokenizer's files, not only its path: a checkpoint continues only on the token ids it learnt.
        self.tokenizer_digest = hf.tokenizer_digest(Path(cfg.tokenizer)) if cfg.tokenizer else None
        self.layout = BatchLayout(cfg.batch_size, ctx.world_size, cfg.grad_accum_steps)
        data = build_loaders(cfg, ctx, self.layout, train_ds, eval_ds, parts.collate_fn)
        self.train_loader, self.eval_loader, self.sampler = data.train, data.eval, data.sampler
        self.stream, self.stream_position = data.stream, data.stream_position
        self.num_train, self.steps_per_epoch = data.num_train, data.steps_per_epoch
        # With loader workers on CPU, a thread takes their batches off the training thread (on CUDA, torch's
        # pin-memory thread does). Without workers, reading a sample seeds the global RNGs: no thread then.
        self._background_batches = ctx.device.type == "cpu" and self.train_loader.num_workers > 0
        return train_ds

    def _build_model(self, parts: Parts, train_ds: Any) -> None:
        """The model, identical on every rank (DDP would broadcast rank 0's anyway), then its strategy's wrapper."""
        cfg, ctx, device = self.cfg, self.ctx, self.ctx.device
        self.module = module = instantiate(cfg, parts.model, device)  # LoRA's adapters injected too
        # What checkpoints leave out (frozen under LoRA: the model's source has it), and its fingerprint.
        self.frozen = lora.frozen_names(module) if lora.is_lora(module) else []
        self._frozen_fingerprint: list[list[float]] | None = None
        if hf.is_transformers(module) and ctx.is_main:
            module.config.save_pretrained(self.run_dir / hf.HF_DIR)  # what `ddptrain export --hf` rebuilds it from
        fp16 = cfg.use_amp and cfg.amp_dtype == "fp16"
        # Under fsdp/hsdp, --use_amp is FSDP's mixed-precision policy instead (parallel/strategies.py).
        if cfg.use_amp and cfg.strategy == "ddp":
            self.autocast = lambda: torch.autocast(device.type, torch.float16 if fp16 else torch.bfloat16)  # noqa: E731
        else:
            self.autocast = contextlib.nullcontext  # a disabled torch.autocast still costs time per micro-step
        # Counted before the per-rank RNG streams start: reading a sample may draw augmentation randomness. A model
        # built on the meta device (fsdp: filled after sharding) is counted there, on a meta copy of the sample.
        on = torch.device("meta") if any(p.is_meta for p in module.parameters()) else device
        self.flops_per_sample = (perf.task_flops_per_sample(module, self.task, train_ds, on, self.train_loader.collate_fn)
                                 if ctx.is_main else 0.0)
        self.parallel = build_parallel(module, cfg, ctx)
        self.model = self.parallel.model
        self.params = [p for p in module.parameters() if p.requires_grad]

    def _build_optimization(self, parts: Parts) -> None:
        """Optimizer, schedule and fp16 scaler. The linear scaling rule is opt-in: lr * global batch / base batch."""
        cfg, ctx, module = self.cfg, self.ctx, self.module
        training = cfg.section("training")  # what the optimizer and its schedule are built from
        self.peak_lr = peak_lr(training, self.layout.global_batch_size)
        lr_warning = cfg.lr_scaling_warning(self.layout.global_batch_size)  # None unless actionable
        if ctx.is_main and lr_warning:
            log.warning("%s", lr_warning)
        if parts.optimizer is not None:
            self.optimizer = parts.optimizer(self.params)
        else:
            self.optimizer = build_optimizer(training, parameter_groups(training, module), self.peak_lr,
                                             fused=not self.parallel.sharded)
        self._fused = bool(self.optimizer.defaults.get("fused"))  # an on-device skip (see train_step)
        self._no_yes = tuple(torch.tensor(v, device=self.ctx.device) for v in (0.0, 1.0))  # float32 flag values
        self._optimizer_stepped = False  # whether the optimizer has state (see train_step)
        # Gradient bytes held between the micro-steps of this process's first step, for the memory line
        # (None until measured, and at --grad_accum_steps 1).
        self.accumulated_grad_bytes: int | None = None
        self.total_steps = cfg.max_steps if self.stream is not None else cfg.epochs * self.steps_per_epoch
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self._own_schedule = parts.scheduler is None  # ddptrain's: the config decides its lr on resume
        self.scheduler = (build_scheduler(training, self.optimizer, self.peak_lr, self.total_steps)
                          if self._own_schedule else parts.scheduler(self.optimizer))
        fp16 = cfg.use_amp and cfg.amp_dtype == "fp16"
        self.scaler = torch.amp.GradScaler(ctx.device.type) if fp16 else None

    def _build_services(self) -> None:
        """What runs beside the steps: checkpoints, watchdog, profiler, stop signals and the control vote, the
        metric window, log and sinks, the evaluator, the sample-id record."""
        cfg, ctx, run_dir, module, device = self.cfg, self.ctx, self.run_dir, self.module, self.ctx.device
        self.injector = FaultInjector(cfg.inject_fault, ctx.rank)
        self.checkpoints = CheckpointManager(ctx, cfg.checkpoint_path, cfg.keep_last, cfg.async_checkpoint,
                                             cfg.checkpoint_timeout_s, self.injector, sharded=self.parallel.sharded,
                                             schedule=SaveSchedule.of(cfg.section("checkpoint")))
        self.watchdog = Watchdog(ctx, rank_log_path(run_dir, ctx.rank), cfg.hang_timeout_s,
                                 startup_timeout_s=cfg.init_timeout_s, checkpoint_timeout_s=cfg.checkpoint_timeout_s)
        self.profiler = StepProfiler(cfg.enable_profiling, run_dir, ctx.rank, cfg.profile_wait,
                                     cfg.profile_warmup, cfg.profile_active)
        self.signals = StopSignals()
        self._vote = LaggedVote(ctx, cfg.control_interval)
        self.clock = Clock(device)
        self._module_started: Any = None
        if getattr(self.parallel, "ddp", None) is not None and not cfg.compile:
            # DDP broadcasts buffers (BatchNorm statistics) before the module runs, which waits for late
            # ranks: the straggler statistic times the module's own forward, from this hook on.
            module.register_forward_pre_hook(self._module_forward_started)
        self.trackers = None
        if ctx.is_main and parse_trackers(cfg.tracker):
            tags = {"ddptrain.world_size": str(ctx.world_size), "ddptrain.strategy": cfg.strategy,
                    "ddptrain.hosts": ",".join(sorted(set(ctx.hosts))) or ctx.host,
                    "ddptrain.version": ddptrain.__version__}
            self.trackers = Trackers(parse_trackers(cfg.tracker), run_dir, cfg, tags)
        self.sinks = MetricSinks(run_dir, cfg.tensorboard, self.trackers) if ctx.is_main else None
        self.peak_tflops = cfg.peak_tflops or perf.known_peak_tflops(device)
        self.window = MetricWindow(device, cfg.log_interval)
        self.normaliser = LossNormaliser(self.task, ctx, cfg.grad_accum_steps)
        self.train_log = TrainLog(ctx, self.sinks, self.clock, self.layout.global_batch_size, self.task.unit,
                                  self.flops_per_sample, self.peak_tflops, cfg.straggler_skew, cfg.max_skipped_steps)
        self.evaluator = Evaluator(ctx, self.eval_loader, self.task, self.autocast, cfg.channels_last,
                                   lockstep=self.parallel.sharded)
        self._sample_log = None
        if cfg.record_sample_ids:
            (run_dir / "samples").mkdir(parents=True, exist_ok=True)
            # Buffered, flushed at log steps and before every save: a killed run loses at most the lines of steps
            # after its last checkpoint, which the resumed run trains (and records) again.
            self._sample_log = open(run_dir / "samples" / f"rank-{ctx.rank}.jsonl", "a")

    def _build_callbacks(self, parts: Parts) -> None:
        """The user's callbacks (`fit`'s, then --callbacks'), then the built-ins the flags ask for; the limit
        of --max_time; what a stop request needs."""
        cfg = self.cfg
        callbacks = [*(parts.callbacks or ()), *load_callbacks(cfg.callbacks)]
        self.ema = EMA(cfg.ema_decay, self.parallel.sharded) if cfg.ema_decay else None
        if self.ema is not None:
            callbacks.append(self.ema)
        if cfg.early_stop_metric:
            callbacks.append(EarlyStopping(cfg.early_stop_metric, cfg.early_stop_patience, cfg.early_stop_mode,
                                           cfg.early_stop_min_delta))
        self.best = BestCheckpoint(cfg.keep_best, cfg.keep_best_mode) if cfg.keep_best else None
        if self.best is not None:
            callbacks.append(self.best)
        self.callbacks = Callbacks(callbacks)
        self.run_view = TrainingRun(self)
        if self.callbacks and self.ctx.is_main:
            self.train_log.on_record = lambda record: self.callbacks.call("on_log", self.run_view, record)
        self.stopped: dict[str, Any] | None = None  # {"step", "reason"} once every rank agreed to stop early
        started = float(os.environ.get(LAUNCH_TIME_ENV) or time.time())
        self._deadline = started + parse_duration(cfg.max_time, "--max_time") if cfg.max_time else None
        self._last_eval: dict[str, Any] = {}
        self._announced_checkpoint = -1

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (epochs or --max_steps), evaluating each epoch and checkpointing as asked.

        Must be called on all ranks. Raises Preempted after a preemption checkpoint has committed.
        """
        status = "failed"
        try:
            summary = self._fit()
            status = "finished"
            return summary
        except Preempted:
            status = "preempted"
            raise
        finally:
            if self.trackers:
                self.trackers.close(status)  # after the weights' export: --tracker_log_model sends them

    def _fit(self) -> dict[str, Any]:
        cfg, pos = self.cfg, self.position
        started = time.perf_counter()
        with self.signals, self.watchdog, self.profiler, self._outputs_closed_at_exit():
            self._resume()
            if self.stopped is not None:
                log.info("run stopped early at step %d (%s) in %s; nothing to train (use another --run_dir, or "
                         "--no-auto_resume to start over)", pos.step, self.stopped["reason"], self.run_dir)
            elif pos.step >= self.total_steps or pos.epoch >= cfg.epochs:
                log.info("run already complete at step %d in %s; nothing to train (use another --run_dir, or "
                         "--no-auto_resume to start over)", pos.step, self.run_dir)
            self.callbacks.call("on_train_start", self.run_view)
            # The callbacks' state is that of the snapshot, taken before its checkpoint committed: what they
            # did on hearing of the commit is done again, as in the run that saved it.
            self._announce_checkpoint()
            bar = ProgressBar(cfg.progress and self.ctx.is_main, self.total_steps, initial=pos.step)
            if self.stream is not None:
                # A stream has no epochs in common: each rank cycles its own share until --max_steps.
                with stream_batches(self.train_loader, self.stream, self.stream_position,
                                    self._background_batches) as batches:
                    while self._training():
                        self._step(batches, bar)
            # Each pass of this loop is (the rest of) one epoch: the sampler resumes at the cursor.
            while self.stream is None and pos.epoch < cfg.epochs and self._training():
                self.sampler.set_position(pos.epoch, pos.cursor)
                with epoch_batches(self.train_loader, background=self._background_batches) as batches:
                    while pos.cursor + self.layout.global_batch_size <= self.num_train and self._training():
                        self._step(batches, bar)
                if not self._training() and pos.cursor + self.layout.global_batch_size <= self.num_train:
                    break  # --max_steps (or a stop) ended the run mid-epoch
                # The epoch is complete: evaluate, move the cursor to the next epoch, maybe save.
                if self._last_eval.get("step") != pos.step:
                    self.evaluate()
                pos.epoch, pos.cursor = pos.epoch + 1, 0
                if self.checkpoints.schedule.due(pos.step, epoch_end=pos.epoch, best=bool(self.run_view.best_wanted)):
                    self.save()

            # The end: log the partial window, evaluate if the last epoch ended early, final save. The last
            # step's gradients are spent: freed first, the final eval, save and gathered export need none.
            self.optimizer.zero_grad(set_to_none=True)
            if self.window.steps:
                self._log_train(bar)
            self.train_log.finish()
            if self._last_eval.get("step") != pos.step:
                self.evaluate()
            self._vote.drain()  # a preemption flag still in flight is moot: the final save follows
            self.watchdog.phase("replica check")
            self.parallel.check_replicas()
            self.save()
            self._wait_for_checkpoint()
        bar.close()
        self._weights_step = pos.step  # the step of the weights the final files hold
        if cfg.load_best_at_end:
            self.checkpoints.confirm_best()  # best/ committed before its weights become the final ones
            self._load_best()
        self._export_weights()
        self.checkpoints.confirm_best()  # after the weights: a best/ that could not be made fails a finished run
        if self.ctx.is_main:  # every rank is past the last collective: a signal from here on finds a complete run
            write_atomic(self.run_dir / FINISHED_MARKER, json.dumps({"step": pos.step, "time": time.time()}).encode())
        summary = self._summary(self._last_eval, time.perf_counter() - started)
        self.callbacks.call("on_train_end", self.run_view, summary)
        return summary

    def _training(self) -> bool:
        """Whether another step follows: not at --max_steps (or the epochs' end), no agreed stop."""
        return self.position.step < self.total_steps and self.stopped is None

    def _step(self, batches: Iterator, bar: ProgressBar) -> None:
        """A training step and what follows it at the step boundary: schedule, logging, flags, saves."""
        cfg, pos = self.cfg, self.position
        self.train_step(batches)
        self.train_log.finish()  # the line of the log step before this step: its numbers arrived meanwhile
        pos.step += 1
        pos.cursor += self.layout.global_batch_size
        if pos.step == 1 + self._first_step:
            # torch warns at a scheduler's first step when the optimizer has not stepped: here, when this run's
            # first update was skipped as non-finite (logged as such). The schedule advances with the step.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                self.scheduler.step()
        else:
            self.scheduler.step()
        self.profiler.step()
        if pos.step == 1 + self._first_step:
            # Tier two: the generous init timeout covered rendezvous and the first step.
            self.ctx.set_collective_timeout(cfg.collective_timeout_s)
            held = self.parallel.memory(self.optimizer)
            # At its fullest a rank holds the gradients between micro-steps (fsdp: unsharded unless each
            # micro-step reduce-scatters) or those after the step, whichever is more.
            held["peak_grad_bytes"] = max(held["grad_bytes"], self.accumulated_grad_bytes or 0)
            self.train_log.write_memory(held, pos.step, pos.epoch, cfg.strategy)
        if pos.step % cfg.log_interval == 0:
            self._log_train(bar)
        self.callbacks.call("on_step_end", self.run_view)  # before the step's eval: it sees the EMA of this step
        if cfg.eval_every_steps and pos.step % cfg.eval_every_steps == 0:
            self.evaluate()
        self._between_steps()

    # ------------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches.

        Non-final micro-batches skip gradient communication, so gradients are reduced once, on the last
        (unless --fsdp_reduce_every_micro_step: then each micro-batch reduce-scatters into the shards).
        A LossSum is divided by the units of the whole step (every rank, every micro-batch), a plain mean by
        the number of micro-batches: with the average over ranks, the update equals one process training on
        the whole global batch (for a mean: when every micro-batch counts as many units). All ranks.
        """
        cfg, wd, window = self.cfg, self.watchdog, self.window
        step = self.position.step + 1  # the number of this step: steps done once it completes
        accum = cfg.grad_accum_steps
        self.optimizer.zero_grad(set_to_none=True)
        spans, micro_batches = [], []
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
            micro_batches.append(batch)
        # The step's count of units, from the host batches: its all-reduce (if counts vary) runs under the
        # first forward.
        scale = self.normaliser.start(micro_batches, step)
        for micro, batch in enumerate(micro_batches):
            batch = to_device(batch, self.ctx.device, cfg.channels_last)
            last = micro == accum - 1
            communicates = self.parallel.communicates(last) and self.ctx.world_size > 1
            wd.phase(self.parallel.communicating_phase if communicates else "forward/backward")
            start = self.clock.now()
            with self.parallel.accumulating(last):
                with self.profiler.region("forward"), self.autocast():
                    output, _ = self.task.loss(self.model, batch)
                own_start = self._module_started if self._module_started is not None else start
                spans.append(("forward", own_start, self.clock.now()))  # this rank's own work, no waiting
                loss, units, sums = self.normaliser.split(output)
                if self.injector.poison_loss(step):
                    loss = loss + float("nan")
                poison = window.add_loss(loss, units)  # 0 for a finite loss, NaN for one that is not
                # What backward starts from: the step's factor, or NaN for a non-finite loss. A non-finite loss
                # on one rank must stop the update on every rank: NaN poisons this rank's gradients, and the
                # gradient all-reduce carries that into the global norm checked below, the same decision
                # everywhere with no extra collective. Seeding backward with it is `(loss * seed).backward()`
                # to the bit, less one op and one autograd node.
                seed = poison.float() + scale.factor(sums)
                with self.profiler.region("backward"):
                    if self.scaler is None:
                        loss.backward(seed)
                    else:
                        self.scaler.scale(loss * seed).backward()
            spans.append(("fwd_bwd", start, self.clock.now()))
            if micro == accum - 2 and self.accumulated_grad_bytes is None:
                # After the last micro-step that only accumulates: the most gradient a rank holds during the
                # step (fsdp without reduce-scatter: the whole model's, unsharded). Once, for the memory line.
                self.accumulated_grad_bytes = self.parallel.grad_bytes_held()

        window.units += scale.units
        wd.phase("optimizer")
        start = self.clock.now()
        with self.profiler.region("optimizer"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()  # sharded gradients: the norm over every rank's shards
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.params, cfg.grad_clip, norm, foreach=True)
            # The gradients are averaged over ranks, so `norm` is identical on every rank: the non-finite
            # decision below is the same everywhere without another collective.
            # A norm is NaN, inf or finite and >= 0: 1.0 where it is not finite, in 2 ops (float32: the fused
            # kernel's found_inf as it is).
            bad = torch.where(norm < math.inf, *self._no_yes)
            if cfg.on_nonfinite == "stop" and self.scaler is None:
                if bool(bad):  # host sync, the price of stopping at the very step
                    self._stop_nonfinite([step])
                self.optimizer.step()
            elif (not self._optimizer_stepped or not self._fused) and bool(bad):
                # Before its first update a fused optimizer has no state: asked to skip, it would allocate
                # momentum buffers uninitialised and never write them. So until the first update the skip is
                # decided on the host (one sync per step until then, none after): the step never happened.
                # The foreach optimizer of sharded parameters has no on-device skip: always decided here.
                if self.scaler is not None:
                    self.scaler.update()  # lower the fp16 loss scale as after any overflow
            else:
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)  # GradScaler hands found_inf to the fused kernel
                    self.scaler.update()
                else:
                    if self._fused:
                        self.optimizer.found_inf = bad  # the fused kernel skips the update on device
                    self.optimizer.step()
                self._optimizer_stepped = True
        spans.append(("optimizer", start, self.clock.now()))
        window.end_step(step, norm, spans)

    def _module_forward_started(self, module: nn.Module, args: Any) -> None:
        self._module_started = self.clock.now()

    def evaluate(self) -> dict[str, Any]:
        """Exact eval of the task's metrics over the eval set (rank 0's buffers). Must be called on all ranks."""
        self.train_log.finish()  # the train line of this step comes before its eval line
        self.watchdog.phase("eval")
        self.injector.at_eval(self.position.step)
        self.parallel.sync_buffers()
        result = self.evaluator.evaluate(self.module, heartbeat=lambda: self.watchdog.phase("eval"))
        if result and self.ema is not None and self.cfg.ema_eval:
            with self.ema.swapped_in(self.module):
                averaged = self.evaluator.evaluate(self.module, heartbeat=lambda: self.watchdog.phase("eval"))
            result.update({f"ema_{key}": value for key, value in averaged.items() if key != "samples"})
        pos = self.position
        if not result:
            self._last_eval = {"step": pos.step}  # no eval set: nothing to evaluate at this step either
            return {}
        shown = " ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float) and k != "tokens_per_sec")
        log.info("eval  step %d epoch %d: %s (%d samples)", pos.step, pos.epoch, shown, result["samples"])
        if self.sinks is not None:
            self.sinks.write({"time": time.time(), "step": pos.step, "epoch": pos.epoch, "split": "eval", **result})
        self._last_eval = {"step": pos.step, **result}
        self.callbacks.call("on_eval", self.run_view, result)
        if self.run_view.stop_now:  # a decision on these metrics, the same on every rank: this is the last step
            self._agree_to_stop(pos.step, self.run_view.stop_reason)
        return self._last_eval

    # --- between steps: control flags, saves -----------------------------------------------------
    def _between_steps(self) -> None:
        """Act on preemption and timed saves at a step boundary, agreed by one tiny CPU all-gather.

        Signals and clocks differ between ranks; the MAX over ranks makes the decision the same everywhere.
        The vote is cast every --control_interval steps and read one step later (see `LaggedVote`), so
        nothing waits for it and the steps in between carry no collective of ddptrain's.
        """
        cfg, step = self.cfg, self.position.step
        self.watchdog.phase("sync")
        main = self.ctx.is_main  # rank 0's clock decides what depends on the time
        due_by_time = main and self.checkpoints.schedule.minutes_up()
        out_of_time = main and self._deadline is not None and time.time() >= self._deadline
        line = self.train_log.unsent()  # a log step's numbers (CPU): gathered with the vote when it is cast here
        (preempt, timed, time_up, stop), rows = self._vote.exchange(  # in the order of VOTE_FLAGS
            step, [self.signals.received is not None, due_by_time, out_of_time, self.run_view.stop_reason is not None],
            line)
        if line is not None:
            self.train_log.send(rows)
        if stop or self.run_view.stop_now:
            self._agree_to_stop(step, self.run_view.stop_reason or "a callback on another rank asked to stop")
        if preempt or time_up:
            self.save()  # holds a stop agreed at this step: the rerun ends here, as the run would have
            self._wait_for_checkpoint()  # raises if it did not commit: no preemption claims a save it lacks
            signal_name = (self.signals.received or "a peer's signal") if preempt else f"--max_time {cfg.max_time}"
            if self.ctx.is_main:
                write_atomic(self.run_dir / PREEMPTED_MARKER,
                             json.dumps({"step": step, "signal": signal_name, "time": time.time()}).encode())
            if preempt:
                log.warning("preempted (%s): checkpoint of step %d committed; exiting", signal_name, step)
            else:
                log.warning("time limit %s reached: checkpoint of step %d committed; exiting with %d (run the "
                            "same command to continue)", signal_name, step, EXIT_PREEMPTED)
            raise Preempted(step, signal_name)
        if self.checkpoints.schedule.due(step, timed=bool(timed), best=bool(self.run_view.best_wanted)):
            self.save()

    def _agree_to_stop(self, step: int, reason: str) -> None:
        """Record the stop every rank agreed on at this step: no step follows, and every later checkpoint holds
        it, so a run killed or preempted after the decision makes it again at the same step. All ranks."""
        if self.stopped is None:
            self.stopped = {"step": step, "reason": reason}
            log.info("stopping at step %d: %s", step, reason)

    def save(self) -> None:
        """Checkpoint the current position (skipped if this step is already saved), kept as best/ if a callback
        asked. All ranks."""
        self.train_log.finish()  # a checkpoint's window starts after the last line: that line must be written
        best, self.run_view.best_wanted = self.run_view.best_wanted, None
        if self.position.step == self.checkpoints.pending_step:
            if best:
                self.checkpoints.keep_best(self.position.step, best)
            return
        self.watchdog.phase("checkpoint")
        if self._sample_log is not None:
            self._sample_log.flush()
        self.parallel.sync_buffers()
        # A vote cast at this boundary is read at the next: settled now, its outcome rides in the checkpoint.
        self._vote.settle()
        self.checkpoints.save(Position(**vars(self.position)), self.snapshot, self.rank_state(), best)
        self._announce_checkpoint()

    def _wait_for_checkpoint(self) -> None:
        """Wait for an async save in flight to commit, under the checkpoint's time limit (not a step's), and
        raise on every rank if it did not. All ranks."""
        self.watchdog.phase("checkpoint")
        self.checkpoints.wait()
        self._announce_checkpoint()

    def _announce_checkpoint(self) -> None:
        """`on_checkpoint` for a checkpoint every rank now knows committed (an async one: at the next wait)."""
        step = self.checkpoints.last_saved_step
        if step > self._announced_checkpoint:
            self._announced_checkpoint = step
            self.callbacks.call("on_checkpoint", self.run_view, step)

    def _resume(self) -> None:
        """Restore the newest usable checkpoint (or --resume_from). All ranks."""
        self._first_step = 0
        self.checkpoints.schedule.start_clock()
        if self.ctx.is_main:
            for marker in (PREEMPTED_MARKER, FINISHED_MARKER):
                (self.run_dir / marker).unlink(missing_ok=True)
        loaded = None
        if self.frozen:
            self.frozen_fingerprint()  # now, on every rank (sharded: a collective), not inside a later save
        if self.cfg.resume_from or self.cfg.auto_resume:
            loaded = self.checkpoints.resume(self.cfg.resume_from, self.checkpointed(self.module.state_dict()),
                                             continue_line=self.cfg.auto_resume)
        if loaded is not None:
            changes = setting_changes(loaded.manifest["config"], self.cfg)
            saved_digest = loaded.trainer.get("tokenizer_digest")
            if saved_digest and self.tokenizer_digest and saved_digest != self.tokenizer_digest:
                changes.append(f"tokenizer {self.cfg.tokenizer}: its files changed (sha256 {saved_digest[:12]} -> "
                               f"{self.tokenizer_digest[:12]})")  # the same path, retrained: other token ids
            if changes and not self.cfg.accept_config_change:
                raise UsageError(changed_settings_error(loaded.path, changes))
            if changes and self.ctx.is_main:
                log.warning("continuing %s with changed training settings (--accept_config_change): %s",
                            loaded.path, "; ".join(changes))
            self.restore(loaded)
        self.checkpoints.start_line(loaded)
        if self.ctx.is_main and self.best is not None and self.best.watch.best_step >= 0:
            self.checkpoints.owe_best({"step": self.best.watch.best_step, **self.best.about()})

    # --- metrics ---------------------------------------------------------------------------------
    def _log_train(self, bar: ProgressBar) -> None:
        self.watchdog.phase("log")
        if self._sample_log is not None:
            self._sample_log.flush()
        pos = self.position
        self.train_log.write(self.window, pos.step, pos.epoch, self.total_steps, self.optimizer.param_groups[0]["lr"],
                             bar)
        self.window.reset()

    def _stop_nonfinite(self, steps: list[int]) -> None:
        local_bad = float(self.window.totals()[2])
        ranks = [r for r, (n,) in enumerate(self.ctx.gather_floats([local_bad])) if n > 0]
        raise TrainingError(f"non-finite gradient norm at step {steps[0]} (non-finite loss on rank(s) "
                            f"{ranks or 'none'}); stopping as --on_nonfinite stop asks")

    # --- the end ---------------------------------------------------------------------------------
    def _load_best(self) -> None:
        """--load_best_at_end: best/'s weights into the model (and its average into the EMA), so that the final
        weights are the best step's; where best/ holds the average (an ema_ metric), the model gets that. All
        ranks."""
        loaded = self.checkpoints.read_best(self.checkpointed(self.module.state_dict()))
        if loaded is None:
            if self.ctx.is_main:
                log.warning("--load_best_at_end: no evaluation made a best checkpoint; the final weights are the "
                            "last step's (%d)", self.position.step)
            return
        self.load_weights(loaded)  # the optimizer's too: the run is over, only the weights are written from here
        self._weights_step = loaded.position.step  # the final files' "step" metadata
        rngs = loaded.trainer["rng"]
        same_world = loaded.position.world_size == self.ctx.world_size
        own = rngs[self.ctx.rank] if same_world else rngs[0]
        about = read_json(loaded.path / BEST_ABOUT) or {}
        if self.ema is not None:
            restored = self.ema.restore_now(own.get("callbacks", {}).get(self.ema.name),
                                            rngs[0].get("callbacks", {}).get(self.ema.name))
            if not all(self.ctx.all_gather_object(restored)):  # sharded on another world size: not here
                raise TrainingError(f"--load_best_at_end: the average in {loaded.path} was sharded for "
                                    f"{loaded.position.world_size} processes, this run has {self.ctx.world_size}: "
                                    "export it with `ddptrain export --weights ema`")
            if about.get("weights") == "ema":
                self.ema.copy_to(self.module)
        if self.ctx.is_main:
            log.info("--load_best_at_end: the final weights are those of %s (step %d, %s %s, %s weights)",
                     loaded.path, loaded.position.step, about.get("metric"), about.get("value"),
                     about.get("weights", "trained"))

    def _export_weights(self) -> None:
        """RUN_DIR/model.safetensors, for a transformers model RUN_DIR/hf/ (save_pretrained), with --ema_decay
        RUN_DIR/model_ema.safetensors. All ranks."""
        if self.parallel.sharded and not self.frozen:  # (LoRA's adapters: below)
            # Streamed a tensor at a time: no rank gathers the whole model. RUN_DIR/hf/ in HF's sharded layout.
            step = {"step": str(self._weights_step)}
            hf_dir = self.run_dir / hf.HF_DIR if hf.is_transformers(self.module) else None
            self.parallel.export(self.run_dir / "model.safetensors", step, hf_dir)
            if hf_dir is not None and self.ctx.is_main:
                hf.save_pretrained_files(self.cfg, self.module, hf_dir)
            if self.ema is not None:
                with self.ema.swapped_in(self.module):
                    self.parallel.export(self.run_dir / "model_ema.safetensors",
                                         {**step, "ema_decay": repr(self.cfg.ema_decay)})
            return
        state = self.parallel.state_dict(self.frozen)  # sharded: gathered onto rank 0 (LoRA: the adapters only)
        if self.ctx.is_main:
            write_atomic(self.run_dir / "model.safetensors",  # under LoRA: the adapters (the rest is the source's)
                         safetensors_bytes(state, metadata={"step": str(self._weights_step)}))
            if self.frozen:
                lora.save_adapter(self.module, state, self.run_dir / lora.ADAPTER_DIR)
                hf.copy_tokenizer(self.cfg, self.run_dir / lora.ADAPTER_DIR)  # base + adapter + tokenizer: all it takes
            elif hf.is_transformers(self.module):
                hf.save_pretrained(self.cfg, state, self.run_dir / hf.HF_DIR, self.module)
        if self.ema is not None:
            with self.ema.swapped_in(self.module):  # a replica's state dict holds the parameters themselves:
                averaged = {k: v.clone() for k, v in self.parallel.state_dict(self.frozen).items()}  # copy before swap
            if self.ctx.is_main:
                write_atomic(self.run_dir / "model_ema.safetensors", safetensors_bytes(
                    averaged, metadata={"step": str(self._weights_step), "ema_decay": repr(self.cfg.ema_decay)}))

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
        skipped = self.train_log.skipped_total
        summary = {"step": self.position.step, "updates": self.position.step - skipped, "epoch": self.position.epoch,
                   "elapsed_s": elapsed, "eval": metrics, "eval_loss": metrics.get("loss"),
                   "eval_accuracy": metrics.get("accuracy")}
        if self.ctx.is_main:
            shown = "".join(f", eval {k} {v:.4f}" for k, v in metrics.items()
                            if isinstance(v, float) and k != "tokens_per_sec")
            updates = f"{summary['updates']} updates" + (f" ({skipped} skipped: non-finite)" if skipped else "")
            log.info("done: %d steps, %s, %d epochs in %.1f s%s. run dir %s · metrics %s · weights %s",
                     summary["step"], updates, summary["epoch"], elapsed, shown,
                     self.run_dir, self.run_dir / "metrics.jsonl", self.run_dir / "model.safetensors")
        return summary
