"""The Python API: `ddptrain.fit(...)` trains your model from your own script.

    import ddptrain
    summary = ddptrain.fit(model=my_model, train_data=train_ds, eval_data=eval_ds,
                           config=ddptrain.TrainConfig(epochs=3, batch_size=32, nproc=2))

- Run as a plain script, `fit` trains in this process (world size 1), or with `nproc = N` starts N local
  worker processes on the launcher of `ddptrain train --nproc N`, with its restarts, hang reports and exit codes
  (`launch_workers`). Each worker is forked from its forkserver, which imported torch and ddptrain once, and
  runs your script's top level again (multiprocessing's spawn rule, as under `mp.spawn`): guard the call with
  `if __name__ == "__main__":`; model, data and task must pickle;
- under torchrun (RANK set), each process runs its part of the job: `torchrun --nproc-per-node 2 my.py`.

`ddptrain train` is a thin layer over `train_worker`, the same path each process takes here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from ddptrain.checkpoints import runlock
from ddptrain.config import TrainConfig, coerce, refuse_ignored
from ddptrain.errors import (
    EXIT_PREEMPTED,
    EXIT_USAGE,
    Preempted,
    TrainingError,
    UsageError,
    WorkerFailed,
    first_line,
)
from ddptrain.observe.log import rank_log_path, setup_logging
from ddptrain.parallel import netinfo
from ddptrain.parallel.launch import caller_kept, launch_local, run_aside, start_worker_server
from ddptrain.parallel.procenv import (
    LOCAL_LAUNCH_ENV,
    exit_code_for,
    name_worker,
    read_launch_env,
    record_for_launcher,
)
from ddptrain.parts import Parts
from ddptrain.preflight import check, check_hf, uses_hf
from ddptrain.settings import FIELDS

__all__ = ["fit", "train_worker", "Parts", "WorkerFailed"]


def train_worker(cfg: TrainConfig, parts: Parts | None = None) -> dict[str, Any]:
    """One training process: process group, the job's run dir lock, rank logs, the Trainer. Returns
    `Trainer.fit`'s summary. All ranks.

    Raises UsageError and Preempted as they are, and WorkerFailed for anything else after reporting it with
    this rank, its host and the step; the process groups are then aborted rather than destroyed.
    """
    from ddptrain.parallel.distributed import distributed
    from ddptrain.parallel.watchdog import Watchdog

    if cfg.num_workers > 0:
        from ddptrain.data.pipeline import worker_context

        # The loaders' forkserver, started before the process group's threads exist: its imports overlap the
        # joining (no measurable gain on 2 cores, docs/performance.md), and where torch is imported already,
        # as in the test suite's warm starts (tests/zygote.py), it can be a fork of this process.
        worker_context()
    run_dir = Path(cfg.run_dir)
    runlock.make_dir(run_dir, "--run_dir")
    with (distributed(cfg.backend, cfg.init_timeout_s, run_dir, cfg.tp) as ctx,
          # before this job writes anything into the run dir
          runlock.held_by_job(ctx, runlock.job_dirs(run_dir, cfg.checkpoint_path))):
        log = setup_logging(run_dir, ctx.rank, ctx.world_size, ctx.host)
        if read_launch_env().launched:  # a process of its own (fit in a user's process keeps its name and heap)
            name_worker(ctx.rank, ctx.world_size, run_dir)
            # What exists now (torch's and the libraries' objects) lives to the end: out of every collection, as
            # the one at the end that frees the Trainer (docs/performance.md, "Costs the code is shaped by").
            gc.freeze()
        log.debug("address %s on interface %s, device %s", ctx.addr, ctx.interface, ctx.device)
        if ctx.is_main and ctx.world_size > 1:
            log.info("ranks by host: %s", netinfo.describe_hosts(ctx.hosts, ctx.addrs))
        return _train(cfg, ctx, run_dir, parts, Watchdog.of_run(cfg.section("parallel"), ctx, run_dir), log)


def _train(cfg: TrainConfig, ctx: Any, run_dir: Path, parts: Parts | None, watchdog: Any,
           log: logging.Logger) -> dict[str, Any]:
    """`train_worker`'s Trainer, built and run under the rank's `watchdog`; what fails reported. All ranks."""
    from ddptrain.checkpoints.format import settle_settings
    from ddptrain.loop.sanity import plugin_names, usage_error_of
    from ddptrain.loop.trainer import Trainer

    trainer = None
    # From here to the teardown, a rank that stops or makes no progress is named: start-up, loading, training,
    # the final save and the teardown alike (the process groups are destroyed after it).
    with contextlib.ExitStack() as watched:
        try:
            watched.enter_context(watchdog)
            if not os.environ.get(LOCAL_LAUNCH_ENV):  # else the launcher checked and wrote it
                refusal = kept = None
                if ctx.is_main:
                    try:
                        kept = settle_settings(cfg)
                    except UsageError as exc:
                        refusal = str(exc)
                refusal, kept = ctx.broadcast_object((refusal, kept))  # every rank exits, or trains, alike
                if refusal is not None:
                    raise UsageError(refusal)
                for name, value in kept.items():
                    setattr(cfg, name, value)
            if ctx.is_main:
                log.info("run dir %s · world size %d · backend %s · device %s", run_dir, ctx.world_size,
                         ctx.backend, ctx.device)
            parts = parts or Parts()
            trainer = Trainer(cfg, ctx, run_dir, dataclasses.replace(parts, task=as_task(parts.task)), watchdog)
            return trainer.fit()
        except (UsageError, Preempted) as exc:
            traceback.clear_frames(exc.__traceback__)  # as below: the exception must not keep the Trainer alive
            raise
        except Exception as exc:
            model_name = plugin_names(cfg.section("data"), parts or Parts())["model"]
            usage = usage_error_of(exc, trainer.module if trainer is not None else None, model_name)
            if usage is not None:  # torch's words for a user's mistake (DDP's unused parameters): one line
                traceback.clear_frames(exc.__traceback__)
                raise usage from None
            step = trainer.position.step if trainer is not None else "startup"
            # The traceback goes once, into this rank's log; the console gets one line per rank (and, from a
            # launcher, one naming the rank that failed first).
            _to_rank_log(log, f"failed at step {step}:\n{traceback.format_exc()}")
            # A peer on this host that died without a word (SIGKILL, the OOM killer) gets its error file from here.
            vanished = watchdog.record_vanished_peers(exc)
            line = (f"rank {ctx.rank} on host {ctx.host} failed at step {step}: {type(exc).__name__}: {first_line(exc)}"
                    f"{netinfo.lost_peers_note(str(exc), ctx.hosts, ctx.addrs, ctx.addr)}"
                    + "".join(f"; lost rank {rank} on this host: its process ended without an error"
                              for rank in vanished))
            sys.stderr.write(f"ddptrain: {line} (traceback in {rank_log_path(run_dir, ctx.rank)})\n")
            record_for_launcher(exc)
            traceback.clear_frames(exc.__traceback__)  # its frames' locals (the Trainer) become garbage now
            raise WorkerFailed(line) from exc
        finally:
            watchdog.phase("teardown")
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
        return build_task(TrainConfig(task=task).section("data"))
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
    for key, value in overrides.items():
        if key not in FIELDS:
            hint = difflib.get_close_matches(key, FIELDS, n=1)
            raise UsageError(f"fit({key}=...): not a TrainConfig setting" + (f"; did you mean {hint[0]}?" if hint else ""))
        overrides[key] = coerce(key, value, f"fit({key}=...)")
    cfg = (config or TrainConfig()).replace(**overrides)
    # What was set: the arguments, and what set a config's settings (a resolved config's `given`; else those away
    # from their defaults).
    set_before = getattr(config, "given", None) if config is not None else set()
    if set_before is None:
        set_before = {name for name, f in FIELDS.items() if getattr(config, name) != f.default}
    given = set(overrides) | set_before
    if not cfg.run_dir:
        # `fit` resumes only a run dir you name (as HF Trainer's resume_from_checkpoint and Lightning's ckpt_path
        # are explicit), or its own run after a launcher's restart. Unnamed, each call starts fresh in
        # runs/<script>, moving that dir's older checkpoints aside to checkpoints/abandoned/.
        cfg.run_dir = str(Path("runs") / Path(sys.argv[0] or "default").stem)
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            cfg.auto_resume = False
    cfg.settle(given)
    cfg.validate()
    refuse_ignored(cfg, set(overrides))
    env = read_launch_env()
    check(cfg, hf_aside=bool(cfg.nproc) and not env.launched)  # (a launcher's: in launch_workers, aside)
    parts = Parts(model, None if train_data is None else (train_data, eval_data), task, collate_fn, optimizer,
                  scheduler, callbacks)
    weights = Path(cfg.run_dir) / "model.safetensors"
    if env.launched or not cfg.nproc:
        summary = train_worker(cfg, parts)  # an nn.Module passed in is the one that trained
        return {**summary, "weights": str(weights)} if env.rank == 0 else None
    outcome = launch_workers(cfg, _fit_worker, (cfg, parts))
    for line in outcome.lines if outcome.code == 0 else ():
        print(f"ddptrain: {line}", file=sys.stderr)
    if outcome.code == EXIT_USAGE:
        raise UsageError("; ".join(line.removeprefix("error: ") for line in outcome.lines))
    if outcome.code == EXIT_PREEMPTED and outcome.preempted:
        raise Preempted(outcome.preempted["step"], str(outcome.preempted.get("signal", "a signal")))
    if outcome.code:
        raise TrainingError(outcome.lines[0] if outcome.lines else f"the workers exited with code {outcome.code}")
    from torch import nn

    if isinstance(model, nn.Module):  # the workers trained copies of it: give it their final weights
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(weights)))
    return {**(outcome.returned or {}), "weights": str(weights)}


def launch_workers(cfg: TrainConfig, target: Any, args: tuple) -> Any:
    """`cfg.nproc` local workers, each running `target(*args)` (`launch.launch_local`): the one way both
    `ddptrain train --nproc` and `fit(nproc=...)` start them. This process outlives the workers' restarts, so it
    holds the job's run lock (the workers know it as theirs by the token), refuses changed settings and writes
    config.toml once; returns the launch's `Outcome`."""
    with caller_kept():  # `fit` runs in the user's process: its environment and signal handlers stay theirs
        start_worker_server(cfg.nproc)  # before this process holds anything: workers start from a clean state
        if uses_hf(cfg):  # (the caller's `check(cfg, hf_aside=True)` left it)
            run_aside(check_hf, cfg)
        from ddptrain.checkpoints.format import settle_settings  # torch, imported beside the server's import

        with runlock.acquire(runlock.job_dirs(Path(cfg.run_dir), cfg.checkpoint_path)) as lock:
            settle_settings(cfg)  # with the launch settings
            os.environ[runlock.TOKEN_ENV] = lock.token
            return launch_local(target, args, cfg.nproc, cfg.max_restarts, Path(cfg.run_dir))


def _fit_worker(cfg: TrainConfig, parts: Parts) -> dict[str, Any] | None:
    """A worker of `fit(nproc=N)`: its part of the job; the summary back to the launcher, an exit code (and the
    error file the launcher reads) as `ddptrain train`'s workers give them."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        cfg = cfg.replace(auto_resume=True)  # a restart resumes this run's own checkpoints
    try:
        return train_worker(cfg, parts)
    except (UsageError, Preempted, WorkerFailed) as exc:
        sys.exit(exit_code_for(exc))

