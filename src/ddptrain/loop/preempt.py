"""Preemption: SIGTERM / SIGUSR1 set a flag that the loop acts on at a step boundary, on all ranks."""

from __future__ import annotations

import signal
from typing import Any

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
