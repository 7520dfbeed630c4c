"""One finished 2-process run with every observer on, shared by the observe, report and export tests.

Started once per test session (the first test that asks for it pays ~20 s), then reused read-only.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from helpers import train

# MiniResNet at width 4 on 8x8 images: a real conv net (FLOPs, BatchNorm buffers) that costs nothing.
OBSERVED_ARGS = ["--model", "mini_resnet", "--width", "4", "--epochs", "3", "--tensorboard", "--enable_profiling",
                 "--profile_wait", "2", "--profile_warmup", "1", "--profile_active", "3", "--peak_tflops", "1",
                 "--progress"]


@dataclass(frozen=True)
class ObservedRun:
    run_dir: Path
    proc: subprocess.CompletedProcess


_cache: dict[str, ObservedRun] = {}


def observed_run(tmp_path_factory) -> ObservedRun:
    if "run" not in _cache:
        run_dir = tmp_path_factory.mktemp("observed") / "run"
        _cache["run"] = ObservedRun(run_dir, train(run_dir, *OBSERVED_ARGS, nproc=2))
    return _cache["run"]
