"""How the benchmarks watch ddptrain's real training loop without changing it.

`StepProbe` wraps a Trainer's `train_step` on its training thread: it calls back at every step boundary —
as a step begins, before its first micro-batch is read — and counts the micro-batches the steps read.
Everything the loop does between two steps (the step itself, the scheduler, log steps, the per-step
control all-reduce, saves) lands between two boundaries. At a boundary the callbacks below may:

* `Interleave`: run a block of the raw loop, so that ddptrain and the raw loop alternate in blocks of K
  optimizer steps (ABAB...) in the same processes, on the same cores, with the same data and model;
* `SaveSchedule`: choose whether the next step ends with a save, and whether it is synchronous or not;
* `Timeline`: only record the time.

All callbacks run on every rank at the same boundary, so a collective inside one (a checkpoint wait) is safe.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from benchmarks.raw_loop import sync_device


def wrap_timed(obj: Any, name: str, clock: Callable[[], float], record: Callable[[float], None]) -> None:
    """Replace obj.name by the same call that hands `record` the `clock` seconds it took."""
    method = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return method(*args, **kwargs)
        finally:
            record(clock() - started)

    setattr(obj, name, timed)


class PhaseClock:
    """The training thread's CPU seconds (`time.thread_time`) inside wrapped calls, summed by phase.

    Both sides of a comparison run on the same thread one after the other, so one clock serves both; the
    caller reads `spent` at the edges of each side's blocks. A wrapper costs ~1 us per call, alike on both.
    """

    def __init__(self) -> None:
        self.spent: Counter[str] = Counter()

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        """Replace obj.name (a method, or a class's attribute) by a call that is timed as `phase`."""

        def add(seconds: float) -> None:
            self.spent[phase] += seconds

        wrap_timed(obj, name, time.thread_time, add)

    def reading(self) -> dict[str, float]:
        """What has been spent so far, by phase, and the thread's whole CPU time as "total"."""
        return {**self.spent, "total": time.thread_time()}


class StepProbe:
    """`on_boundary(steps_done)` as each of `trainer`'s steps begins; `taken` counts micro-batches read.

    With a `clock`, the training thread's CPU inside each read of a batch is timed as "receiving batches"."""

    def __init__(self, trainer: Any, on_boundary: Callable[[int], None], clock: PhaseClock | None = None):
        self.on_boundary = on_boundary
        self.taken = 0
        self.clock = clock
        train_step = trainer.train_step

        def probed(batches: Iterator) -> None:
            self.on_boundary(trainer.position.step)
            train_step(self._counted(batches))

        trainer.train_step = probed  # fit() calls self.train_step: an instance attribute wins

    def _counted(self, batches: Iterator) -> Iterator:
        while True:
            started = time.thread_time() if self.clock is not None else 0.0
            try:
                batch = next(batches)
            except StopIteration:
                return
            if self.clock is not None:
                self.clock.spent["receiving batches"] += time.thread_time() - started
            self.taken += 1
            yield batch


class Timeline:
    """Boundary times: `times[i]` is when step i+1 began (device work of earlier steps finished)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, steps_done: int) -> None:
        sync_device(self.device)
        self.times.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


# --- where the CPU goes ----------------------------------------------------------------------------

CPU_KINDS = ("training thread", "ddptrain threads", "torch threads", "loader workers")


def _schedstat(task_dir: Path) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of one thread, from the kernel's schedstat."""
    try:
        run, wait, _ = (task_dir / "schedstat").read_text().split()
        return int(run), int(wait)
    except (OSError, ValueError):  # the thread ended, or no schedstat (not Linux)
        return 0, 0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for task in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return []


class CpuAccount:
    """CPU time by kind of thread in this process and its children, from /proc (Linux; nothing elsewhere).

    Wall time says how much slower a side is; this says where: the training thread's own time, ddptrain's
    helper threads (named ddptrain-*: batches, metrics, watchdog), torch's threads (gloo's loops, the
    store), and the DataLoader workers (child processes, every thread of theirs). The training thread's
    wait is the time it was runnable but had no core: on a saturated machine, what the others cost it.
    Nanosecond counters (schedstat), not the 10 ms ticks of /proc/*/stat.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.training = threading.get_native_id()  # created on the training thread

    def snapshot(self) -> dict[str, int]:
        """Nanoseconds so far by kind, and "training thread wait"."""
        named = {t.native_id: t.name for t in threading.enumerate()}
        out = dict.fromkeys((*CPU_KINDS, "training thread wait"), 0)
        tasks = Path(f"/proc/{self.pid}/task")
        for entry in (os.listdir(tasks) if tasks.is_dir() else []):
            tid = int(entry)
            run, wait = _schedstat(tasks / entry)
            if tid == self.training:
                kind = "training thread"
                out["training thread wait"] += wait
            elif named.get(tid, "").startswith("ddptrain-"):
                kind = "ddptrain threads"
            elif tid in named:
                continue  # other Python threads (the harness's own, none in a training step)
            else:
                kind = "torch threads"
            out[kind] += run
        for child in _children(self.pid):
            for entry in (os.listdir(f"/proc/{child}/task") if Path(f"/proc/{child}/task").is_dir() else []):
                out["loader workers"] += _schedstat(Path(f"/proc/{child}/task/{entry}"))[0]
        return out

    @staticmethod
    def spent(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
        """Seconds of each kind between two snapshots (a thread that ended in between is not counted)."""
        return {kind: max(0, after[kind] - before[kind]) / 1e9 for kind in after}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def cpu_ms_per_step(blocks: list[dict[str, float]], steps: int) -> dict[str, float]:
    """Blocks' seconds by kind, summed, as milliseconds per step (a kind missing from a block counts 0)."""
    kinds = dict.fromkeys(kind for block in blocks for kind in block)
    return {kind: 1000 * sum(b.get(kind, 0.0) for b in blocks) / max(steps, 1) for kind in kinds}


class Interleave:
    """At every K-th boundary: close ddptrain's block of K steps, run K raw-loop steps, open the next block.

    A short pause before each block lets the other side's loader workers finish refilling their prefetch
    queues, so neither side's data loading runs on the other's clock. Pauses are not timed. Each block's
    CPU time by kind of thread (`CpuAccount`) is read outside the timed spans.
    """

    def __init__(self, device: torch.device, block_steps: int, run_other: Callable[[int], float], settle_s: float,
                 max_blocks: int, phases: PhaseClock | None = None):
        self.device, self.block_steps, self.run_other, self.settle_s = device, block_steps, run_other, settle_s
        self.max_blocks = max_blocks
        self.phases = phases or PhaseClock()
        # per block: the training thread's CPU seconds by phase (PhaseClock), and in all ("total")
        self.phase_cpu: dict[str, list[dict[str, float]]] = {"ours": [], "theirs": []}
        self.ours: list[float] = []  # seconds of each ddptrain block
        self.theirs: list[float] = []  # seconds of the raw block that followed it
        self.peak_mb: dict[str, float] = {"ours": 0.0, "theirs": 0.0}  # CUDA: allocator peak during each side's blocks
        self.cpu: dict[str, list[dict[str, float]]] = {"ours": [], "theirs": []}  # per block, CpuAccount.spent
        self._account = CpuAccount()
        self._opened: float | None = None
        self._opened_cpu: dict[str, int] = {}
        self._opened_phases: dict[str, float] = {}

    def _peak(self, side: str) -> None:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
            self.peak_mb[side] = max(self.peak_mb[side], peak)
            torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self, steps_done: int) -> None:
        if steps_done % self.block_steps or len(self.ours) == self.max_blocks:
            return
        sync_device(self.device)
        now = time.perf_counter()
        if self._opened is not None:
            self.ours.append(now - self._opened)
            self.phase_cpu["ours"].append(_delta(self._opened_phases, self.phases.reading()))
            self.cpu["ours"].append(self._account.spent(self._opened_cpu, self._account.snapshot()))
            self._peak("ours")
            time.sleep(self.settle_s)
            before, phases_before = self._account.snapshot(), self.phases.reading()
            self.theirs.append(self.run_other(self.block_steps))
            self.phase_cpu["theirs"].append(_delta(phases_before, self.phases.reading()))
            self.cpu["theirs"].append(self._account.spent(before, self._account.snapshot()))
            self._peak("theirs")
            if len(self.ours) == self.max_blocks:
                return
        time.sleep(self.settle_s)
        self._opened_cpu = self._account.snapshot()
        self._opened_phases = self.phases.reading()
        self._opened = time.perf_counter()


class CommCounter:
    """A DDP communication hook: the stock all-reduce, counted by the micro-step it happened in."""

    def __init__(self, micro_of: Callable[[], int]):
        self.micro_of = micro_of
        self.calls: Counter[int] = Counter()  # micro-step index -> bucket all-reduces

    def hook(self, state, bucket):  # unannotated: DDP rejects annotations other than its own types
        self.calls[self.micro_of()] += 1
        return default_hooks.allreduce_hook(state, bucket)


class CommTimer:
    """A DDP communication hook that times what DDP all-reduces: per bucket, its bytes and the seconds from
    the hook's call (the bucket is ready) to the all-reduce's completion, seen on the thread that completes it.

    `skip=True` all-reduces nothing (each bucket is returned as it is, already complete): the same processes
    then run the same steps without gradient communication, which measures the compute of N processes
    sharing the machine. Must be registered on every rank alike (a skipping rank must not wait on others).
    """

    def __init__(self, skip: bool = False):
        self.skip = skip
        self.buckets: list[tuple[int, float, float]] = []  # (bytes, ready at, done at), perf_counter seconds

    def hook(self, state, bucket):  # unannotated: DDP rejects annotations other than its own types
        buffer = bucket.buffer()
        ready = time.perf_counter()
        if self.skip:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(buffer)
            self.buckets.append((buffer.numel() * buffer.element_size(), ready, ready))
            return future

        def done(fut):
            self.buckets.append((buffer.numel() * buffer.element_size(), ready, time.perf_counter()))
            return fut.value()

        return default_hooks.allreduce_hook(state, bucket).then(done)

    def per_step(self, step_starts: list[float]) -> list[dict[str, float]]:
        """For each interval between step boundaries: bytes all-reduced, bucket count, all-reduce seconds (each
        bucket from when it was ready, or the previous one done, to its own completion: the backend runs them
        one after another) and the span from the first bucket ready to the last one done."""
        steps = []
        for start, end in zip(step_starts, step_starts[1:]):
            inside = sorted((b for b in self.buckets if start <= b[1] < end), key=lambda b: b[1])
            busy, free_at = 0.0, 0.0
            for _, ready, done in inside:
                busy += done - max(ready, free_at)
                free_at = done
            steps.append({"bytes": sum(b[0] for b in inside), "buckets": len(inside), "all_reduce_s": busy,
                          "span_s": inside[-1][2] - inside[0][1] if inside else 0.0})
        return steps


class SaveSchedule:
    """Saves after steps first, first + 2P, first + 4P, ..., alternately synchronous and asynchronous.

    Each save is followed by a window of P steps (the save's cost lands there) and then P clean steps (the
    baseline). An asynchronous write still running at the end of its window is waited for there, so all
    of its cost stays inside its own window. The trainer's own path does the saving: the schedule only sets
    the manager's schedule to save every step for the step before a save, and the manager's `async_save`.
    """

    def __init__(self, trainer: Any, first: int, period: int, num_saves: int):
        self.trainer, self.period = trainer, period
        self.save_steps = [first + 2 * period * k for k in range(num_saves)]
        self.timeline = Timeline(trainer.ctx.device)
        self.blocked: dict[int, float] = {}  # save step -> seconds the training thread spent in checkpoints.save
        self.unfinished: dict[int, float] = {}  # async save step -> seconds waited for it at its window end
        manager = trainer.checkpoints
        original = manager.save

        def timed_save(**when: Any) -> bool:
            started = time.perf_counter()
            saved = original(**when)
            if saved:
                self.blocked[self.trainer.position.step] = time.perf_counter() - started
            return saved

        manager.save = timed_save  # the loop hands every boundary to checkpoints.save: an instance attribute wins

    def is_async(self, save_step: int) -> bool:
        return self.save_steps.index(save_step) % 2 == 1

    def __call__(self, steps_done: int) -> None:
        manager = self.trainer.checkpoints
        closing = steps_done - self.period + 1  # the save whose window ends with the step just done
        if closing in self.save_steps and self.is_async(closing):
            started = time.perf_counter()
            manager.wait()  # all ranks: joins the writer and agrees on its outcome
            self.unfinished[closing] = time.perf_counter() - started
        self.timeline(steps_done)
        upcoming = steps_done + 1
        manager.schedule.every_steps = 1 if upcoming in self.save_steps else 0
        if upcoming in self.save_steps:
            manager.async_save = self.is_async(upcoming)

    def summary(self) -> dict[str, Any]:
        """Per save: seconds blocked in checkpoints.save, seconds of training lost over its window vs the clean
        steps."""
        steps = self.timeline.step_seconds()  # steps[i] is the duration of step i+1
        saves = []
        for save_step in self.save_steps:
            window = steps[save_step - 1:save_step - 1 + self.period]
            clean = steps[save_step - 1 - self.period:save_step - 1]
            if len(window) < self.period or len(clean) < self.period:
                continue
            baseline = statistics.median(clean)
            saves.append({"step": save_step, "mode": "async" if self.is_async(save_step) else "sync",
                          "blocked_s": self.blocked.get(save_step, float("nan")),
                          "lost_s": sum(window) - self.period * baseline, "step_s": baseline,
                          "waited_at_window_end_s": self.unfinished.get(save_step, 0.0)})
        return {"saves": saves}
