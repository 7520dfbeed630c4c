"""The train line of metrics.jsonl: a window's numbers reduced over ranks once per log step, with the
step-time breakdown, throughput, MFU, GPU utilisation (CUDA) and straggler statistics."""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddptrain.errors import TrainingError
from ddptrain.loop.state import MetricWindow, WindowNumbers, WindowTotals
from ddptrain.observe import perf
from ddptrain.observe.gpu_util import GpuUtilisation, step_breakdown, utilisation_warning
from ddptrain.observe.metrics import MetricSinks, ProgressBar
from ddptrain.parallel.distributed import DistributedContext

log = logging.getLogger("ddptrain")


class Clock:
    """Timestamps for the step-time breakdown: host clock on CPU, CUDA events on GPU (read at log steps)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        # A timestamp: on CPU the host clock itself, with no Python frame around it (six per step).
        self.now: Callable[[], Any] = self._recorded_event if self.cuda else time.perf_counter

    @staticmethod
    def _recorded_event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


@dataclass
class _Pending:
    """A train line between `TrainLog.write` and `TrainLog.finish`."""

    step: int
    epoch: int
    total_steps: int
    lr: float
    bar: ProgressBar
    numbers: WindowNumbers
    values: list[torch.Tensor]  # the numbers' vectors, on the host (CUDA: once `ready`)
    ready: Any  # CUDA: the event after its copy to the host; None on CPU
    log_interval: int
    spans: list
    elapsed: float
    data_wait: float
    units: int
    util: list[float]
    tokens: tuple[int, int, int]  # token batches': (padded ones' positions, padded positions, input tokens)
    breakdown: dict[str, float] = field(default_factory=lambda: {"fwd_bwd": 0.0, "optimizer": 0.0, "forward": 0.0})
    totals: WindowTotals | None = None
    mine: list[float] | None = None  # this rank's numbers for the line, once on the host (`TrainLog._read`)
    gather: Callable[[], list[list[float]]] | None = None  # every rank's, once sent


class TrainLog:
    """Turns a `MetricWindow` into one train line: `write` at a log step, `finish` at the next step boundary
    (or before an eval, a save, the end). Both on all ranks: one all-gather per line."""

    def __init__(self, ctx: DistributedContext, sinks: MetricSinks | None, clock: Clock, global_batch_size: int,
                 unit: str, flops_per_sample: float, peak_tflops: float, straggler_skew: float,
                 max_skipped: int = 0, on_record: Callable[[dict[str, Any]], None] | None = None):
        self.ctx, self.sinks, self.clock = ctx, sinks, clock
        self.global_batch_size, self.unit = global_batch_size, unit
        self.flops_per_sample, self.peak_tflops = flops_per_sample, peak_tflops
        self.straggler_skew = straggler_skew
        self.max_skipped = max_skipped
        self.skipped_total = 0  # updates skipped (non-finite) in the whole run, restored on resume
        self.skipped_in_a_row = 0
        self.on_record = on_record  # rank 0: each train line's record (the callbacks' on_log)
        self._streak: dict[int, int] = {}
        self.gpu = GpuUtilisation(ctx.device)
        self._pending: _Pending | None = None

    def write_memory(self, held: dict[str, int], step: int, epoch: int, strategy: str) -> None:
        """The "memory" line: what each rank holds (`held`: its parameter, gradient and optimizer bytes once
        every kind of state exists, and the gradient bytes at their fullest during a step), and the CUDA
        allocator's peak. All ranks; rank 0 writes."""
        device = self.ctx.device
        held = {**held, "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0}
        ranks = self.ctx.gather_floats([float(v) for v in held.values()])
        if self.sinks is None:
            return
        by_key = [dict(zip(held, r)) for r in ranks]
        log.info("memory (%s): parameters + gradients + optimizer state %s MiB per rank; gradients at their "
                 "peak in a step %s MiB", strategy,
                 " / ".join(f"{(r['param_bytes'] + r['grad_bytes'] + r['optimizer_bytes']) / 2**20:.2f}"
                            for r in by_key),
                 " / ".join(f"{r['peak_grad_bytes'] / 2**20:.2f}" for r in by_key))
        self.sinks.write({"time": time.time(), "step": step, "epoch": epoch, "split": "memory", "strategy": strategy,
                          **{key: [int(r[i]) for r in ranks] for i, key in enumerate(held)}})

    def write_eval(self, result: dict[str, Any], step: int, epoch: int) -> None:
        """An eval's line: the log (rank 0), metrics.jsonl and the trackers."""
        shown = " ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float) and k != "tokens_per_sec")
        log.info("eval  step %d epoch %d: %s (%d samples)", step, epoch, shown, result["samples"])
        if self.sinks is not None:
            self.sinks.write({"time": time.time(), "step": step, "epoch": epoch, "split": "eval", **result})

    def write(self, window: MetricWindow, step: int, epoch: int, total_steps: int, lr: float,
              bar: ProgressBar) -> None:
        """Start the train line of the window that ends at `step`; `finish` completes it. All ranks.

        Nothing here waits: the window's device numbers start for the host (on CUDA into pinned memory, no
        sync); where they are on the host already (CPU) this rank's numbers for the line are ready to be sent
        (`unsent`, `send`), at this boundary. `finish`, at the next step boundary, finds the copy and the
        gather done, so a log step stalls no rank.
        """
        self.finish()
        numbers = window.snapshot()
        values, ready = numbers.vectors, None
        if self.clock.cuda:
            values = [v.to("cpu", non_blocking=True) for v in values]  # into pinned memory: nothing waits
            ready = torch.cuda.Event()
            ready.record()
        pending = _Pending(step=step, epoch=epoch, total_steps=total_steps, lr=lr, bar=bar, numbers=numbers,
                           values=values, ready=ready, log_interval=window.log_interval, spans=window.spans,
                           elapsed=time.perf_counter() - window.started, data_wait=window.data_wait,
                           units=window.units, util=self.gpu.read(),  # NVML's samples of this window
                           tokens=(window.positions, window.padding, window.inputs))
        if ready is None:
            self._read(pending)
        self._pending = pending

    def unsent(self) -> list[float] | None:
        """This rank's numbers of the line started at this boundary, if they are on the host and not sent yet:
        the caller sends them (`send`) with another collective of the boundary. The same on every rank."""
        p = self._pending
        return p.mine if p is not None and p.gather is None and p.mine is not None else None

    def send(self, rows: Callable[[], list[list[float]]] | None) -> None:
        """The `unsent` numbers went out with another collective whose `rows` wait for every rank's; None: they
        did not, so their own gather starts now. All ranks."""
        assert self._pending is not None
        self._send(self._pending, rows)

    def _send(self, p: _Pending, rows: Callable[[], list[list[float]]] | None) -> None:
        assert p.gather is None and p.mine is not None
        p.gather = rows if rows is not None else self.ctx.start_gather_floats(p.mine)

    def _read(self, p: _Pending) -> None:
        """This rank's sums and timings for the line, from the window's numbers on the host."""
        if p.ready is not None:
            p.ready.synchronize()  # the copy (and every span's events) finished while the next step ran
        p.totals = p.numbers.read([v.tolist() for v in p.values])
        loss_sum, count, bad_loss = p.totals.sums
        # Times cover the steps this process ran; after a resume the restored window also holds steps that
        # the previous process timed.
        steps = max(len(p.spans), 1)
        for spans in p.spans:
            for name, start, end in spans:
                p.breakdown[name] += self.clock.seconds(start, end)
        # Per-rank timing for straggler detection: step time, data wait and own time (data wait + forward).
        own = (p.data_wait + p.breakdown["forward"]) / steps
        p.mine = [loss_sum, count, bad_loss, p.elapsed / steps, p.data_wait / steps, own, p.units,
                  sum(p.util) / len(p.util) if p.util else math.nan, *p.tokens]

    def finish(self) -> None:
        """Write the train line that `write` started, if any. All ranks, at the same step boundaries."""
        p, self._pending = self._pending, None
        if p is None:
            return
        if p.gather is None:  # not sent at its boundary (CUDA: read now, the copy is done), or finished early
            if p.mine is None:
                self._read(p)
            self._send(p, None)
        rows = p.gather()
        ctx, step = self.ctx, p.step
        batches = rows[::ctx.tp_size]  # one rank of each tensor-parallel group: its ranks read the same batch
        window_base = (step - 1) // p.log_interval * p.log_interval
        flags = p.totals.flags
        bad_steps = [window_base + i + 1 for i, flag in enumerate(flags) if flag]
        loss_sum, count = sum(r[0] for r in batches), sum(r[1] for r in batches)
        bad_loss_ranks = [rank for rank, r in enumerate(rows) if r[2] > 0]
        where = f"non-finite loss on rank(s) {bad_loss_ranks}" if bad_loss_ranks else "non-finite gradients"
        if (bad_steps or bad_loss_ranks) and ctx.is_main:
            log.warning("non-finite gradient norm at step(s) %s (%s): update skipped (--on_nonfinite skip)",
                        bad_steps, where)
        self._count_skips(flags[:step - window_base], window_base, where)
        if not ctx.is_main:
            return
        steps, ran, elapsed = max(len(p.spans), 1), len(p.spans), p.elapsed
        samples_per_sec = ran * self.global_batch_size / elapsed if elapsed > 0 else 0.0
        record = {
            "time": time.time(), "step": step, "epoch": p.epoch, "split": "train",
            "loss": loss_sum / count if count else float("nan"),
            "lr": p.lr,
            "samples_per_sec": samples_per_sec,
            "samples_per_sec_per_rank": samples_per_sec / ctx.world_size,
            "grad_norm": p.totals.norm,
            "step_time_s": elapsed / steps,
            "data_wait_s": p.data_wait / steps,
            "fwd_bwd_s": p.breakdown["fwd_bwd"] / steps,
            "optimizer_s": p.breakdown["optimizer"] / steps,
            "peak_mem_mb": perf.peak_memory_mb(ctx.device),
            "nonfinite_steps": len(bad_steps),
            **self._straggler_fields([r[3:6] for r in rows]),
        }
        if self.unit == "tokens":
            tokens = [r[6] for r in batches]
            # Trained tokens (the labels that count: a masked prompt's are not) and input tokens (what the model
            # read, padding aside): per second, all ranks and per rank.
            for kind, count in (("train", sum(tokens)), ("input", sum(r[10] for r in batches))):
                record[f"{kind}_tokens_per_sec"] = count / elapsed if elapsed > 0 else 0.0
                record[f"{kind}_tokens_per_sec_per_rank"] = record[f"{kind}_tokens_per_sec"] / ctx.world_size
            # Ranks that train on unequal numbers of tokens do unequal work (padded rows, bins filled unevenly):
            # the most of a rank over the mean.
            record["token_skew"] = max(tokens) * len(tokens) / sum(tokens) if sum(tokens) else 1.0
            positions = sum(r[8] for r in batches)
            if positions:  # padded batches: the share of their positions that are padding (--packing saves it)
                record["pad_fraction"] = sum(r[9] for r in batches) / positions
        mfu = perf.mfu(record["samples_per_sec_per_rank"], self.flops_per_sample, self.peak_tflops)
        if mfu is not None:
            record["mfu"] = mfu
        if self.gpu.enabled:
            self._utilisation(record, [r[7] for r in rows])
        line = (f"train step {step}/{p.total_steps} epoch {p.epoch}: loss {record['loss']:.4f} lr {p.lr:.4g} "
                f"{samples_per_sec:.1f} samples/s (data wait "
                f"{100 * record['data_wait_s'] / max(record['step_time_s'], 1e-9):.1f}%)")
        self.sinks.write(record, announce=line)  # logged by the writer thread: the handlers' writes are slow
        if self.on_record is not None:
            self.on_record(record)
        p.bar.update(step, p.epoch, record["loss"], samples_per_sec)

    def _count_skips(self, flags: list[float], window_base: int, where: str) -> None:
        """Count the window's skipped updates; fail (every rank: the flags come from the global norm) once
        --max_skipped_steps of them came in a row: a run that skips every update trains nothing."""
        for i, flag in enumerate(flags):
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if flag else 0
            self.skipped_total += int(bool(flag))
            if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
                last = window_base + i + 1
                raise TrainingError(f"{self.skipped_in_a_row} updates in a row skipped (steps "
                                    f"{last - self.skipped_in_a_row + 1}-{last}: {where}); the run is not "
                                    "learning: check the data, the loss and the learning rate (--max_skipped_steps "
                                    "sets this limit)")

    def state_dict(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_total = state.get("skipped_total", 0)
        self.skipped_in_a_row = state.get("skipped_in_a_row", 0)

    def _utilisation(self, record: dict[str, Any], by_rank: list[float]) -> None:
        """The ranks' mean GPU utilisation into the record, and a warning when it stays low (rank 0)."""
        known = [u for u in by_rank if not math.isnan(u)]
        if not known:  # a window shorter than NVML's sample period
            return
        record["gpu_util_pct"] = sum(known) / len(known)
        record["gpu_util_pct_by_rank"] = [None if math.isnan(u) else round(u, 1) for u in by_rank]
        warning = utilisation_warning(known, step_breakdown(record["step_time_s"], record["data_wait_s"],
                                                            record["fwd_bwd_s"], record["optimizer_s"]))
        if warning:
            log.warning("step %d: %s", record["step"], warning)

    def _straggler_fields(self, per_rank: list[list[float]]) -> dict[str, Any]:
        """Slowest rank, its host and the skew (max/median) of the ranks' own time per step.

        In synchronous DDP every rank's step takes the same wall time: the fast ranks wait for the slow one
        inside the gradient all-reduce. So a straggler is found by its own time, data wait + forward, which
        no collective pads.
        """
        times = [t for t, _, _ in per_rank]
        own = [o for _, _, o in per_rank]
        slowest = max(range(len(own)), key=own.__getitem__)
        median = statistics.median(own)
        skew = own[slowest] / median if median > 0 else 1.0
        for rank in range(len(own)):
            streak = self._streak.get(rank, 0)
            self._streak[rank] = streak + 1 if own[rank] >= self.straggler_skew * median else 0
        if self._streak.get(slowest, 0) == 3:
            log.warning("straggler: %s (%s) has been %.2fx the median time of data wait + forward for 3 log "
                        "intervals", self.ctx.name(slowest), self.ctx.addrs[slowest], skew)
        mesh = {"slowest_dp_rank": slowest // self.ctx.tp_size} if self.ctx.tp_size > 1 else {}
        return {"slowest_rank": slowest, "slowest_host": self.ctx.hosts[slowest], **mesh, "step_time_skew": skew,
                "data_wait_max_s": max(w for _, w, _ in per_rank),
                "step_time_s_by_rank": [round(t, 6) for t in times],
                "data_wait_s_by_rank": [round(w, 6) for _, w, _ in per_rank]}

    def summary(self, position: Any, last_eval: dict[str, Any], elapsed: float, run_dir: Any,
                weights: dict[str, Any] | None = None) -> dict[str, Any]:
        """What `fit` returns, and its last line on rank 0: steps, updates (and those skipped as non-finite),
        epochs, time, the last eval's metrics (and its step), where the run's files are. `weights`
        (`FinalWeights.about`): the step the final weights are of, where that is another (--load_best_at_end)."""
        metrics = {k: v for k, v in last_eval.items() if k != "step"}
        skipped = self.skipped_total
        summary = {"step": position.step, "updates": position.step - skipped, "epoch": position.epoch,
                   "elapsed_s": elapsed, "eval": metrics, "eval_loss": metrics.get("loss"),
                   "eval_accuracy": metrics.get("accuracy"), **(weights or {})}
        if self.ctx.is_main:
            shown = "".join(f", eval {k} {v:.4f}" for k, v in metrics.items()
                            if isinstance(v, float) and k != "tokens_per_sec")
            of = summary.get("weights_step", position.step)
            if shown and (last_eval.get("step") not in (None, position.step) or of != position.step):
                shown += f" (at step {last_eval.get('step', position.step)})"
            updates = f"{summary['updates']} updates" + (f" ({skipped} skipped: non-finite)" if skipped else "")
            best = summary.get("best")
            whose = "" if of == position.step else (
                f" of step {of}" + (f" (best {best['metric']} {best['value']:.4f})" if best and
                                    isinstance(best.get("value"), float) else ""))
            log.info("done: %d steps, %s, %d epochs in %.1f s%s. run dir %s · metrics %s · weights%s %s",
                     summary["step"], updates, summary["epoch"], elapsed, shown,
                     run_dir, run_dir / "metrics.jsonl", whose, run_dir / "model.safetensors")
        return summary
