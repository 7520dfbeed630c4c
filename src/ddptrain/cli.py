"""Command line: `ddptrain train | doctor | report | export | plan`. Thin: parse, dispatch, map exit codes."""

from __future__ import annotations

import gc
import os
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
        code = handlers[command](rest)
    except UsageError as exc:
        if os.environ.get("DDPTRAIN_LOCAL_LAUNCH") and os.environ.get("TORCHELASTIC_ERROR_FILE"):  # launch.py
            from ddptrain.observe.watchdog import record_for_launcher

            record_for_launcher(exc)  # a worker of `--nproc`: the launcher prints each distinct error once
        else:
            print(f"ddptrain: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except Preempted:
        code = EXIT_PREEMPTED
    except KeyboardInterrupt:
        code = 130
    # The trainer sits in reference cycles (hooks, LR lambdas) and holds process-group objects. Free them while
    # the interpreter is whole (the exception and its frames are gone by now): a ProcessGroupGloo freed during
    # interpreter finalization can abort the process after its work is done (cf. pytorch/pytorch#179291).
    gc.collect()
    return code


def _lazy(module: str):
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(module).main(argv)

    return run


def cmd_train(argv: list[str]) -> int:
    from ddptrain.config import resolve_config

    cfg = resolve_config(argv)
    from ddptrain.distributed import read_launch_env  # imports torch (~3 s): only after the flags are good

    env = read_launch_env()
    if env.launched:
        # nproc / max_restarts configure the local launcher. A config file's values do not apply to a worker,
        # but asking a worker for them on the command line is a mistake worth naming.
        if cfg.nproc and any(a == "--nproc" or a.startswith("--nproc=") for a in argv):
            raise UsageError("--nproc starts local workers, but this process is already a worker of a launcher "
                             "(RANK is set); drop --nproc and use the launcher's --nproc-per-node")
        return run_worker(cfg)
    if cfg.nproc:
        from ddptrain import config as config_mod
        from ddptrain.checkpoint import write_atomic
        from ddptrain.launch import LOCAL_LAUNCH_ENV, launch_local, strip_flag

        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.toml", config_mod.to_toml(cfg).encode())  # with the launch settings
        os.environ[LOCAL_LAUNCH_ENV] = "1"
        worker_argv = strip_flag(strip_flag(argv, "--nproc"), "--max_restarts")
        return launch_local("train", worker_argv, cfg.nproc, cfg.max_restarts, run_dir)
    return run_worker(cfg)


def run_worker(cfg) -> int:
    """One training process: set up the process group, train, and turn failures into exit codes."""
    import ddptrain.config as config_mod
    from ddptrain import netinfo
    from ddptrain.checkpoint import write_atomic
    from ddptrain.distributed import distributed
    from ddptrain.launch import LOCAL_LAUNCH_ENV
    from ddptrain.observe.log import setup_logging
    from ddptrain.observe.watchdog import record_for_launcher
    from ddptrain.trainer import Trainer

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with distributed(cfg.backend, cfg.init_timeout_s, run_dir) as ctx:
        log = setup_logging(run_dir, ctx.rank, ctx.world_size, ctx.host)
        log.debug("address %s on interface %s, device %s", ctx.addr, ctx.interface, ctx.device)
        if ctx.is_main and ctx.world_size > 1:
            log.info("ranks by host: %s", netinfo.describe_hosts(ctx.hosts, ctx.addrs))
        step = "startup"
        trainer = None
        try:
            if ctx.is_main and not os.environ.get(LOCAL_LAUNCH_ENV):  # else the launcher wrote it
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
                             f"{type(exc).__name__}: {exc}"
                             f"{netinfo.lost_peers_note(str(exc), ctx.hosts, ctx.addrs, ctx.addr)}\n")
            record_for_launcher(exc)
            ctx.failed = True
            return EXIT_FAILURE
        finally:
            if trainer is not None:
                trainer.close()  # loader workers stop now, not at a garbage collection after the group is gone
