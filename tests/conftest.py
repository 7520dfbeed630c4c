"""Hygiene fixtures: a test must not leak launcher env vars, process groups or threads."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))  # this checkout's ddptrain, whatever pip installed
sys.path.insert(1, str(Path(__file__).parent))
sys.path.insert(2, str(Path(__file__).parent.parent))  # benchmarks/ is a top-level package of the repo
# The test folders (by subpackage, and e2e/): a file may import another's fixtures by module name, whichever folder
# pytest collects first (basenames are unique across the folders).
sys.path[3:3] = [str(folder) for folder in sorted(Path(__file__).parent.iterdir())
                 if folder.is_dir() and any(folder.glob("test_*.py"))]

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DDPTRAIN_FAULT")


@pytest.fixture(autouse=True)
def _hygiene():
    env_before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    leaked_env = [k for k in _LAUNCH_VARS if os.environ.get(k) != env_before[k]]
    assert not leaked_env, f"test leaked environment variables: {leaked_env}"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test leaked an initialised process group")
    leaked = [t.name for t in threading.enumerate()
              if t.ident not in threads_before and t.is_alive() and t.name.startswith("ddptrain")]
    assert not leaked, f"test leaked threads: {leaked}"


def pytest_addoption(parser):
    parser.addoption("--no-processes", action="store_true",
                     help="skip every test at the moment it would start a process (`make test-fast`)")


@pytest.fixture(autouse=True, scope="session")
def _no_processes(request):
    """Under --no-processes, starting a process (subprocess, multiprocessing, a fork) skips the test that asks:
    what is left runs in this one process, in seconds."""
    if not request.config.getoption("--no-processes"):
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        pytest.skip("starts a process (--no-processes)")

    saved = (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork)
    subprocess.Popen._execute_child = refuse
    multiprocessing.process.BaseProcess.start = refuse
    os.fork = refuse
    yield
    subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork = saved


def pytest_collection_modifyitems(config, items):
    """Skip the gpu tests without a device; run the files that hold a slow test first, so that under
    `pytest -n 3 --dist loadfile` (make test) they start at once rather than end the run alone."""
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file keeps its order
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
