"""torch.profiler over a scheduled window, one Chrome trace per rank in RUN_DIR/traces/."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

log = logging.getLogger("ddptrain")


class StepProfiler:
    """`step()` after every optimizer step advances the schedule (wait -> warmup -> active, once).

    The trace is written as traces/rank-<R>.pt.trace.json: Perfetto (ui.perfetto.dev) opens it, and
    TensorBoard's profiler plugin finds it by the .pt.trace.json suffix.
    """

    def __init__(self, enabled: bool, run_dir: Path, rank: int, wait: int, warmup: int, active: int):
        self.path = run_dir / "traces" / f"rank-{rank}.pt.trace.json"
        self._prof = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=True, with_stack=False,
                                 schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                                 on_trace_ready=self._write)

    def _write(self, prof: profile) -> None:
        prof.export_chrome_trace(str(self.path))
        log.info("profiler trace written: %s", self.path)

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def region(self, name: str) -> contextlib.AbstractContextManager:
        """A named range in the trace (forward, backward, optimizer, ...); free when not profiling."""
        if self._prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)
