"""`ddptrain train --nproc N`: N local workers through torch.distributed's elastic agent (what torchrun runs).

Each worker is a fresh `python -m ddptrain <command> ...` process with torchrun's environment, so the
local path and a cluster's `torchrun -m ddptrain train` path execute the same code. On failure the
agent restarts all workers (`--max_restarts`), and they resume from the newest committed checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddptrain.errors import EXIT_FAILURE, EXIT_PREEMPTED, EXIT_USAGE

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


def launch_local(command: str, argv: list[str], nproc: int, max_restarts: int, run_dir: Path | None) -> int:
    """Run `python -m ddptrain <command> argv` on `nproc` local workers; return the job's exit code."""
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"ddptrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # a private store on a free port, like --standalone
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
        signals_to_handle=FORWARDED_SIGNALS,
        shutdown_timeout=int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "60")),  # grace to checkpoint
    )
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    started = time.time()
    try:
        elastic_launch(config, sys.executable)("-m", "ddptrain", command, *argv)
        return 0
    except ChildFailedError as exc:
        return _report_failure(exc, run_dir, started)
    except SignalException as exc:
        preempted = _preempted_since(run_dir, started)
        if preempted:
            print(f"ddptrain: preempted by {exc.sigval.name}: checkpoint of step {preempted['step']} committed; "
                  f"exit {EXIT_PREEMPTED} (run the same command to resume)", file=sys.stderr)
            return EXIT_PREEMPTED
        print(f"ddptrain: stopped by {exc.sigval.name} before a checkpoint committed", file=sys.stderr)
        return 128 + int(exc.sigval)


def _preempted_since(run_dir: Path | None, started: float) -> dict | None:
    marker = run_dir / "PREEMPTED" if run_dir else None
    if marker is None or not marker.is_file():
        return None
    data = json.loads(marker.read_text())
    return data if data.get("time", 0) >= started else None


def _report_failure(exc: ChildFailedError, run_dir: Path | None, started: float) -> int:
    """One line naming the root-cause rank, host and error; exit code 75 / 2 / 1 as the workers said."""
    codes = {f.exitcode for f in exc.failures.values()}
    if codes == {EXIT_PREEMPTED}:
        preempted = _preempted_since(run_dir, started) or {"step": "?"}
        print(f"ddptrain: preempted: checkpoint of step {preempted['step']} committed; exit {EXIT_PREEMPTED} "
              "(run the same command to resume)", file=sys.stderr)
        return EXIT_PREEMPTED
    if EXIT_USAGE in codes:
        return EXIT_USAGE  # the workers already printed their one line
    rank, failure = exc.get_first_failure()
    message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
    message = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
    if failure.exitcode < 0:
        message = f"killed by signal {-failure.exitcode}"
    host = os.uname().nodename
    others = sorted(r for r in exc.failures if r != rank)
    also = f" (also failed: rank {', '.join(map(str, others))})" if others else ""
    where = f"; its log: {run_dir / 'logs' / f'rank-{rank}.log'}" if run_dir else ""
    print(f"ddptrain: training failed: rank {rank} on host {host}: {message}{also}{where}", file=sys.stderr)
    return EXIT_FAILURE
