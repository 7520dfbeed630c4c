"""Metric sinks on rank 0: metrics.jsonl (the contract), TensorBoard, and a progress bar."""

from __future__ import annotations

import json
import logging
import math
import queue
import sys
import threading
from pathlib import Path
from typing import Any

from ddptrain.errors import UsageError

SPLITS = ("train", "eval", "memory")  # memory: what each rank holds, once per run start
NUMERIC_SKIP = ("time", "step", "epoch")
log = logging.getLogger("ddptrain")


def require_tensorboard() -> None:
    """UsageError unless the optional tensorboard package is importable."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'ddptrain[tensorboard]' "
                         "(or pass --no-tensorboard)") from None


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write them as null so every line stays standard JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricSinks:
    """Rank 0 only. Appends one JSON object per line and mirrors numbers to TensorBoard, on a writer thread.

    Formatting a line, a dozen TensorBoard summaries and the log line that announces it cost milliseconds;
    on the training thread they would hold up every rank at the next collective. `close` drains the queue,
    so no line is lost when a run ends or fails.
    """

    def __init__(self, run_dir: Path, tensorboard: bool, trackers: Any = None):
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers  # observe.trackers.Trackers: each line goes to them too, on their own threads
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        # A SimpleQueue: put() wakes the writer for a third of what queue.Queue's costs the training thread.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="ddptrain-metrics", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any], announce: str = "") -> None:
        """Queue `record` for the writer thread, which then logs `announce` (if any) at INFO."""
        assert record["split"] in SPLITS
        self._queue.put((record, announce))
        if self.trackers:
            self.trackers.log(record)

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            record, announce = item
            try:
                self._write(record)
            except Exception as exc:  # a full disk must not kill training; say so once per line lost
                log.error("metrics line of step %s not written: %s: %s", record.get("step"), type(exc).__name__, exc)
            if announce:
                log.info("%s", announce)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key not in NUMERIC_SKIP and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path, start_byte: int = 0) -> list[dict[str, Any]]:
    """Lines of a metrics.jsonl from byte `start_byte` on (a line start); a torn line (a run still being
    written, or a crash mid-line) is skipped.

    After a resume, steps between the checkpoint and the crash appear twice; the later line wins.
    """
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, "rb") as fh:
        fh.seek(start_byte)
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:  # JSONDecodeError, or UnicodeDecodeError from bytes cut mid-character
                continue
            latest[(record.get("split"), record.get("step"))] = record
    return sorted(latest.values(), key=lambda r: (r["step"], r["split"] == "eval"))


class ProgressBar:
    """tqdm on rank 0 only, and only when stderr is a terminal (logs of batch jobs stay clean)."""

    def __init__(self, enabled: bool, total_steps: int, initial: int):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial, unit="step", dynamic_ncols=True, leave=False)

    def update(self, step: int, epoch: int, loss: float, samples_per_sec: float) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", samples_s=f"{samples_per_sec:,.0f}",
                                  refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
