"""Command line: `ddptrain train | doctor | report | export | plan`. Thin: parse, dispatch, map exit codes."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from ddptrain.errors import EXIT_FAILURE, EXIT_PREEMPTED, EXIT_USAGE, Preempted, UsageError

USAGE = """usage: ddptrain <command> [options]

commands:
  train    train a model on 1..N processes (`ddptrain train --help` lists every flag)
  doctor   check a node or cluster before training: versions, network, bandwidth, shared storage
  report   draw pictures and a report.md from a run dir
  export   write a checkpoint's weights as one .safetensors file
  plan     predict step time and scaling efficiency at 8..1024 GPUs
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    handlers = {"train": cmd_train, "doctor": _lazy("ddptrain.doctor"), "report": _lazy("ddptrain.report"),
                "export": _lazy("ddptrain.export"), "plan": _lazy("ddptrain.plan")}
    if command not in handlers:
        print(f"ddptrain: error: unknown command {command!r}; use one of {', '.join(handlers)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return handlers[command](rest)
    except UsageError as exc:
        print(f"ddptrain: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Preempted:
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        return 130


def _lazy(module: str):
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(module).main(argv)

    return run


def cmd_train(argv: list[str]) -> int:
    from ddptrain.config import resolve_config
    from ddptrain.distributed import read_launch_env

    cfg = resolve_config(argv)
    env = read_launch_env()
    if cfg.nproc:
        if env.launched:
            raise UsageError("--nproc starts local workers, but this process is already a worker of a launcher "
                             "(RANK is set); drop --nproc and use the launcher's --nproc-per-node")
        from ddptrain.launch import launch_local, strip_flag

        # Workers get `--nproc 0` so that an nproc from the config file does not make them launch again.
        worker_argv = strip_flag(strip_flag(argv, "--nproc"), "--max_restarts") + ["--nproc", "0"]
        return launch_local("train", worker_argv, cfg.nproc, cfg.max_restarts, Path(cfg.run_dir))
    return run_worker(cfg)


def run_worker(cfg) -> int:
    """One training process: set up the process group, train, and turn failures into exit codes."""
    import ddptrain.config as config_mod
    from ddptrain.checkpoint import write_atomic
    from ddptrain.distributed import distributed
    from ddptrain.observe.log import setup_logging
    from ddptrain.observe.watchdog import record_for_launcher
    from ddptrain.trainer import Trainer

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with distributed(cfg.backend, cfg.init_timeout_s, run_dir) as ctx:
        log = setup_logging(run_dir, ctx.rank, ctx.world_size, ctx.host)
        step = "startup"
        trainer = None
        try:
            if ctx.is_main:
                write_atomic(run_dir / "config.toml", config_mod.to_toml(cfg).encode())
                log.info("run dir %s · world size %d · backend %s · device %s", run_dir, ctx.world_size,
                         ctx.backend, ctx.device)
            trainer = Trainer(cfg, ctx, run_dir)
            trainer.fit()
            return 0
        except (UsageError, Preempted):
            raise
        except Exception as exc:
            step = trainer.position.step if trainer is not None else step
            log.error("failed at step %s:\n%s", step, traceback.format_exc())
            sys.stderr.write(traceback.format_exc())
            sys.stderr.write(f"ddptrain: rank {ctx.rank} on host {ctx.host} failed at step {step}: "
                             f"{type(exc).__name__}: {exc}\n")
            record_for_launcher(exc)
            return EXIT_FAILURE
