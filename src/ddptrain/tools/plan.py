"""`ddptrain plan`: predict step time and scaling efficiency of data-parallel training (DDP, and FSDP next to
it) at 8..1024 GPUs.

Inputs: the measured time of one optimizer step on one device, the gradient bytes all-reduced per step,
and the network's all-reduce bus bandwidth and latency (from `ddptrain doctor`, or given). The model:

* A ring all-reduce of S bytes over N ranks moves 2(N-1)/N * S bytes through each link and takes
  2(N-1) latency-bound hops: t(S) = 2(N-1)*alpha + (S/B) * 2(N-1)/N, with B the bus bandwidth (the
  doctor's busbw, which is defined so that this holds) and alpha the time of one hop.
* DDP cuts the gradients into buckets of --bucket_cap_mb and all-reduces each bucket as soon as the
  backward pass has produced it; buckets are reduced one after another. (DDP makes its first bucket
  1 MiB only when it is given no cap; ddptrain always passes one, and torch then sizes the first
  bucket like the others.)
  A bucket holds whole parameter tensors, taken in the order backward produces them (the reverse of
  the model's), and closes once it reaches its limit: a tensor larger than the limit lands in the open
  bucket with everything before it. With the model's tensor sizes (`--run_dir`) the buckets are built
  that way; from a byte count alone (`--grad_mib`) they are the limits themselves, as if tensors were
  small. Gradients appear at a uniform rate (bytes per second) during backward, so bucket i is ready
  at t_bwd * (bytes up to and including i) / S. Communication that ends before backward ends is hidden;
  the rest is exposed and adds to the step: step(N) = step(1) + max(0, end of last all-reduce - t_bwd).
* Weak scaling: the per-device batch and so the per-device compute are the same at every N, and
  efficiency = step(1) / step(N) = throughput(N) / (N * throughput(1)).

* FSDP (next to DDP, same inputs): parameters live in `units` equal shards (the model's fsdp_blocks plus
  the root; the input embedding and output head split by vocabulary rows are no units, and the activations
  they exchange instead are not modelled). A ring all-gather or reduce-scatter of S bytes takes (N-1)*alpha + (S/B)*(N-1)/N, half an
  all-reduce. Per step FSDP all-gathers every unit in forward, again in backward (shards are freed after
  forward), and reduce-scatters every unit's gradients: 1.5x DDP's bytes. Each unit's gather overlaps the
  previous unit's compute, so what cannot hide is the first unit's gather in each pass, the last unit's
  reduce-scatter, and whatever of a pass's communication exceeds its compute (forward = backward / 2).

* Memory (`ddptrain plan --model ... --strategy fsdp --nproc N`, any training flags after plan's own): what
  one rank holds at the fullest moment of a step, from the model built on the meta device: its share of
  parameters, gradients and optimizer state, the unit being computed gathered whole with its gradients and
  FSDP2's buffers, and the activations one micro-batch saves for backward (counted on fake tensors). The rules
  are in ddptrain/tools/memplan.py; `make bench` (section big_model) holds them against measured peaks.

* Tensor parallel (`--tp N` among the training flags; `--gpus_per_node`, which N must divide): a rank of a group
  holds 1/N of the layers the model's tp_plan splits and of the activations between a split layer and a rowwise
  one, the rest whole, and fsdp shards that over the ranks/N data-parallel ranks. Per block the group all-reduces
  one micro-batch's activation after each rowwise layer in forward and for each colwise layer's input gradient
  in backward (the gpt: 2 and 2), sizes read from the meta forward; the compute waits for each. Printed: the
  all-reduces and bytes per step, the bytes each rank sends (2(N-1)/N of them), the busbw that keeps them at
  10% of a step (--step_ms, else 100 ms), and with --busbw_gbps or --doctor their time.

Not modelled (each makes real runs slower than predicted): compute slowed by communication kernels
sharing the device (NCCL uses SMs; on CPU gloo uses the same cores), hierarchical networks (give the
slowest, inter-node bandwidth), NCCL's tree algorithms at large N (they cut latency: the prediction is
pessimistic there), stragglers, data stalls, and anything but DDP's bucketed all-reduce.
"""

from __future__ import annotations

import argparse
import re
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.cliargs import ArgParser
from ddptrain.config import TrainConfig, load_toml, resolve_config
from ddptrain.errors import EXIT_OK, UsageError
from ddptrain.observe.metrics import read_metrics
from ddptrain.tools.tables import format_table

if TYPE_CHECKING:  # the memory model imports torch and the models; the speed table needs neither
    from ddptrain.tools import memplan

MIB = 1 << 20
FIRST_BUCKET_BYTES = MIB  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)
DEFAULT_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_BACKWARD_FRACTION = 0.6  # backward ~ 2x forward, plus ~10% optimizer and the rest of the step


@dataclass(frozen=True)
class Workload:
    """What one device does per optimizer step, and what the network can do."""

    step_s: float  # one optimizer step on one device (no communication)
    backward_fraction: float  # share of step_s spent in the backward pass (where all-reduce can hide)
    grad_bytes: int  # gradient bytes all-reduced per optimizer step
    busbw_bytes_per_s: float  # all-reduce bus bandwidth B
    latency_s: float  # alpha: one hop of the ring
    bucket_cap_bytes: int = 25 * MIB
    first_bucket_bytes: int = FIRST_BUCKET_BYTES
    tensor_bytes: tuple[int, ...] = ()  # gradient tensors in the order backward produces them; () = unknown
    fsdp_units: int = 8  # FSDP units parameters are split into (blocks + root)

    def buckets(self) -> list[int]:
        if self.tensor_bytes:
            return ddp_bucket_sizes(self.tensor_bytes, self.bucket_cap_bytes, self.first_bucket_bytes)
        return bucket_sizes(self.grad_bytes, self.bucket_cap_bytes, self.first_bucket_bytes)

    @property
    def backward_s(self) -> float:
        return self.step_s * self.backward_fraction


@dataclass(frozen=True)
class Prediction:
    world_size: int
    num_buckets: int
    comm_s: float  # all bucket all-reduces back to back
    exposed_s: float  # the part not hidden behind backward
    step_s: float
    efficiency: float
    step_no_overlap_s: float  # if nothing overlapped (a bound from above)
    efficiency_no_overlap: float
    fsdp_comm_s: float = 0.0  # FSDP: all-gathers (forward, backward) and reduce-scatters, back to back
    fsdp_step_s: float = 0.0
    fsdp_efficiency: float = 1.0


def bucket_sizes(grad_bytes: int, cap_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES) -> list[int]:
    """DDP's bucket sizes in the order they become ready: a small first bucket, then full ones, a remainder."""
    sizes, left = [], grad_bytes
    limit = min(first_bytes, cap_bytes) if first_bytes > 0 else cap_bytes
    while left > 0:
        take = min(left, limit)
        sizes.append(take)
        left -= take
        limit = cap_bytes
    return sizes


def ddp_bucket_sizes(tensor_bytes: tuple[int, ...] | list[int], cap_bytes: int,
                     first_bytes: int = FIRST_BUCKET_BYTES) -> list[int]:
    """DDP's buckets (torch's _compute_bucket_assignment_by_size) over gradient tensors given in the order
    backward produces them: a tensor joins the open bucket, which closes once it holds >= its limit (the
    first limit `first_bytes`, then `cap_bytes`)."""
    sizes, open_bytes = [], 0
    limit = min(first_bytes, cap_bytes) if first_bytes > 0 else cap_bytes
    for size in tensor_bytes:
        open_bytes += size
        if open_bytes >= limit:
            sizes.append(open_bytes)
            open_bytes, limit = 0, cap_bytes
    return sizes + [open_bytes] if open_bytes else sizes


def ring_all_reduce_s(num_bytes: int, world_size: int, busbw_bytes_per_s: float, latency_s: float) -> float:
    """t = 2(N-1)*alpha + (S/B) * 2(N-1)/N; zero for one rank."""
    if world_size <= 1:
        return 0.0
    hops = 2 * (world_size - 1)
    return hops * latency_s + num_bytes / busbw_bytes_per_s * hops / world_size


def ring_half_s(num_bytes: int, world_size: int, busbw_bytes_per_s: float, latency_s: float) -> float:
    """A ring all-gather or reduce-scatter of `num_bytes` (the whole tensor): (N-1)*alpha + (S/B)*(N-1)/N."""
    if world_size <= 1:
        return 0.0
    return (world_size - 1) * latency_s + num_bytes / busbw_bytes_per_s * (world_size - 1) / world_size


def predict_fsdp(work: Workload, world_size: int) -> tuple[float, float]:
    """(communication seconds, step seconds) of FSDP at `world_size` devices (see the module docstring)."""
    if world_size <= 1:
        return 0.0, work.step_s
    unit = ring_half_s(work.grad_bytes // work.fsdp_units, world_size, work.busbw_bytes_per_s, work.latency_s)
    units = work.fsdp_units
    forward_s, backward_s = work.backward_s / 2, work.backward_s
    # forward: u gathers; the first waits, the rest hide behind forward compute as far as it lasts.
    forward_exposed = unit + max(0.0, (units - 1) * unit - forward_s)
    # backward: u gathers and u reduce-scatters; the first gather and the last reduce-scatter wait.
    backward_exposed = 2 * unit + max(0.0, (2 * units - 2) * unit - backward_s)
    return 3 * units * unit, work.step_s + forward_exposed + backward_exposed


def predict(work: Workload, world_size: int) -> Prediction:
    """Step time and efficiency at `world_size` devices (weak scaling), for DDP and for FSDP."""
    if world_size <= 1:
        return Prediction(1, 0, 0.0, 0.0, work.step_s, 1.0, work.step_s, 1.0, 0.0, work.step_s, 1.0)
    sizes = work.buckets()
    backward = work.backward_s
    done_bytes, end, comm = 0, 0.0, 0.0
    for size in sizes:
        done_bytes += size
        ready = backward * done_bytes / work.grad_bytes
        t = ring_all_reduce_s(size, world_size, work.busbw_bytes_per_s, work.latency_s)
        end = max(ready, end) + t  # buckets go one after another, each once it is ready
        comm += t
    # exposed <= comm exactly; (backward + t) - backward can round above t, and the bound keeps
    # step <= no_overlap (efficiency >= efficiency_no_overlap) in floating point too
    exposed = min(comm, max(0.0, end - backward))
    step = work.step_s + exposed
    no_overlap = work.step_s + comm
    fsdp_comm, fsdp_step = predict_fsdp(work, world_size)
    return Prediction(world_size, len(sizes), comm, exposed, step, work.step_s / step, no_overlap,
                      work.step_s / no_overlap, fsdp_comm, fsdp_step, work.step_s / fsdp_step)


# --- inputs from files -------------------------------------------------------------------------------

_SWEEP_ROW = re.compile(r"^\s*(\d+) (B|KiB|MiB)\s+([\d.]+)\s+([\d.eE+-]+)\s+([\d.eE+-]+)\s*$")
_SWEEP_WORLD = re.compile(r"all-reduce sweep .*N = (\d+)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": MIB}


def network_from_doctor(text: str, source: str) -> tuple[float, float, int]:
    """(busbw bytes/s, alpha seconds, N) from `ddptrain doctor`'s printed all-reduce sweep.

    B is the bus bandwidth of the largest size (bandwidth-bound); alpha is the smallest size's time over
    its 2(N-1) hops (latency-bound: an upper bound on alpha).
    """
    world = _SWEEP_WORLD.search(text)
    rows = [m for m in map(_SWEEP_ROW.match, text.splitlines()) if m]
    if not world or not rows:
        raise UsageError(f"--doctor {source}: no all-reduce sweep found; save the output of `ddptrain doctor "
                         "--nproc N` (or its torchrun/srun form) to a file and pass that")
    n = int(world.group(1))
    if n < 2:
        raise UsageError(f"--doctor {source}: the sweep ran on 1 rank, which measures no network; run the "
                         "doctor on at least 2 ranks (ideally across nodes)")
    points = sorted((int(m.group(1)) * _UNITS[m.group(2)], float(m.group(3)) / 1000, float(m.group(5)))
                    for m in rows)
    return points[-1][2] * 1e9, hop_latency(points[0][1], n), n


def hop_latency(smallest_all_reduce_s: float, world_size: int) -> float:
    """alpha: a latency-bound (smallest) all-reduce over its 2(N-1) ring hops; an upper bound on alpha."""
    return smallest_all_reduce_s / (2 * (world_size - 1))


def backward_fraction(fwd_bwd_s: float, step_s: float) -> float:
    """The backward pass's share of a step where only forward+backward together is measured (backward ~ 2x
    forward): the window in which DDP can overlap communication."""
    return min(1.0, 2 / 3 * fwd_bwd_s / step_s)


def compute_from_run(run_dir: Path) -> tuple[float, float | None, int]:
    """(median step seconds, backward fraction or None, gradient bytes) from a finished 1-process run."""
    metrics_path, config_path = run_dir / "metrics.jsonl", run_dir / "config.toml"
    if not metrics_path.is_file() or not config_path.is_file():
        raise UsageError(f"--run_dir {run_dir}: no metrics.jsonl and config.toml there; pass the run dir of a "
                         "finished `ddptrain train` run")
    lines = [r for r in read_metrics(metrics_path) if r["split"] == "train" and r.get("step_time_s")]
    if len(lines) < 2:
        raise UsageError(f"--run_dir {run_dir}: fewer than 2 train lines in metrics.jsonl (the first is warm-up); "
                         "train longer or with a smaller --log_interval")
    if len(lines[-1].get("step_time_s_by_rank", [0])) != 1:
        raise UsageError(f"--run_dir {run_dir}: the run used {len(lines[-1]['step_time_s_by_rank'])} processes, "
                         "so its step time includes communication; measure compute on 1 process (--nproc 1)")
    steady = lines[1:]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    backward = None
    if all("fwd_bwd_s" in r for r in steady):
        backward = backward_fraction(statistics.median(r["fwd_bwd_s"] for r in steady), step_s)
    cfg = TrainConfig(**load_toml(str(config_path)))
    return step_s, backward, gradient_bytes(cfg)


def gradient_bytes(cfg) -> int:
    """Bytes of the trainable parameters of cfg's model (built on the meta device: no memory, no compute)."""
    return sum(gradient_tensor_bytes(cfg))


def gradient_tensor_bytes(cfg) -> tuple[int, ...]:
    """Bytes of each trainable parameter of cfg's model (on the meta device), in the order backward produces
    their gradients: the reverse of the model's (tied weights counted once, as DDP does)."""
    import torch

    from ddptrain.loop.plugins import model_of

    with torch.device("meta"):
        model = model_of(cfg)
    return tensor_bytes_in_backward_order(model)


def fsdp_unit_count(cfg) -> int:
    """FSDP units of cfg's model under --strategy fsdp: its blocks plus the root (on the meta device)."""
    import torch

    from ddptrain.loop.plugins import model_of
    from ddptrain.parallel import vocab
    from ddptrain.parallel.strategies import fsdp_blocks

    with torch.device("meta"):
        model = model_of(cfg)
    vocabulary = set(vocab.vocab_weights(model)) if vocab.wanted(cfg.section("parallel")) else set()
    return sum(not vocab.only_vocabulary(b, vocabulary) for b in fsdp_blocks(model, cfg.fsdp_blocks)) + 1


def tensor_bytes_in_backward_order(model) -> tuple[int, ...]:
    return tuple(p.numel() * p.element_size() for p in reversed(list(model.parameters())) if p.requires_grad)


# --- command line ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(prog="ddptrain plan", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Predict DDP step time and scaling efficiency at many GPUs.\n\n"
                       + __doc__.split("\n\n", 1)[1])
    compute = parser.add_argument_group("compute (one device)")
    compute.add_argument("--run_dir", help="a finished 1-process `ddptrain train` run: step time from its "
                         "metrics.jsonl, gradient bytes from its config.toml")
    compute.add_argument("--step_ms", type=float, help="one optimizer step on one device, in ms (overrides "
                         "--run_dir)")
    compute.add_argument("--grad_mib", type=float, help="gradient MiB all-reduced per step (overrides --run_dir)")
    compute.add_argument("--backward_fraction", type=float, help="share of the step spent in backward "
                         f"(default: from --run_dir, else {DEFAULT_BACKWARD_FRACTION})")
    network = parser.add_argument_group("network")
    network.add_argument("--doctor", metavar="FILE", help="saved output of `ddptrain doctor` on >= 2 ranks: "
                         "bandwidth from its largest all-reduce, latency from its smallest")
    network.add_argument("--busbw_gbps", type=float, help="all-reduce bus bandwidth in GB/s (the doctor's busbw; "
                         "overrides --doctor)")
    network.add_argument("--latency_us", type=float, help="latency of one ring hop in microseconds (overrides "
                         "--doctor; default 10)")
    ddp = parser.add_argument_group("DDP")
    ddp.add_argument("--bucket_cap_mb", type=float, default=25.0, help="DDP bucket size in MiB (default: 25)")
    ddp.add_argument("--fsdp_units", type=int, help="FSDP: units the parameters are sharded in (default: the "
                     "--run_dir model's fsdp_blocks + 1, else 8)")
    memory = parser.add_argument_group("memory (with the training flags: --model ... --strategy fsdp --nproc N)")
    memory.add_argument("--activation_mib", type=float, help="activations of one micro-batch in MiB, where the "
                        "task's batch cannot be made up on the meta device (plug-in tasks, dict batches)")
    memory.add_argument("--gpus_per_node", type=int, default=8, help="with the training flag --tp N: the ranks of a "
                        "node, which N must divide (a tensor-parallel group stays inside a node; default 8)")
    ddp.add_argument("--gpus", default=",".join(map(str, DEFAULT_GPUS)),
                     help="comma-separated device counts (default: 8,16,...,1024)")
    return parser


def workload_from_args(args: argparse.Namespace) -> Workload:
    step_s = grad_bytes = backward = None
    tensors: tuple[int, ...] = ()
    units = 8
    if args.run_dir:
        step_s, backward, grad_bytes = compute_from_run(Path(args.run_dir))
        cfg = TrainConfig(**load_toml(str(Path(args.run_dir) / "config.toml")))
        tensors = gradient_tensor_bytes(cfg)
        units = fsdp_unit_count(cfg)
    if args.fsdp_units is not None:
        if args.fsdp_units < 1:
            raise UsageError("--fsdp_units must be >= 1")
        units = args.fsdp_units
    if args.step_ms is not None:
        step_s = args.step_ms / 1000
    if args.grad_mib is not None:
        grad_bytes, tensors = int(args.grad_mib * MIB), ()
    if args.backward_fraction is not None:
        backward = args.backward_fraction
    if step_s is None or grad_bytes is None:
        raise UsageError("give the compute: --run_dir of a 1-process run, or --step_ms and --grad_mib")
    busbw = latency = None
    if args.doctor:
        path = Path(args.doctor)
        if not path.is_file():
            raise UsageError(f"--doctor {args.doctor}: no such file; save `ddptrain doctor` output there")
        busbw, latency, _ = network_from_doctor(path.read_text(errors="replace"), args.doctor)
    if args.busbw_gbps is not None:
        busbw = args.busbw_gbps * 1e9
    if args.latency_us is not None:
        latency = args.latency_us / 1e6
    if busbw is None:
        raise UsageError("give the network: --busbw_gbps (the busbw of `ddptrain doctor`'s largest all-reduce) "
                         "or --doctor FILE")
    checks = [("--step_ms", step_s > 0), ("--grad_mib", grad_bytes > 0), ("--busbw_gbps", busbw > 0),
              ("--latency_us", latency is None or latency >= 0), ("--bucket_cap_mb", args.bucket_cap_mb > 0),
              ("--backward_fraction", backward is None or 0 <= backward <= 1)]
    for flag, ok in checks:
        if not ok:
            raise UsageError(f"{flag} must be positive" + (" and at most 1" if flag == "--backward_fraction" else ""))
    return Workload(step_s=step_s, backward_fraction=DEFAULT_BACKWARD_FRACTION if backward is None else backward,
                    grad_bytes=grad_bytes, busbw_bytes_per_s=busbw,
                    latency_s=10e-6 if latency is None else latency,
                    bucket_cap_bytes=int(args.bucket_cap_mb * MIB), first_bucket_bytes=int(args.bucket_cap_mb * MIB),
                    tensor_bytes=tensors, fsdp_units=units)


def parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--gpus {text!r}: write device counts separated by commas, e.g. 8,64,512") from None
    if not gpus or min(gpus) < 1:
        raise UsageError(f"--gpus {text!r}: every device count must be >= 1")
    return gpus


def render(work: Workload, predictions: list[Prediction]) -> str:
    buckets = len(work.buckets())
    header = (f"ddptrain plan: step {1000 * work.step_s:.1f} ms on one device "
              f"({100 * work.backward_fraction:.0f}% backward), gradients {work.grad_bytes / MIB:.1f} MiB in "
              f"{buckets} buckets of <= {work.bucket_cap_bytes / MIB:g} MiB, "
              f"busbw {work.busbw_bytes_per_s / 1e9:.3g} GB/s, hop latency {1e6 * work.latency_s:.3g} us")
    names = ["GPUs", "all-reduce ms", "exposed ms", "step ms", "efficiency", "no-overlap step ms", "no-overlap eff",
             "fsdp comm ms", "fsdp step ms", "fsdp eff"]
    rows = [[str(p.world_size), f"{1000 * p.comm_s:.2f}", f"{1000 * p.exposed_s:.2f}", f"{1000 * p.step_s:.2f}",
             f"{100 * p.efficiency:.1f}%", f"{1000 * p.step_no_overlap_s:.2f}", f"{100 * p.efficiency_no_overlap:.1f}%",
             f"{1000 * p.fsdp_comm_s:.2f}", f"{1000 * p.fsdp_step_s:.2f}", f"{100 * p.fsdp_efficiency:.1f}%"]
            for p in predictions]
    model = ("model: ring all-reduce t = 2(N-1)*alpha + (S/B)*2(N-1)/N per bucket, buckets reduced in order as "
             "backward produces them; fsdp: all-gather (forward, backward) + reduce-scatter per unit, "
             f"{work.fsdp_units} units, each overlapping the previous unit's compute; "
             "efficiency = step(1)/step(N) at a fixed per-device batch. Optimistic where "
             "devices share a slower inter-node link (pass that busbw), where communication slows compute, or with "
             "stragglers; `ddptrain plan --help` lists the assumptions.")
    table = format_table(names, rows, align="right")
    return "\n".join([textwrap.fill(header, 110), "", table, "", textwrap.fill(model, 110)])


def main(argv: list[str]) -> int:
    args, train_argv = build_parser().parse_known_args(argv)
    gpus = parse_gpus(args.gpus)
    memory = memory_from_args(args, train_argv)
    if memory is not None:
        from ddptrain.tools import memplan

        cfg, shape = memory
        if cfg.nproc:
            gpus = [cfg.nproc]
        check_tp_fits(cfg.tp, gpus, cfg.nproc or args.gpus_per_node)
        print(render_memory(cfg, shape, [memplan.footprint(shape, cfg, n) for n in gpus]))
        if cfg.tp > 1:
            print()
            print(render_tensor_parallel(cfg, tp_traffic(cfg, shape), *tp_network(args)))
        tokens = render_tokens(cfg)
        if tokens:
            print()
            print(tokens)
        if not (args.run_dir or args.step_ms is not None) or cfg.tp > 1:
            return EXIT_OK  # memory alone: no step time to scale (the data-parallel table models no (dp, tp) mesh)
        print()
    work = workload_from_args(args)
    print(render(work, [predict(work, n) for n in gpus]))
    return EXIT_OK


def memory_from_args(args: argparse.Namespace, train_argv: list[str]) -> tuple[Any, memplan.ModelShape] | None:
    """The training flags after plan's own (`--model ... --strategy fsdp --nproc N ...`, or --config FILE): the
    model on the meta device; None when there are none."""
    if not train_argv:
        return None
    from ddptrain.tools import memplan

    if args.activation_mib is not None and args.activation_mib < 0:
        raise UsageError("--activation_mib must be >= 0")
    cfg = resolve_config(train_argv, prog="ddptrain plan")
    return cfg, memplan.model_shape(cfg, args.activation_mib)


def render_memory(cfg: Any, shape: memplan.ModelShape, footprints: list[memplan.Footprint]) -> str:
    gathered = [u for u in shape.units if not u.vocabulary] or list(shape.units)
    largest = max(gathered, key=lambda u: u.elements)
    split = len(shape.units) - len(gathered)
    sharded = cfg.strategy != "ddp"
    header = (f"ddptrain plan: memory per rank, {cfg.model} under --strategy {cfg.strategy}: "
              f"{shape.elements / 1e6:.1f}M parameters ({4 * shape.elements / MIB:.0f} MiB in fp32), "
              f"{shape.trainable / 1e6:.3g}M trainable"
              + (f", {len(gathered)} units (largest {largest.name}: {4 * largest.elements / MIB:.0f} MiB fp32)"
                 + (f" and {split} split by vocabulary rows at 2 ranks or more, never gathered" if split else "") if sharded else "")
              + (f"; activations {shape.activations / MIB:.1f} MiB (fp32) per micro-batch of {cfg.batch_size}"
                 if shape.activations_known else "; activations not counted for this task (--activation_mib)")
              + (f"; --activation_checkpointing: {sum(u.inputs is not None for u in shape.units)} blocks keep their "
                 "inputs, one recomputed at a time" if cfg.activation_checkpointing and shape.activations_known else "")
              + (f"; --tp {cfg.tp}: the tp_plan's layers hold {shape.tp_elements / 1e6:.1f}M parameters, each rank of "
                 f"a group 1/{cfg.tp} of them and of the activations between a split layer and a rowwise one, the rest "
                 "(norms; embeddings and head unless split by vocabulary rows) whole on each rank of a group"
                 + (f", then sharded over the ranks/{cfg.tp} data-parallel ranks" if sharded else "")
                 if cfg.tp > 1 else ""))
    names = ["ranks", *(["dp x tp"] if cfg.tp > 1 else []), "params MiB", "grads MiB", "optimizer MiB", "gathered MiB",
             "activations MiB", "peak MiB/rank", "peak / fp32 model", "at"]
    fp32 = 4 * shape.elements
    rows = []
    for f in footprints:  # the kinds at the peak's moment: they add up to the peak
        kinds = (f.params, f.grads_at_peak, f.optimizer, f.gathered, f.activations)
        mesh = [f"{f.ranks // cfg.tp} x {cfg.tp}"] if cfg.tp > 1 else []
        rows.append([str(f.ranks), *mesh, *(f"{b / MIB:.0f}" for b in kinds), f"{f.device_peak / MIB:.0f}",
                     f"{f.device_peak / fp32:.2f}x", f.moment])
    notes = ("peak = what the rank holds at its fullest moment of a step: its share of parameters, gradients and "
             "optimizer state, the unit being computed gathered whole with its gradients and FSDP2's buffers, the "
             "activations still saved; plus the framework itself (CUDA context, libraries: measure a tiny "
             "model's run) and the allocator's slack. `ddptrain plan --help` lists the rules.")
    if cfg.cpu_offload:
        notes = ("--cpu_offload: params, grads and optimizer state live in host memory (not in the peak). " + notes)
    table = format_table(names, rows, align="right")
    return "\n".join([textwrap.fill(header, 110), "", table, "", textwrap.fill(notes, 110)])


def check_tp_fits(tp: int, gpus: list[int], per_node: int) -> None:
    """--tp N as training refuses it: N must divide every device count and the ranks of a node (a group stays
    inside a node)."""
    if tp == 1:
        return
    if per_node < 1:
        raise UsageError("--gpus_per_node must be >= 1")
    odd = [n for n in gpus if n % tp or min(n, per_node) % tp]
    if odd:
        raise UsageError(f"--tp {tp} must divide every device count and the {per_node} ranks of a node (a "
                         f"tensor-parallel group stays inside a node), not {', '.join(map(str, odd))}: change --tp, --gpus "
                         "or --gpus_per_node")


@dataclass(frozen=True)
class TensorParallelTraffic:
    """The all-reduces of a tensor-parallel group per optimizer step (memplan's Collective, at the compute dtype)."""

    tp: int
    micro_steps: int  # --grad_accum_steps
    by_layer: dict[tuple[str, str], int]  # (layer as the tp_plan names it, "forward" or "backward") -> how many
    sizes: tuple[int, ...]  # bytes of each all-reduce of one micro-batch (a recomputed forward's again)
    element_bytes: int

    @property
    def blocks(self) -> int:
        """The blocks whose layers split: each of the plan's layers is in each of them once."""
        return max(self.by_layer.values(), default=0)

    @property
    def step_bytes(self) -> int:
        """Bytes all-reduced per optimizer step (each all-reduce counted once)."""
        return sum(self.sizes) * self.micro_steps

    @property
    def rank_bytes(self) -> float:
        """Bytes each rank sends (and receives) per step in ring all-reduces over the group: 2(N-1)/N of each."""
        return self.step_bytes * 2 * (self.tp - 1) / self.tp

    def step_s(self, busbw_bytes_per_s: float, latency_s: float) -> float:
        """The all-reduces of a step back to back (the next layer waits for each: nothing hides them)."""
        return self.micro_steps * sum(ring_all_reduce_s(size, self.tp, busbw_bytes_per_s, latency_s)
                                      for size in self.sizes)


def tp_traffic(cfg: Any, shape: memplan.ModelShape) -> TensorParallelTraffic:
    """cfg's --tp all-reduces per step from the meta forward's (memplan.model_shape), at the compute dtype: the
    forward all-reduces of a block --activation_checkpointing recomputes run again in its backward."""
    from ddptrain.tools import memplan

    element = memplan.compute_bytes(cfg)
    by_layer: dict[tuple[str, str], int] = {}
    sizes = []
    for c in shape.collectives:
        key = (c.layer, c.direction)
        by_layer[key] = by_layer.get(key, 0) + 1
        sizes += [c.size * element // 4] * (2 if c.recomputed and c.direction == "forward" else 1)
    return TensorParallelTraffic(cfg.tp, cfg.grad_accum_steps, by_layer, tuple(sizes), element)


_TP_GROUP = re.compile(r"^  all-reduce of .* within each group: [\d.]+ ms, busbw ([\d.eE+-]+) GB/s", re.M)


def tp_network(args: argparse.Namespace) -> tuple[float | None, float | None, float]:
    """(step seconds or None, busbw bytes/s or None, hop latency) for the --tp estimate, from plan's own flags: a
    --doctor file of `doctor --tp N` gives the busbw it measured within a group."""
    step_s = args.step_ms / 1000 if args.step_ms is not None else None
    if step_s is None and args.run_dir:
        step_s = compute_from_run(Path(args.run_dir))[0]
    busbw, latency = (args.busbw_gbps * 1e9 if args.busbw_gbps is not None else None), 10e-6
    if busbw is None and args.doctor and Path(args.doctor).is_file():
        text = Path(args.doctor).read_text(errors="replace")
        busbw, latency, _ = network_from_doctor(text, args.doctor)
        group = _TP_GROUP.search(text)  # `doctor --tp N`'s all-reduce within a group: the links TP uses
        if group:
            busbw = float(group.group(1)) * 1e9
    if args.latency_us is not None:
        latency = args.latency_us / 1e6
    return step_s, busbw, latency


TP_BUDGET = 0.1  # the share of a step the tensor-parallel all-reduces may take, for the bandwidth they need


def render_tensor_parallel(cfg: Any, traffic: TensorParallelTraffic, step_s: float | None, busbw: float | None,
                           latency_s: float) -> str:
    if not traffic.sizes:
        return (f"ddptrain plan: --tp {traffic.tp}: the all-reduces of the tensor-parallel groups are not counted for "
                "this task (its batch cannot be made up on the meta device)")

    def layers(direction: str) -> tuple[int, str]:
        mine = [(layer, n) for (layer, d), n in traffic.by_layer.items() if d == direction]
        return sum(n for _, n in mine) // traffic.blocks, ", ".join(layer for layer, _ in mine)

    (forward, after), (backward, of) = layers("forward"), layers("backward")
    size = max(traffic.sizes)
    tokens = cfg.batch_size * cfg.seq_len * traffic.element_bytes if cfg.task == "language_model" else 0
    shape = (f" = micro-batch {cfg.batch_size} x seq {cfg.seq_len} x width {size // tokens} x "
             f"{traffic.element_bytes} B" if tokens and size % tokens == 0 else "")
    recomputed = len(traffic.sizes) - sum(traffic.by_layer.values())
    header = (f"ddptrain plan: tensor parallel --tp {traffic.tp}: all-reduces over the {traffic.tp} ranks of a group "
              f"(inside a node), per block {forward} in forward (after {after}) and {backward} in backward (the "
              f"input gradients of {of}), each of one micro-batch's activation, {size / MIB:.3g} MiB{shape}; "
              f"{traffic.blocks} blocks"
              + (f"; --activation_checkpointing runs the forward's {recomputed} again in backward"
                 if recomputed else ""))
    budget = step_s if step_s is not None else 0.1
    rows = [("all-reduces per step", f"{len(traffic.sizes) * traffic.micro_steps}"
             + (f" ({traffic.micro_steps} micro-batches)" if traffic.micro_steps > 1 else "")),
            ("all-reduced per step", f"{traffic.step_bytes / MIB:.1f} MiB"),
            ("each rank sends per step", f"{traffic.rank_bytes / MIB:.1f} MiB, and receives as much (2(N-1)/N of it, "
             f"N = {traffic.tp})"),
            ("busbw it needs", f"{traffic.rank_bytes / (TP_BUDGET * budget) / 1e9:.3g} GB/s, to take <= "
             f"{100 * TP_BUDGET:.0f}% of a {1000 * budget:.0f} ms step" + ("" if step_s is not None else
                                                                         " (--step_ms: yours)"))]
    if busbw is not None:
        spent = traffic.step_s(busbw, latency_s)
        rows.append((f"at busbw {busbw / 1e9:.3g} GB/s", f"{1000 * spent:.2f} ms per step"
                     + (f", {100 * spent / step_s:.2g}% of the step" if step_s else "")))
    lines = [f"  {label:<27} {value}" for label, value in rows]
    notes = ("The compute waits for each of them (nothing overlaps them): keep a group on NVLink-class links inside "
             "a node; `ddptrain doctor --tp N` measures a group's busbw. Not counted here: the data-parallel "
             "collectives, which under --tp carry each rank's share of the split layers over ranks/N ranks (the "
             "scaling table of --step_ms is not drawn for a (dp, tp) mesh).")
    return "\n".join([textwrap.fill(header, 110), "", *lines, "", textwrap.fill(notes, 110)])


def render_tokens(cfg: Any) -> str | None:
    """For a language model on `hf:` records: the tokens a rank trains on per micro-batch padded (each batch to its
    longest row) and packed (--packing: bins of --seq_len), from the records' lengths (tokenized as the run
    tokenizes them, into the same cache); None for other data."""
    if cfg.task != "language_model" or not cfg.dataset.startswith("hf:"):
        return None
    from ddptrain.data.packing import padded_fill, plan_bins
    from ddptrain.models import hf

    train, _ = hf.build_datasets(cfg.section("data"), Path(cfg.run_dir))
    lengths = train.row_lengths()
    bins = len(plan_bins(lengths, cfg.seq_len, cfg.seed))
    fill, tokens, batch = padded_fill(lengths, cfg.batch_size, cfg.seed), sum(lengths), cfg.batch_size
    packed_fill = tokens / (bins * cfg.seq_len)
    rows = [["padded", f"{batch} rows", f"{batch * tokens / len(lengths) / fill:.0f}", f"{batch * tokens / len(lengths):.0f}",
             f"{100 * (1 - fill):.0f} %", str(len(lengths))],
            ["--packing", f"{batch} bins", f"{batch * cfg.seq_len}", f"{batch * packed_fill * cfg.seq_len:.0f}",
             f"{100 * (1 - packed_fill):.0f} %", str(bins)]]
    header = (f"ddptrain plan: tokens per micro-batch of a rank, {len(lengths)} records of {cfg.dataset[3:]} "
              f"({tokens} tokens, mean {tokens / len(lengths):.0f}, longest {max(lengths)}) at --seq_len {cfg.seq_len}: "
              f"packed, each position computed holds {packed_fill / fill:.2f}x the tokens it holds padded")
    table = format_table(["", "micro-batch", "positions", "tokens", "padding", "samples an epoch"], rows,
                         align="right")
    return "\n".join([textwrap.fill(header, 110), "", table])
