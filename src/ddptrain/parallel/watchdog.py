"""Step watchdog: a rank that makes no progress, or a peer that stopped, fails the job in one line naming it.

Two hangs look alike from outside and differ inside:

- A rank is alive but makes no progress (a stalled data loader, a collective a peer never joins). The training
  loop reports each phase change (`watchdog.phase(...)`, an attribute write); a checker thread fires when the
  phase has not changed for `hang_timeout_s` (start-up and checkpoint phases get their own, longer limits).
- A rank stopped altogether (SIGSTOP, a frozen VM): nothing in it runs, so only a peer can tell, and the
  peers all wait in collectives, perhaps in a phase with a long limit. Every rank's heartbeat thread
  publishes (seq, step, phase) to the job's store at once and then every interval; beats come from a thread,
  so a slow but live rank keeps beating in any phase and only a stopped one falls silent. Each rank watches
  the next in a ring (and rank 0 when that serves the store): a peer whose beat has not changed for
  `hang_timeout_s` is the stuck rank, whatever phase this rank waits in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddptrain.errors import EXIT_FAILURE
from ddptrain.observe.log import rank_log_path
from ddptrain.parallel.distributed import DistributedContext
from ddptrain.parallel.procenv import PEER_LOSS_MARKERS, PeerVanished, record_for_launcher

log = logging.getLogger("ddptrain")
# The order phases follow within one step: of two ranks idle in the same step, the one in the earlier phase
# is behind (in a hang the others wait inside a collective of a later phase).
PHASE_ORDER = ("startup", "load", "setup", "data", "forward/backward", "backward+all-reduce", "optimizer", "log",
               "sync", "eval", "replica check", "checkpoint", "final save", "teardown")
# Phases entered a few times a run (not once a step): a rank publishes its beat as it enters one, so that a peer
# that reports it stopped names the phase it stopped in, not the one an interval before.
ANNOUNCED_PHASES = frozenset({"startup", "load", "setup", "eval", "checkpoint", "final save", "teardown"})
DONE = "done"  # the last beat of a rank that left its watchdog: silent from then on, and not stuck


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


def _process_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a process from /proc, None if it is gone or unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], fields[19]  # stat fields 3 and 22 (after the command name, which may hold spaces)


def _ended(facts: dict) -> bool:
    """Whether the process a peer's facts describe has ended (gone, a zombie, or its pid reused)."""
    state = _process_state(facts["pid"])
    return state is None or state[0] in "ZX" or state[1] != facts["start"]


class HangError(RuntimeError):
    pass


@dataclass
class _Watched:
    """What this rank knows of a peer's heartbeat, on this rank's monotonic clock (no cross-host skew)."""
    beat: dict | None = None
    changed_at: float = 0.0  # when a read first saw the current beat
    read_at: float = 0.0  # the last read that answered: silence is judged only up to it


class Watchdog:
    def __init__(self, ctx: DistributedContext, log_path: Path, hang_timeout_s: float, startup_timeout_s: float,
                 checkpoint_timeout_s: float, store: dist.Store | None = None):
        self.ctx, self.log_path = ctx, log_path
        self.hang_timeout_s = hang_timeout_s
        # Phases allowed longer than a step: the set-up after the model is built (the first batch's check, the first
        # compile) and checkpoint writes. Building the data and the model (tokenizing; waiting on the file lock
        # of a rank that tokenizes), reading weights or a checkpoint and the final weights' export may each take
        # as long as their size asks, with no collective to time: this rank's own timer leaves them alone. A
        # peer that stops in them is still named by its silent heartbeat.
        self.startup_timeout_s = startup_timeout_s  # how long a peer may take to publish its first beat
        self.slow_phase_limits_s = {"startup": math.inf, "load": math.inf, "setup": startup_timeout_s,
                                    "checkpoint": checkpoint_timeout_s, "final save": math.inf}
        self.step, self._phase, self._since = 0, "startup", time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        if store is None and ctx.world_size > 1:
            store = dist.distributed_c10d._get_default_store()
        self._store = store
        self._beats, self._warned = 0, False
        self._publishing = threading.Lock()  # the heartbeat thread's beats and the main thread's announcements
        # Static facts of this process, every rank's gathered as the watchdog starts: a peer on this host that
        # finds it stopped ends it (pid and start time guard against a reused pid) and records the hang where the
        # launcher looks for its error.
        state = _process_state(os.getpid())
        self._me = {"host": ctx.host, "pid": os.getpid(), "start": state[1] if state else "",
                    "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE", "")}
        self._facts: list[dict] = []
        # Under env:// rank 0 serves the store unless torchelastic's agent does; a stopped rank 0 then shows
        # as a store that does not answer, so whoever watches it needs rank 0's beat (pid, host) beforehand.
        self._store_on_rank0 = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
        watched = {(ctx.rank + 1) % ctx.world_size} | ({0} if self._store_on_rank0 else set())
        self._watched = {rank: _Watched() for rank in sorted(watched - {ctx.rank})}
        self._reading_since: float | None = None  # a store read in flight since (monotonic)
        self._entered = time.monotonic()

    @classmethod
    def of_run(cls, parallel: Any, ctx: DistributedContext, run_dir: Path) -> Watchdog:
        """A rank's watchdog from the [parallel] section's limits, its reports in the rank's log (RUN_DIR/logs).
        Not started: enter it."""
        return cls(ctx, rank_log_path(run_dir, ctx.rank), parallel.hang_timeout_s,
                   startup_timeout_s=parallel.init_timeout_s, checkpoint_timeout_s=parallel.checkpoint_timeout_s)

    def phase(self, name: str, step: int | None = None) -> None:
        """Record progress: this rank entered `name`. Cheap enough for the hot path (an attribute write; entering
        one of the few ANNOUNCED_PHASES also publishes a beat)."""
        entered = name != self._phase
        self._phase, self._since = name, time.monotonic()
        if step is not None:
            self.step = step
        if entered and name in ANNOUNCED_PHASES and self.beating:
            self._publish()

    @property
    def beating(self) -> bool:
        """Whether this rank publishes heartbeats now: between entering and leaving the watchdog (not after its
        last beat, DONE)."""
        return self._store is not None and bool(self._threads) and not self._stop.is_set()

    # --- threads -------------------------------------------------------------------------------
    def __enter__(self) -> Watchdog:
        if self.hang_timeout_s > 0:
            self._entered = time.monotonic()
            targets = [self._check]
            if self._store is not None:
                self._publish()  # at once: a rank stopped before its first interval is still named
                # A collective, not the store: a watcher reading the facts from beats could miss a peer stopped
                # within its first interval (or a stopped rank 0, whose store then answers no one).
                self._facts = [{}] * self.ctx.world_size
                dist.all_gather_object(self._facts, self._me, group=self.ctx.control_group)
                targets += [self._heartbeat, self._watch]
            for target in targets:
                thread = threading.Thread(target=target, name=f"ddptrain-{target.__name__[1:]}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # the heartbeat thread then publishes the last beat (DONE)
        for thread in self._threads:
            thread.join(timeout=1.0)

    def _interval(self) -> float:
        # A stopped peer is named within about two intervals past hang_timeout_s.
        return max(0.2, min(2.0, self.hang_timeout_s / 10))

    @staticmethod
    def _key(rank: int) -> str:
        return f"ddptrain/heartbeat/{rank}"

    def _publish(self, phase: str | None = None) -> None:
        with self._publishing:
            self._beats += 1
            beat = {"seq": self._beats, "step": self.step, "phase": phase or self._phase, "host": self.ctx.host,
                    "idle_s": time.monotonic() - self._since, "time": time.time()}
            try:
                self._store.set(self._key(self.ctx.rank), json.dumps(beat))
            except Exception as exc:  # the store may be back at the next beat; the collectives say if not
                if not self._warned:
                    log.warning("watchdog: rank %d cannot publish its heartbeat to the store (%s: %s); retrying "
                                "every %.1f s, a hang report may not name the stuck rank meanwhile",
                                self.ctx.rank, type(exc).__name__, exc, self._interval())
                    self._warned = True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._interval()):
            self._publish()
        self._publish(DONE)

    def _watch(self) -> None:
        """Read the watched peers' beats every interval. A read may block (a stopped rank 0 serving the store):
        `_reading_since` lets the checker see that; a read that fails (the store's server exited at the end of
        the run) leaves nothing to judge, so silence counts only up to the last read that answered."""
        while True:
            for rank, seen in self._watched.items():
                key = self._key(rank)
                self._reading_since = time.monotonic()
                try:
                    raw = self._store.get(key) if self._store.check([key]) else None
                except Exception:
                    continue
                finally:
                    self._reading_since = None
                now = time.monotonic()
                if raw is not None:
                    beat = json.loads(raw)
                    if seen.beat is None or beat["seq"] != seen.beat["seq"]:
                        seen.changed_at = now
                    seen.beat = beat
                seen.read_at = now
            if self._stop.wait(self._interval()):
                return

    def _check(self) -> None:
        while not self._stop.wait(self._interval()):
            now = time.monotonic()
            stopped = self._stopped_peer(now)
            if stopped is not None:
                rank, what = stopped
                self._fire(f"hang: {what}; {self._where(now - self._since)}", rank)
            limit = self.slow_phase_limits_s.get(self._phase, self.hang_timeout_s)
            idle = now - self._since
            if idle > limit:
                self._fire(*self._describe(idle, self._peers()))

    # --- judging -------------------------------------------------------------------------------
    def _stopped_peer(self, now: float) -> tuple[int | None, str] | None:
        """(rank, what) of a watched peer that stopped: its beat unchanged for hang_timeout_s, no beat at all
        past the start-up limit, or (rank None unless rank 0 serves it) a store read unanswered that long."""
        reading = self._reading_since
        if reading is not None and now - reading > self.hang_timeout_s:
            silent = f"the job's store has not answered for {now - reading:.0f} s"
            if self._store_on_rank0 and self.ctx.rank != 0:
                return 0, f"{self._name(0)} stopped responding ({silent}, and rank 0 serves it{self._last(0, now)})"
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return None, f"{silent} (served by the launcher's agent at {where})"
        for rank, seen in self._watched.items():
            if seen.beat is None:
                if seen.read_at - self._entered > self.startup_timeout_s:
                    return rank, (f"{self._name(rank)} stopped responding (no heartbeat in "
                                  f"{seen.read_at - self._entered:.0f} s since this rank started)")
            elif seen.beat["phase"] != DONE and seen.read_at - seen.changed_at > self.hang_timeout_s:
                return rank, f"{self._name(rank)} stopped responding ({self._last(rank, now).removeprefix('; ')})"
        return None

    def _name(self, rank: int, host: str | None = None) -> str:
        return self.ctx.name(rank, host)

    def _last(self, rank: int, now: float) -> str:
        seen = self._watched.get(rank)
        if seen is None or seen.beat is None:
            return ""
        beat = seen.beat
        return f"; last heartbeat {now - seen.changed_at:.0f} s ago at step {beat['step']}, phase {beat['phase']}"

    def _where(self, idle: float) -> str:
        return (f"seen from {self._name(self.ctx.rank, self.ctx.host)}, idle {idle:.0f} s at step {self.step} "
                f"(phase {self._phase})")

    def _peers(self) -> list[dict]:
        """Latest heartbeats of the other ranks (bounded wait: the store may not answer)."""
        if self._store is None:
            return []
        found: list[dict] = []

        def read() -> None:
            for rank in range(self.ctx.world_size):
                key = self._key(rank)
                if rank != self.ctx.rank and self._store.check([key]):
                    beat = json.loads(self._store.get(key))
                    beat["age_s"] = time.time() - beat["time"]
                    beat["idle_s"] += beat["age_s"]
                    found.append({"rank": rank, **beat})

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=5.0)
        return found

    def describe(self, idle: float) -> str:
        return self._describe(idle, self._peers())[0]

    def _describe(self, idle: float, peers: list[dict]) -> tuple[str, int | None]:
        """The line for this rank's own timer, and the peer it names as stopped: a peer whose
        beats stopped several intervals ago (a live rank's come every interval), else the peer furthest
        behind is named."""
        me = self._name(self.ctx.rank, self.ctx.host)
        line = f"{me} made no progress for {idle:.0f} s at step {self.step} (phase {self._phase})"
        peers = [p for p in peers if p["phase"] != DONE]
        silent = [p for p in peers if p.get("age_s", 0.0) > max(3 * self._interval(), 1.0)]
        if silent:
            worst = max(silent, key=lambda p: p["age_s"])
            return (f"hang: {self._name(worst['rank'], worst['host'])} stopped responding (last heartbeat "
                    f"{worst['age_s']:.0f} s ago at step {worst['step']}, phase {worst['phase']}); {line}"), worst["rank"]
        line = f"hang: {line}"
        if peers:
            # The stuck rank is the one furthest behind: lowest step, then earliest phase, then longest idle.
            worst = min(peers, key=lambda p: _progress(p["step"], p["phase"], p["idle_s"]))
            if _progress(worst["step"], worst["phase"], worst["idle_s"]) < _progress(self.step, self._phase, idle):
                line += (f"; {self._name(worst['rank'], worst['host'])} is furthest behind: step "
                         f"{worst['step']}, phase {worst['phase']}, idle {worst['idle_s']:.0f} s")
        return line, None

    # --- a lost peer ---------------------------------------------------------------------------
    def record_vanished_peers(self, error: BaseException, wait_s: float = 2.0) -> list[int]:
        """After `error` said a peer went away: the peers on this host whose processes ended (a SIGKILL, the OOM
        killer) without recording an error get one, so that the launcher names the rank that died, not this
        rank that lost it (the agent reports whichever failed process it finds first). A dying peer gets
        `wait_s` to finish; the ranks recorded are returned."""
        text = str(error)
        local = [(rank, facts) for rank, facts in enumerate(self._facts)
                 if rank != self.ctx.rank and facts and facts["host"] == self.ctx.host and facts["error_file"]]
        if not local or not any(marker in text for marker in PEER_LOSS_MARKERS):
            return []
        deadline = time.monotonic() + wait_s
        while True:
            ended = [(rank, facts) for rank, facts in local if _ended(facts)]
            if ended or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        recorded = []
        for rank, facts in ended:
            vanished = PeerVanished(f"its process (pid {facts['pid']}) ended without an error of its own (killed "
                                    f"by a signal: SIGKILL, the OOM killer?), as rank {self.ctx.rank} on this "
                                    "host found when it lost it")  # (no peer-loss words: the launcher ranks those last)
            with contextlib.suppress(OSError):
                if record_for_launcher(vanished, facts["error_file"], replace=False):
                    recorded.append(rank)
        return recorded

    # --- firing --------------------------------------------------------------------------------
    def _end_if_stopped(self, rank: int, error: HangError) -> None:
        """A stopped process cannot act on the launcher's SIGTERM: its agent would wait out the shutdown grace
        (60 s under --nproc, 30 s under torchrun) before its SIGKILL, the job hanging on meanwhile. A peer on
        this host that is stopped (state T, the same process that beat) is ended now, its error file holding
        the hang, so that the launcher names it whichever of the two it reports. On another host its own
        agent ends it."""
        facts = self._facts[rank] if rank < len(self._facts) else {}
        if not facts or facts["host"] != self.ctx.host or _process_state(facts["pid"]) != ("T", facts["start"]):
            return
        if facts["error_file"]:
            try:
                record_for_launcher(error, facts["error_file"])
            except OSError:
                pass  # the launcher then reports it killed by a signal; this rank's own record names it
        os.kill(facts["pid"], signal.SIGKILL)

    def _fire(self, message: str, stopped_rank: int | None = None) -> None:
        """Report `message` (and this rank's stacks), end `stopped_rank` if it is a stopped process here, exit."""
        dump_stacks(self.log_path, message, self.ctx.rank)
        log.error("%s; stacks in %s", message, self.log_path)
        sys.stderr.write(f"ddptrain: {message}; stacks in {self.log_path}\n")
        sys.stderr.flush()
        if stopped_rank is not None:
            self._end_if_stopped(stopped_rank, HangError(message))
        record_for_launcher(HangError(message))
        os._exit(EXIT_FAILURE)  # the main thread is stuck; only a hard exit ends the process
