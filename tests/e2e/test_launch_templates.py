"""scripts/launch.sh and scripts/slurm.sbatch: environment handling, and SLURM's USR1 -> checkpoint -> requeue.

SLURM itself is replaced by two small fakes on PATH: `scontrol` (hostnames of the allocation; requeue is
recorded) and `srun` (runs one task per node on this machine, each with its SLURM_NODEID). The signal is
delivered the way slurmstepd does for `--signal=USR1@90`: to every process of the job step, not to the
batch shell.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, TINY, cli_env, metrics

from ddptrain.parallel.procenv import free_port

LAUNCH = REPO / "scripts" / "launch.sh"
SBATCH = REPO / "scripts" / "slurm.sbatch"

FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_SLURM_DIR/log"
if [[ $1 == show && $2 == hostnames ]]; then tr ',' '\\n' <<< "$3"; fi
"""

# One task per node, in its own session like a real step; pids recorded for the signal delivery.
FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_SLURM_DIR/log"
nodes=1
while [[ $1 == --* ]]; do
    [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}
    shift
done
pids=()
for ((node = 0; node < nodes; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 setsid "$@" > "$FAKE_SLURM_DIR/task-$node.out" 2>&1 &
    pids+=($!)
    echo $! >> "$FAKE_SLURM_DIR/tasks"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def _fake_slurm(tmp_path: Path) -> Path:
    fake = tmp_path / "slurm"
    (fake / "bin").mkdir(parents=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        path = fake / "bin" / name
        path.write_text(text)
        path.chmod(0o755)
    return fake


def _slurm_env(fake: Path, **extra: str) -> dict[str, str]:
    env = cli_env({"PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "FAKE_SLURM_DIR": str(fake),
                   "PYTHON": sys.executable, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t",
                   "SLURM_SUBMIT_DIR": str(REPO)})
    env.update(extra)
    return env


def _launch_dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, timeout=30,
                          env=cli_env({"LAUNCH_DRY_RUN": "1", "PYTHON": "python3", **env}))


def _torchrun_args(stdout: str) -> list[str]:
    words = shlex.split(stdout)
    assert words[1:3] == ["-m", "torch.distributed.run"], stdout
    return words


def _value(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


# --- launch.sh -----------------------------------------------------------------------------------

def test_launch_static_two_nodes_passes_args_through():
    proc = _launch_dry_run({"NNODES": "2", "NPROC_PER_NODE": "4", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3",
                            "MASTER_PORT": "29600"}, "--lr", "0.5", "--run_dir", "runs/x")
    assert proc.returncode == 0, proc.stderr
    words = _torchrun_args(proc.stdout)
    assert (_value(words, "--nnodes"), _value(words, "--node-rank"), _value(words, "--master-addr"),
            _value(words, "--master-port"), _value(words, "--nproc-per-node")) == ("2", "1", "10.1.2.3", "29600", "4")
    assert "SIGUSR1" in _value(words, "--signals-to-handle").split(",")
    assert words[-7:] == ["-m", "ddptrain", "train", "--lr", "0.5", "--run_dir", "runs/x"]


def test_launch_one_node_is_standalone_and_runs_doctor():
    proc = _launch_dry_run({"NPROC_PER_NODE": "2"}, "doctor", "--run_dir", "r")
    words = _torchrun_args(proc.stdout)
    assert "--standalone" in words and "--master-addr" not in words
    assert words[-5:] == ["-m", "ddptrain", "doctor", "--run_dir", "r"]


def test_launch_c10d_elastic_and_store_host():
    env = {"NNODES": "1:2", "NPROC_PER_NODE": "2", "RDZV_ENDPOINT": "10.0.0.1:29400", "RDZV_ID": "job7",
           "MAX_RESTARTS": "3", "RDZV_CONF": "last_call_timeout=5"}
    host = _torchrun_args(_launch_dry_run({**env, "LOCAL_ADDR": "10.0.0.1"}).stdout)
    other = _torchrun_args(_launch_dry_run({**env, "LOCAL_ADDR": "10.0.0.2"}).stdout)
    assert (_value(host, "--nnodes"), _value(host, "--rdzv-backend"), _value(host, "--rdzv-endpoint"),
            _value(host, "--rdzv-id"), _value(host, "--max-restarts")) == ("1:2", "c10d", "10.0.0.1:29400", "job7", "3")
    assert _value(host, "--rdzv-conf") == "last_call_timeout=5,is_host=1"
    assert _value(other, "--rdzv-conf") == "last_call_timeout=5"
    assert _value(other, "--local-addr") == "10.0.0.2"


@pytest.mark.parametrize("env, names", [
    ({"NNODES": "2"}, "MASTER_ADDR"),
    ({"NNODES": "1:2", "MASTER_ADDR": "h"}, "RDZV_ENDPOINT"),
    ({"NNODES": "2", "MASTER_ADDR": "h", "NODE_RANK": "2"}, "NODE_RANK"),
    ({"NPROC_PER_NODE": "zero"}, "NPROC_PER_NODE"),
])
def test_launch_bad_environment_is_one_line(env, names):
    proc = _launch_dry_run(env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and names in proc.stderr, proc.stderr


def test_srun_tasks_without_torchrun_map_slurm_variables():
    from ddptrain.parallel.procenv import read_launch_env

    env = read_launch_env({"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
                           "SLURM_NTASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launched) == (3, 1, 4, 2, True)
    # Under torchrun inside an srun task, torchrun's RANK wins over SLURM's variables.
    env = read_launch_env({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "RANK": "5", "WORLD_SIZE": "8",
                           "LOCAL_RANK": "1", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size) == (5, 8)


# --- slurm.sbatch --------------------------------------------------------------------------------

def test_sbatch_environment_per_node(tmp_path):
    fake = _fake_slurm(tmp_path)
    env = _slurm_env(fake, SLURM_JOB_NODELIST="node-a,node-b", SLURM_JOB_NUM_NODES="2", NPROC_PER_NODE="8",
                     NODE_RANK="5", LAUNCH_DRY_RUN="1")  # a NODE_RANK left in the environment must not leak
    proc = subprocess.run(["bash", str(SBATCH), "--lr", "0.5"], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    tasks = [_torchrun_args((fake / f"task-{n}.out").read_text()) for n in (0, 1)]
    for node, words in enumerate(tasks):
        assert (_value(words, "--nnodes"), _value(words, "--node-rank"), _value(words, "--master-addr"),
                _value(words, "--master-port")) == ("2", str(node), "node-a", str(20000 + 4242 % 20000))
        assert words[-7:] == ["-m", "ddptrain", "train", "--run_dir", "runs/t-4242", "--lr", "0.5"]
    log = (fake / "log").read_text()
    assert "srun --nodes=2 --ntasks-per-node=1" in log and "requeue" not in log

    env.update(RDZV="c10d")
    assert subprocess.run(["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True).returncode == 0
    words = _torchrun_args((fake / "task-1.out").read_text())
    assert (_value(words, "--rdzv-endpoint"), _value(words, "--rdzv-id")) == (f"node-a:{20000 + 4242}", "4242")

    proc = subprocess.run(["bash", str(SBATCH), "--run_dir", "elsewhere"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "RUN_DIR" in proc.stderr


def wait_until(condition, proc: subprocess.Popen, log: Path, limit_s: float) -> None:
    """Poll `condition` (files another process writes) until it holds; fail if `proc` exits or time runs out."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} early:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"not reached in {limit_s} s:\n{log.read_text()}"
        time.sleep(0.2)


def last_train_step(run_dir: Path) -> int:
    """The newest train step in metrics.jsonl so far (0 before the first line)."""
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in metrics(run_dir, "train")), default=0) if path.exists() else 0


def _step_processes(task_pids: list[int]) -> list[int]:
    """Every process of the fake job step: the task processes and all their descendants."""
    found, todo = [], list(task_pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # exited meanwhile
                pass
    return found


def _signal_step(fake: Path, sig: int) -> None:
    """What slurmstepd does for --signal (without B:): signal every process of the job step."""
    tasks = fake / "tasks"
    for pid in _step_processes([int(p) for p in tasks.read_text().split()] if tasks.exists() else []):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_sbatch_usr1_checkpoints_and_requeues(tmp_path):
    fake = _fake_slurm(tmp_path)
    run_dir = tmp_path / "run"
    env = _slurm_env(fake, SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", NPROC_PER_NODE="2",
                     MASTER_PORT=str(free_port()), RUN_DIR=str(run_dir),
                     DDPTRAIN_TEST_SLOW_RANK="1", DDPTRAIN_TEST_SLOW_S="0.003")
    args = [*TINY, "--dataset", "multinode_plugins:slow_rank_synthetic", "--eval_size", "0", "--epochs", "100",
            "--max_steps", "400", "--save_every", "0"]
    out = open(tmp_path / "sbatch.out", "w+")
    job = subprocess.Popen(["bash", str(SBATCH), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                           cwd=tmp_path)
    try:
        wait_until(lambda: last_train_step(run_dir) >= 2, job, tmp_path / "sbatch.out", limit_s=150)
        _signal_step(fake, signal.SIGUSR1)
        assert job.wait(timeout=120) == 0, (tmp_path / "sbatch.out").read_text()
    finally:
        _signal_step(fake, signal.SIGKILL)  # only if the test failed: normally nothing is left
        job.kill()
        job.wait()
    output = (tmp_path / "sbatch.out").read_text()
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    assert marker["signal"] == "SIGUSR1"
    assert (run_dir / "checkpoints" / f"step-{marker['step']}" / "manifest.json").is_file()
    assert marker["step"] < 400, "the signal arrived after training ended"
    assert "scontrol requeue 4242" in (fake / "log").read_text()
    assert "preempted" in output, output
    assert last_train_step(run_dir) <= marker["step"], "training went on after the preemption checkpoint"
    task_output = (fake / "task-0.out").read_text()  # both workers agreed on the same step
    expected = f"WARNING preempted (SIGUSR1): checkpoint of step {marker['step']} committed"
    for rank in (0, 1):
        assert f"[rank {rank}/2 {socket.gethostname()}] {expected}" in task_output, task_output
