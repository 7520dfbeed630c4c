"""One benchmark process: trains with ddptrain's real Trainer, watched by a probe (see probe.py).

Started on every rank by torchrun (`common.torchrun`):

    python -m torch.distributed.run --standalone --nproc-per-node N -m benchmarks.worker JOBS.json OUT.json

JOBS.json is a list of jobs, run one after another in the same process group; each is
{"name", "mode", "argv": [ddptrain train flags], ...mode settings}. Modes:

* interleave  — ddptrain and the raw loop alternate in blocks of `block_steps` optimizer steps;
* accumulate  — the same, against the raw loop that all-reduces on every micro-step, with both DDP
                wrappers' bucket all-reduces counted per micro-step by a communication hook;
* checkpoint  — alternating synchronous and asynchronous saves on ddptrain's own save path;
* timeline    — ddptrain alone: step boundary times and its metrics.jsonl; optionally an all-reduce
                sweep first (bandwidth and latency for the scaling model), and DDP's gradient all-reduces
                timed per step by a communication hook ("comm": "time"), or skipped ("comm": "skip");
* pair        — two Trainers (`argv` and `argv_b`, e.g. an option on and off) in the same processes,
                alternating blocks of `Trainer.train_step` (options.py).

A job with "freeze": true (the grouped launches of common.run_launches) leaves what survives it, such as the
modules it imported, out of the later jobs' garbage collections.

Rank 0 writes a list of results to OUT.json.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.probe import (
    CommCounter,
    CommTimer,
    Interleave,
    PhaseClock,
    SaveSchedule,
    StepProbe,
    Timeline,
    wrap_timed,
)
from benchmarks.raw_loop import LOSSES, RawLoop, sync_device
from ddptrain.config import TrainConfig, resolve_config
from ddptrain.loop.plugins import datasets_of, model_of
from ddptrain.loop.trainer import Trainer
from ddptrain.observe.log import setup_logging
from ddptrain.observe.metrics import read_metrics
from ddptrain.parallel.distributed import DistributedContext, distributed
from ddptrain.tools.plan import tensor_bytes_in_backward_order


def raw_loop_for(cfg: TrainConfig, ctx: DistributedContext, sync_every_micro_step: bool = False) -> RawLoop:
    """The raw loop on the same model (same init), data, batch, loader workers, task and options as `cfg`."""
    if cfg.task not in LOSSES:
        raise ValueError(f"the raw loop has no hand-written loss for --task {cfg.task}; choose from {sorted(LOSSES)}")
    torch.manual_seed(cfg.seed)
    train, _ = datasets_of(cfg)
    return RawLoop(model_of(cfg), train, device=ctx.device, batch_size=cfg.batch_size,
                   num_workers=cfg.num_workers, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   seed=cfg.seed, grad_accum_steps=cfg.grad_accum_steps, sync_every_micro_step=sync_every_micro_step,
                   use_amp=cfg.use_amp, channels_last=cfg.channels_last, compile=cfg.compile, task=cfg.task,
                   strategy=cfg.strategy)


def all_reduce_sweep(ctx: DistributedContext, sizes: list[int], iters: int) -> list[dict[str, float]]:
    """Median seconds of an all-reduce of each size on the training backend (what DDP's buckets use)."""
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, device=ctx.device)
        dist.all_reduce(tensor)
        times = []
        for _ in range(iters):
            dist.barrier()
            sync_device(ctx.device)
            started = time.perf_counter()
            dist.all_reduce(tensor)
            sync_device(ctx.device)
            times.append(time.perf_counter() - started)
        rows.append({"bytes": size, "seconds": statistics.median(times)})
    return rows


def train_steps(trainer: Trainer, batches: Any, steps: int) -> float:
    """`steps` optimizer steps of the trainer's own train_step (no log steps); wall seconds."""
    sync_device(trainer.ctx.device)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batches)
        trainer.position.step += 1
        trainer.states["optim"].scheduler.step()
    sync_device(trainer.ctx.device)
    return time.perf_counter() - started


def run_pair(job: dict[str, Any], ctx: DistributedContext) -> dict[str, Any]:
    """Trainer A (`argv`) and B (`argv_b`) alternate blocks of `block_steps` steps, `blocks` times each."""
    trainers, iterators = [], []
    for argv in (job["argv"], job["argv_b"]):
        cfg = resolve_config(argv)
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        trainer = Trainer(cfg, ctx, Path(cfg.run_dir))
        trainer.data.sampler.set_position(0, 0)
        trainers.append(trainer)
        iterators.append(iter(trainer.data.train))
    times: list[list[float]] = [[], []]
    for _ in range(job["blocks"]):
        for side in (0, 1):
            time.sleep(job.get("settle_s", 0.1))
            times[side].append(train_steps(trainers[side], iterators[side], job["block_steps"]))
    saved = [activation_bytes(trainer, iterator) for trainer, iterator in zip(trainers, iterators)] \
        if job.get("activations") else [0, 0]
    del iterators
    memory = [trainer.parallel.memory(trainer.optimizer) for trainer in trainers]  # rank 0's, state all made
    # The gradients at their fullest in a step, as the memory line states them (Trainer._step).
    peak_grad = [max(held["grad_bytes"], trainer.stepper.accumulated_grad_bytes or 0)
                 for held, trainer in zip(memory, trainers)]
    for trainer in trainers:
        trainer.close()
    del trainers
    gc.collect()
    return {"name": job["name"], "mode": "pair", "world_size": ctx.world_size, "a_s": times[0], "b_s": times[1],
            "a_memory": memory[0], "b_memory": memory[1], "a_peak_grad_bytes": peak_grad[0],
            "b_peak_grad_bytes": peak_grad[1], "a_activation_bytes": saved[0], "b_activation_bytes": saved[1]}


def activation_bytes(trainer: Trainer, batches: Any) -> int:
    """Bytes of the tensors autograd keeps for backward across one micro-batch's forward (each storage once):
    the activation memory --activation_checkpointing trades for recomputation. Its own packing hooks run
    inside a checkpointed block, so what is seen here is what outlives the forward."""
    from ddptrain.data.batch import to_device

    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    _, batch = next(batches)
    batch = to_device(batch, trainer.ctx.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output, _ = trainer.task.loss(trainer.parallel.model, batch)
    loss, _, _ = trainer.stepper.normaliser.split(output)
    with trainer.parallel.accumulating(True):
        (loss * 0).backward()  # frees the graph the same way on every rank (DDP's hooks fire)
    trainer.optimizer.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in trainer.module.parameters()}
    return sum(size for ptr, size in seen.items() if ptr not in params)


def time_calls(obj: Any, names: tuple[str, ...]) -> dict[str, list[float]]:
    """Wrap obj's methods to record each call's seconds (attributes the overhead; ~1 us per call)."""
    spent: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        wrap_timed(obj, name, time.perf_counter, spent[name].append)
    return spent


def phase_clock(trainer: Trainer, raw: RawLoop) -> PhaseClock:
    """Time the training thread's CPU in the same phases of both sides: forward (the loss of a batch),
    backward (`Tensor.backward`, for this job), the optimizer's step and receiving batches (the raw loop
    reads its loader; ddptrain's reads are timed by StepProbe); and ddptrain's gradient norm, which the raw
    loop does not take: a pass over the gradients, whose cost grows with the parameter count."""
    clock = PhaseClock()
    clock.wrap(trainer.task, "loss", "forward")
    clock.wrap(raw, "loss_of", "forward")
    clock.wrap(torch.Tensor, "backward", "backward")
    clock.wrap(trainer.optimizer, "step", "optimizer")
    clock.wrap(raw.optimizer, "step", "optimizer")
    clock.wrap(raw, "_next_batch", "receiving batches")
    clock.wrap(torch.nn.utils, "get_total_norm", "gradient norm")  # ddptrain's non-finite guard: one read of the grads
    return clock


def handoff_seconds(loader: Any, fetches: int = 6, wait_s: float = 0.3) -> float:
    """Median seconds `next()` takes when the workers are ahead: the cost of receiving a ready batch."""
    batches = iter(loader)
    next(batches)
    times = []
    for _ in range(fetches):
        time.sleep(wait_s)  # the workers refill the prefetch queue
        started = time.perf_counter()
        next(batches)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_job(job: dict[str, Any], ctx: DistributedContext) -> dict[str, Any]:
    """One job (all ranks); the result is rank 0's view."""
    if job["mode"] == "pair":
        return run_pair(job, ctx)
    cfg = resolve_config(job["argv"])
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, ctx.rank, ctx.world_size, ctx.host)
    result: dict[str, Any] = {"name": job["name"], "mode": job["mode"], "world_size": ctx.world_size,
                              "threads": torch.get_num_threads()}
    if job.get("sweep_sizes"):
        result["sweep"] = all_reduce_sweep(ctx, job["sweep_sizes"], job.get("sweep_iters", 5))

    trainer = Trainer(cfg, ctx, run_dir)
    result["grad_bytes"] = sum(p.numel() * p.element_size() for p in trainer.stepper.params)
    result["grad_tensor_bytes"] = list(tensor_bytes_in_backward_order(trainer.module))
    mode = job["mode"]
    counters: dict[str, CommCounter] = {}
    spent: dict[str, list[float]] = {}
    clock = None
    backward, total_norm = torch.Tensor.backward, torch.nn.utils.get_total_norm
    if mode in ("interleave", "accumulate"):
        spent = time_calls(trainer, ("_between_steps", "_log_train"))
        spent.update(time_calls(trainer.train_log, ("finish",)))  # a log step's line, at the boundary after it
        raw = raw_loop_for(cfg, ctx, sync_every_micro_step=mode == "accumulate")
        clock = phase_clock(trainer, raw)
        callback: Any = Interleave(ctx.device, job["block_steps"], raw.run, job.get("settle_s", 0.1),
                                   max_blocks=job["blocks"], phases=clock)
    elif mode == "checkpoint":
        callback = SaveSchedule(trainer, job["first_save"], job["period"], job["num_saves"])
    else:
        callback = Timeline(ctx.device)
    probe = StepProbe(trainer, callback, clock)
    comm_timer = CommTimer(skip=job["comm"] == "skip") if job.get("comm") else None
    if comm_timer is not None and trainer.parallel.ddp is not None:
        trainer.parallel.ddp.register_comm_hook(None, comm_timer.hook)
        if comm_timer.skip:  # replicas differ by design here: the end-of-run equality check would fail the job
            trainer.parallel.check_replicas = lambda: None
    if mode == "accumulate":
        counters["ddptrain"] = CommCounter(lambda: (probe.taken - 1) % cfg.grad_accum_steps)
        counters["raw"] = CommCounter(lambda: raw.micro)
        trainer.parallel.ddp.register_comm_hook(None, counters["ddptrain"].hook)
        raw.ddp.register_comm_hook(None, counters["raw"].hook)

    started = time.perf_counter()
    try:
        summary = trainer.fit()
    finally:
        torch.Tensor.backward, torch.nn.utils.get_total_norm = backward, total_norm  # timed for this job only
    result["steps"] = summary["step"]
    if isinstance(callback, Interleave):
        result["ours_s"], result["theirs_s"] = callback.ours, callback.theirs
        result["raw_steps"] = len(callback.theirs) * job["block_steps"]
        result["peak_mb"] = callback.peak_mb
        result["cpu_s"] = callback.cpu  # rank 0's CPU by kind of thread, per block of each side
        result["phase_cpu_s"] = callback.phase_cpu  # its training thread's CPU by phase, per block
        result["global_batch_size"] = trainer.data.layout.global_batch_size
        result["flops_per_sample"], result["peak_tflops"] = trainer.train_log.flops_per_sample, trainer.train_log.peak_tflops
    elif isinstance(callback, SaveSchedule):
        result.update(callback.summary())
        result["checkpoint_bytes"] = _newest_checkpoint_bytes(cfg)
    else:
        result["step_s"] = callback.step_seconds()
        if comm_timer is not None:
            result["comm"] = comm_timer.per_step(callback.times)
        if job.get("handoff_probe"):
            result["handoff_s"] = handoff_seconds(trainer.data.train, job.get("handoff_fetches", 6),
                                                  job.get("handoff_wait_s", 0.3))
    result["calls_s"] = {name: {"count": len(times), "median_s": statistics.median(times) if times else 0.0,
                                "total_s": sum(times)} for name, times in spent.items()}
    for side, counter in counters.items():
        result[f"{side}_calls_by_micro"] = {str(k): v for k, v in sorted(counter.calls.items())}
    if ctx.is_main:
        result["metrics"] = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]
    result["wall_s"] = time.perf_counter() - started
    trainer.close()
    if mode in ("interleave", "accumulate"):
        raw.close()
    del trainer, callback
    gc.collect()  # this job's memory is freed before the next job starts
    return result


def _newest_checkpoint_bytes(cfg: TrainConfig) -> int:
    from ddptrain.checkpoints.format import committed_steps

    found = committed_steps(cfg.checkpoint_path)
    return sum(f.stat().st_size for f in found[0][1].rglob("*") if f.is_file()) if found else 0


def main(argv: list[str]) -> None:
    jobs = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    first = resolve_config(jobs[0]["argv"])
    if any(resolve_config(job["argv"]).num_workers > 0 for job in jobs):
        from ddptrain.data.pipeline import worker_context

        # The loaders' forkserver, started before the process group's threads exist, as `ddptrain train`'s
        # workers start it (api.train_worker): where torch is imported already it can be a fork of this process.
        worker_context()
    with distributed(first.backend, first.init_timeout_s, out.parent) as ctx:
        results = []
        for job in jobs:
            results.append(run_job(job, ctx))
            if job.get("freeze"):  # (collected already) what it left, e.g. MLflow's modules, out of later collections
                gc.freeze()
        if ctx.is_main:
            out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
