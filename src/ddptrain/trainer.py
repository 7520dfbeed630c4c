"""Trainer: fit / train_step / evaluate.

`fit` reads top to bottom; the dense numerics (autocast, no_sync accumulation, unscale, clip, non-finite
guard, optimizer) live in `train_step`. Nothing in a step waits for the device except at log steps:
metrics accumulate in device tensors and are reduced and read once per `--log_interval`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.checkpoint import CheckpointManager, Loaded, Position, Snapshot, safetensors_bytes, write_atomic
from ddptrain.config import TrainConfig
from ddptrain.data import (BatchLayout, GlobalOrderSampler, ShardedEvalSampler, build_datasets, epoch_batches,
                           make_loader, mix_seed)
from ddptrain.distributed import DistributedContext, LaggedVote
from ddptrain.errors import Preempted, TrainingError, UsageError
from ddptrain.faults import FaultInjector
from ddptrain.models import build_model
from ddptrain.observe import perf
from ddptrain.observe.metrics import MetricSinks, ProgressBar
from ddptrain.observe.profiler import StepProfiler
from ddptrain.observe.watchdog import Watchdog

log = logging.getLogger("ddptrain")
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_MARKER = "PREEMPTED"


# --- pieces chosen once --------------------------------------------------------------------------

def build_optimizer(cfg: TrainConfig, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """SGD (the seed's default) or AdamW, fused: one kernel per step and an on-device skip (`found_inf`)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay,
                             fused=True)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, then constant or cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states, as tensors and plain values (safe to load with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])


def seed_rank_rngs(seed: int, rank: int) -> None:
    """Per-rank streams for dropout and friends (model init is seeded identically before this)."""
    torch.manual_seed(mix_seed(seed, 1, rank))
    np.random.seed(mix_seed(seed, 2, rank) & 0xFFFFFFFF)
    random.seed(mix_seed(seed, 3, rank))


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


class Clock:
    """Timestamps for the step-time breakdown: host clock on CPU, CUDA events on GPU (read at log steps)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


# --- the trainer ---------------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, run_dir: Path):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        device = ctx.device

        # Data first: its size decides the schedule. Global batch = micro batch x world x accumulation.
        train_ds, eval_ds = build_datasets(cfg)
        self.layout = BatchLayout(cfg.batch_size, ctx.world_size, cfg.grad_accum_steps)
        self.num_train = len(train_ds)
        self.steps_per_epoch = self.layout.steps_per_epoch(self.num_train)
        if self.steps_per_epoch == 0:
            raise UsageError(f"--batch_size {cfg.batch_size} x {ctx.world_size} processes x --grad_accum_steps "
                             f"{cfg.grad_accum_steps} = {self.layout.global_batch_size} exceeds the "
                             f"{self.num_train} training samples; lower one of them")
        self.sampler = GlobalOrderSampler(self.num_train, self.layout, ctx.rank, cfg.seed)
        self.train_loader = make_loader(train_ds, self.sampler, cfg, device, seed=mix_seed(cfg.seed, 4, ctx.rank))
        # With loader workers on CPU, a thread takes their batches off the training thread (on CUDA, torch's
        # pin-memory thread does). Without workers, reading a sample seeds the global RNGs: no thread then.
        self._background_batches = device.type == "cpu" and self.train_loader.num_workers > 0
        self.eval_loader = None
        if eval_ds is not None and len(eval_ds) > 0:
            eval_sampler = ShardedEvalSampler(len(eval_ds), cfg.batch_size, ctx.rank, ctx.world_size)
            self.eval_loader = make_loader(eval_ds, eval_sampler, cfg, device, seed=mix_seed(cfg.seed, 5, ctx.rank))

        # Model: identical init on every rank (DDP would broadcast rank 0's anyway), then the wrapper.
        torch.manual_seed(cfg.seed)
        model = build_model(cfg).to(device)
        if cfg.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.module = model
        # Counted before the per-rank RNG streams start: reading a sample may draw augmentation randomness.
        self.flops_per_sample = self._count_flops(train_ds) if ctx.is_main else 0.0
        self.ddp: DDP | None = None
        self.model: nn.Module = model
        if ctx.world_size > 1:
            self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                           bucket_cap_mb=cfg.bucket_cap_mb, static_graph=cfg.static_graph,
                           gradient_as_bucket_view=cfg.gradient_as_bucket_view)
            self.model = self.ddp
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.params = [p for p in model.parameters() if p.requires_grad]

        # Optimizer and schedule. The linear scaling rule is opt-in: lr * global batch / base batch.
        scale = self.layout.global_batch_size / cfg.base_batch_size if cfg.scale_lr else 1.0
        self.peak_lr = cfg.lr * scale
        self.optimizer = build_optimizer(cfg, self.params, self.peak_lr)
        self._optimizer_stepped = False  # whether the optimizer has state (see train_step)
        self.total_steps = cfg.epochs * self.steps_per_epoch
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        min_ratio = cfg.min_lr / self.peak_lr if self.peak_lr > 0 else 0.0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, self.total_steps, cfg.lr_schedule, min_ratio))
        fp16 = cfg.use_amp and cfg.amp_dtype == "fp16"
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None
        self.amp_dtype = torch.float16 if fp16 else torch.bfloat16

        # Per-rank RNG streams from here on: data order and augmentation never read them.
        seed_rank_rngs(cfg.seed, ctx.rank)
        self.position = Position(step=0, epoch=0, cursor=0, global_batch_size=self.layout.global_batch_size,
                                 world_size=ctx.world_size)
        self.injector = FaultInjector(cfg.inject_fault, ctx.rank)
        self.checkpoints = CheckpointManager(ctx, cfg.checkpoint_path, cfg.keep_last, cfg.async_checkpoint,
                                             cfg.checkpoint_timeout_s, self.injector)
        self.watchdog = Watchdog(ctx, run_dir / "logs" / f"rank-{ctx.rank}.log", cfg.hang_timeout_s,
                                 startup_timeout_s=cfg.init_timeout_s, checkpoint_timeout_s=cfg.checkpoint_timeout_s)
        self.profiler = StepProfiler(cfg.enable_profiling, run_dir, ctx.rank, cfg.profile_wait,
                                     cfg.profile_warmup, cfg.profile_active)
        self.signals = StopSignals()
        self._vote = LaggedVote(ctx)
        self.clock = Clock(device)
        self._module_started: Any = None
        if self.ddp is not None and not cfg.compile:
            # DDP broadcasts buffers (BatchNorm statistics) before the module runs, which waits for late
            # ranks: the straggler statistic times the module's own forward, from this hook on.
            model.register_forward_pre_hook(self._module_forward_started)
        self.sinks = MetricSinks(run_dir, cfg.tensorboard) if ctx.is_main else None
        self.peak_tflops = cfg.peak_tflops or perf.known_peak_tflops(device)
        self._reset_window()
        self._straggler_streak: dict[int, int] = {}
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
        last_eval: dict[str, float] = {}
        with self.signals, self.watchdog, self.profiler, self._outputs_closed_at_exit():
            self._resume()
            if pos.step >= self.total_steps or pos.epoch >= cfg.epochs:
                log.info("run already complete at step %d in %s; nothing to train (use another --run_dir, or "
                         "--no-auto_resume to start over)", pos.step, self.run_dir)
            bar = ProgressBar(cfg.progress and self.ctx.is_main, self.total_steps, initial=pos.step)
            # Each pass of this loop is (the rest of) one epoch: the sampler resumes at the cursor.
            while pos.epoch < cfg.epochs and pos.step < self.total_steps:
                self.sampler.set_position(pos.epoch, pos.cursor)
                with epoch_batches(self.train_loader, background=self._background_batches) as batches:
                    while (pos.cursor + self.layout.global_batch_size <= self.num_train
                           and pos.step < self.total_steps):
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
                if pos.step >= self.total_steps and pos.cursor + self.layout.global_batch_size <= self.num_train:
                    break  # --max_steps ended the run mid-epoch
                # The epoch is complete: evaluate, move the cursor to the next epoch, maybe save.
                last_eval = self.evaluate()
                pos.epoch, pos.cursor = pos.epoch + 1, 0
                if cfg.save_every and pos.epoch % cfg.save_every == 0:
                    self.save()

            # The end: log the partial window, evaluate if the last epoch ended early, final save.
            if self._window_steps:
                self._log_train(bar)
            if not last_eval or last_eval["step"] != pos.step:
                last_eval = self.evaluate()
            self._vote.drain()  # a preemption flag still in flight is moot: the final save follows
            self._check_replicas()
            self.save()
            self.checkpoints.wait()
        bar.close()
        self._export_weights()
        return self._summary(last_eval, time.perf_counter() - started)

    # ------------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches.

        Non-final micro-batches run under DDP's no_sync, so gradients are all-reduced once, on the last.
        Each micro-batch loss is divided by the number of micro-batches: with DDP's average over ranks,
        the update equals one process training on the whole global batch. Must be called on all ranks.
        """
        cfg, wd = self.cfg, self.watchdog
        step = self.position.step + 1  # the number of this step: steps done once it completes
        accum = cfg.grad_accum_steps
        self.optimizer.zero_grad(set_to_none=True)
        spans = []
        for micro in range(accum):
            wd.phase("data", step)
            self.injector.at_micro_step(step, micro)  # after the phase: an injected hang reads as a data stall
            waited = time.perf_counter()
            ids, inputs, targets = next(batches)
            self._data_wait += time.perf_counter() - waited
            if self._sample_log is not None:
                self._sample_log.write(json.dumps({"step": step, "micro": micro, "ids": ids}) + "\n")
            inputs = inputs.to(self.ctx.device, non_blocking=True)
            targets = targets.to(self.ctx.device, non_blocking=True)
            if cfg.channels_last and inputs.dim() == 4:
                inputs = inputs.contiguous(memory_format=torch.channels_last)

            last = micro == accum - 1
            sync = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
            wd.phase("backward+all-reduce" if last and self.ddp is not None else "forward/backward")
            start = self.clock.now()
            with sync:
                with self.profiler.region("forward"), torch.autocast(self.ctx.device.type, self.amp_dtype,
                                                                       enabled=cfg.use_amp):
                    loss = F.cross_entropy(self.model(inputs), targets)
                own_start = self._module_started if self._module_started is not None else start
                spans.append(("forward", own_start, self.clock.now()))  # this rank's own work, no waiting
                if self.injector.poison_loss(step):
                    loss = loss + float("nan")
                finite = torch.isfinite(loss.detach())
                self._win_loss += torch.where(finite, loss.detach().double(), 0.0)
                self._win_count += finite.double()
                self._win_bad_loss += (~finite).double()
                # A non-finite loss on one rank must stop the update on every rank. Multiplying by NaN
                # poisons this rank's gradients, and DDP's all-reduce carries that into the global norm
                # checked below: the same decision everywhere, with no extra collective.
                scaled = loss * torch.where(finite, 1.0 / accum, torch.nan)
                with self.profiler.region("backward"):
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            spans.append(("fwd_bwd", start, self.clock.now()))

        wd.phase("optimizer")
        start = self.clock.now()
        with self.profiler.region("optimizer"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.params, cfg.grad_clip, norm, foreach=True)
            # DDP has averaged the gradients, so `norm` is identical on every rank: the non-finite
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
            self._win_bad_steps[(step - 1) % cfg.log_interval] = bad
            self._last_norm = norm
        spans.append(("optimizer", start, self.clock.now()))
        self._spans.append(spans)
        self._window_steps += 1

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm running statistics). All ranks.

        DDP broadcasts them at the start of each forward, so after the last forward every rank holds the
        statistics of its own batches. Evaluating, checkpointing and exporting must all see one model: the
        one rank 0 saves. Training is unchanged, since the next forward would broadcast the same values.
        """
        if self.ddp is not None:
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)

    def _module_forward_started(self, module: nn.Module, args: Any) -> None:
        self._module_started = self.clock.now()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact eval: each sample counted once; sums of loss, correct and count are all-reduced.

        Runs the unwrapped module: ranks may hold different numbers of eval batches, and DDP's forward
        would start collectives a rank with fewer batches never joins. Must be called on all ranks.
        """
        self.watchdog.phase("eval")
        self._sync_buffers()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        self.module.eval()
        for _, inputs, targets in self.eval_loader or ():
            self.watchdog.phase("eval")
            inputs = inputs.to(self.ctx.device, non_blocking=True)
            targets = targets.to(self.ctx.device, non_blocking=True)
            if self.cfg.channels_last and inputs.dim() == 4:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with torch.autocast(self.ctx.device.type, self.amp_dtype, enabled=self.cfg.use_amp):
                logits = self.module(inputs)
            totals[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
            totals[1] += (logits.argmax(dim=1) == targets).sum()
            totals[2] += targets.numel()
        self.module.train()
        dist.all_reduce(totals)
        loss_sum, correct, count = totals.tolist()
        if count == 0:
            return {}
        result = {"step": self.position.step, "loss": loss_sum / count, "accuracy": correct / count,
                  "samples": int(count)}
        log.info("eval  step %d epoch %d: loss %.4f accuracy %.4f (%d samples)", self.position.step,
                 self.position.epoch, result["loss"], result["accuracy"], count)
        if self.sinks is not None:
            self.sinks.write({"time": time.time(), "step": self.position.step, "epoch": self.position.epoch,
                              "split": "eval", "loss": result["loss"], "accuracy": result["accuracy"],
                              "samples": int(count)})
        return result

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
        self._sync_buffers()
        self.checkpoints.save(Position(**vars(self.position)), self._snapshot, rng_state(self.ctx.device))
        self._last_save_time = time.monotonic()

    def _snapshot(self) -> Snapshot:
        return Snapshot(
            position=Position(**vars(self.position)),
            model=self.module.state_dict(),
            optimizer=self.optimizer.state_dict(),
            trainer={"scheduler": self.scheduler.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                     "window": {"loss": self._win_loss.cpu(), "count": self._win_count.cpu(),
                                "bad_loss": self._win_bad_loss.cpu(), "bad_steps": self._win_bad_steps.cpu(),
                                "steps": self._window_steps}},
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
            loaded = self.checkpoints.resume(self.cfg.resume_from, self.module.state_dict())
        if loaded is not None:
            self._apply(loaded)
        if self.ctx.is_main:
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
        window = loaded.trainer["window"]
        self._win_loss.copy_(window["loss"])
        self._win_count.copy_(window["count"])
        self._win_bad_loss.copy_(window["bad_loss"])
        bad_steps = window.get("bad_steps")
        if bad_steps is not None and bad_steps.shape == self._win_bad_steps.shape:  # else --log_interval changed
            self._win_bad_steps.copy_(bad_steps)
        self._window_steps = window["steps"]
        pos.step, pos.epoch, pos.cursor = saved.step, saved.epoch, saved.cursor
        self._first_step = saved.step
        self.checkpoints.last_saved_step = saved.step
        if saved.global_batch_size != pos.global_batch_size:
            log.warning("global batch changed on resume: %d -> %d; the data order continues at sample %d of "
                        "epoch %d, but steps are no longer comparable with the original run",
                        saved.global_batch_size, pos.global_batch_size, saved.cursor, saved.epoch)
        rngs = loaded.trainer["rng"]
        if saved.world_size == self.ctx.world_size:
            set_rng_state(rngs[self.ctx.rank], self.ctx.device)
        else:
            log.warning("world size changed on resume: %d -> %d; data order continues sample-exactly, per-rank "
                        "RNG streams (dropout) are reseeded", saved.world_size, self.ctx.world_size)
            seed_rank_rngs(mix_seed(self.cfg.seed, saved.step), self.ctx.rank)

    # --- metrics ---------------------------------------------------------------------------------
    def _reset_window(self) -> None:
        device = self.ctx.device
        self._win_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._win_count = torch.zeros((), dtype=torch.float64, device=device)
        self._win_bad_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._win_bad_steps = torch.zeros(self.cfg.log_interval, dtype=torch.bool, device=device)
        self._last_norm = torch.zeros((), device=device)
        self._window_steps = 0
        self._data_wait = 0.0
        self._spans: list[list[tuple[str, Any, Any]]] = []
        self._window_started = time.perf_counter()

    def _log_train(self, bar: ProgressBar) -> None:
        """Reduce the window's numbers over ranks and write one train line. The step's only host sync."""
        self.watchdog.phase("log")
        cfg, ctx, pos = self.cfg, self.ctx, self.position
        # The window's numbers come to the host here, once; one gather on the CPU control group then gives
        # every rank every rank's sums and timings: a single collective per log step.
        loss_sum, count, bad_loss = torch.stack([self._win_loss, self._win_count, self._win_bad_loss]).tolist()
        window_base = (pos.step - 1) // cfg.log_interval * cfg.log_interval
        bad_steps = [window_base + i + 1 for i, flag in enumerate(self._win_bad_steps.tolist()) if flag]
        elapsed = time.perf_counter() - self._window_started
        # Times cover the steps this process ran; after a resume the restored window also holds steps that
        # the previous process timed.
        steps = len(self._spans)
        breakdown = {"fwd_bwd": 0.0, "optimizer": 0.0, "forward": 0.0}
        for spans in self._spans:
            for name, start, end in spans:
                breakdown[name] += self.clock.seconds(start, end)
        # Per-rank timing for straggler detection: step time, data wait and own time (data wait + forward).
        own = (self._data_wait + breakdown["forward"]) / max(steps, 1)
        rows = ctx.gather_floats([loss_sum, count, bad_loss, elapsed / max(steps, 1), self._data_wait / max(steps, 1),
                                  own])
        loss_sum, count = sum(r[0] for r in rows), sum(r[1] for r in rows)
        bad_loss_ranks = [rank for rank, r in enumerate(rows) if r[2] > 0]
        per_rank = [r[3:] for r in rows]
        if bad_steps or bad_loss_ranks:
            self._report_nonfinite(bad_steps, bad_loss_ranks)
        if ctx.is_main:
            samples_per_sec = steps * self.layout.global_batch_size / elapsed if elapsed > 0 else 0.0
            record = {
                "time": time.time(), "step": pos.step, "epoch": pos.epoch, "split": "train",
                "loss": loss_sum / count if count else float("nan"),
                "lr": self.optimizer.param_groups[0]["lr"],
                "samples_per_sec": samples_per_sec,
                "samples_per_sec_per_rank": samples_per_sec / ctx.world_size,
                "grad_norm": float(self._last_norm),
                "step_time_s": elapsed / max(steps, 1),
                "data_wait_s": self._data_wait / max(steps, 1),
                "fwd_bwd_s": breakdown["fwd_bwd"] / max(steps, 1),
                "optimizer_s": breakdown["optimizer"] / max(steps, 1),
                "peak_mem_mb": perf.peak_memory_mb(ctx.device),
                "nonfinite_steps": len(bad_steps),
                **self._straggler_fields(per_rank),
            }
            mfu = perf.mfu(record["samples_per_sec_per_rank"], self.flops_per_sample, self.peak_tflops)
            if mfu is not None:
                record["mfu"] = mfu
            self.sinks.write(record)
            log.info("train step %d/%d epoch %d: loss %.4f lr %.4g %.1f samples/s (data wait %.1f%%)",
                     pos.step, self.total_steps, pos.epoch, record["loss"], record["lr"], samples_per_sec,
                     100 * record["data_wait_s"] / max(record["step_time_s"], 1e-9))
            bar.update(pos.step, pos.epoch, record["loss"], samples_per_sec)
        self._reset_window()

    def _straggler_fields(self, per_rank: list[list[float]]) -> dict[str, Any]:
        """Slowest rank, its host and the skew (max/median) of the ranks' own time per step.

        In synchronous DDP every rank's step takes the same wall time: the fast ranks wait for the slow one
        inside the gradient all-reduce. So a straggler is found by its own time, data wait + forward, which
        no collective pads.
        """
        times = [t for t, _, _ in per_rank]
        own = [o for _, _, o in per_rank]
        slowest = max(range(len(own)), key=own.__getitem__)
        median = float(np.median(own))
        skew = own[slowest] / median if median > 0 else 1.0
        for rank in range(len(own)):
            streak = self._straggler_streak.get(rank, 0)
            self._straggler_streak[rank] = streak + 1 if own[rank] >= self.cfg.straggler_skew * median else 0
        if self._straggler_streak.get(slowest, 0) == 3:
            log.warning("straggler: rank %d on host %s (%s) has been %.2fx the median time of data wait + "
                        "forward for 3 log intervals", slowest, self.ctx.hosts[slowest], self.ctx.addrs[slowest],
                        skew)
        return {"slowest_rank": slowest, "slowest_host": self.ctx.hosts[slowest], "step_time_skew": skew,
                "data_wait_max_s": max(w for _, w, _ in per_rank),
                "step_time_s_by_rank": [round(t, 6) for t in times],
                "data_wait_s_by_rank": [round(w, 6) for _, w, _ in per_rank]}

    def _report_nonfinite(self, bad_steps: list[int], bad_loss_ranks: list[int]) -> None:
        """Name the steps and the ranks whose own loss was non-finite."""
        where = f"non-finite loss on rank(s) {bad_loss_ranks}" if bad_loss_ranks else "non-finite gradients"
        if self.ctx.is_main:
            log.warning("non-finite gradient norm at step(s) %s (%s): update skipped (--on_nonfinite skip)",
                        bad_steps, where)

    def _stop_nonfinite(self, steps: list[int]) -> None:
        local_bad = float(self._win_bad_loss)
        ranks = [r for r, (n,) in enumerate(self.ctx.gather_floats([local_bad])) if n > 0]
        raise TrainingError(f"non-finite gradient norm at step {steps[0]} (non-finite loss on rank(s) "
                            f"{ranks or 'none'}); stopping as --on_nonfinite stop asks")

    # --- the end ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _check_replicas(self) -> None:
        """Prove that DDP kept the ranks' parameters bitwise identical (a silent divergence is the worst bug).

        A fingerprint per parameter (sum and sum of squares in float64) is gathered on the control group.
        Must be called on all ranks.
        """
        if self.ctx.world_size == 1:
            return
        self.watchdog.phase("replica check")
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        prints = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()])
                              for p in self.params]).flatten().cpu()
        gathered = self.ctx.gather_floats(prints.tolist())
        for rank, theirs in enumerate(gathered[1:], start=1):
            if theirs != gathered[0]:
                first = next(i for i, (a, b) in enumerate(zip(theirs, gathered[0])) if a != b) // 2
                raise TrainingError(f"replicas diverged: rank {rank} ({self.ctx.hosts[rank]}) differs from rank 0 "
                                    f"in parameter {names[first]}")
        log.info("replicas identical across %d ranks (%d parameter tensors)", self.ctx.world_size, len(names))

    def _count_flops(self, dataset: Any) -> float:
        try:
            sample = dataset[0][0]
            if not isinstance(sample, torch.Tensor):
                return 0.0
            flops = perf.train_flops_per_sample(self.module, sample.unsqueeze(0).to(self.ctx.device))
            log.info("model: %.3g parameters, %.3g training FLOPs per sample",
                     sum(p.numel() for p in self.module.parameters()), flops)
            return flops
        except Exception as exc:  # an exotic plug-in model: MFU is a nicety, never a reason to fail
            log.warning("FLOP count unavailable (%s: %s); no MFU will be reported", type(exc).__name__, exc)
            return 0.0

    def _export_weights(self) -> None:
        if self.ctx.is_main:
            write_atomic(self.run_dir / "model.safetensors",
                         safetensors_bytes(self.module.state_dict(), metadata={"step": str(self.position.step)}))

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

    def _summary(self, last_eval: dict[str, float], elapsed: float) -> dict[str, Any]:
        summary = {"step": self.position.step, "epoch": self.position.epoch, "elapsed_s": elapsed,
                   "eval_loss": last_eval.get("loss"), "eval_accuracy": last_eval.get("accuracy")}
        if self.ctx.is_main:
            acc = summary["eval_accuracy"]
            log.info("done: %d steps, %d epochs in %.1f s%s. run dir %s · metrics %s · weights %s",
                     summary["step"], summary["epoch"], elapsed,
                     f", eval accuracy {acc:.4f}" if acc is not None else "",
                     self.run_dir, self.run_dir / "metrics.jsonl", self.run_dir / "model.safetensors")
        return summary
