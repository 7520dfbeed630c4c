"""torch.profiler over a scheduled window: per rank, a Chrome trace and an op summary in RUN_DIR/traces/."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

log = logging.getLogger("ddptrain")

LOGGED_ROWS = 10  # of the summary, in rank 0's log at the end; the file has them all


class StepProfiler:
    """`step()` after every optimizer step advances the schedule (wait -> warmup -> active, once).

    The trace is written as traces/rank-<R>.pt.trace.json: Perfetto (ui.perfetto.dev) opens it, and
    TensorBoard's profiler plugin finds it by the .pt.trace.json suffix. Next to it, summary-rank-<R>.txt:
    `key_averages().table()` of the active steps, ops by the time they spend themselves on the device
    (self CUDA time with CUDA, self CPU time without; totals would rank the step and forward/backward ranges
    first, which contain everything). Rank 0 logs its top rows when the run ends.
    """

    def __init__(self, enabled: bool, run_dir: Path, rank: int, wait: int, warmup: int, active: int):
        self.path = run_dir / "traces" / f"rank-{rank}.pt.trace.json"
        self.summary_path = run_dir / "traces" / f"summary-rank-{rank}.txt"
        self._is_main = rank == 0
        self._top_rows = ""  # the head of the summary, logged at exit on rank 0
        self._prof = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            activities = [ProfilerActivity.CPU]
            self._sort_by = "self_cpu_time_total"
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
                self._sort_by = "self_device_time_total"  # torch 2.13's name for self CUDA time
            self._prof = profile(activities=activities, record_shapes=True, with_stack=False,
                                 schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                                 on_trace_ready=self._write)

    def _write(self, prof: profile) -> None:
        prof.export_chrome_trace(str(self.path))
        averages = prof.key_averages()
        self.summary_path.write_text(averages.table(sort_by=self._sort_by, row_limit=-1) + "\n")
        self._top_rows = averages.table(sort_by=self._sort_by, row_limit=LOGGED_ROWS)
        log.info("profiler trace written: %s, op summary: %s", self.path, self.summary_path)

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            if self._is_main and self._top_rows:
                what = "self CUDA" if self._sort_by == "self_device_time_total" else "self CPU"
                log.info("profiler: top %d ops by %s time (all of them in %s)\n%s", LOGGED_ROWS, what,
                         self.summary_path, self._top_rows)

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def region(self, name: str) -> contextlib.AbstractContextManager:
        """A named range in the trace (forward, backward, optimizer, ...); free when not profiling."""
        if self._prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)
