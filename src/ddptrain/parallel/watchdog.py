"""Step watchdog: a rank that makes no progress dumps every thread's stack and fails the job in one line.

The training loop reports each phase change (`watchdog.phase(...)`, an attribute write). A checker thread
fires when the phase has not changed for `hang_timeout_s` (or for the generous startup timeout while
starting up and checkpointing). A heartbeat thread publishes (step, phase, time) to the job's store, so the
rank that fires can name the peer that is actually stuck: in a hang every rank ends up waiting, and the
useful fact is who stopped first.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from ddptrain.errors import EXIT_FAILURE
from ddptrain.parallel.distributed import DistributedContext

log = logging.getLogger("ddptrain")
# The order phases follow within one step: of two ranks idle in the same step, the one in the earlier phase
# is behind (in a hang the others wait inside a collective of a later phase).
PHASE_ORDER = ("startup", "data", "forward/backward", "backward+all-reduce", "optimizer", "log", "sync", "eval",
               "replica check", "checkpoint")


def dump_stacks(log_path: Path, message: str, rank: int) -> None:
    """`message`, then the Python stack of every thread, into the rank log (onto stderr if it cannot be written)."""
    try:
        with open(log_path, "a") as fh:
            fh.write(f"\n{message}\nstacks of every thread of rank {rank}:\n")
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
    except OSError:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _progress(step: int, phase: str, idle_s: float) -> tuple[int, int, float]:
    """Sort key: lower is further behind (earlier step, earlier phase, then idle longer)."""
    order = PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)
    return step, order, -idle_s


class HangError(RuntimeError):
    pass


def record_for_launcher(exc: BaseException) -> None:
    """Write `exc` to torchelastic's error file so the launcher reports it as this rank's root cause.

    Atomically (tmp, then rename): the agent SIGTERMs the other workers as soon as one fails, and reads each
    error file as it exits; a file cut short by that signal would crash the agent's JSON parse (and with it
    the whole launch, restarts included). A worker stopped mid-write leaves no file, which the agent expects.
    """
    target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if target:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        tmp = f"{target}.{os.getpid()}.tmp"
        os.environ["TORCHELASTIC_ERROR_FILE"] = tmp  # ErrorHandler writes where this names, in torch's format
        try:
            ErrorHandler().record_exception(exc)
            os.replace(tmp, target)
        finally:
            os.environ["TORCHELASTIC_ERROR_FILE"] = target


class Watchdog:
    def __init__(self, ctx: DistributedContext, log_path: Path, hang_timeout_s: float, startup_timeout_s: float,
                 checkpoint_timeout_s: float):
        self.ctx, self.log_path = ctx, log_path
        self.hang_timeout_s = hang_timeout_s
        # Phases allowed longer than a step: start-up (rendezvous, first compile) and checkpoint writes.
        self.slow_phase_limits_s = {"startup": startup_timeout_s, "checkpoint": checkpoint_timeout_s}
        self.step, self._phase, self._since = 0, "startup", time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._store = dist.distributed_c10d._get_default_store() if ctx.world_size > 1 else None

    def phase(self, name: str, step: int | None = None) -> None:
        """Record progress: this rank entered `name`. Cheap enough for the hot path."""
        self._phase, self._since = name, time.monotonic()
        if step is not None:
            self.step = step

    # --- threads -------------------------------------------------------------------------------
    def __enter__(self) -> Watchdog:
        if self.hang_timeout_s > 0:
            targets = [self._check] + ([self._heartbeat] if self._store is not None else [])
            for target in targets:
                thread = threading.Thread(target=target, name=f"ddptrain-{target.__name__[1:]}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=1.0)

    def _interval(self) -> float:
        return max(0.2, min(5.0, self.hang_timeout_s / 10))

    def _heartbeat(self) -> None:
        key, warned = f"ddptrain/heartbeat/{self.ctx.rank}", False
        while not self._stop.wait(self._interval()):
            beat = {"step": self.step, "phase": self._phase, "host": self.ctx.host,
                    "idle_s": time.monotonic() - self._since, "time": time.time()}
            try:
                self._store.set(key, json.dumps(beat))
            except Exception as exc:  # the store may be back at the next beat; the collectives say if not
                if not warned:
                    log.warning("watchdog: rank %d cannot publish its heartbeat to the store (%s: %s); retrying "
                                "every %.1f s, a hang report may not name the rank furthest behind meanwhile",
                                self.ctx.rank, type(exc).__name__, exc, self._interval())
                    warned = True

    def _check(self) -> None:
        while not self._stop.wait(self._interval()):
            limit = self.slow_phase_limits_s.get(self._phase, self.hang_timeout_s)
            idle = time.monotonic() - self._since
            if idle > limit:
                self._fire(idle)

    # --- firing --------------------------------------------------------------------------------
    def _peers(self) -> list[dict]:
        """Latest heartbeats of the other ranks (bounded wait: the store may be unreachable)."""
        if self._store is None:
            return []
        found: list[dict] = []

        def read() -> None:
            for rank in range(self.ctx.world_size):
                key = f"ddptrain/heartbeat/{rank}"
                if rank != self.ctx.rank and self._store.check([key]):
                    beat = json.loads(self._store.get(key))
                    beat["idle_s"] += time.time() - beat["time"]  # age of the beat itself
                    found.append({"rank": rank, **beat})

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=5.0)
        return found

    def describe(self, idle: float) -> str:
        me = f"rank {self.ctx.rank} on host {self.ctx.host}"
        line = f"hang: {me} made no progress for {idle:.0f} s at step {self.step} (phase {self._phase})"
        peers = self._peers()
        if peers:
            # The stuck rank is the one furthest behind: lowest step, then earliest phase, then longest idle.
            worst = min(peers, key=lambda p: _progress(p["step"], p["phase"], p["idle_s"]))
            if _progress(worst["step"], worst["phase"], worst["idle_s"]) < _progress(self.step, self._phase, idle):
                line += (f"; rank {worst['rank']} on host {worst['host']} is furthest behind: step "
                         f"{worst['step']}, phase {worst['phase']}, idle {worst['idle_s']:.0f} s")
        return line

    def _fire(self, idle: float) -> None:
        message = self.describe(idle)
        dump_stacks(self.log_path, message, self.ctx.rank)
        log.error("%s; stacks in %s", message, self.log_path)
        sys.stderr.write(f"ddptrain: {message}; stacks in {self.log_path}\n")
        sys.stderr.flush()
        record_for_launcher(HangError(message))
        os._exit(EXIT_FAILURE)  # the main thread is stuck; only a hard exit ends the process
