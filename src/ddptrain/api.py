"""The Python API: `ddptrain.fit(...)` trains your model from your own script.

    import ddptrain
    summary = ddptrain.fit(model=my_model, train_data=train_ds, eval_data=eval_ds,
                           config=ddptrain.TrainConfig(epochs=3, batch_size=32, nproc=2))

- Run as a plain script, `fit` trains in this process (world size 1), or with `nproc = N` starts N local
  worker processes itself (the `mp.spawn` pattern: each imports your script, so guard the call with
  `if __name__ == "__main__":`; model, data and task must pickle);
- under torchrun (RANK set), each process runs its part of the job: `torchrun --nproc-per-node 2 my.py`.

`ddptrain train` is a thin layer over `train_worker`, the same path each process takes here.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from ddptrain.config import TrainConfig
from ddptrain.errors import Preempted, TrainingError, UsageError, first_line
from ddptrain.parts import Parts

__all__ = ["fit", "train_worker", "Parts", "WorkerFailed"]




class WorkerFailed(TrainingError):
    """This rank's training failed; the cause is already logged, on stderr and in the launcher's error file."""


def train_worker(cfg: TrainConfig, parts: Parts | None = None) -> dict[str, Any]:
    """One training process: process group, the job's run dir lock, rank logs, the Trainer. Returns
    `Trainer.fit`'s summary. All ranks.

    Raises UsageError and Preempted as they are, and WorkerFailed for anything else after reporting it with
    this rank, its host and the step; the process groups are then aborted rather than destroyed.
    """
    from ddptrain.checkpoints import runlock
    from ddptrain.checkpoints.format import refuse_changed_settings, write_resolved
    from ddptrain.loop.sanity import plugin_names, usage_error_of
    from ddptrain.loop.trainer import Trainer
    from ddptrain.observe.log import rank_log_path, setup_logging
    from ddptrain.parallel import netinfo
    from ddptrain.parallel.distributed import distributed
    from ddptrain.parallel.procenv import LOCAL_LAUNCH_ENV, name_worker, read_launch_env
    from ddptrain.parallel.watchdog import record_for_launcher

    if cfg.num_workers > 0:
        from ddptrain.data.pipeline import worker_context

        # The loaders' forkserver, started before the process group's threads exist: its imports overlap the
        # joining (no measurable gain on 2 cores, docs/performance.md), and where torch is imported already,
        # as in the test suite's warm starts (tests/zygote.py), it can be a fork of this process.
        worker_context()
    run_dir = Path(cfg.run_dir)
    runlock.make_dir(run_dir, "--run_dir")
    with (distributed(cfg.backend, cfg.init_timeout_s, run_dir) as ctx,
          runlock.held_by_job(ctx, runlock.job_dirs(cfg))):  # before this job writes anything into the run dir
        log = setup_logging(run_dir, ctx.rank, ctx.world_size, ctx.host)
        if read_launch_env().launched:
            name_worker(ctx.rank, ctx.world_size, run_dir)
        log.debug("address %s on interface %s, device %s", ctx.addr, ctx.interface, ctx.device)
        if ctx.is_main and ctx.world_size > 1:
            log.info("ranks by host: %s", netinfo.describe_hosts(ctx.hosts, ctx.addrs))
        trainer = None
        try:
            if not os.environ.get(LOCAL_LAUNCH_ENV):  # else the launcher checked and wrote it
                refusal = None
                if ctx.is_main:
                    try:
                        refuse_changed_settings(cfg)
                    except UsageError as exc:
                        refusal = str(exc)
                    else:
                        write_resolved(cfg, run_dir)
                refusal = ctx.broadcast_object(refusal)  # every rank exits alike
                if refusal is not None:
                    raise UsageError(refusal)
            if ctx.is_main:
                log.info("run dir %s · world size %d · backend %s · device %s", run_dir, ctx.world_size,
                         ctx.backend, ctx.device)
            parts = parts or Parts()
            trainer = Trainer(cfg, ctx, run_dir, dataclasses.replace(parts, task=as_task(parts.task)))
            return trainer.fit()
        except (UsageError, Preempted) as exc:
            traceback.clear_frames(exc.__traceback__)  # as below: the exception must not keep the Trainer alive
            raise
        except Exception as exc:
            model_name = plugin_names(cfg, parts or Parts())["model"]
            usage = usage_error_of(exc, trainer.module if trainer is not None else None, model_name)
            if usage is not None:  # torch's words for a user's mistake (DDP's unused parameters): one line
                traceback.clear_frames(exc.__traceback__)
                raise usage from None
            step = trainer.position.step if trainer is not None else "startup"
            # The traceback goes once, into this rank's log; the console gets one line per rank (and, from a
            # launcher, one naming the rank that failed first).
            _to_rank_log(log, f"failed at step {step}:\n{traceback.format_exc()}")
            line = (f"rank {ctx.rank} on host {ctx.host} failed at step {step}: {type(exc).__name__}: {first_line(exc)}"
                    f"{netinfo.lost_peers_note(str(exc), ctx.hosts, ctx.addrs, ctx.addr)}")
            sys.stderr.write(f"ddptrain: {line} (traceback in {rank_log_path(run_dir, ctx.rank)})\n")
            record_for_launcher(exc)
            traceback.clear_frames(exc.__traceback__)  # its frames' locals (the Trainer) become garbage now
            raise WorkerFailed(line) from exc
        finally:
            if trainer is not None:
                trainer.close()  # loader workers stop now, not at a garbage collection after the group is gone
                trainer.parallel.release()
            trainer = None  # `distributed` frees it with the process groups: nothing else may hold it


def _to_rank_log(log: logging.Logger, message: str) -> None:
    """`message` as an ERROR line of this rank's log file (RUN_DIR/logs/rank-R.log) only, not the console."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def as_task(task: Any) -> Any:
    """None (the config's --task), a built-in task's name, or any object with loss(model, batch)."""
    from ddptrain.loop.tasks import BUILTIN_TASKS, TASK_CLASSES, PluginTask, build_task

    if task is None or isinstance(task, TASK_CLASSES):
        return task
    if isinstance(task, str):
        if task not in BUILTIN_TASKS:
            raise UsageError(f"task={task!r}: not a built-in ({', '.join(BUILTIN_TASKS)}); pass an object with "
                             "loss(model, batch)")
        return build_task(TrainConfig(task=task))
    return PluginTask(task, type(task).__name__)


def fit(model: Any = None, train_data: Any = None, eval_data: Any = None, task: Any = None,
        config: TrainConfig | None = None, *, collate_fn: Any = None, optimizer: Any = None, scheduler: Any = None,
        callbacks: list[Any] | None = None, **overrides: Any) -> dict[str, Any] | None:
    """Train `model` on `train_data`, evaluating on `eval_data`, as `config` (plus keyword overrides) says.

    `model`: an nn.Module, or fn(cfg) -> nn.Module (built after seeding, identically on every rank); None
    for the config's --model. `train_data` / `eval_data`: datasets, map-style or iterable, whose items may be
    any nesting of tensors; None for the config's --dataset. `task`: a built-in's name, an object with
    loss(model, batch) (see ddptrain.loop.tasks), or None for the config's --task. `collate_fn`, `optimizer`,
    `scheduler`, `callbacks` (see ddptrain.Callback): see `Parts`. Returns the summary (step, epoch, eval metrics, and `weights`: the path of the final
    RUN_DIR/model.safetensors) in the calling process, or None on ranks other than 0 under torchrun; raises
    UsageError for bad input and TrainingError when training fails.

    The trained weights, in every mode: an nn.Module you pass holds them when `fit` returns. In this process
    (or under torchrun) it is the module that trained; with `nproc = N` the workers trained copies of it, and
    `fit` loads the final weights into yours. Under --strategy fsdp/hsdp in this process your module is
    sharded in place: load `summary["weights"]` into a fresh one. A model given as fn(cfg) or by --model:
    load `summary["weights"]`.
    """
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in overrides:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise UsageError(f"fit({key}=...): not a TrainConfig field" + (f"; did you mean {hint[0]}?" if hint else ""))
    cfg = dataclasses.replace(config or TrainConfig(), **overrides)
    if not cfg.run_dir:
        # `fit` resumes only a run dir you name (as HF Trainer's resume_from_checkpoint and Lightning's ckpt_path
        # are explicit), or its own run after a launcher's restart. Unnamed, each call starts fresh in
        # runs/<script>, moving that dir's older checkpoints aside to checkpoints/abandoned/.
        cfg.run_dir = str(Path("runs") / Path(sys.argv[0] or "default").stem)
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            cfg.auto_resume = False
    cfg.validate()
    from ddptrain.preflight import check

    check(cfg)
    parts = Parts(model, None if train_data is None else (train_data, eval_data), task, collate_fn, optimizer,
                  scheduler, callbacks)
    from ddptrain.parallel.procenv import read_launch_env

    env = read_launch_env()
    weights = Path(cfg.run_dir) / "model.safetensors"
    if env.launched or not cfg.nproc:
        summary = train_worker(cfg, parts)  # an nn.Module passed in is the one that trained
        return {**summary, "weights": str(weights)} if env.rank == 0 else None
    summary = _spawn(cfg, parts)
    from torch import nn

    if isinstance(model, nn.Module):  # the workers trained copies of it: give it their final weights
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(weights)))
    return {**summary, "weights": str(weights)}


def _spawn(cfg: TrainConfig, parts: Parts) -> dict[str, Any]:
    """`cfg.nproc` local workers with torchrun's environment on a free port; rank 0's summary. A failed attempt
    is started again, up to `cfg.max_restarts` times, as `ddptrain train --nproc` does: the workers resume from
    the newest committed checkpoint."""
    import torch.multiprocessing as mp

    from ddptrain.checkpoints import runlock
    from ddptrain.parallel.procenv import free_port

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    # As `ddptrain train --nproc`'s launcher: this process holds the job's lock, its workers get the token.
    with runlock.acquire(runlock.job_dirs(cfg)) as lock:
        for attempt in range(cfg.max_restarts + 1):
            try:
                mp.start_processes(_spawned, args=(cfg, free_port(), parts, results, lock.token, attempt),
                                   nprocs=cfg.nproc, start_method="spawn")
                return results.get()
            except mp.ProcessRaisedException as exc:
                last = str(exc).strip().splitlines()[-1]  # "module.Class: message" of the worker's exception
                if last.startswith("ddptrain.errors.UsageError: "):
                    raise UsageError(last.split(": ", 1)[1]) from None
                failure = f"rank {exc.error_index} failed: {last}"
            except mp.ProcessExitedException as exc:
                how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
                failure = f"rank {exc.error_index} {how}"
            if attempt == cfg.max_restarts:
                raise TrainingError(failure + (f" (after {attempt} restarts)" if attempt else ""))
            print(f"ddptrain: {failure}; restarting the workers ({cfg.max_restarts - attempt} restarts left)",
                  file=sys.stderr, flush=True)
            cfg = dataclasses.replace(cfg, auto_resume=True)  # this run's own checkpoints, now
    raise AssertionError("unreachable")


def _spawned(rank: int, cfg: TrainConfig, port: int, parts: Parts, results: Any, lock_token: str,
             attempt: int) -> None:
    from ddptrain.checkpoints.runlock import TOKEN_ENV

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.nproc),
                      LOCAL_WORLD_SIZE=str(cfg.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ[TOKEN_ENV] = lock_token
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)  # as torch's agent numbers them (faults.py reads it)
    if "OMP_NUM_THREADS" not in os.environ:  # as `--nproc` gives its workers: the cores shared out
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nproc))
    summary = train_worker(cfg, parts)
    if rank == 0:
        results.put(summary)

