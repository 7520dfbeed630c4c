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


class _WouldTrain(AssertionError):
    """cli_in_process reached a training, here or in worker processes."""


# What a fresh interpreter's warnings filters are (no -W, no -X dev): pytest's own would hide what it prints.
_DEFAULT_WARNING_FILTERS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                            ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                            ("ignore", ResourceWarning, "")]


def cli_in_process(args: list[str], *, env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`ddptrain ARGS` through the CLI's own `main`, in this process: for a command that ends before any training
    process would start (a usage error, `plan`, `report`, `export`, `prepare-text`), without a process. Returns what
    `run_cli` returns (exit code, stdout, stderr), so `one_line_error` reads it the same way.

    The call sees what run_cli's child would: the environment cli_env(env) (launcher and job variables gone),
    `cwd` (default the repo) first on sys.path as `python -m` puts it and env's PYTHONPATH after it, sys.argv,
    Python's default warning filters and no logging handler (a warning or log record lands on the captured
    stderr, as an interpreter prints it), and an uncaught exception is its traceback on stderr and exit 1, a
    SystemExit its code. All of it is restored after, with signal handlers, torch's and `random`'s RNG, and the
    modules imported from the paths it added (a test's plug-ins). Reaching the training (`train` with a valid
    config) raises AssertionError: that test needs run_cli. Not honoured here: variables read at an import or
    an interpreter's start that happened before (HF_HUB_OFFLINE, torch's logging, thread counts): use run_cli.
    """
    import contextlib
    import importlib
    import io
    import logging
    import random
    import signal
    import traceback
    import warnings

    from ddptrain import cli

    def refuse(*_args, **_kwargs):
        raise _WouldTrain(f"`ddptrain {' '.join(args)}` went on to train: test it with run_cli")

    saved_environ, saved_argv, saved_path, saved_cwd = dict(os.environ), sys.argv, list(sys.path), os.getcwd()
    saved_modules = set(sys.modules)
    saved_signals = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
    root, ours = logging.getLogger(), logging.getLogger("ddptrain")
    saved_logging = (root.handlers[:], ours.handlers[:], ours.propagate, ours.level)
    saved_rng = (torch.get_rng_state(), random.getstate())
    saved_starts = {name: getattr(cli, name) for name in ("run_worker", "launch_workers", "start_worker_server")}
    work_dir = Path(cwd or REPO)
    child_env = cli_env(env)
    # The paths `python -m` and PYTHONPATH would add that this process lacks (never the checkout's own).
    added = [str(work_dir), *(env or {}).get("PYTHONPATH", "").split(os.pathsep)]
    added = [path for path in dict.fromkeys(added)
             if path and path not in sys.path and not Path(path).resolve().is_relative_to(REPO)]
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(child_env)
        os.chdir(work_dir)
        sys.argv = [str(Path(cli.__file__).with_name("__main__.py")), *args]
        sys.path[:0] = added
        importlib.invalidate_caches()
        root.handlers[:], ours.handlers[:] = [], []
        ours.propagate = True
        ours.setLevel(logging.NOTSET)
        for name in saved_starts:
            setattr(cli, name, refuse)
        with (warnings.catch_warnings(record=True) as shown, contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            warnings.resetwarnings()
            for action, category, module in reversed(_DEFAULT_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            try:
                code = cli.main(list(args))
            except _WouldTrain:
                raise
            except SystemExit as exc:  # as the interpreter ends on it
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if not isinstance(exc.code, int | None):
                    print(exc.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                code = 1
        for warning in shown:
            err.write(warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno,
                                             warning.line))
    finally:
        for name, function in saved_starts.items():
            setattr(cli, name, function)
        root.handlers[:], ours.handlers[:] = saved_logging[:2]
        ours.propagate = saved_logging[2]
        ours.setLevel(saved_logging[3])
        torch.set_rng_state(saved_rng[0])
        random.setstate(saved_rng[1])
        for sig, handler in saved_signals.items():
            if handler is not None and signal.getsignal(sig) != handler:
                signal.signal(sig, handler)
        for name in set(sys.modules) - saved_modules:
            where = getattr(sys.modules[name], "__file__", None) or ""
            if any(where.startswith(path + os.sep) for path in added):
                del sys.modules[name]
        sys.path[:] = saved_path
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        if dict(os.environ) != saved_environ:
            os.environ.clear()
            os.environ.update(saved_environ)
    return subprocess.CompletedProcess(["ddptrain", *args], code, out.getvalue(), err.getvalue())


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
