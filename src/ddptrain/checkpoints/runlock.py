"""One job per run dir: an advisory lock that the job holds on its run dir and checkpoint dir for its life.

Two jobs on one run dir (a double submit, a requeue while the old job still runs) would move aside, purge
and overwrite each other's checkpoints. So each job locks `RUN_DIR/.lock`, and `CHECKPOINT_DIR/.lock` where
--checkpoint_dir is outside the run dir, and a second job is refused (UsageError, exit 2) before it writes
anything.

The locks are POSIX record locks (fcntl's F_SETLK, through `fcntl.lockf`): the kernel drops them when the
holding process exits however it exits, so a crashed or SIGKILLed job never blocks its restart; and they
are what NFS (NLM/lockd for v3, the protocol itself for v4), Lustre (mounted with `-o flock`) and GPFS
carry between nodes. BSD `flock(2)` is not used: it is node-local on several network filesystems (Linux
NFS clients before 2.6.12, CIFS/SMB, many FUSE mounts), where a job on another node would not see it.
Where the filesystem has no working POSIX locks (an error from the call) the job warns and runs unlocked;
NFS mounted `nolock` and Lustre's `localflock` grant them per node only, which no call can detect.

Who holds them: a launcher that writes into the run dir before its workers start and outlives their
elastic restarts (`ddptrain train --nproc N`, `fit(nproc=N)`), else rank 0 of the job. POSIX locks belong
to a process, so a worker cannot tell its own launcher's lock from another job's by the lock alone: the
launcher writes a random token into the lock file and gives it to its workers in TOKEN_ENV.

The holder writes who it is (host, pid, job id, start time) into the file, so a refused job can name it.
The file is never deleted: a job that unlinked it would let the next one lock a fresh file of the same name
while a third still held the old one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ddptrain.errors import TrainingError, UsageError

LOCK_FILE = ".lock"
TOKEN_ENV = "DDPTRAIN_RUN_LOCK_TOKEN"  # a launcher's token for its workers: "its lock is ours"
UNLOCKED = "unlocked"  # TOKEN_ENV when the launcher found no POSIX locks: its workers need not warn again
_BUSY = (errno.EACCES, errno.EAGAIN)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
# Lock files this process holds, by resolved path. Closing *any* descriptor of a file drops the process's
# POSIX lock on it, so a second acquire in the holding process (fit called again meanwhile) must not even
# open the file: it is refused from here.
_held: dict[str, dict[str, Any]] = {}


class RunDirBusy(UsageError):
    """Another job holds the lock: the message names the directory, the holder and the fix."""


def make_dir(directory: Path, flag: str) -> None:
    """Create one of a job's directories (`flag` chose it), or raise UsageError naming both: the same line
    whether the launcher or a lone worker is the first to need it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {directory} ({exc.strerror}); choose a writable {flag}") from None


def job_dirs(run_dir: Path, checkpoints: Path) -> list[tuple[Path, str]]:
    """(directory, flag that chooses it) of each directory a job must own: the run dir, and the checkpoint dir
    where it is not inside the run dir (two run dirs may share one --checkpoint_dir)."""
    if checkpoints.resolve().is_relative_to(run_dir.resolve()):
        return [(run_dir, "--run_dir")]
    return [(run_dir, "--run_dir"), (checkpoints, "--checkpoint_dir")]


class JobLock:
    """The locks this process holds for its job (none when this job's launcher holds them)."""

    def __init__(self, fds: dict[str, int], token: str):
        self.fds, self.token = fds, token

    def release(self) -> None:
        """Unlock (closing the descriptor is the unlock). The files stay: see the module docstring."""
        for key, fd in self.fds.items():
            _held.pop(key, None)
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> JobLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(dirs: list[tuple[Path, str]], launcher_token: str = "") -> JobLock:
    """Lock every directory of `dirs` for this job, or raise RunDirBusy naming the holder; nothing is written
    unless every lock is had. A lock held by the launcher whose `launcher_token` it carries counts as had."""
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", ""),
          "since": time.time(), "token": secrets.token_hex(16)}
    fds: dict[str, int] = {}
    unlocked = False
    try:
        for directory, flag in dirs:
            path = directory / LOCK_FILE
            key = str(path.resolve())
            if key in _held:
                raise RunDirBusy(_refusal(directory, flag, _held[key]))
            make_dir(directory, flag)
            fd = fds[key] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _NO_LOCKS:
                    unlocked = True
                    os.close(fds.pop(key))
                    sys.stderr.write(f"ddptrain: warning: {path}: this filesystem has no POSIX locks "
                                     f"({exc.strerror}); a second job on this {_label(flag)} would not be "
                                     "refused\n")
                    continue
                if exc.errno not in _BUSY:
                    raise
                holder = _read_holder(fd)
                if launcher_token and holder and holder.get("token") == launcher_token:
                    os.close(fds.pop(key))  # this job's launcher holds it (our descriptor held nothing)
                    continue
                raise RunDirBusy(_refusal(directory, flag, holder)) from None
        data = json.dumps(me).encode()
        for fd in fds.values():
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
    except BaseException as exc:
        for fd in fds.values():
            os.close(fd)
        if isinstance(exc, OSError):
            raise UsageError(f"cannot lock {path} ({exc.strerror}); check --run_dir / --checkpoint_dir") from None
        raise
    _held.update(dict.fromkeys(fds, me))
    return JobLock(fds, UNLOCKED if unlocked and not fds else me["token"])


def _read_holder(fd: int) -> dict[str, Any] | None:
    """What the holder wrote; it writes right after locking, so an empty file is worth a few retries."""
    for _ in range(20):
        try:
            holder = json.loads(os.pread(fd, 4096, 0))
        except ValueError:
            holder = None
        if isinstance(holder, dict) and {"host", "pid", "since"} <= holder.keys():
            return holder
        time.sleep(0.1)
    return None


def _refusal(directory: Path, flag: str, holder: dict[str, Any] | None) -> str:
    if holder:
        job = f" (job {holder['job']})" if holder.get("job") else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        who = f"pid {holder['pid']} on host {holder['host']}{job}, running since {since}"
    else:
        who = "a process that has not written its name into the lock file yet"
    return (f"{_label(flag)} {directory} is in use by another job: {who}; wait for it, stop it, "
            f"or use another {flag}")


def _label(flag: str) -> str:
    return flag.removeprefix("--").replace("_", " ")  # --run_dir: "run dir"


@contextlib.contextmanager
def held_by_job(ctx: Any, dirs: list[tuple[Path, str]]) -> Iterator[None]:
    """Hold the job's locks while the body runs, or raise RunDirBusy on every rank. All ranks (rank 0 takes
    the locks, or finds them held by this job's launcher; every rank learns the outcome).

    Enter it before anything is written into the run dir: a refused job changes nothing there.
    """
    lock, outcome = None, None
    if ctx.is_main:
        token = os.environ.get(TOKEN_ENV, "")
        if token != UNLOCKED:  # else the launcher found no locks here and said so
            try:
                lock = acquire(dirs, launcher_token=token)
            except UsageError as exc:  # RunDirBusy, or a run dir this process cannot lock at all
                outcome = (type(exc).__name__, str(exc))
            except Exception as exc:  # must reach the other ranks too, or they wait in the broadcast for good
                outcome = ("", f"taking the run dir lock failed on rank 0 ({ctx.hosts[0]}): "
                               f"{type(exc).__name__}: {exc}")
    outcome = ctx.broadcast_object(outcome)
    if outcome is not None:
        kind, message = outcome
        raise {"RunDirBusy": RunDirBusy, "UsageError": UsageError}.get(kind, TrainingError)(message)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
