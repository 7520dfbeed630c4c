"""Training runs that several test modules inspect. Each costs seconds of CPU, so each runs once per session.

The runs share one global batch of 32 samples and differ only in how it is split:

    single    1 process  x batch 32 x accumulation 1   (`python -m ddptrain train`)
    pair      2 processes x batch 16 x accumulation 1  (`torchrun -m ddptrain train`)
    accum_1x4 1 process  x batch 8  x accumulation 4   (`--config single/config.toml` plus overrides)
    accum_2x2 2 processes x batch 8 x accumulation 2   (the real Trainer under torchrun, DDP hook counted)

250 training samples make 7 global batches per epoch; the last 26 samples of each epoch's order are
dropped (drop_last). The eval split has 61 samples, which 2 processes cannot share evenly.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, TINY, run_cli, run_python, train

NUM_TRAIN = 250
GLOBAL_BATCH = 32
STEPS_PER_EPOCH = NUM_TRAIN // GLOBAL_BATCH
EPOCHS = 2
EVAL_SIZE = 61  # TINY's --eval_size
SHARED = ["--dataset_size", str(NUM_TRAIN), "--epochs", str(EPOCHS), "--record_sample_ids"]

_done: dict[str, Path] = {}


def torchrun(args: list[str], nproc: int = 2, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node N ARGS` (what `torchrun` runs)."""
    return _check(run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args],
                             timeout=timeout))


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        command = " ".join(map(str, proc.args[:7]))
        raise AssertionError(f"{command} ... exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    return proc


def _once(name: str, factory: pytest.TempPathFactory, make) -> Path:
    if name not in _done:
        run_dir = factory.mktemp(name)
        make(run_dir)
        _done[name] = run_dir
    return _done[name]


def single(factory: pytest.TempPathFactory) -> Path:
    return _once("single", factory, lambda d: train(d, *SHARED, "--batch_size", "32"))


def pair(factory: pytest.TempPathFactory) -> Path:
    return _once("pair", factory, lambda d: torchrun(
        ["-m", "ddptrain", "train", *TINY, "--run_dir", str(d), *SHARED, "--batch_size", "16"]))


def accum_1x4(factory: pytest.TempPathFactory) -> Path:
    # Driven by the single run's resolved config.toml: the file must round-trip through --config.
    base = single(factory)
    return _once("accum_1x4", factory, lambda d: _check(run_cli(
        ["train", "--config", str(base / "config.toml"), "--run_dir", str(d), "--batch_size", "8",
         "--grad_accum_steps", "4"])))


def accum_2x2(factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The run dir and the worker's report: {"world_size", "micro_batches", "steps", "hook_calls"}."""
    def make(d: Path) -> None:
        torchrun([str(REPO / "tests" / "worker_accum_hooks.py"), str(d / "hooks.json"), *TINY,
                  "--run_dir", str(d), *SHARED, "--batch_size", "8", "--grad_accum_steps", "2"])

    run_dir = _once("accum_2x2", factory, make)
    return run_dir, json.loads((run_dir / "hooks.json").read_text())
