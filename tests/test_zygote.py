"""The tests' warm start (tests/zygote.py): a launch forked from the zygote is what a fresh interpreter is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, TINY, cli_env, run_cli, weights
from zygote import zygote


def test_a_warm_launch_sees_its_own_argv_cwd_env_and_seeds(tmp_path):
    warm = zygote(cli_env(), REPO)
    env = cli_env({"PROBE": "one"})
    first = warm.run(["-m", "zygote_probe", "3", "x y"], env=env, cwd=tmp_path, timeout=60)
    second = warm.run(["-m", "zygote_probe", "0"], env=cli_env({"PROBE": "two"}), cwd=REPO, timeout=60)
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert (first.returncode, second.returncode) == (3, 0)
    assert a["argv"] == ["3", "x y"] and b["argv"] == ["0"]
    assert (a["cwd"], a["path"][0], a["probe"]) == (str(tmp_path), str(tmp_path), "one")
    assert (b["cwd"], b["probe"]) == (str(REPO), "two")
    assert a["main"] == "__main__"
    assert a["random"] != b["random"], "the forks share the zygote's random state"
    assert a["torch_preloaded"] and a["ppid"] == warm.proc.pid, "the launch was not a fork of the zygote"
    assert first.stderr == "to stderr\nline\n"  # text mode's universal newlines, as subprocess.run


PROBE_SCRIPT = str(Path(__file__).with_name("zygote_probe.py"))
PROBE_CODE = f"import runpy, sys; sys.argv[0] = 'probe'; runpy.run_path({PROBE_SCRIPT!r}, run_name='__main__')"


@pytest.mark.parametrize("command", [["-m", "zygote_probe"], [PROBE_SCRIPT], ["-c", PROBE_CODE]],
                         ids=["module", "script", "code"])
def test_a_warm_launch_has_the_argv_and_sys_path_of_a_fresh_one(command, tmp_path):
    """`python -m MODULE`, `python SCRIPT` and `python -c CODE`: each puts its own entry first on sys.path (the
    working directory, the script's directory, '') and its own argv[0]."""
    env = cli_env()
    args = [*command, "0", "x"]
    warm = zygote(env, REPO).run(args, env=env, cwd=tmp_path, timeout=60)
    cold = subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert warm.returncode == cold.returncode == 0, warm.stderr + cold.stderr
    seen, fresh = json.loads(warm.stdout), json.loads(cold.stdout)
    assert seen["path"] == fresh["path"] and seen["argv"] == fresh["argv"] == ["0", "x"]
    assert (seen["argv0"], seen["main"]) == (fresh["argv0"], fresh["main"])
    assert seen["torch_preloaded"] and not fresh["torch_preloaded"]


def test_a_shim_on_path_runs_shell_commands_as_forks(tmp_path):
    """The shim that tests running shell commands put first on PATH: exit codes and output pass through, and
    an environment the zygote refuses runs in a fresh interpreter."""
    warm = zygote(cli_env(), REPO)
    warm.shim(tmp_path, "zygote_probe")
    warm.shim(tmp_path)
    env = cli_env({"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    out = subprocess.run(["bash", "-c", "zygote_probe 4; echo exit $?"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    seen = json.loads(out.stdout.splitlines()[0])
    assert out.stdout.splitlines()[1] == "exit 4" and seen["ppid"] == warm.proc.pid and seen["cwd"] == str(tmp_path)
    assert "to stderr" in out.stderr
    refused = subprocess.run(["bash", "-c", "zygote_probe 0"], env={**env, "OMP_NUM_THREADS": "3"}, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 0 and json.loads(refused.stdout)["ppid"] != warm.proc.pid
    usage = subprocess.run(["bash", "-c", "ddptrain train --bogus"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert usage.returncode == 2 and "--bogus" in usage.stderr


def test_an_environment_read_at_import_starts_a_fresh_interpreter(monkeypatch):
    """A launch whose environment differs where an interpreter's start or torch's import reads it is not a
    fork (helpers.run_cli then starts a fresh one); a session whose own environment changed so gets a zygote
    started in the new one."""
    warm = zygote(cli_env(), REPO)
    assert warm.accepts(cli_env({"DDPTRAIN_FAULT": "x", "RANK": "0"}))
    odd_node = {"PYTHONPATH": str(REPO / "tests" / "odd_node")}  # its sitecustomize.py runs at a start
    for changed in ({"OMP_NUM_THREADS": "2"}, {"TORCH_LOGS": "+dynamo"}, odd_node):
        assert not warm.accepts(cli_env(changed)), changed
    value = os.environ.get("KMP_INIT_AT_FORK", "") + "x"  # (importing scikit-learn sets it to FALSE)
    monkeypatch.setenv("KMP_INIT_AT_FORK", value)
    again = zygote(cli_env(), REPO)
    assert again is not warm and not warm.alive() and again.env["KMP_INIT_AT_FORK"] == value
    assert zygote(cli_env(), REPO) is again


def test_a_warm_launch_forks_its_forkserver_from_itself():
    """multiprocessing's forkserver, started in a warm launch, is a fork of it, not a fresh interpreter."""
    warm = zygote(cli_env(), REPO)
    out = warm.run(["-m", "zygote_probe", "forkserver"], env=cli_env(), cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "import zygote" in out.stdout and "forkserver import main" not in out.stdout, out.stdout


@pytest.mark.parametrize("nproc", [0, 2])
def test_a_warm_run_trains_bitwise_as_a_fresh_one(tmp_path, nproc):
    args = ["train", *TINY, "--max_steps", "6"] + (["--nproc", str(nproc)] if nproc else [])
    warm = run_cli([*args, "--run_dir", str(tmp_path / "warm")])
    cold = run_cli([*args, "--run_dir", str(tmp_path / "cold")], fresh=True)
    assert warm.returncode == cold.returncode == 0, (warm.stderr, cold.stderr)
    w, c = weights(tmp_path / "warm" / "model.safetensors"), weights(tmp_path / "cold" / "model.safetensors")
    assert all((w[k] == c[k]).all() for k in w)
    bad = run_cli(["train", "--bogus"])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--bogus" in bad.stderr


def test_a_warm_launch_past_its_timeout_is_killed(tmp_path):
    warm = zygote(cli_env(), REPO)
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        warm.run(["-m", "zygote_probe", "sleep"], env=cli_env(), cwd=REPO, timeout=3)
    assert caught.value.output == "sleeping\n"
    assert json.loads(warm.run(["-m", "zygote_probe", "0"], env=cli_env(), cwd=REPO, timeout=60).stdout)


def test_a_background_launch_is_signalled_like_a_popen(tmp_path):
    """`start` (helpers.start_cli): the pid is the launched process itself, leader of its own session."""
    warm = zygote(cli_env(), REPO)
    ready = tmp_path / "sleeping"
    proc = warm.start(["-m", "zygote_probe", "sleep"], env=cli_env({"PROBE": str(ready)}), cwd=REPO)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    assert Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1].split()[3] == str(proc.pid)  # its session
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    out, err = proc.communicate(timeout=30)
    assert out == "sleeping\n" and err == ""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except FileNotFoundError:
        return True


def test_the_zygote_ends_with_the_session_even_a_killed_one():
    """The zygote serves until its stdin, a pipe from the session, closes: a session that dies without its
    exit handlers (os._exit here, SIGKILL in life) takes its zygote along."""
    probe = ("import os, sys; sys.path[:0] = [%r, %r]\n"
             "from helpers import cli_env, REPO\nfrom zygote import zygote\n"
             "print(zygote(cli_env(), REPO).proc.pid, flush=True)\nos._exit(0)\n") % (str(REPO / "src"),
                                                                                     str(REPO / "tests"))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout)
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the zygote outlived the session that started it"
