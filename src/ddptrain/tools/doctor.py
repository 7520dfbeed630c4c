"""`ddptrain doctor`: check a node or a whole cluster before training on it.

It runs under the same launchers as training — `ddptrain doctor --nproc N`, `scripts/launch.sh doctor`,
`torchrun ... -m ddptrain doctor`, or `srun` starting one task per device — and rank 0 prints:

* one table with a row per rank: host, address and network interface, device, torch / python / ddptrain
  versions, a hash of the installed ddptrain sources, rendezvous time, barrier latency, and what the rank
  saw of the run dir;
* an all-reduce sweep (1 KiB to 64 MiB) with algorithm bandwidth (bytes / time) and bus bandwidth
  (algbw * 2(N-1)/N, the traffic each link carries in a ring all-reduce, comparable across world sizes);
* with `--tp N`, an all-reduce within each tensor-parallel group (N consecutive ranks of a node, as training
  groups them) of one micro-batch's activation (`--config`'s training config, as `ddptrain plan --tp N` counts
  it; else --tp_mib), and what the config's all-reduces of a step would take at that bandwidth;
* the problems found, each naming the odd ranks: versions or code that differ from the rest, a run dir
  a rank cannot write, a run dir that is not the same (shared) storage on every node, a wrong all-reduce.

Exit status: 0 healthy, 1 problems (listed), 2 usage error. Must be started on all ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import ddptrain
from ddptrain.cliargs import ArgParser
from ddptrain.config import resolve_config
from ddptrain.errors import EXIT_FAILURE, EXIT_OK, UsageError
from ddptrain.parallel.launch import launch_local, start_worker_server, strip_flag
from ddptrain.parallel.procenv import read_launch_env
from ddptrain.tools import plan
from ddptrain.tools.tables import format_table

VERDICT_VAR = "DDPTRAIN_DOCTOR_VERDICT"  # set by `--nproc`: rank 0 writes the problems there
SWEEP_MIN_BYTES = 1 << 10
BARRIER_ROUNDS = 10


def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(prog="ddptrain doctor", allow_abbrev=False,
                       description="Check versions, network, bandwidth and shared storage on every rank.")
    parser.add_argument("--nproc", type=int, default=0, help="start this many local workers (0 = this process "
                        "is a worker of torchrun/srun, or the only rank)")
    parser.add_argument("--run_dir", default="runs", help="the directory training will use; checked for "
                        "being writable and shared by every rank (default: runs)")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                        help="process-group backend, as for training (default: auto)")
    parser.add_argument("--max_mb", type=float, default=64.0, help="largest all-reduce of the sweep in MiB")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces per size")
    parser.add_argument("--timeout_s", type=float, default=300.0, help="rendezvous and collective timeout")
    tp = parser.add_argument_group("tensor parallel")
    tp.add_argument("--tp", type=int, default=1, help="time an all-reduce within each group of this many consecutive "
                    "ranks of a node, as --tp N training makes them (default 1: none)")
    tp.add_argument("--config", metavar="FILE", help="with --tp: the training config (TOML): its all-reduces per step "
                    "(`ddptrain plan --tp N`'s count) set the size timed and are put beside the measured bandwidth")
    tp.add_argument("--tp_mib", type=float, default=16.0, help="with --tp and no --config: the size of the "
                    "all-reduce timed, MiB (default 16)")
    return parser


def code_hash() -> str:
    """sha256 (first 12 hex digits) of the installed ddptrain package's sources, by relative path."""
    package = Path(__file__).resolve().parent.parent  # this file is ddptrain/tools/doctor.py
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@dataclass
class RankReport:
    rank: int
    host: str
    addr: str
    interface: str
    device: str
    torch: str
    python: str
    ddptrain: str
    code: str
    rendezvous_s: float
    barrier_ms: float
    run_dir_error: str  # "" when this rank could write its token file
    run_dir_seen: list[int]  # ranks whose token files this rank sees
    all_reduce_ok: bool  # every all-reduce of the sweep returned the expected sum on this rank


def main(argv: list[str], entry: Callable[[str, list[str]], None] | None = None) -> int:
    """`ddptrain doctor ARGV`; `entry(command, argv)` runs each worker of `--nproc` (the command line's
    `cli.run_command`)."""
    args = build_parser().parse_args(argv)
    if args.nproc < 0 or args.iters < 1 or args.max_mb <= 0 or args.timeout_s <= 0:
        raise UsageError("--nproc must be >= 0, --iters >= 1, --max_mb and --timeout_s > 0")
    if args.tp < 1 or args.tp_mib <= 0:
        raise UsageError("--tp must be >= 1 and --tp_mib > 0")
    if args.config and args.tp == 1:
        raise UsageError("--config: the doctor reads the training config for its --tp all-reduces; pass --tp N")
    traffic = tp_traffic(args)  # a config's usage error here, before any worker starts
    if args.nproc:
        if read_launch_env().launched:
            raise UsageError("--nproc starts local workers, but this process is already a worker of a launcher "
                             "(RANK is set); drop --nproc")
        if entry is None:
            raise UsageError("--nproc: run it as the command `ddptrain doctor --nproc N`, which starts the workers")
        return _launch(argv, args, entry)
    return check(args, traffic)


def tp_traffic(args: argparse.Namespace):
    """`--config`'s tensor-parallel all-reduces per step at --tp (plan.TensorParallelTraffic), None without it."""
    if not args.config:
        return None
    from ddptrain.tools import memplan

    cfg = resolve_config(["--config", args.config, "--tp", str(args.tp)], prog="ddptrain doctor")
    return plan.tp_traffic(cfg, memplan.model_shape(cfg))


def _launch(argv: list[str], args: argparse.Namespace, entry: Callable[[str, list[str]], None]) -> int:
    """`--nproc N`: the workers report to a verdict file, so that a problem is exit 1, not a crash report."""
    start_worker_server(args.nproc)

    verdict = Path(tempfile.gettempdir()) / f"ddptrain-doctor-{uuid.uuid4().hex}.json"
    os.environ[VERDICT_VAR] = str(verdict)
    try:
        outcome = launch_local(entry, ("doctor", strip_flag(argv, "--nproc")), args.nproc, 0, Path(args.run_dir),
                               what="doctor")
        for line in outcome.lines:
            sys.stderr.write(f"ddptrain: {line}\n")
        if outcome.code != EXIT_OK:
            return outcome.code
        problems = json.loads(verdict.read_text())["problems"]
        return EXIT_FAILURE if problems else EXIT_OK
    finally:
        os.environ.pop(VERDICT_VAR, None)
        verdict.unlink(missing_ok=True)


def check(args: argparse.Namespace, traffic=None) -> int:
    """Every check, on every rank; rank 0 prints. `traffic`: `tp_traffic(args)`. Must be called on all ranks."""
    import torch

    from ddptrain.parallel.distributed import distributed

    started = time.perf_counter()
    scratch = Path(tempfile.gettempdir()) / "ddptrain-doctor"  # NCCL flight-recorder dumps, never the run dir
    with distributed(args.backend, args.timeout_s, scratch) as ctx:
        rendezvous_s = time.perf_counter() - started
        barrier_ms = _barrier_latency_ms(ctx)
        run_dir_error, seen = _probe_run_dir(ctx, Path(args.run_dir))
        sweep, sums_ok = _all_reduce_sweep(ctx, int(args.max_mb * (1 << 20)), args.iters)
        tp_size = max(traffic.sizes) if traffic and traffic.sizes else int(args.tp_mib * (1 << 20))
        group = _tp_all_reduce(ctx, args.tp, tp_size, args.iters) if args.tp > 1 else None
        mine = RankReport(
            rank=ctx.rank, host=ctx.host, addr=ctx.addr, interface=ctx.interface, device=_device_name(ctx.device),
            torch=torch.__version__, python=platform.python_version(), ddptrain=ddptrain.__version__,
            code=code_hash(),
            rendezvous_s=rendezvous_s, barrier_ms=barrier_ms, run_dir_error=run_dir_error, run_dir_seen=seen,
            all_reduce_ok=sums_ok)
        reports = [RankReport(**r) for r in _gather_objects(ctx, asdict(mine))]
        problems = find_problems(reports, args.run_dir)
        if args.tp > 1 and group is None:
            problems.append(f"--tp {args.tp} does not divide the ranks of every node (world {ctx.world_size}, "
                            f"{ctx.local_world_size} on this one): a tensor-parallel group must stay inside a node")
        elif group is not None and not group["ok"]:
            problems.append(f"all-reduce within the --tp {args.tp} groups returned wrong sums")
        if ctx.is_main:
            section = render_tp(args.tp, group, traffic) if args.tp > 1 else ""
            print(render(reports, sweep, ctx.backend, args.run_dir, problems, section), flush=True)
            if os.environ.get(VERDICT_VAR):
                Path(os.environ[VERDICT_VAR]).write_text(json.dumps({"problems": problems}))
        if os.environ.get(VERDICT_VAR):
            return EXIT_OK  # the parent of `--nproc` turns the verdict into the exit status
        return EXIT_FAILURE if problems else EXIT_OK


# --- measurements (each must be called on all ranks) -------------------------------------------------

def _gather_objects(ctx, obj: object) -> list:
    import torch.distributed as dist

    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.control_group)
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier_latency_ms(ctx) -> float:
    """Median time of a barrier on the training backend, in ms."""
    import torch.distributed as dist

    times = []
    for _ in range(BARRIER_ROUNDS + 1):
        begin = time.perf_counter()
        dist.barrier()
        _sync(ctx.device)
        times.append(time.perf_counter() - begin)
    return 1000 * statistics.median(times[1:])  # the first one also waits for late ranks


def _probe_run_dir(ctx, run_dir: Path) -> tuple[str, list[int]]:
    """Each rank writes a token file into RUN_DIR/.doctor/<token>/ and lists which ranks' files it sees.

    Returns (error writing this rank's file or "", ranks seen). On shared storage every rank sees all.
    """
    token = ctx.broadcast_object(uuid.uuid4().hex[:12] if ctx.is_main else None)
    probe = run_dir / ".doctor" / str(token)
    mine = probe / f"rank-{ctx.rank}"
    error = ""
    try:
        probe.mkdir(parents=True, exist_ok=True)
        mine.write_text(f"{ctx.host} {ctx.addr}\n")
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc.strerror or exc}"
    ctx.barrier()  # every rank has written (or failed to) before anyone looks
    seen = sorted(int(p.name.split("-")[1]) for p in probe.glob("rank-*")) if probe.is_dir() else []
    ctx.barrier()  # every rank has looked before anyone cleans up
    mine.unlink(missing_ok=True)
    ctx.barrier()  # every token file is gone: whoever comes first removes the directories
    for directory in (probe, probe.parent):
        try:
            directory.rmdir()
        except OSError:  # already removed by a rank of this node, never created, or not empty
            pass
    return error, seen


def _all_reduce_sweep(ctx, max_bytes: int, iters: int) -> tuple[list[dict], bool]:
    """Time all-reduces of 1 KiB, 4 KiB, ... up to max_bytes; the slowest rank's time counts.

    Each rank contributes rank + 1, so every element of the result must be N(N+1)/2: a cheap check that the
    bytes arrive intact.
    """
    import torch
    import torch.distributed as dist

    rows, ok = [], True
    world = ctx.world_size
    size = SWEEP_MIN_BYTES
    while size <= max_bytes:
        tensor = torch.full((size // 4,), float(ctx.rank + 1), dtype=torch.float32, device=ctx.device)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        ok = ok and bool((tensor == world * (world + 1) / 2).all())
        dist.barrier()
        _sync(ctx.device)
        begin = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        _sync(ctx.device)
        seconds = (time.perf_counter() - begin) / iters
        slowest = max(t for (t,) in ctx.gather_floats([seconds]))
        algbw = size / slowest / 1e9
        rows.append({"bytes": size, "time_ms": 1000 * slowest, "algbw_gbps": algbw,
                     "busbw_gbps": bus_bandwidth(algbw, world)})
        size *= 4
    return rows, ok


def _tp_all_reduce(ctx, tp: int, size: int, iters: int) -> dict | None:
    """Time an all-reduce of `size` bytes within each group of `tp` consecutive ranks (a --tp group), all groups
    at once, as training runs them; the slowest rank's time counts. None where `tp` does not divide every node's
    ranks (all ranks agree: each node's count is gathered)."""
    import torch
    import torch.distributed as dist

    counts = [int(n) for (n,) in ctx.gather_floats([float(ctx.local_world_size)])]
    if ctx.world_size % tp or any(n % tp for n in counts):
        return None
    groups = [dist.new_group(list(range(first, first + tp))) for first in range(0, ctx.world_size, tp)]
    mine = groups[ctx.rank // tp]
    tensor = torch.full((max(1, size // 4),), float(ctx.rank % tp + 1), dtype=torch.float32, device=ctx.device)
    dist.all_reduce(tensor, group=mine)  # warm-up, and a check of the sum
    ok = bool((tensor == tp * (tp + 1) / 2).all())
    dist.barrier()
    _sync(ctx.device)
    begin = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=mine)
    _sync(ctx.device)
    seconds = (time.perf_counter() - begin) / iters
    slowest = max(t for (t,) in ctx.gather_floats([seconds]))
    for group in groups:
        dist.destroy_process_group(group)
    algbw = tensor.numel() * 4 / slowest / 1e9
    return {"bytes": tensor.numel() * 4, "time_ms": 1000 * slowest, "algbw_gbps": algbw,
            "busbw_gbps": bus_bandwidth(algbw, tp), "ok": ok}


def render_tp(tp: int, group: dict | None, traffic) -> str:
    """The --tp section: the all-reduce measured within a group, and what the config's per step would take."""
    lines = [f"tensor parallel --tp {tp} (groups of {tp} consecutive ranks of a node)"]
    if group is not None:
        lines.append(f"  all-reduce of {_size(group['bytes'])} within each group: {group['time_ms']:.3f} ms, busbw "
                     f"{group['busbw_gbps']:.3g} GB/s (slowest rank)")
    if traffic is not None and traffic.sizes:
        lines.append(f"  the config needs per step: {len(traffic.sizes) * traffic.micro_steps} all-reduces, "
                     f"{traffic.step_bytes / (1 << 20):.1f} MiB, each rank sending "
                     f"{traffic.rank_bytes / (1 << 20):.1f} MiB")
        if group is not None:
            spent = traffic.step_s(group["busbw_gbps"] * 1e9, 0.0)
            lines.append(f"  at the measured busbw they take {1000 * spent:.2f} ms a step, on the critical path "
                         "(compare with the step's compute: `ddptrain plan --tp N --step_ms MS`)")
    elif traffic is None:
        lines.append("  --config TRAINING.toml: what that job's all-reduces need per step")
    return "\n".join(lines)


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """Ring all-reduce: each rank sends and receives 2(N-1)/N of the buffer, so busbw = algbw * 2(N-1)/N."""
    return algbw * 2 * (world_size - 1) / world_size


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        return f"{torch.cuda.get_device_name(device)} (cuda {torch.version.cuda}, nccl {nccl})"
    return f"cpu ({os.cpu_count()} cores)"


# --- verdict and printing (pure functions) -------------------------------------------------------------

def _who(reports: list[RankReport], ranks: list[int]) -> str:
    hosts = dict.fromkeys(f"{reports[r].host} ({reports[r].addr})" for r in ranks)
    return f"rank {', '.join(map(str, ranks))} on {', '.join(hosts)}"


def find_problems(reports: list[RankReport], run_dir: str) -> list[str]:
    """One line per problem, naming the odd ranks (the value most ranks share is taken as the norm)."""
    problems = []
    for field, what in (("torch", "torch version"), ("python", "python version"), ("ddptrain", "ddptrain version"),
                        ("code", "ddptrain code hash"), ("device", "device")):
        values = [getattr(r, field) for r in reports]
        norm = max(dict.fromkeys(values), key=values.count)  # ties: the value of the lowest rank
        odd = [r.rank for r in reports if getattr(r, field) != norm]
        if odd:
            theirs = ", ".join(dict.fromkeys(getattr(reports[r], field) for r in odd))
            problems.append(f"{what} differs: {_who(reports, odd)} has {theirs}, the others {norm}")
    wrong = [r.rank for r in reports if not r.all_reduce_ok]
    if wrong:
        problems.append(f"all-reduce returned wrong sums on {_who(reports, wrong)}: data is corrupted in transit")
    unwritable = [r.rank for r in reports if r.run_dir_error]
    if unwritable:
        errors = "; ".join(dict.fromkeys(reports[r].run_dir_error for r in unwritable))
        problems.append(f"run dir {run_dir} is not writable by {_who(reports, unwritable)} ({errors})")
    everyone = [r.rank for r in reports]
    views: dict[tuple[int, ...], list[int]] = {}
    for r in reports:
        if not r.run_dir_error:
            views.setdefault(tuple(r.run_dir_seen), []).append(r.rank)
    if any(list(seen) != everyone for seen in views):
        described = "; ".join(f"{_who(reports, ranks)}: sees the files of rank {', '.join(map(str, seen))}"
                              for seen, ranks in views.items())
        problems.append(f"run dir {run_dir} is not the same storage on every rank ({described}); put it on a "
                        "filesystem every node mounts at the same path")
    return problems


def _size(num_bytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes // scale} {unit}"
    return f"{num_bytes} B"


def render(reports: list[RankReport], sweep: list[dict], backend: str, run_dir: str, problems: list[str],
           tensor_parallel: str = "") -> str:
    world = len(reports)
    ranks = format_table(
        ["rank", "host", "address", "iface", "device", "torch", "python", "ddptrain", "code", "rdzv s",
         "barrier ms", "run dir"],
        [[str(r.rank), r.host, r.addr, r.interface, r.device, r.torch, r.python, r.ddptrain, r.code,
          f"{r.rendezvous_s:.2f}", f"{r.barrier_ms:.3f}",
          "not writable" if r.run_dir_error else f"sees {len(r.run_dir_seen)}/{world}"] for r in reports])
    bandwidth = format_table(["size", "time ms", "algbw GB/s", "busbw GB/s"],
                       [[_size(row["bytes"]), f"{row['time_ms']:.3f}", f"{row['algbw_gbps']:.3g}",
                         f"{row['busbw_gbps']:.3g}"] for row in sweep])
    verdict = ("healthy: versions and code agree, the run dir is writable and shared, all-reduce works"
               if not problems else "problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return (f"ddptrain doctor: {world} rank(s), backend {backend}, run dir {run_dir}\n\n{ranks}\n\n"
            f"all-reduce sweep (busbw = algbw * 2(N-1)/N, N = {world}; slowest rank's time)\n{bandwidth}\n\n"
            + (f"{tensor_parallel}\n\n" if tensor_parallel else "") + verdict)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
