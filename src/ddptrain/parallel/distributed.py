"""Process-group lifecycle: read the launcher's environment, pick backend and device, init, tear down.

Every process — one per device — builds one `DistributedContext`. A plain `python -m ddptrain train`
without a launcher is world size 1 with a private in-memory store, so the training code has one path.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import logging
import os
import socket
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ddptrain.errors import UsageError
from ddptrain.parallel import netinfo
from ddptrain.parallel.procenv import read_launch_env

log = logging.getLogger("ddptrain")
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
    tp_size: int = 1  # --tp: ranks per tensor-parallel group, tp consecutive ranks of one node

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of a tensor-parallel group read the same micro-batch, so
        the sampler, the loaders' seeds and the batch layout count groups, not ranks."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks (tensor-parallel groups) the job has."""
        return self.world_size // self.tp_size

    def name(self, rank: int, host: str | None = None) -> str:
        """How reports name `rank`: "rank 3 on host h", and under --tp its place in the mesh, "(dp 1, tp 1)": the
        data-parallel rank it reads as and its place in its tensor-parallel group. `host`: where the caller knows
        it (a heartbeat's), else the one gathered at the start."""
        host = host if host is not None else self.hosts[rank] if rank < len(self.hosts) else "?"
        mesh = f" (dp {rank // self.tp_size}, tp {rank % self.tp_size})" if self.tp_size > 1 else ""
        return f"rank {rank} on host {host}{mesh}"

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
        and gives them indexed by rank (the same lists to every caller). Must be called on all ranks, in the
        same order as other collectives."""
        mine = torch.tensor(values, dtype=torch.float64)
        if self.world_size == 1:
            return lambda: [mine.tolist()]
        out = [torch.empty_like(mine) for _ in range(self.world_size)]  # (gloo's all_gather_into_tensor is recent)
        work = dist.all_gather(out, mine, group=self.control_group, async_op=True)
        rows: list[list[float]] = []

        def wait() -> list[list[float]]:
            if not rows:
                work.wait()
                rows.extend(torch.stack(out).tolist())
            return rows

        return wait

    def start_sum(self, values: list[float]) -> Callable[[], float]:
        """Start summing the first of `values` over all ranks on the control group (float64: exact for counts);
        the function returned waits for it. Must be called on all ranks, in the same order as other
        collectives of the control group."""
        tensor = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(tensor, group=self.control_group, async_op=True)

        def wait() -> float:
            work.wait()
            return tensor[0].item()

        return wait

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Rank `src`'s `obj` on every rank (pickled between our own processes only). All ranks."""
        box = [obj]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=src, group=self.control_group)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's `obj`, indexed by rank (pickled between our own processes only). All ranks."""
        if self.world_size == 1:
            return [obj]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

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
    stalling between steps), and casting only every `interval` steps takes the tiny collective and its gloo
    work off the other steps: a flag raised just after a cast waits `interval` + 1 steps at most. Every rank
    casts and reads at the same steps (multiples of `interval` of the steps done, which all ranks agree on),
    so decisions stay identical. Other numbers due at a cast's boundary (a train line's) ride on the same
    gather: one collective on the control group where there would be two.
    """

    def __init__(self, ctx: DistributedContext, interval: int = 1):
        self.ctx, self.interval = ctx, interval
        self._pending: tuple[Callable[[], list[list[float]]], int] | None = None
        # The outcome of a vote waited for early (`settle`) or carried over a restart: the next read's result.
        self.settled: list[float] | None = None

    def exchange(self, step: int, flags: list[float],
                 rider: list[float] | None = None) -> tuple[list[float], Callable[[], list[list[float]]] | None]:
        """At the boundary after step `step`: the reduced flags of the vote cast one boundary before, or zeros
        if none was; casts `flags` when `step` is a multiple of the interval, with this rank's `rider` numbers
        if given. Returns the reduced flags and, if the rider was carried, a function that waits for every
        rank's rider numbers (indexed by rank); None if it was not (no cast here: the caller sends them).

        Must be called on all ranks, at every step boundary, with a rider on all ranks or on none. A world of
        one decides at once, every step, and carries nothing.
        """
        if self.ctx.world_size == 1:
            settled, self.settled = self.settled, None
            return (flags if settled is None else [max(pair) for pair in zip(flags, settled)]), None
        agreed = self.drain() or [0.0] * len(flags)
        if step % self.interval != 0:
            return agreed, None
        rows, width = self.ctx.start_gather_floats([*flags, *(rider or [])]), len(flags)
        self._pending = rows, width
        return agreed, (lambda: [row[width:] for row in rows()]) if rider is not None else None

    def settle(self) -> list[float] | None:
        """Wait for the vote in flight now, if any, and keep its result for the next read, which it is then
        whatever happens in between (a checkpoint records it, so a restarted run reads it at the same step).
        Returns the kept result. All ranks."""
        if self._pending is not None:
            self.settled = self.drain()
        return self.settled

    def drain(self) -> list[float] | None:
        """Wait for the vote in flight, if any, and return its result (or the settled one). All ranks."""
        if self.settled is not None:
            settled, self.settled = self.settled, None
            return settled
        if self._pending is None:
            return None
        rows, width = self._pending
        self._pending = None
        return [max(column) for column in zip(*(row[:width] for row in rows()))]


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
def distributed(backend: str, init_timeout_s: float, run_dir: Path, tp: int = 1) -> Iterator[DistributedContext]:
    """Initialise the process group for this worker and destroy it on every exit path. `tp`: --tp, ranks per
    tensor-parallel group (inside a node).

    Must be entered on all ranks. What holds a process group from C++ (a Trainer: DDP's reducer) must be
    unreachable from the caller when the block ends: it is collected here, before the groups (`_teardown`).
    """
    env = read_launch_env()
    if env.world_size % tp or env.local_world_size % tp:
        raise UsageError(f"--tp {tp} must divide the ranks of each node ({env.local_world_size} of a world of "
                         f"{env.world_size}): a tensor-parallel group stays inside a node; change --tp or --nproc")
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
    importlib.import_module("torch.distributed.nn")  # a plain `import torch...` here would make `torch` local
    dist.init_process_group(**kwargs)
    failed, ctx = False, None
    try:
        ctx = DistributedContext(rank=env.rank, local_rank=env.local_rank, world_size=env.world_size,
                                 local_world_size=env.local_world_size, backend=backend, device=device,
                                 host=socket.gethostname(), timeout_s=init_timeout_s, tp_size=tp)
        ctx.control_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        ctx.addr, ctx.interface = netinfo.job_address()
        peers: list[tuple[str, str]] = [("", "")] * env.world_size
        dist.all_gather_object(peers, (ctx.host, ctx.addr), group=ctx.control_group)
        ctx.hosts = [host for host, _ in peers]
        ctx.addrs = [addr for _, addr in peers]
        yield ctx
    except BaseException:
        failed = True
        raise
    finally:
        groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
        _teardown(failed)
        if ctx is not None:  # an exception's frames may hold ctx: they must not hold a destroyed group too
            ctx.control_group = None
        kept = sum(group() is not None for group in groups)
        if kept:  # their gloo threads would run into interpreter finalization (see _teardown)
            log.warning("%d process group(s) outlived their destruction: something still holds them", kept)


def _teardown(failed: bool) -> None:
    """Collect the Trainer, then destroy the process groups (after success) or abort them (after a failure).

    The order keeps a finished run from hanging here. A gloo group's destructor joins its worker threads,
    and one of them may be waiting for the GIL: it frees each finished collective's work, and when Python
    has already dropped the work's tensors, freeing them takes the GIL. Python's references to a group drop
    the GIL before the last one frees it (torch's `IntrusivePtrNoGilDestructor`); a C++ owner does not.
    DDP's Reducer is one: freed with the Trainer after `destroy_process_group`, it held a group's last
    reference and ran ~ProcessGroupGloo with the GIL held, while a gloo thread waited for the GIL in
    ~AsyncAllreduceWork (the hang seen at the end of finished runs; a loop doing that hung within 3
    iterations, 3 times in 3). The Trainer sits in reference cycles, so it is collected first, while the
    groups are registered; destroying them then drops their last references, Python's. And no group lives
    on into interpreter finalization, where a gloo thread that waits for the GIL is ended by `pthread_exit`
    inside a noexcept destructor: "terminate called without an active exception".

    A failed rank may have collectives in flight that its peers will never join: destroying would wait for
    them (NCCL can hang there), aborting drops them. A finished rank has waited for all of its collectives,
    so destroying needs nothing from its peers, not even that they are still there.
    """
    gc.collect()
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and abort is not None:
        log.debug("aborting the process groups after a failure")
        abort()
    else:
        log.debug("destroying the process groups")
        dist.destroy_process_group()
