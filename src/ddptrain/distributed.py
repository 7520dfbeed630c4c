"""Process-group lifecycle: read the launcher's environment, pick backend and device, init, tear down.

Every process — one per device — builds one `DistributedContext`. A plain `python -m ddptrain train`
without a launcher is world size 1 with a private in-memory store, so the training code has one path.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ddptrain import netinfo
from ddptrain.errors import UsageError

log = logging.getLogger("ddptrain")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TEARDOWN_TIMEOUT_S = 60.0  # a healthy teardown takes milliseconds (gloo) to seconds (NCCL)
GLOO_THREAD = "pt_gloo_runloop"  # what torch names a gloo process group's worker threads


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


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


@dataclass
class DistributedContext:
    """Where this process sits in the job. Built by `distributed()`; read everywhere else."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device
    host: str
    control_group: dist.ProcessGroup | None = None  # gloo: small CPU messages (flags, timings)
    hosts: list[str] = field(default_factory=list)  # host of each rank, gathered once
    addr: str = ""  # the address this rank uses for the job (tells apart hosts that share a name)
    interface: str = ""  # the network interface of `addr`
    addrs: list[str] = field(default_factory=list)  # address of each rank, gathered with the hosts
    timeout_s: float = 0.0  # the collective timeout in force on every group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def where(self) -> str:
        return f"rank {self.rank} on host {self.host}"

    def barrier(self) -> None:
        """Must be called on all ranks."""
        dist.barrier(group=self.control_group)

    def reduce_flags(self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX) -> list[float]:
        """Elementwise `op` of a few numbers over all ranks on the CPU control group.

        Must be called on all ranks. No device sync: the control group is gloo on CPU tensors.
        """
        tensor = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op, group=self.control_group)
        return tensor.tolist()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values`, indexed by rank. Must be called on all ranks."""
        return self.start_gather_floats(values)()

    def start_gather_floats(self, values: list[float]) -> Callable[[], list[list[float]]]:
        """Start gathering every rank's `values` on the control group; the function returned waits for them
        and gives them indexed by rank. Must be called on all ranks, in the same order as other collectives."""
        mine = torch.tensor(values, dtype=torch.float64)
        if self.world_size == 1:
            return lambda: [mine.tolist()]
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(out, mine, group=self.control_group, async_op=True)

        def wait() -> list[list[float]]:
            work.wait()
            return [t.tolist() for t in out]

        return wait

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Rank `src`'s `obj` on every rank (pickled between our own processes only). All ranks."""
        box = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=src, group=self.control_group)
        return box[0]

    def set_collective_timeout(self, seconds: float) -> None:
        """Switch every group's collective timeout (tier two, after the first step). All ranks."""
        timeout = datetime.timedelta(seconds=seconds)
        for group in {dist.group.WORLD, self.control_group}:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        self.timeout_s = seconds

    @contextlib.contextmanager
    def collective_timeout(self, seconds: float) -> Iterator[None]:
        """Collectives issued inside get `seconds` (a rank waiting for rank 0's checkpoint write). All ranks."""
        before = self.timeout_s
        self.set_collective_timeout(seconds)
        try:
            yield
        finally:
            self.set_collective_timeout(before)


class LaggedVote:
    """A MAX over ranks of a few flags, cast every `interval` steps and read at the step boundary after.

    Deciding one step after the cast costs nothing (the collective runs under that step's compute instead of
    stalling between steps), and casting only every `interval` steps takes the tiny all-reduce and its gloo
    work off the other steps: a flag raised just after a cast waits `interval` + 1 steps at most. Every rank
    casts and reads at the same steps (multiples of `interval` of the steps done, which all ranks agree on),
    so decisions stay identical.
    """

    def __init__(self, ctx: DistributedContext, interval: int = 1):
        self.ctx, self.interval = ctx, interval
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def exchange(self, step: int, flags: list[float]) -> list[float]:
        """At the boundary after step `step`: the reduced flags of the vote cast one boundary before, or zeros
        if none was; casts `flags` when `step` is a multiple of the interval.

        Must be called on all ranks, at every step boundary. A world of one decides at once, every step.
        """
        if self.ctx.world_size == 1:
            return flags
        agreed = self.drain() or [0.0] * len(flags)
        if step % self.interval == 0:
            tensor = torch.tensor(flags, dtype=torch.float64)
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.ctx.control_group, async_op=True)
            self._pending = (work, tensor)
        return agreed

    def settle(self) -> None:
        """Wait for the vote in flight, if any, keeping its result for the next `exchange` or `drain`."""
        if self._pending is not None:
            self._pending[0].wait()

    def drain(self) -> list[float] | None:
        """Wait for the vote in flight, if any, and return its result. All ranks."""
        if self._pending is None:
            return None
        work, tensor = self._pending
        self._pending = None
        work.wait()
        return tensor.tolist()


def _pick_device(backend: str, local_rank: int) -> torch.device:
    if torch.cuda.is_available() and backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                             "visible; start at most that many processes per node")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _enable_nccl_diagnostics(run_dir: Path) -> None:
    """Async error handling and the flight recorder, dumping into the run dir (user settings win)."""
    fr_dir = run_dir / "flight_recorder"
    fr_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(fr_dir / "rank-"))


@contextlib.contextmanager
def distributed(backend: str, init_timeout_s: float, run_dir: Path) -> Iterator[DistributedContext]:
    """Initialise the process group for this worker and destroy it on every exit path.

    Must be entered on all ranks.
    """
    env = read_launch_env()
    backend = resolve_backend(backend)
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs CUDA devices; use --backend gloo (or auto) on CPU")
    device = _pick_device(backend, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        _enable_nccl_diagnostics(run_dir)
    timeout = datetime.timedelta(seconds=init_timeout_s)
    kwargs: dict = {"backend": backend, "timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if not env.launched:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    else:  # explicit: under srun there is no RANK / WORLD_SIZE for env:// to read
        kwargs.update(rank=env.rank, world_size=env.world_size)
    # torch.distributed.nn evaluates `group=group.WORLD` into its functions' defaults when first imported,
    # which building DDP does (through torch._dynamo). Imported after init, those defaults hold the default
    # group for the life of the interpreter: destroying it frees nothing, and its gloo threads run on into
    # interpreter finalization. Imported before, the defaults are None (the default group, looked up per call).
    import torch.distributed.nn  # noqa: F401
    dist.init_process_group(**kwargs)
    failed, ctx = False, None
    try:
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        ctx = DistributedContext(rank=env.rank, local_rank=env.local_rank, world_size=env.world_size,
                                 local_world_size=env.local_world_size, backend=backend, device=device,
                                 host=socket.gethostname(), control_group=control, timeout_s=init_timeout_s)
        ctx.addr, ctx.interface = netinfo.job_address()
        peers: list[tuple[str, str]] = [("", "")] * env.world_size
        dist.all_gather_object(peers, (ctx.host, ctx.addr), group=control)
        ctx.hosts = [host for host, _ in peers]
        ctx.addrs = [addr for _, addr in peers]
        yield ctx
    except BaseException:
        failed = True
        raise
    finally:
        quiesced = _teardown(failed, run_dir, env.rank)
        if ctx is not None:  # an exception's frames may hold ctx: they must not hold a destroyed group too
            ctx.control_group = None
        # The Trainer sits in reference cycles (hooks, LR lambdas) and holds process-group objects: only the
        # cyclic collector frees it. Free it now, while the interpreter is whole: a ProcessGroupGloo left for
        # interpreter finalization keeps its threads running into it, which can abort a process whose work is
        # done ("terminate called without an active exception"; cf. pytorch/pytorch#179291). The quiescing
        # collectives outlive the groups (see _quiesce_gloo_groups).
        gc.collect()
        del quiesced


def _teardown(failed: bool, run_dir: Path, rank: int) -> list[Any]:
    """Destroy the process groups after success; abort them after a failure. Waits TEARDOWN_TIMEOUT_S at most.

    A failed rank may have collectives in flight that its peers will never join: destroying would wait for
    them (NCCL can hang there), aborting drops them. A destroy that still does not return (work left pending
    in a backend's queue; cf. pytorch/pytorch#75097) must not hold a finished run hostage: everything the run
    writes is written by now. It is left behind on its thread, loudly, with every thread's stack in the log.
    """
    if not dist.is_initialized():
        return []
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    aborting = failed and abort is not None
    what = "aborting" if aborting else "destroying"
    log.debug("%s the process groups%s", what, " after a failure" if aborting else "")
    held: list[Any] = []
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> None:
        if cuda_device is not None:  # a new thread starts on device 0
            torch.cuda.set_device(cuda_device)
        if aborting:
            abort()
        else:
            held.extend(_quiesce_gloo_groups())
            dist.destroy_process_group()

    ender = threading.Thread(target=run, name="ddptrain-teardown", daemon=True)
    ender.start()
    ender.join(TEARDOWN_TIMEOUT_S)
    if ender.is_alive():
        from ddptrain.observe.log import rank_log_path
        from ddptrain.observe.watchdog import dump_stacks

        path = rank_log_path(run_dir, rank)
        state = "the run has failed already" if failed else "the run's outputs are all written"
        message = (f"teardown: rank {rank} on host {socket.gethostname()}: {what} the process groups did not "
                   f"return in {TEARDOWN_TIMEOUT_S:.0f} s; {state}, so this process goes on without it")
        dump_stacks(path, message, rank)
        log.error("%s; stacks of every thread in %s", message, path)
        sys.stderr.write(f"ddptrain: {message}; stacks in {path}\n")
    return held


def _quiesce_gloo_groups() -> list[Any]:
    """One last tiny all-reduce on every gloo group of this rank, waited for; returns them, to be held until
    the groups are freed. All ranks, after their last collective.

    A gloo worker thread frees a finished collective's work under the group's queue lock, and when Python
    has already dropped the work's tensors, freeing them takes the GIL. A group freed meanwhile (its
    destructor takes that lock, with the GIL held by whoever drops the last reference) deadlocks with it:
    the hang seen at the end of finished runs, main thread in ~ProcessGroupGloo, a gloo thread waiting for
    the GIL in ~AsyncAllgatherWork. Waiting here releases the GIL, so every such thread finishes first;
    and these last works' tensors stay Python's until the groups are gone, so freeing them needs nothing.
    A peer that failed after the last collective never joins: this rank then waits out TEARDOWN_TIMEOUT_S.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    names: dict = getattr(world, "pg_names", {}) or {}
    held = []
    for group in sorted(names, key=names.get):  # creation order: the same on every rank
        if "gloo" not in str(dist.get_backend(group)):
            continue
        tensor = torch.zeros(1)
        held.append((dist.all_reduce(tensor, group=group, async_op=True), tensor))
    for work, _ in held:
        work.wait()
    return held


def quiet_gloo_threads(timeout_s: float = 2.0) -> bool:
    """Wait until no gloo worker thread of this process is running, before a fork. True once they are asleep
    (twice in a row), False if `timeout_s` passed first; True at once where /proc is not there.

    A gloo thread that frees a finished collective's work drops its tensors, and a tensor Python knows needs
    the GIL for that: pybind11 gives the thread a fresh Python thread state, which CPython links in under
    its runtime lock (HEAD_LOCK), without the GIL. A fork at that instant copies the lock held, and CPython
    before 3.11.8 and 3.12 (gh-112275) takes it in the child's PyOS_AfterFork_Child: the child hangs before
    its first line of Python. A DataLoader worker forked so never answers, and its trainer waits for the
    batch for good (seen: rank 1 in its first eval, right after `sync_buffers`' broadcast). A gloo thread
    that is asleep is idle, or waits for the GIL with its thread state made, and then cannot run before
    the fork, whose caller holds the GIL. Collectives still in flight must be waited for first.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return True
    deadline = time.monotonic() + timeout_s
    asleep_in_a_row = 0
    while asleep_in_a_row < 2:
        asleep_in_a_row = asleep_in_a_row + 1 if not _gloo_thread_running(tasks) else 0
        if asleep_in_a_row < 2:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)  # releases the GIL: a gloo thread waiting for it finishes its frees
    return True


def _gloo_thread_running(tasks: Path) -> bool:
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() != GLOO_THREAD:
                continue
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):  # the thread has just exited
            continue
        if state == "R":
            return True
    return False
