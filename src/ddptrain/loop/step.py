"""One optimizer step: `StepRunner.run`, the dense numerics of a step (autocast, skipped gradient sync on
accumulation micro-steps, unscale, clip, non-finite guard, optimizer), and `SampleLog`, the record of which
samples each step read."""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ddptrain.data.batch import to_device
from ddptrain.errors import TrainingError
from ddptrain.loop.normalise import LossNormaliser
from ddptrain.parallel.tensor import by_mesh, clip_grads, grad_norm


class SampleLog:
    """--record_sample_ids: RUN_DIR/samples/rank-R.jsonl, one line per micro-batch with its sample ids.
    Buffered, flushed at log steps and before every save: a killed run loses at most the lines of steps after
    its last checkpoint, which the resumed run trains (and records) again."""

    def __init__(self, run_dir: Path, rank: int, stream_position: Any):
        (run_dir / "samples").mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "samples" / f"rank-{rank}.jsonl", "a")
        self.stream_position = stream_position

    def write(self, step: int, micro: int, ids: Any) -> None:
        row = {"step": step, "micro": micro, "ids": ids}
        if self.stream_position is not None:
            row["epoch"] = self.stream_position.epoch  # each rank's own epoch of its share
        self._file.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def make_autocast(use_amp: bool, amp_dtype: str, strategy: str, device: torch.device) -> Callable[[], Any]:
    """The forward's autocast context under ddp --use_amp. Under fsdp/hsdp --use_amp is FSDP's mixed-precision
    policy instead (parallel/strategies.py); a disabled torch.autocast still costs time per micro-step."""
    if use_amp and strategy == "ddp":
        dtype = torch.float16 if amp_dtype == "fp16" else torch.bfloat16
        return lambda: torch.autocast(device.type, dtype)
    return contextlib.nullcontext


@dataclass
class StepServices:
    """What sees each phase of a step: the watchdog, the profiler, the clock of its spans, the metric window,
    the fault injector, the sample-id record (or None)."""

    watchdog: Any
    profiler: Any
    clock: Any
    window: Any
    injector: Any
    sample_log: SampleLog | None


class StepRunner:
    """The numerics of `Trainer.train_step`, over the model, optimizer and scaler it was built with; the
    trainer's watchdog, profiler, clock, metric window and fault injector see each phase."""

    def __init__(self, training: Any, performance: Any, ctx: Any, parallel: Any, task: Any,
                 optimizer: torch.optim.Optimizer, scaler: Any, autocast: Callable[[], Any], services: StepServices):
        """`training`, `performance`: the config's sections (--grad_accum_steps, --grad_clip, --on_nonfinite;
        --channels_last, --compile)."""
        self.accum, self.channels_last = training.grad_accum_steps, performance.channels_last
        self.grad_clip, self.stop_on_nonfinite = training.grad_clip, training.on_nonfinite == "stop"
        self.ctx, self.parallel, self.task = ctx, parallel, task
        self.optimizer, self.scaler, self.autocast = optimizer, scaler, autocast
        self.params = [p for p in parallel.module.parameters() if p.requires_grad]
        self.by_mesh = by_mesh(self.params)  # grad_norm's groups (under --tp, two meshes)
        self.watchdog, self.profiler, self.clock = services.watchdog, services.profiler, services.clock
        self.window, self.injector, self.sample_log = services.window, services.injector, services.sample_log
        self.normaliser = LossNormaliser(task, ctx, training.grad_accum_steps)
        self.fused = bool(optimizer.defaults.get("fused"))  # an on-device skip (see `run`)
        self._no_yes = tuple(torch.tensor(v, device=ctx.device) for v in (0.0, 1.0))  # float32 flag values
        self.optimizer_stepped = False  # whether this process updated (see `run`; a resumed optimizer has state)
        # Gradient bytes held between the micro-steps of this process's first step, for the memory line
        # (None until measured, and at --grad_accum_steps 1).
        self.accumulated_grad_bytes: int | None = None
        self._module_started: float | None = None
        if getattr(parallel, "ddp", None) is not None and not performance.compile:
            # DDP broadcasts buffers (BatchNorm statistics) before the module runs, which waits for late
            # ranks: the straggler statistic times the module's own forward, from this hook on.
            parallel.module.register_forward_pre_hook(self._module_forward_started)

    def memory_held(self) -> dict[str, int]:
        """What a rank holds (parallel.memory), with the gradients at their fullest: those between micro-steps
        (fsdp: unsharded unless each micro-step reduce-scatters) or those after the step, whichever is more."""
        held = self.parallel.memory(self.optimizer)
        held["peak_grad_bytes"] = max(held["grad_bytes"], self.accumulated_grad_bytes or 0)
        return held

    def _module_forward_started(self, module: nn.Module, args: Any) -> None:
        self._module_started = self.clock.now()

    def run(self, batches: Iterator, step: int) -> None:
        """Optimizer step number `step` over `grad_accum_steps` micro-batches.

        Non-final micro-batches skip gradient communication, so gradients are reduced once, on the last
        (unless --fsdp_reduce_every_micro_step: then each micro-batch reduce-scatters into the shards).
        A LossSum is divided by the units of the whole step (every rank, every micro-batch), a plain mean by
        the number of micro-batches: with the average over ranks, the update equals one process training on
        the whole global batch (for a mean: when every micro-batch counts as many units). All ranks.
        """
        wd, window, accum = self.watchdog, self.window, self.accum
        self.optimizer.zero_grad(set_to_none=True)
        spans, micro_batches = [], []
        for micro in range(accum):
            wd.phase("data", step)
            self.injector.at_micro_step(step, micro)  # after the phase: an injected hang reads as a data stall
            waited = time.perf_counter()
            ids, batch = next(batches)
            window.data_wait += time.perf_counter() - waited
            if self.sample_log is not None:
                self.sample_log.write(step, micro, ids)
            window.count_tokens(batch)
            micro_batches.append(batch)
        # The step's count of units, from the host batches: its all-reduce (if counts vary) runs under the
        # first forward.
        scale = self.normaliser.start(micro_batches, step)
        for micro, batch in enumerate(micro_batches):
            batch = to_device(batch, self.ctx.device, self.channels_last)
            last = micro == accum - 1
            communicates = self.parallel.communicates(last) and self.ctx.world_size > 1
            wd.phase(self.parallel.communicating_phase if communicates else "forward/backward")
            start = self.clock.now()
            with self.parallel.accumulating(last):
                with self.profiler.region("forward"), self.autocast():
                    output, _ = self.task.loss(self.parallel.model, batch)
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
            norm = self._update(step)
        spans.append(("optimizer", start, self.clock.now()))
        window.end_step(step, norm, spans)

    def _update(self, step: int) -> torch.Tensor:
        """Unscale, clip, and update unless the gradient norm is not finite; returns the norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
        norm = grad_norm(self.by_mesh)  # sharded gradients: the norm over every rank's shards
        if self.grad_clip > 0:
            clip_grads(self.by_mesh, self.grad_clip, norm)
        # The gradients are averaged over ranks, so `norm` is identical on every rank: the non-finite
        # decision below is the same everywhere without another collective.
        # A norm is NaN, inf or finite and >= 0: 1.0 where it is not finite, in 2 ops (float32: the fused
        # kernel's found_inf as it is).
        bad = torch.where(norm < math.inf, *self._no_yes)
        if self.stop_on_nonfinite and self.scaler is None:
            if bool(bad):  # host sync, the price of stopping at the very step
                self._stop_nonfinite(step)
            self.optimizer.step()
        elif (not (self.optimizer_stepped or self.optimizer.state) or not self.fused) and bool(bad):
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
                if self.fused:
                    self.optimizer.found_inf = bad  # the fused kernel skips the update on device
                self.optimizer.step()
            self.optimizer_stepped = True
        return norm

    def _stop_nonfinite(self, step: int) -> None:
        local_bad = float(self.window.totals()[2])
        ranks = [r for r, (n,) in enumerate(self.ctx.gather_floats([local_bad])) if n > 0]
        raise TrainingError(f"non-finite gradient norm at step {step} (non-finite loss on rank(s) "
                            f"{ranks or 'none'}); stopping as --on_nonfinite stop asks")
