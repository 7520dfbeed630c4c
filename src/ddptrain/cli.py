"""Command line: `ddptrain train | doctor | report | export | plan`. Thin: parse, dispatch, map exit codes."""

from __future__ import annotations

import gc
import importlib
import sys

from ddptrain.api import launch_workers, train_worker
from ddptrain.config import resolve_config
from ddptrain.errors import EXIT_USAGE, Preempted, UsageError, WorkerFailed, say_error
from ddptrain.parallel.launch import start_worker_server, strip_flag
from ddptrain.parallel.procenv import exit_code_for, read_launch_env
from ddptrain.preflight import check

USAGE = """usage: ddptrain <command> [options]

commands:
  train    train a model on 1..N processes (`ddptrain train --help` lists every flag)
  doctor   check a node or cluster before training: versions, network, bandwidth, shared storage
  report   draw pictures and a report.md from a run dir
  export   write a checkpoint's weights as one .safetensors file
  prepare-text  turn text files into byte-level token files for --dataset tokens
  plan     predict step time and scaling efficiency at 8..1024 GPUs
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    handlers = {"train": cmd_train, "doctor": _lazy("ddptrain.tools.doctor", entry=run_command),
                "report": _lazy("ddptrain.tools.report"),
                "export": _lazy("ddptrain.tools.export"), "plan": _lazy("ddptrain.tools.plan"),
                "prepare-text": _lazy("ddptrain.data.text")}
    if command not in handlers:
        say_error(f"unknown command {command!r}; use one of {', '.join(handlers)}")
        return EXIT_USAGE
    try:
        code = handlers[command](rest)
    except (UsageError, Preempted, WorkerFailed) as exc:
        code = exit_code_for(exc)
    except KeyboardInterrupt:
        code = 130
    return code


def entry() -> int:
    """The `ddptrain` command (its console script and `python -m ddptrain`): `main`, then a quick exit.

    At exit the interpreter collects its garbage over every object still alive, and a process that imported
    torch holds over a million, and freezing them cuts that pass to a quarter (measured: docs/performance.md,
    "Costs the code is shaped by"). Only the youngest objects can still be a command's garbage; what a command
    opened it has closed, and the rest is torch's and Python's, which live until the end anyway.
    """
    code = main()
    gc.collect(1)
    gc.freeze()
    return code


def _lazy(module: str, **kwargs):
    def run(argv: list[str]) -> int:
        return importlib.import_module(module).main(argv, **kwargs)

    return run


def cmd_train(argv: list[str]) -> int:
    cfg = resolve_config(argv)
    env = read_launch_env()
    # The dataset's files against the flags, still before any process starts (a launcher's Hugging Face model
    # and data: in a process of their own, launch_workers's).
    check(cfg, hf_aside=bool(cfg.nproc) and not env.launched)
    if env.launched:
        # nproc / max_restarts configure the local launcher. A config file's values do not apply to a worker,
        # but asking a worker for them on the command line is a mistake worth naming.
        if cfg.nproc and any(a == "--nproc" or a.startswith("--nproc=") for a in argv):
            raise UsageError("--nproc starts local workers, but this process is already a worker of a launcher "
                             "(RANK is set); drop --nproc and use the launcher's --nproc-per-node")
        return run_worker(cfg)
    if cfg.nproc:
        start_worker_server(cfg.nproc)  # it imports torch and the trainer while this process imports torch
        worker_argv = strip_flag(strip_flag(argv, "--nproc"), "--max_restarts")
        outcome = launch_workers(cfg, run_command, ("train", worker_argv))
        for line in outcome.lines:
            sys.stderr.write(f"ddptrain: {line}\n")
        return outcome.code
    return run_worker(cfg)


def run_command(command: str, argv: list[str]) -> None:
    """A worker of `ddptrain <command> --nproc N`: `ddptrain <command> argv` under the launcher's agent, which
    reads its exit code."""
    sys.argv = ["ddptrain", command, *argv]
    code = main([command, *argv])
    if code:
        sys.exit(code)


def run_worker(cfg) -> int:
    """One training process (`ddptrain.api.train_worker`)."""
    train_worker(cfg)
    return 0
