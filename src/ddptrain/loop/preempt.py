"""Preemption: SIGTERM / SIGUSR1 set a flag, and --max_time sets a deadline, that the loop acts on at a step
boundary, on all ranks."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

from ddptrain.checkpoints.format import write_atomic
from ddptrain.config import parse_duration
from ddptrain.errors import EXIT_PREEMPTED, Preempted
from ddptrain.parallel.procenv import LAUNCH_TIME_ENV, PREEMPTED_MARKER

log = logging.getLogger("ddptrain")

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """SIGTERM / SIGUSR1 only set a flag; the loop acts on it at the next step boundary, on all ranks.
    `max_time` (--max_time, counted from the launch) sets the deadline at which the run checkpoints and exits."""

    def __init__(self, max_time: str = "") -> None:
        self.received: str | None = None
        self.max_time = max_time
        started = float(os.environ.get(LAUNCH_TIME_ENV) or time.time())
        self.deadline = started + parse_duration(max_time, "--max_time") if max_time else None
        self._previous: dict[int, Any] = {}

    def agreed(self, ctx: Any) -> str | None:
        """The signal any rank received so far: its name ("SIGTERM" where this rank received it, "SIGUSR1 on rank 1"
        where only a peer did), or None if none did. All ranks: one gather on the control group."""
        names = ctx.all_gather_object(self.received)
        return self.received or next((f"{name} on rank {rank}" for rank, name in enumerate(names) if name), None)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline

    def exit(self, step: int, preempted: bool, run_dir: Path | None) -> NoReturn:
        """End the run after the checkpoint of `step` committed: by a signal (`preempted`, this rank's or a
        peer's) or at the time limit. Rank 0 (`run_dir` given) leaves the PREEMPTED marker the launcher reads."""
        signal_name = (self.received or "a peer's signal") if preempted else f"--max_time {self.max_time}"
        if run_dir is not None:
            write_atomic(run_dir / PREEMPTED_MARKER,
                         json.dumps({"step": step, "signal": signal_name, "time": time.time()}).encode())
        if preempted:
            log.warning("preempted (%s): checkpoint of step %d committed; exiting", signal_name, step)
        else:
            log.warning("time limit %s reached: checkpoint of step %d committed; exiting with %d (run the same "
                        "command to continue)", signal_name, step, EXIT_PREEMPTED)
        raise Preempted(step, signal_name)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """The handlers as they were before (a signal acts at once again). Safe to call twice."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
