"""A process's place in its job, read from its launcher's variables without importing torch; a new job's
environment and rendezvous port, for whatever starts ddptrain processes (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import setproctitle

from ddptrain.errors import (
    EXIT_FAILURE,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    Preempted,
    UsageError,
    WorkerFailed,
    say_error,
)

# What a launcher (torchrun's elastic agent, SLURM) or ddptrain sets for its workers. A process that inherits
# them believes it is a worker of that job, so a new job starts without them.
JOB_VAR_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC", "SLURM_",
                    "DDPTRAIN_")

# What `--nproc`'s launcher (parallel.launch) sets for its workers, and the files by which rank 0 answers whoever
# started the job (that launcher, a SLURM script); here, a leaf, so that the trainer and the worker entry read
# them without importing the launcher.
LOCAL_LAUNCH_ENV = "DDPTRAIN_LOCAL_LAUNCH"  # set for workers of `--nproc`: the launcher reports their errors
LAUNCH_TIME_ENV = "DDPTRAIN_LAUNCH_TIME"  # when `--nproc`'s launcher started: --max_time counts from there
LAUNCHER_PID_ENV = "DDPTRAIN_LAUNCHER_PID"  # the `--nproc` launcher, which its workers must not outlive
# Rank 0's word to whoever started the job (the launcher, a SLURM script), each cleared when the run resumes:
PREEMPTED_MARKER = "PREEMPTED"  # RUN_DIR/PREEMPTED: written after the preemption checkpoint commits
FINISHED_MARKER = "FINISHED"  # RUN_DIR/FINISHED: the run is complete, its final weights written
# Errors of a rank that lost a peer: the consequence of another rank's failure, not its cause.
PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                     "NCCL communicator was aborted", "remote process exited")


class PeerVanished(RuntimeError):
    """Recorded for a rank by a peer on its host (parallel.watchdog): the rank's process ended without an error
    of its own."""


# How such a record's message begins (torch's error file holds "<class name>: <message>"): the launcher ranks
# it after the rank's own errors.
VANISHED = f"{PeerVanished.__name__}: "


def fresh_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default os.environ) without any job's variables (JOB_VAR_PREFIXES)."""
    return {k: v for k, v in (os.environ if environ is None else environ).items()
            if not k.startswith(JOB_VAR_PREFIXES)}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it); another process could take it before it is bound."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launched: bool  # False: a bare `python -m ddptrain train` (world 1, no rendezvous)


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """The worker's place in the job, from torchrun's variables (or SLURM's when srun starts workers).

    A half-set environment is a UsageError naming what is missing.
    """
    env = os.environ if environ is None else environ
    present = [v for v in TORCHRUN_VARS if v in env]
    # srun started one task per device directly (no torchrun): SLURM's variables and MASTER_ADDR/PORT only.
    srun_tasks = "RANK" not in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env
    if present and len(present) < len(TORCHRUN_VARS) and not srun_tasks:
        missing = [v for v in TORCHRUN_VARS if v not in env]
        raise UsageError(f"launcher environment is half-set: {', '.join(present)} set but {', '.join(missing)} "
                         "missing; start workers with torchrun / scripts/launch.sh, or unset them")
    if srun_tasks:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UsageError("srun started several tasks but MASTER_ADDR/MASTER_PORT are unset; "
                             "export them (scripts/slurm.sbatch does) or launch through torchrun")
        return LaunchEnv(rank=int(env["SLURM_PROCID"]), local_rank=int(env.get("SLURM_LOCALID", "0")),
                         world_size=int(env["SLURM_NTASKS"]),
                         local_world_size=int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
                         launched=True)
    if not present:
        return LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launched=False)
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    except ValueError:
        raise UsageError("RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return LaunchEnv(rank=rank, local_rank=local, world_size=world,
                     local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")), launched=True)


def name_worker(rank: int, world_size: int, run_dir: object) -> None:
    """Call a launched worker `ddptrain rank R/N: RUN_DIR` in ps, top and nvidia-smi (its command line; the short
    name that `top` and `ps -o comm` show is the first 15 bytes, `ddptrain rank R`), so that an operator finds
    rank 3 on a node. A process that nothing launched (fit in a user's own program) keeps its name."""
    setproctitle.setproctitle(f"ddptrain rank {rank}/{world_size}: {run_dir}")


def record_for_launcher(exc: BaseException, error_file: str | None = None, replace: bool = True) -> bool:
    """Write `exc` to torchelastic's error file (this process's, or `error_file`: a peer's) so the launcher
    reports it as that rank's root cause; with `replace` False, only where that rank recorded nothing. Whether
    it was written.

    Atomically (tmp, then rename): the agent SIGTERMs the other workers as soon as one fails, and reads each
    error file as it exits; a file cut short by that signal would crash the agent's JSON parse (and with it
    the whole launch, restarts included). A worker stopped mid-write leaves no file, which the agent expects.
    """
    env_target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    target = error_file or env_target
    if not target:
        return False
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    tmp = f"{target}.{os.getpid()}.tmp"
    os.environ["TORCHELASTIC_ERROR_FILE"] = tmp  # ErrorHandler writes where this names, in torch's format
    try:
        ErrorHandler().record_exception(exc)
        if replace:
            os.replace(tmp, target)
            return True
        try:
            os.link(tmp, target)  # fails where the rank's own record is
        except FileExistsError:
            return False
        return True
    finally:
        if not replace:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if env_target is None:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
        else:
            os.environ["TORCHELASTIC_ERROR_FILE"] = env_target


def exit_code_for(exc: UsageError | Preempted | WorkerFailed) -> int:
    """The exit code a ddptrain process ends with on one of its own exceptions, the usage error reported on the
    way: a worker of `--nproc`'s launcher (or of `fit(nproc=N)`) records it where the launcher reads it, which
    prints each distinct error once; any other process says it. A WorkerFailed is already reported."""
    if isinstance(exc, UsageError):
        if os.environ.get(LOCAL_LAUNCH_ENV) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            record_for_launcher(exc)
        else:
            say_error(str(exc))
        return EXIT_USAGE
    return EXIT_PREEMPTED if isinstance(exc, Preempted) else EXIT_FAILURE
