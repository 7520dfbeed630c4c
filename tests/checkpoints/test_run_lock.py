"""One job per run dir. A second job started on a run dir (or checkpoint dir) that a running job holds is
refused (exit 2, one line naming the holder and the fix) before it changes anything there, and the running job
finishes with its checkpoints intact; a SIGKILLed job leaves no lock that blocks the next run; a job's own
launcher never refuses its workers, across elastic restarts; and a committed checkpoint is never deleted to
make room for a save. Real processes, gloo on CPU.

A running job is held still by `lock_plugins:gated_synthetic` (it waits for a gate file before reading a
training sample), so a test's second job always meets it mid-run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, TINY, cli_env, one_line_error, run_cli, start_cli, train
from lock_plugins import GATE_ENV

# --nproc 2 x batch 32: 4 steps per epoch; a checkpoint at step 2 and at the end (step 4).
JOB = ["--epochs", "1", "--save_every_steps", "2"]
GATED = ["--dataset", "lock_plugins:gated_synthetic"]
HOST = socket.gethostname()


@dataclass
class Holder:
    proc: subprocess.Popen
    run_dir: Path
    gate: Path
    checkpoints: Path | None = None  # its --checkpoint_dir, if outside the run dir

    def state(self) -> list[dict[str, tuple[bytes, int]]]:
        """Every file and directory the job owns: its bytes and modification time."""
        return [snapshot(d) for d in (self.run_dir, self.checkpoints) if d is not None]


def start(run_dir: Path, gate: Path, trigger: Path | None, *extra: str, restart: int = 0,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """A gated `ddptrain train` in the background, in its own process group."""
    gate.touch()
    gate_spec = f"{gate},{trigger or ''},{restart}"
    return start_cli(["train", *TINY, "--run_dir", str(run_dir), *JOB, *GATED, *extra],
                     env={GATE_ENV: gate_spec, **(env or {})})


def wait_at_gate(holder: Holder, processes: int, limit_s: float = 240) -> None:
    """Until `processes` of the job wait at the gate and its run dir has stopped changing."""
    deadline = time.monotonic() + limit_s
    while len(list(holder.gate.parent.glob(f"{holder.gate.name}.waiting-*"))) < processes:
        assert holder.proc.poll() is None, f"the job ended before it reached the gate: {holder.proc.communicate()}"
        assert time.monotonic() < deadline, "the job did not reach the gate"
        time.sleep(0.05)
    before = holder.state()
    while (after := _settled(holder)) != before:
        assert time.monotonic() < deadline, "the waiting job's run dir keeps changing"
        before = after


def _settled(holder: Holder) -> list:
    time.sleep(1.0)
    return holder.state()


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def finish(holder: Holder, limit_s: float = 240) -> subprocess.CompletedProcess:
    holder.gate.unlink(missing_ok=True)
    out, err = holder.proc.communicate(timeout=limit_s)
    return subprocess.CompletedProcess(holder.proc.args, holder.proc.returncode, out, err)


def stop(holder: Holder) -> None:
    """Release the gate and SIGKILL what still runs of the job: its launcher and the launcher's workers, which
    torch's agent starts each in a session of its own (a process-group kill would miss them)."""
    holder.gate.unlink(missing_ok=True)
    if holder.proc.poll() is None:
        for pid in [holder.proc.pid, *descendants(holder.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        holder.proc.communicate(timeout=240)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):  # the process has just exited
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def assert_names_holder(line: str, run_dir: Path, pid: int, flag: str = "--run_dir") -> None:
    assert str(run_dir) in line, line
    assert f"pid {pid} on host {HOST}" in line and "running since" in line, line
    assert line.endswith(f"wait for it, stop it, or use another {flag}"), line


@pytest.fixture(scope="module")
def holder(tmp_path_factory) -> Holder:
    """A 2-process job (`--nproc 2`) with its checkpoints outside its run dir, its step-2 checkpoint committed,
    waiting at the gate before step 3."""
    base = tmp_path_factory.mktemp("holder")
    run_dir, gate, checkpoints = base / "run", base / "gate", base / "checkpoints"
    proc = start(run_dir, gate, checkpoints / "step-2" / "manifest.json", "--nproc", "2", "--checkpoint_dir",
                 str(checkpoints))
    job = Holder(proc, run_dir, gate, checkpoints)
    try:
        wait_at_gate(job, processes=2)
        yield job
    finally:
        stop(job)


def test_a_second_job_with_nproc_is_refused_by_its_launcher_and_changes_nothing(holder):
    before = holder.state()
    proc = train(holder.run_dir, "--epochs", "2", nproc=2, check=False)
    line = one_line_error(proc)  # exit 2, one line, no traceback: the launcher said it, once
    assert_names_holder(line, holder.run_dir, holder.proc.pid)
    assert line.startswith(f"ddptrain: error: run dir {holder.run_dir} is in use by another job"), line
    assert holder.state() == before


def test_a_second_job_under_torchrun_is_refused_on_every_rank(holder):
    before = holder.state()
    # The agent looks at its workers every 10 s instead of 0.1 s, so that each rank has time to say and do by
    # itself what it does when refused before the agent stops the survivor.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "10", "-m", "ddptrain", "train", *TINY, "--run_dir",
                           str(holder.run_dir), "--epochs", "2"],
                          capture_output=True, text=True, timeout=240, env=cli_env(), cwd=REPO)
    # torchrun itself exits 1 whatever its workers' codes. Every rank printed the same one line; each exited 2,
    # unless the agent stopped it first (SIGTERM, -15) once its peer had exited.
    assert proc.returncode != 0, proc.stderr
    codes = [int(code) for code in re.findall(r"exitcode\s+:\s*(-?\d+)", proc.stderr)]
    assert sorted(codes) in ([2, 2], [-15, 2]), proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddptrain: ")]
    assert len(errors) == 2 and len(set(errors)) == 1, proc.stderr
    assert_names_holder(errors[0], holder.run_dir, holder.proc.pid)
    assert proc.stderr.count("Traceback") <= 1, proc.stderr  # torchrun's own; none from a worker
    assert holder.state() == before


def test_fit_is_refused_in_process_and_with_nproc(holder):
    import ddptrain
    from ddptrain.config import resolve_config
    from ddptrain.errors import UsageError

    before = holder.state()
    cfg = resolve_config([*TINY, "--run_dir", str(holder.run_dir), "--epochs", "2"])
    for nproc in (0, 2):
        with pytest.raises(UsageError) as refused:
            ddptrain.fit(config=cfg, nproc=nproc)
        assert_names_holder(str(refused.value), holder.run_dir, holder.proc.pid)
    assert holder.state() == before


def test_a_job_sharing_the_checkpoint_dir_is_refused_before_writing_its_own_run_dir(holder, tmp_path):
    before = holder.state()
    proc = train(tmp_path / "run", "--checkpoint_dir", str(holder.checkpoints), check=False)  # rank 0 of 1 refuses
    line = one_line_error(proc)
    assert_names_holder(line, holder.checkpoints, holder.proc.pid, flag="--checkpoint_dir")
    assert line.startswith(f"ddptrain: error: checkpoint dir {holder.checkpoints} is in use"), line
    assert holder.state() == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]  # no config, log or metrics


def test_a_plain_second_job_is_refused_and_the_holder_then_finishes_with_all_its_checkpoints(holder):
    before = holder.state()
    line = one_line_error(train(holder.run_dir, "--epochs", "2", check=False))  # one process: its rank 0 refuses
    assert_names_holder(line, holder.run_dir, holder.proc.pid)
    assert holder.state() == before
    done = finish(holder)
    assert done.returncode == 0, done.stderr
    for step in (2, 4):
        assert (holder.checkpoints / f"step-{step}" / "manifest.json").is_file()
    assert not (holder.checkpoints / "abandoned").exists()
    assert (holder.run_dir / "model.safetensors").is_file()


def test_a_sigkilled_job_leaves_no_lock_that_blocks_the_next_run(tmp_path):
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    job = Holder(start(run_dir, gate, run_dir / "checkpoints" / "step-2" / "manifest.json"), run_dir, gate)
    try:
        wait_at_gate(job, processes=1)
        os.kill(job.proc.pid, signal.SIGKILL)  # no chance to unlock anything: the kernel must
        job.proc.communicate(timeout=240)
    finally:
        stop(job)
    assert json.loads((run_dir / ".lock").read_text())["pid"] == job.proc.pid  # its name stays in the file
    # The same job again (the gate is gone): another dataset would be another training, refused on resume.
    proc = train(run_dir, *JOB, *GATED, env={GATE_ENV: f"{gate},,0"}, timeout=240)
    assert f"resuming from {run_dir / 'checkpoints' / 'step-2'}" in (run_dir / "logs" / "rank-0.log").read_text()
    assert proc.returncode == 0 and (run_dir / "model.safetensors").is_file()
    assert json.loads((run_dir / ".lock").read_text())["pid"] != job.proc.pid


def test_workers_restarted_by_the_elastic_agent_are_not_refused_by_their_own_launcher(tmp_path):
    # Rank 1 dies in step 3. The restarted workers (incarnation 1) are held at the gate once past the lock: rank
    # 0 reads a sample at start-up (its FLOPs estimate), rank 1 waits for it in a collective. Another job tried
    # then is refused: the launcher holds the lock across the restart, and lets only its own workers through.
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    job = Holder(start(run_dir, gate, None, "--nproc", "2", "--max_restarts", "1", restart=1,
                       env={"DDPTRAIN_FAULT": "rank=1,step=3,kind=sigkill"}), run_dir, gate)
    try:
        wait_at_gate(job, processes=1)
        other = train(run_dir, nproc=2, check=False)
        assert_names_holder(one_line_error(other), run_dir, job.proc.pid)
        done = finish(job)
    finally:
        stop(job)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in (run_dir / "logs" / "rank-0.log").read_text()
    assert (run_dir / "checkpoints" / "step-4" / "manifest.json").is_file()


def test_prepare_step_dir_never_deletes_a_committed_checkpoint_but_clears_a_partial_one(tmp_path):
    from ddptrain.checkpoints.format import CheckpointError, prepare_step_dir

    committed = tmp_path / "step-3"
    committed.mkdir()
    (committed / "model.safetensors").write_bytes(b"weights")
    (committed / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match=re.escape(str(committed))):
        prepare_step_dir(tmp_path, 3)
    assert sorted(p.name for p in committed.iterdir()) == ["manifest.json", "model.safetensors"]
    partial = tmp_path / "step-4"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half a file")  # a crash before the manifest
    assert prepare_step_dir(tmp_path, 4) == partial
    assert list(partial.iterdir()) == []


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_dir_that_cannot_be_created_is_one_line_naming_it_on_one_process_and_with_nproc(tmp_path, nproc):
    """Issue 35 item 8: a lone worker made the run dir before any check (a traceback, exit 1), the launcher
    gave one line. A parent that is a file stands for a read-only mount (root writes through chmod)."""
    (tmp_path / "file").write_text("not a directory")
    run_dir = tmp_path / "file" / "run"
    proc = run_cli(["train", *TINY, "--run_dir", str(run_dir), "--nproc", str(nproc)])
    assert one_line_error(proc) == (
        f"ddptrain: error: cannot create {run_dir} (Not a directory); choose a writable --run_dir")
