"""Fault injection, used by the test suite and usable for chaos runs.

A spec is ``key=value`` pairs separated by commas, from ``--inject_fault`` or ``DDPTRAIN_FAULT``::

    rank=1,step=5,kind=sigkill            # rank 1 kills itself in step 5, before its first micro-batch
    rank=0,step=3,micro=1,kind=raise      # in step 3, before micro-batch 1 (the second) is read
    rank=1,step=4,kind=hang               # sleeps in step 4 while the others wait in its collectives
    rank=0,step=2,kind=nan                # this rank's loss becomes NaN in step 2
    rank=0,step=6,kind=sigkill,at=save    # dies while writing the checkpoint of step 6 (sharded: its shards)
    rank=1,step=6,kind=raise,at=snapshot  # fails taking its state for the checkpoint of step 6, before any write
    rank=0,step=6,kind=ioerror,at=load,times=2  # reading checkpoint step-6 fails with EIO twice, then works
    rank=0,step=6,kind=ioerror,at=best,times=2  # keeping step-6 as best/ fails with ENOSPC twice, then works
    rank=0,step=6,kind=corrupt-checkpoint # flips a byte in the checkpoint of step 6 after it commits
    rank=0,step=4,kind=stall,at=save,seconds=30  # a slow checkpoint write: sleeps 30 s (or until SIGTERM/SIGUSR1)
    rank=1,step=4,kind=stop,at=eval       # SIGSTOPs itself in the eval after step 4: frozen, heartbeat too
    rank=1,step=0,kind=stop,at=startup    # SIGSTOPs itself as its Trainer starts to build
    rank=1,step=0,kind=stop,at=load       # ... as the model's weights come in (step=S>0: reading step-S)
    rank=1,step=8,kind=stop,at=final      # ... as the final save after the last step, 8, starts

Steps are numbered like `metrics.jsonl` and `checkpoints/step-N`: step N is the N-th optimizer step.

``at=save`` fires on the rank named: every rank writes its shards, and the fault fires on that rank once its
shard files are written, inside DCP's collective save. ``at=load`` with ``kind=ioerror`` makes reading
checkpoint ``step-S`` raise ``OSError(EIO)`` the first ``times`` reads (default 1): a transient I/O error.
``at=eval`` fires on the rank named as it starts the evaluation that follows step S. ``at=startup`` (step 0)
fires as the Trainer starts to build, ``at=load`` with a kind other than ioerror as the weights come in (step 0)
or checkpoint step-S is read, ``at=final`` as the final save after the last step S starts.

``kind=hang`` stops the main thread only (its watchdog threads go on: a rank that makes no progress);
``kind=stop`` stops the whole process with SIGSTOP (a frozen VM or a ^Z: nothing in it runs, its heartbeat
neither).

``restart=N`` (default 0) arms the fault only in the N-th incarnation under an elastic launcher
(TORCHELASTIC_RESTART_COUNT), so a restarted job does not fail again at the same place.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ddptrain.errors import UsageError

KINDS = ("raise", "sigkill", "exit", "hang", "stop", "stall", "nan", "corrupt-checkpoint", "ioerror")
PLACES = ("step", "save", "snapshot", "load", "best", "eval", "startup", "final")
ENV_VAR = "DDPTRAIN_FAULT"


class InjectedFault(RuntimeError):
    """The exception raised by kind=raise."""


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    step: int
    kind: str
    micro: int = 0
    at: str = "step"
    restart: int = 0
    seconds: int = 0  # kind=stall: how long
    times: int = 1  # kind=ioerror: how many reads fail

    @classmethod
    def parse(cls, spec: str, source: str) -> FaultSpec:
        fields: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep:
                raise UsageError(f"{source}: {part!r} is not key=value (e.g. 'rank=1,step=5,kind=sigkill')")
            fields[key] = value
        keys = ("rank", "step", "kind", "micro", "at", "restart", "seconds", "times")
        unknown = set(fields) - set(keys)
        if unknown:
            raise UsageError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}; use {', '.join(keys)}")
        ints = {}
        for key in ("rank", "step", "micro", "restart", "seconds", "times"):
            if key in fields:
                try:
                    ints[key] = int(fields[key])
                except ValueError:
                    raise UsageError(f"{source}: {key}={fields[key]!r} is not an integer") from None
        if "rank" not in ints or "step" not in ints:
            raise UsageError(f"{source}: rank= and step= are required")
        if fields.get("kind") not in KINDS:
            raise UsageError(f"{source}: kind must be one of {', '.join(KINDS)}")
        if fields.get("at", "step") not in PLACES:
            raise UsageError(f"{source}: at must be one of {', '.join(PLACES)}")
        kind, at = fields["kind"], fields.get("at", "step")
        if kind == "ioerror" and at not in ("load", "best") or at == "best" and kind != "ioerror":
            raise UsageError(f"{source}: kind=ioerror goes with at=load or at=best, and at=best with kind=ioerror")
        return cls(kind=fields["kind"], at=fields.get("at", "step"), **ints)


class FaultInjector:
    """Checks placed at fixed points of the training loop; all are no-ops when no fault is armed."""

    def __init__(self, spec_text: str, rank: int, interrupted: Callable[[], bool] = lambda: False):
        spec_text = spec_text or os.environ.get(ENV_VAR, "")
        spec = FaultSpec.parse(spec_text, source=ENV_VAR) if spec_text else None
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.spec = spec if spec and spec.rank == rank and spec.restart == restart else None
        # Whether a preemption signal reached this process (the Trainer's StopSignals): a stall ends then, so that
        # a test can signal a save it knows to be in progress and need not guess how long it lasts.
        self.interrupted = interrupted

    def _due(self, step: int, at: str, micro: int = 0) -> bool:
        s = self.spec
        return s is not None and s.step == step and s.at == at and s.micro == micro

    def at_micro_step(self, step: int, micro: int) -> None:
        """Called before each micro-batch is read; `step` is the number of the step in progress."""
        if self._due(step, "step", micro) and self.spec.kind not in ("nan", "corrupt-checkpoint"):
            self._fire(f"step {step} micro-batch {micro}")

    def poison_loss(self, step: int) -> bool:
        """True when this rank's loss should become NaN in this step."""
        return self.spec is not None and self.spec.kind == "nan" and self.spec.step == step

    def during_save(self, step: int) -> None:
        """Called after a checkpoint's data files are written and before its manifest commits: by every rank
        inside DCP's save, and by rank 0 before it commits."""
        if self._due(step, "save") and self.spec.kind != "corrupt-checkpoint":
            self._fire(f"checkpoint write of step {step}")

    def at_snapshot(self, step: int) -> None:
        """Called on every rank as it takes its state for the checkpoint of `step`, before anything is written."""
        if self._due(step, "snapshot"):
            self._fire(f"the snapshot for the checkpoint of step {step}")

    def at_eval(self, step: int) -> None:
        """Called on every rank as it starts the evaluation after step `step`."""
        if self._due(step, "eval"):
            self._fire(f"the evaluation after step {step}")

    def at_startup(self) -> None:
        """Called on every rank as its Trainer starts to build (step=0 names it), its watchdog running."""
        if self._due(0, "startup"):
            self._fire("start-up")

    def at_load(self, step: int) -> None:
        """Called before each attempt to read checkpoint step-`step` (and with 0, before the model's weights come
        in): kind=ioerror raises EIO `times` times; another kind fires there."""
        if self._due(step, "load") and self.spec.kind != "ioerror":
            self._fire(f"reading the checkpoint of step {step}" if step else "loading the model's weights")
        self._io_error(step, "load", errno.EIO, f"reading the checkpoint of step {step}")

    def at_final(self, step: int) -> None:
        """Called on every rank as it starts the final save, after the last step `step` (its checkpoint
        committed)."""
        if self._due(step, "final"):
            self._fire(f"the final save after step {step}")

    def at_best(self, step: int) -> None:
        """Called on rank 0 before each attempt to make step-`step` best/: kind=ioerror raises ENOSPC (a full
        disk in the copy) `times` times."""
        self._io_error(step, "best", errno.ENOSPC, f"keeping the checkpoint of step {step} as best/")

    def _io_error(self, step: int, at: str, code: int, what: str) -> None:
        if self._due(step, at):
            left = self.spec.times - 1
            self.spec = replace(self.spec, times=left) if left > 0 else None
            raise OSError(code, f"injected fault kind=ioerror {what}")

    def after_commit(self, step: int, ckpt_dir: Path) -> None:
        """kind=corrupt-checkpoint: flip one byte in the middle of rank 0's committed shard file."""
        if self.spec is not None and self.spec.kind == "corrupt-checkpoint" and self.spec.step == step:
            target = ckpt_dir / "shards" / "__0_0.distcp"
            with open(target, "r+b") as fh:
                fh.seek(target.stat().st_size // 2)
                byte = fh.read(1)
                fh.seek(-1, os.SEEK_CUR)
                fh.write(bytes([byte[0] ^ 0xFF]))

    def _fire(self, where: str) -> None:
        spec, self.spec = self.spec, None  # fire once per process
        message = f"injected fault kind={spec.kind} at {where}"
        if spec.kind == "raise":
            raise InjectedFault(message)
        if spec.kind == "exit":
            os._exit(13)
        if spec.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.kind == "hang":
            while True:
                time.sleep(3600)
        if spec.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if spec.kind == "stall":  # (a signal that the loop keeps as a flag ends it: see `interrupted`)
            deadline = time.monotonic() + spec.seconds
            while time.monotonic() < deadline and not self.interrupted():
                time.sleep(0.01)
