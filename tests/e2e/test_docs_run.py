"""Every shell command in README.md and docs/*.md runs as written, in order, on a fresh clone after `make run`.

The rule for writers: a ```bash block holds commands a reader pastes, one per line (a trailing `\\` continues
it, ` #` starts a comment); what a command prints goes in a block without a language; a ```toml block
whose first line is `# NAME.toml ...` is a file the reader writes. The test takes these blocks of README.md,
then of docs/*.md by name, writes the files and runs each command with bash in a scratch copy of the files a
fresh clone has (configs/, examples/, scripts/, README.md, docs/), with this checkout's ddptrain and .venv
first on PATH (`ddptrain` forked from the test session's zygote, tests/zygote.py), changed only as follows:

- `make run` is its Makefile command (the .venv is installed already), and a command a reader has already
  run (the same text on an earlier line or page) is not run again: its result is there;
- LIMITS: every `ddptrain train` (console script, `python -m`, torchrun) gets `--max_steps N --log_interval 1
  --num_workers 0 --eval_size 64` appended (N = 2, or enough to reach the command's injected fault or
  profiler window; the eval size is the synthetic dataset's), and a process count above 2 is cut to 2 (the
  test machine has 2 cores);
- SHORTEN: a few strings replaced, each for a stated reason;
- SKIP: commands that cannot run here, each with its reason.

A command fails the test when it exits non-zero, prints a traceback, or trains nothing ("run already
complete": it would have shown the reader nothing). CHECKS then look for what a few commands promise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, cli_env
from zygote import zygote

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COPIED = ["configs", "examples", "scripts", "README.md", "docs"]  # what the commands read from a clone
BLOCK = re.compile(r"^```(bash|sh|shell|toml)\n(.*?)^```", re.M | re.S)
FILE = re.compile(r"# ([\w.-]+\.toml)\b")  # the first line of a toml block that is a file to write
TRAIN = re.compile(r"(?:^|\s)(?:ddptrain|-m ddptrain) train(?:\s|$)")
MAX_PROCS = 2
COMMAND_TIMEOUT_S = 240

MAKE_RUN = "ddptrain train --config configs/quickstart.toml"  # the Makefile's `run` target, after its install

SKIP = {  # regex on the command -> why it does not run here
    r"^make test\b|\bpytest\b": "runs the test suite, of which this test is a part",
    r"^python -m venv|^pip install": "installs: this test runs in the installed .venv, and pip needs the network",
    r"^make bench|benchmarks\.run": "a benchmark, minutes long (tests/e2e/test_bench.py runs every section at toy size)",
    r"benchmarks/gpu\.sh": "needs CUDA (tests/e2e/test_bench_gpu.py checks its harness on CPU)",
    r"^tensorboard ": "a server that runs until stopped (CHECKS look for the event files it would read)",
    r"cifar10\.toml": "reads the CIFAR-10 files, which are never downloaded (docs/data.md; "
                      "tests/data/test_image_datasets.py trains on files in that format)",
    r"--nnodes|NNODES=|^export NNODES|NODE_RANK=|RDZV_ENDPOINT|/shared/":
        "multi-node: one command per node (tests/e2e/test_multinode.py runs two hosts in network namespaces)",
    r"\bsbatch\b": "SLURM (tests/e2e/test_launch_templates.py runs slurm.sbatch with a fake srun)",
}

SHORTEN = {  # doc text -> what runs here, and why
    "seconds=30": ("seconds=1", "the stall example's 30 s; 1 s shows it as well"),
    "runs/quickstart/checkpoints/step-384": ("runs/quickstart/checkpoints/step-2",
                                             "the quickstart ends at step 384; under LIMITS at step 2"),
    "--model mini_resnet --nproc 4 --batch_size 64 --grad_accum_steps 2": (
        "--model mini_resnet --width 16 --image_size 16 --nproc 4 --batch_size 64 --grad_accum_steps 2",
        "concepts.md's linear-scaling example is sized for GPUs (17 s a step on a CPU core); the lr arithmetic "
        "it shows does not depend on the model's size"),
    "--config my_job.toml": ("--config my_job.toml --width 16 --image_size 16",
                             "my_job.toml's mini_resnet at its full size: 26 s for 2 steps here; the file's keys are "
                             "read the same at any size"),
}


def commands(page: Path) -> list[str | tuple[str, str]]:
    """A page's commands (continuations joined, comments and blank lines dropped) and, as (name, text), the
    files its toml blocks tell the reader to write, in page order."""
    found: list[str | tuple[str, str]] = []
    for language, block in BLOCK.findall(page.read_text()):
        if language == "toml":
            name = FILE.match(block)
            if name:
                found.append((name.group(1), block))
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                found.append(re.sub(r"\s+", " ", line))
    return found


def skip_reason(command: str) -> str | None:
    return next((why for pattern, why in SKIP.items() if re.search(pattern, command)), None)


def limited(command: str) -> str:
    """`command` as it runs here: SHORTEN, at most MAX_PROCS processes, and LIMITS for a training run."""
    for text, (short, _) in SHORTEN.items():
        command = command.replace(text, short)
    command = re.sub(r"(--nproc(?:-per-node)? |NPROC_PER_NODE=)(\d+)",
                     lambda m: m.group(1) + str(min(int(m.group(2)), MAX_PROCS)), command)
    if not TRAIN.search(command):
        return command
    steps = 2
    fault = re.search(r"--inject_fault \S*\bstep=(\d+)", command)
    if fault:
        steps = max(steps, int(fault.group(1)) + 1)
    if "--enable_profiling" in command:
        window = [int(m.group(1)) if (m := re.search(rf"--profile_{name} (\d+)", command)) else default
                  for name, default in (("wait", 5), ("warmup", 2), ("active", 3))]
        steps = max(steps, sum(window) + 1)
    return f"{command} --max_steps {steps} --log_interval 1 --num_workers 0 --eval_size 64"


def plan() -> list[tuple[str, str | tuple[str, str], str | None]]:
    """(page, command as written or a file to write, why it is not run or None), in reading order."""
    planned, seen = [], set()
    for page in PAGES:
        for command in commands(page):
            if isinstance(command, tuple):
                planned.append((page.name, command, None))
                continue
            written = command
            if command == "make run":
                command = MAKE_RUN
            why = skip_reason(command)
            if why is None and command in seen:
                why = "already run above: its result is there"
            seen.add(command)
            planned.append((page.name, written if written == command else f"{written} -> {command}", why))
    return planned


def checks(scratch: Path, outputs: dict[str, str]) -> list[str]:
    """What a few commands promise beyond exit 0; the failures."""
    problems = []
    stall = next((out for cmd, out in outputs.items() if "kind=stall,at=save" in cmd), "")
    took = re.search(r"checkpoint committed: \S+/step-(\d+) \(([\d.]+) s\)", stall)
    if not (took and float(took.group(2)) >= 1.0):
        problems.append("the stall example's checkpoint did not stall (is a checkpoint saved at its step?)")
    kill = next((out for cmd, out in outputs.items() if "kind=sigkill" in cmd), "")
    if "resuming from" not in kill:
        problems.append("the sigkill example did not restart and resume")
    for expected in ["model.safetensors", "model.json"]:  # `ddptrain export ... model.safetensors`
        if not (scratch / expected).is_file():
            problems.append(f"ddptrain export wrote no {expected}")
    if not list(scratch.glob("runs/*/traces/rank-0.pt.trace.json")):
        problems.append("the profiling example wrote no trace")
    if not list(scratch.glob("runs/*/tb/events.*")):
        problems.append("the TensorBoard example wrote no event files")
    return problems


def test_the_documented_commands_parse_into_a_plan():
    """Cheap: the extraction finds the commands, and every skip names its reason."""
    planned = plan()
    assert planned[0][1].startswith("make run") and planned[0][2] is None
    run = [cmd for _, cmd, why in planned if why is None and isinstance(cmd, str)]
    assert ("my_job.toml", True) in {(cmd[0], "nproc = 2" in cmd[1]) for _, cmd, _ in planned if isinstance(cmd, tuple)}
    assert any("ddptrain export" in cmd for cmd in run) and any("ddptrain plan" in cmd for cmd in run)
    assert all(why for _, _, why in planned if why is not None)
    assert limited("ddptrain train --inject_fault rank=0,step=4,kind=stall,at=save,seconds=30 --nproc 8") == \
        "ddptrain train --inject_fault rank=0,step=4,kind=stall,at=save,seconds=1 --nproc 2 --max_steps 5 " \
        "--log_interval 1 --num_workers 0 --eval_size 64"


@pytest.mark.slow
def test_every_documented_command_runs_in_order(tmp_path: Path):
    scratch = tmp_path / "clone"
    scratch.mkdir()
    for name in COPIED:
        source = REPO / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, scratch / name)
    # `ddptrain` runs as a fork of the session's zygote (tests/zygote.py), which imported torch once
    shims = tmp_path / "bin"
    shims.mkdir()
    zygote(cli_env(), REPO).shim(shims)
    env = cli_env({"PATH": os.pathsep.join([str(shims), str(Path(sys.executable).parent), os.environ.get("PATH", "")])})
    failures, outputs, timings = [], {}, []
    for page, step, why in plan():
        if isinstance(step, tuple):
            (scratch / step[0]).write_text(step[1])
            continue
        if why is not None:
            continue
        command = limited(step.split(" -> ")[-1])
        started = time.monotonic()
        try:
            proc = subprocess.run(["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or ""  # bytes, whatever `text`
                             for o in (exc.stdout, exc.stderr))
            code = f"nothing: timed out after {COMMAND_TIMEOUT_S} s"
        timings.append(f"{time.monotonic() - started:6.1f} s  {command}")
        outputs[command] = output
        if code != 0 or "Traceback (most recent call last)" in output or "run already complete" in output:
            failures.append(f"{page}: `{command}` exited {code}:\n{output[-3000:]}")
    print("\n".join(timings))
    failures += checks(scratch, outputs)
    assert not failures, "\n\n".join(failures)
