"""N local workers through torch.distributed's elastic agent (what torchrun runs): `ddptrain train --nproc N`
and `ddptrain.fit(nproc=N)` alike.

Each worker runs the caller's target: the CLI's is `ddptrain train ...` (`cli.main`) with torchrun's
environment, so the local path and a cluster's `torchrun -m ddptrain train` path execute the same code; `fit`'s
is `api._fit_worker` with the user's model and data (pickled, as `mp.spawn` would). On failure the agent
restarts all workers (`--max_restarts`), and they resume from the newest committed checkpoint. How the launch
ended comes back as an `Outcome` (exit code, the lines that say why, rank 0's return value): the CLI prints it,
`fit` raises it.

The workers are forked from a forkserver that imported torch and the trainer once (`start_worker_server`),
not started as fresh interpreters: importing those costs seconds of CPU per process (docs/performance.md),
which a launch paid once per worker and again at every restart. The launcher starts the forkserver before it
imports torch itself, so the two imports run side by side. Each worker then takes the shape a fresh one had: a
session of its own (as torch's subprocess workers), the default signal handlers, the launcher's environment.
A launch leaves the calling process as it found it (environment, signal handlers): `fit` runs in the user's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import forkserver
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.errors import EXIT_FAILURE, EXIT_PREEMPTED, EXIT_USAGE
from ddptrain.observe.log import rank_log_path
from ddptrain.parallel.procenv import (
    FINISHED_MARKER,
    PEER_LOSS_MARKERS,
    VANISHED,
    LAUNCH_TIME_ENV,
    LAUNCHER_PID_ENV,
    LOCAL_LAUNCH_ENV,
    PREEMPTED_MARKER,
)

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


# The agent forwards these to the workers, which checkpoint and exit; SIGUSR1 is SLURM's --signal.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag VALUE` / `flag=VALUE` (the workers must not launch again)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


# What the workers' forkserver imports once: parallel.forkserver first (it leaves the job's signals), then
# what every worker would import anyway. torch._dynamo is one: torch.optim's Optimizer imports it when built.
WORKER_PRELOAD = ["ddptrain.parallel.forkserver", "torch", "ddptrain.cli", "ddptrain.api", "ddptrain.loop.trainer",
                  "torch._dynamo"]


def start_worker_server(nproc: int) -> None:
    """Start the forkserver that `launch_local`'s workers fork from; it imports in the background.

    The environment the workers need is set first: the forkserver keeps the one it started with, and torch's
    OpenMP reads OMP_NUM_THREADS when it loads.
    """
    # With the agent's store shared across restart rounds, restarted workers can read the previous round's
    # peer addresses and fail to connect (pytorch/pytorch#135712, #167288): give every round a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LOCAL_LAUNCH_ENV] = "1"
    os.environ.setdefault(LAUNCH_TIME_ENV, repr(time.time()))
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    multiprocessing.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)
    forkserver.ensure_running()


def run_aside(target: Callable[..., Any], *args: Any) -> Any:
    """`target(*args)` in a process forked from the worker server (`start_worker_server` first): torch is
    imported there already, and what `target` imports and holds (transformers, datasets, a tokenized set) leaves
    with that process rather than stay in this one, which outlives the job. Its exception is raised here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        return pool.submit(_aside, target, args).result()


def _aside(target: Callable[..., Any], args: tuple) -> Any:
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):  # the job's signals end it, as they end a worker
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return target(*args)


def _worker(target: Callable[..., Any], args: tuple, environ: dict[str, str]) -> Any:
    """One worker of `launch_local`, in a process forked from the forkserver: `target(*args)`, its return value
    passed back to the launcher."""
    os.setsid()  # as torch starts a subprocess worker: the launcher's terminal signals reach it through the agent
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):  # ignored by the forkserver (parallel.forkserver)
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The forkserver has the launcher's environment of when it started; what the launcher set since (the run
    # lock's token) is added, under what the agent set for this worker (its rank, the rendezvous).
    for key, value in environ.items():
        os.environ.setdefault(key, value)
    _exit_with_launcher(int(os.environ[LAUNCHER_PID_ENV]))
    try:
        return target(*args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _exit_with_launcher(pid: int) -> None:
    """End this worker when the launcher ends without stopping it (SIGKILL, the OOM killer).

    The workers sit in sessions of their own under the forkserver, so nothing else reaches them: they would
    train on, write checkpoints into a run dir that a rerun now owns, and then wait forever for torch's agent
    to collect their result (holding their memory, and on a GPU the device's). A thread waits on the
    launcher's pidfd and exits the process when it fires.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = None  # already gone

    def wait_then_exit() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        rank = os.environ.get("RANK", "?")
        message = (f"ddptrain: rank {rank}: the launcher (pid {pid}) ended without stopping its workers; "
                   f"this worker stops too (the next run resumes from the newest committed checkpoint)")
        logging.getLogger("ddptrain").error(message.removeprefix("ddptrain: "))
        with contextlib.suppress(OSError, ValueError):
            print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_FAILURE)

    threading.Thread(target=wait_then_exit, name="ddptrain-launcher-watch", daemon=True).start()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a launch ended: the job's exit code (0, 75 preempted, 2 bad input, 1 failed, 128 + a signal), the
    lines that say why (for stderr, after "ddptrain: "), rank 0's return value, and the preemption's record."""

    code: int
    lines: tuple[str, ...] = ()
    returned: Any = None
    preempted: dict | None = None


def launch_local(target: Callable[..., Any], args: tuple, nproc: int, max_restarts: int, run_dir: Path | None,
                 what: str = "training") -> Outcome:
    """Run `target(*args)` on `nproc` local workers (a module-level function and picklable arguments: they reach
    the workers by pickle), forked from the server that `start_worker_server` started first; restart them all
    up to `max_restarts` times when one fails. The agent installs its
    signal handlers in this process and sets TORCHELASTIC_* variables: `caller_kept` undoes that."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"ddptrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # a private store on a free port, like --standalone
        max_restarts=max_restarts, monitor_interval=0.1, start_method="forkserver",
        signals_to_handle=FORWARDED_SIGNALS,
        shutdown_timeout=int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "60")),  # grace to checkpoint
    )
    started = time.time()
    if "LOGLEVEL" not in os.environ:  # the user asked for the agent's own logs: keep them all
        quiet_agent_logs()
    try:
        returned = elastic_launch(config, _worker)(target, args, dict(os.environ))
        return Outcome(0, returned=returned.get(0))
    except ChildFailedError as exc:
        return _failure_outcome(exc, run_dir, started, what)
    except SignalException as exc:
        preempted = _preempted_since(run_dir, started)
        finished = _marker_since(run_dir, FINISHED_MARKER, started)
        if finished and not (preempted and preempted.get("finished")):
            # the signal reached this launcher while the workers tore down a complete run
            return Outcome(0, (f"{exc.sigval.name} after the run finished at step {finished['step']} (final "
                               "weights written); exit 0",))
        if preempted:
            return _preempted_outcome({**preempted, "signal": exc.sigval.name})
        return Outcome(128 + int(exc.sigval), (f"stopped by {exc.sigval.name} before a checkpoint committed",))


def _preempted_outcome(preempted: dict) -> Outcome:
    """Exit 75 and the line that says what the workers left: the checkpoint a preemption or the time limit
    committed, or a complete run whose end a signal reached (`finished`: its final save went on to the end)."""
    step, signal_name = preempted.get("step", "?"), str(preempted.get("signal", "a signal"))
    if preempted.get("finished"):
        why = (f"preempted by {signal_name} during the run's end, which finished: the run is complete at step "
               f"{step} (final weights written); exit {EXIT_PREEMPTED} (a rerun finds it complete and changes "
               "nothing)")
    else:
        why = ("time limit " + signal_name if signal_name.startswith("--") else f"preempted by {signal_name}") + (
            f": checkpoint of step {step} committed; exit {EXIT_PREEMPTED} (run the same command to resume)")
    return Outcome(EXIT_PREEMPTED, (why,), preempted=preempted)


@contextlib.contextmanager
def caller_kept():
    """The calling process's environment and signal handlers as they were, after a launch changed them (the
    forkserver's settings, the agent's handlers and its TORCHELASTIC_* variables)."""
    environ = dict(os.environ)
    names = [name.strip() for name in FORWARDED_SIGNALS.split(",")]
    handlers = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names)}
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class _AgentNoise(logging.Filter):
    """Keep the agent's restart notices; drop its per-process chatter, which ddptrain's one line replaces."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "attempts left" in record.getMessage() or record.levelno >= logging.CRITICAL


def quiet_agent_logs() -> None:
    noise = _AgentNoise()
    # torch.multiprocessing.spawn: "Terminating process N via signal SIGTERM", when a forked worker's failure
    # makes the agent stop its peers (a usage error is then one line, not two).
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.multiprocessing.spawn"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if not any(isinstance(f, _AgentNoise) for f in logger.filters):
            logger.addFilter(noise)


def _marker_since(run_dir: Path | None, name: str, started: float) -> dict | None:
    """What rank 0 wrote into RUN_DIR/`name` since this launch `started`, or None."""
    marker = run_dir / name if run_dir else None
    if marker is None or not marker.is_file():
        return None
    data = json.loads(marker.read_text())
    return data if data.get("time", 0) >= started else None


def _preempted_since(run_dir: Path | None, started: float) -> dict | None:
    return _marker_since(run_dir, PREEMPTED_MARKER, started)


def _failure_text(failure) -> str:
    """The error message a worker recorded (a dict when written by torch's ErrorHandler)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message))
    return message


def _every_failure(exc: ChildFailedError) -> dict:
    """The failures the agent reported, and those of workers it did not.

    The agent reports the workers it found failed at its first look, then stops the rest. A worker that raised
    first but took longer to exit (aborting its process groups) than a peer that lost it is stopped, not
    reported, though it recorded its error (`watchdog.record_for_launcher`) beside the reported ones' files
    (ATTEMPT_DIR/LOCAL_RANK/error.json): read those too, so that the root cause is the rank that raised.
    """
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = dict(exc.failures)
    files = [Path(f.error_file) for f in failures.values() if os.path.isfile(getattr(f, "error_file", None) or "")]
    attempts = {path.parent.parent for path in files if path.parent.name.isdigit()}  # (torch's "<N/A>": none)
    for attempt in attempts:
        for path in sorted(attempt.glob("*/error.json")):
            rank = int(path.parent.name)  # the local rank: one node under launch_local, so the global rank
            if rank not in failures:
                try:
                    failures[rank] = ProcessFailure(local_rank=rank, pid=0, exitcode=EXIT_FAILURE,
                                                    error_file=str(path))
                except (OSError, ValueError, KeyError):  # (written atomically; a stranger's file would not be)
                    continue
    return failures


def _root_cause(failures: dict):
    """(rank, failure) that started the failure.

    torch picks the earliest whole-second timestamp, so a rank that lost its peer in the same second as the
    peer's own error (or a peer killed without an error file) can be named instead; errors that only say a
    peer went away rank after the others.
    """
    def tier(item) -> int:
        """0: an error the rank recorded itself; 1: its death as a peer on its host saw it, or a failure it did not
        record (the agent's stand-in: the rank was still writing its error when the agent looked); 2: a
        consequence (a lost peer, the agent's SIGTERM)."""
        failure = item[1]
        text = _failure_text(failure)
        if failure.exitcode == -signal.SIGTERM and not _recorded(failure) or any(m in text for m in PEER_LOSS_MARKERS):
            return 2
        return 1 if text.startswith(VANISHED) or not _recorded(failure) else 0

    return min(failures.items(), key=lambda item: (tier(item), item[1].timestamp, item[0]))


def _recorded(failure) -> bool:
    """Whether the worker wrote its own error file. The agent makes up the data of one that did not (torch 2.13:
    {"message": "<NONE>", ...}), so its file is what tells."""
    return bool(failure.error_file) and os.path.isfile(failure.error_file)


def _failure_outcome(exc: ChildFailedError, run_dir: Path | None, started: float, what: str) -> Outcome:
    """One line naming the root-cause rank, host and error; exit code 75 / 2 / 1 as the workers said."""
    codes = {f.exitcode for f in exc.failures.values()}
    # A preemption notice that reached the workers but not this launcher: the first worker to exit 75 makes
    # the agent stop the others (SIGTERM) as it tears down. They had all agreed on the committed checkpoint
    # before any exited, so a fresh PREEMPTED marker makes it a preemption still.
    if codes == {EXIT_PREEMPTED, -signal.SIGTERM} and _preempted_since(run_dir, started):
        codes = {EXIT_PREEMPTED}
    if codes == {EXIT_PREEMPTED}:
        return _preempted_outcome(_preempted_since(run_dir, started) or {"step": "?"})
    if EXIT_USAGE in codes:
        # Every worker hit the same bad input: say it once.
        messages = dict.fromkeys(_failure_text(f).removeprefix("UsageError: ").strip()
                                 for f in exc.failures.values() if f.exitcode == EXIT_USAGE)
        return Outcome(EXIT_USAGE, tuple(f"error: {message}" for message in messages))
    failures = _every_failure(exc)
    rank, failure = _root_cause(failures)
    message = _failure_text(failure)
    # The first line says what went wrong: torch's longer messages (DDP's) end with advice and details.
    message = message.strip().splitlines()[0] if message.strip() else f"exit code {failure.exitcode}"
    message = message.removeprefix(VANISHED)
    if failure.exitcode < 0 and not _recorded(failure):
        message = f"killed by {_signal_name(-failure.exitcode)}"
    host = os.uname().nodename
    others = sorted(r for r in failures if r != rank)
    also = f" (also failed: rank {', '.join(map(str, others))})" if others else ""
    where = f"; its log: {rank_log_path(run_dir, rank)}" if run_dir else ""
    return Outcome(EXIT_FAILURE, (f"{what} failed: rank {rank} on host {host}: {message}{also}{where}",))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
