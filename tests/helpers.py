"""Shared helpers for tests that run ddptrain as users do: real processes, gloo on CPU."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from zygote import zygote

from ddptrain.parallel.procenv import fresh_env

REPO = Path(__file__).resolve().parents[1]

# A tiny, fast, BatchNorm-free job: results are exactly comparable across world sizes. Batch, optimizer and lr
# are pinned (the tests count steps of 32 samples and expect learning at SGD's lr 0.1), not left to the defaults,
# which differ for language models (a fine-tuner's AdamW: config.transformer_defaults).
TINY = ["--model", "mlp", "--image_size", "8", "--width", "32", "--dataset_size", "256", "--eval_size", "61",
        "--num_workers", "0", "--log_interval", "1", "--no-progress", "--batch_size", "32", "--optimizer", "sgd",
        "--lr", "0.1"]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = fresh_env()
    # This checkout's sources first: a test exercises the tree it sits in, whichever one pip installed.
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])})
    env.update(extra or {})
    return env


# DDPTRAIN_TEST_COLD=1 starts every launch as a fresh interpreter (to compare with the zygote's warm starts).
WARM_STARTS = os.environ.get("DDPTRAIN_TEST_COLD", "") in ("", "0")


def _warm(env: dict[str, str]):
    """The session's zygote if a launch in `env` can fork from it, else None (a fresh interpreter)."""
    if not WARM_STARTS:
        return None
    warm = zygote(cli_env(), REPO)
    return warm if warm.accepts(env) else None


def run_python(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180,
               cwd: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python ARGS` (`-m MODULE ...`, `-c CODE ...` or `SCRIPT ...`) in a process of its own, in the tests'
    environment (cli_env + `env`); output captured as text.

    The process is forked from the session's zygote (tests/zygote.py), which imported torch once, unless
    `fresh` (a test of what a process imports or of its start) or an environment the fork cannot honour.
    """
    full_env = cli_env(env)
    warm = None if fresh else _warm(full_env)
    if warm is not None:
        return warm.run(args, env=full_env, cwd=cwd or REPO, timeout=timeout)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or REPO)


def run_cli(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180,
            cwd: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m ddptrain ARGS`, as `run_python` runs it."""
    return run_python(["-m", "ddptrain", *args], env=env, timeout=timeout, cwd=cwd, fresh=fresh)


def start_cli(args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None):
    """`python -m ddptrain ARGS` in the background, in a session of its own (a test signals it, or its whole
    group), output to pipes read by `communicate`: forked from the session's zygote as `run_python` is, else a
    subprocess.Popen."""
    full_env = cli_env(env)
    warm = _warm(full_env)
    argv = ["-m", "ddptrain", *args]
    if warm is not None:
        return warm.start(argv, env=full_env, cwd=cwd or REPO)
    return subprocess.Popen([sys.executable, *argv], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd or REPO, start_new_session=True)


def train(run_dir: Path, *extra: str, nproc: int = 0, env: dict[str, str] | None = None,
          timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
    args = ["train", *TINY, "--run_dir", str(run_dir), *extra]
    if nproc:
        args += ["--nproc", str(nproc)]
    proc = run_cli(args, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def metrics(run_dir: Path, split: str | None = None) -> list[dict]:
    """metrics.jsonl lines; after a resume the later line for a step wins (as `ddptrain report` reads it)."""
    from ddptrain.observe.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    return [r for r in rows if split is None or r["split"] == split]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs: max |diff| {(a[key] - b[key]).abs().max()}"


def assert_close_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], rel: float) -> None:
    """Equal up to floating-point reordering: every tensor within `rel` of its largest magnitude."""
    assert expected.keys() == actual.keys()
    for key, want in expected.items():
        scale = want.abs().max().item()
        torch.testing.assert_close(actual[key], want, rtol=rel, atol=rel * scale,
                                   msg=lambda m, key=key: f"{key}: {m}")


def initial_weights(*flags: str) -> dict[str, torch.Tensor]:
    """The weights a run of TINY + `flags` starts from: the trainer seeds the model's init with --seed."""
    from ddptrain.config import resolve_config
    from ddptrain.loop.plugins import model_of

    cfg = resolve_config([*TINY, *flags], validate=False)
    torch.manual_seed(cfg.seed)
    return model_of(cfg).state_dict()


def assert_trained(final: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], margin: float = 1e-2) -> None:
    """Equal results mean little if nothing moved (a learning rate of 0 makes every split equal): some weight
    must have moved by `margin`, far beyond the tolerances the equality tests use."""
    moved = max((final[k].double() - initial[k].double()).abs().max().item() for k in final)
    assert moved > margin, f"the weights moved by at most {moved:g} from their initialisation"


RESUMED = re.compile(r"resuming from .+ \(step (\d+)\)$", re.MULTILINE)


def assert_restarted(proc: subprocess.CompletedProcess, run_dir: Path, from_step: int) -> None:
    """A kill-and-restart test must not pass when nothing was killed: the launcher restarted the worker group
    once, and rank 0 then resumed from the checkpoint of `from_step` (and only once)."""
    restarts = proc.stderr.count("attempts left; will restart worker group")
    assert restarts == 1, f"the launcher restarted the workers {restarts} times, not once\n{proc.stderr}"
    resumed = [int(s) for s in RESUMED.findall((run_dir / "logs" / "rank-0.log").read_text())]
    assert resumed == [from_step], f"rank 0 resumed from steps {resumed}, not once from step {from_step}"


def last_committed(run_dir: Path) -> Path:
    from ddptrain.checkpoints.format import committed_steps

    return committed_steps(run_dir / "checkpoints")[0][1]


def _read(ckpt_dir: Path):
    from ddptrain.checkpoints.read import read_checkpoint

    return read_checkpoint(ckpt_dir, torch.device("cpu"))


def checkpoint_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights, whole, read as `ddptrain export` reads them."""
    from ddptrain.checkpoints.shards import consolidate

    return consolidate(_read(ckpt_dir))


def optimizer_state(ckpt_dir: Path) -> dict:
    """A checkpoint's optimizer state, whole: {"state": {parameter name: {key: tensor}}, "param_groups": [...]}."""
    from ddptrain.checkpoints.shards import consolidate

    loaded = _read(ckpt_dir)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in consolidate(loaded, "optim").items():
        parameter, key = name.removeprefix("state.").rsplit(".", 1)
        state.setdefault(parameter, {})[key] = value
    return {"state": state, "param_groups": loaded.trainer["param_groups"]}


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """Assert a usage error: exit 2, exactly one line on stderr, no traceback; return the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 120) -> None:
    """Wait until `path` exists while `proc` (a run started in the background) is still running."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path} appeared: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def pid_of_rank(run_dir: Path, rank: int, proc) -> int:
    """The worker of `rank`: the process holding logs/rank-R.log open."""
    target, deadline = str(run_dir / "logs" / f"rank-{rank}.log"), time.monotonic() + 120
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                    return int(pid)
            except OSError:  # gone meanwhile, or not ours to read
                continue
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no process opened {target}"
        time.sleep(0.01)


def processes_holding(directory: Path) -> list[int]:
    """Pids of the processes with a file under `directory` open (a run's workers hold their rank logs)."""
    prefix, found = str(directory) + os.sep, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix) for fd in os.listdir(f"/proc/{pid}/fd")):
                found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunsCode:
    """Unpickling this runs a shell command that creates `sentinel` — what a malicious checkpoint would do."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def plant_hostile(checkpoint: Path, name: str, sentinel: Path) -> None:
    """Replace checkpoint/name by a pickle that runs code and re-sign the manifest, so that only the safe
    loader stands between the file and the payload."""
    torch.save({"state": RunsCode(sentinel), "param_groups": []}, checkpoint / name)
    data = (checkpoint / name).read_bytes()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
