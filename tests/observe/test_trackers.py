"""Experiment trackers (docs/trackers.md) against a real MLflow tracking server on loopback (SQLite backend in a
temporary directory), read back through MLflow's own client, and W&B offline, read back from its run files in
the run dir with W&B's own reader (`wandb leet inspect --json`). MLflow's local SQLite store is also created cut
part-way and by two processes at once. The last test stops the MLflow server mid-run.

A job killed, restarted, preempted and rerun starts its workers three times. Where an MLflow test and a W&B test
check the same such job, one run of it with both trackers on serves both (each tracker has its own thread and
its own run), made once by a module fixture."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import (TINY, assert_restarted, cli_env, cli_in_process, metrics, one_line_error, run_cli, start_cli,
                     train, wait_for)

from ddptrain.parallel.procenv import free_port

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402
from sqlalchemy import event  # noqa: E402  (the full mlflow package's)
from sqlalchemy.engine import Engine  # noqa: E402

from ddptrain.config import ObserveSettings, TrainConfig  # noqa: E402
from ddptrain.observe import trackers  # noqa: E402
from ddptrain.observe.trackers import MlflowBackend, Trackers  # noqa: E402

# 16 steps of 2 micro-batches, checkpoints every 4; the slow dataset leaves time to signal the launcher mid-run,
# and the control vote every step acts on the signal at the next.
JOB = ["--model", "fault_plugins:dropout_mlp", "--dataset", "fault_plugins:slow_augmented_synthetic",
       "--batch_size", "8", "--grad_accum_steps", "2", "--epochs", "2", "--save_every_steps", "4", "--keep_last", "0",
       "--num_workers", "2", "--control_interval", "1"]
MLFLOW = [*JOB, "--tracker", "mlflow"]
STEPS = 16
WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` with a SQLite store, on a free loopback port, without its job runner (a pool of processes
    for MLflow's GenAI jobs, which a tracking server has no use for). The store is in memory where the system has
    /dev/shm: SQLite waits for the disk at each commit, and the server commits at every request."""
    log_path = tmp_path_factory.mktemp("mlflow") / "server.log"
    port = free_port()
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    uri = f"http://127.0.0.1:{port}"
    in_memory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (tempfile.TemporaryDirectory(prefix="ddptrain-mlflow-", dir=in_memory) as work,
          open(log_path, "w") as log):
        proc = subprocess.Popen([exe, "server", "--backend-store-uri", f"sqlite:///{work}/store.db",
                                 "--default-artifact-root", f"{work}/artifacts", "--host", "127.0.0.1",
                                 "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                                start_new_session=True)
        running = SimpleServer(uri, proc)
        try:
            deadline = time.monotonic() + 180
            while not running.healthy():
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.05)
            yield running
        finally:
            running.stop()


class SimpleServer:
    def __init__(self, uri: str, proc: subprocess.Popen):
        self.uri, self.proc = uri, proc

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGKILL the server and its workers (uvicorn runs in a child process of `mlflow server`)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted by the kernel and then get no answer."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def env(self, experiment: str) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.uri, "MLFLOW_EXPERIMENT_NAME": experiment}


def _start(run_dir: Path, env: dict[str, str], *extra: str, job: list[str] = MLFLOW) -> subprocess.Popen:
    return start_cli(["train", *TINY, *job, "--run_dir", str(run_dir), "--nproc", "2", *extra], env=env)


def proc_result(proc: subprocess.Popen, stderr: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def _runs(client: MlflowClient, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def _wait_until(done, proc: subprocess.Popen, what: str, every_s: float, limit_s: float = 180) -> None:
    """Poll `done()` every `every_s` until it holds, while `proc` (a run started in the background) runs."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert proc.poll() is None, f"run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} in {limit_s} s"
        time.sleep(every_s)


@dataclass(frozen=True)
class Rerun:
    """A job whose first launch lost a worker, was restarted and then preempted, and which was run again to its
    end; with what the trackers held in between, for the tests that read it."""

    run_dir: Path
    experiment: str
    mlflow_runs_when_preempted: tuple = ()  # the experiment's runs, read from the server after the preemption
    wandb_when_preempted: tuple[dict, ...] = ()  # the records of the preempted attempt's W&B folder, before the rerun


def wandb_run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"]


def _trained_to(run_dir: Path, step: int) -> bool:
    """Whether metrics.jsonl has a train line of `step` or later."""
    return (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in metrics(run_dir, "train"))


@pytest.fixture(scope="module")
def killed_preempted_rerun(server, tmp_path_factory) -> Rerun:
    """MLflow (and W&B offline) on JOB. Rank 1 SIGKILLed after step 7 once MLflow holds the line of step 6
    (callback_plugins.KillWhenTracked), so the launcher's restart from the step-4 checkpoint trains steps 5 and 6
    again; the job then preempted by SIGTERM after the step-8 checkpoint (exit 75), and the same command run
    again with --tracker_log_model."""
    run_dir = tmp_path_factory.mktemp("kill-preempt")
    experiment = f"kill-preempt-{uuid.uuid4().hex[:6]}"
    env = {**server.env(experiment), **WANDB_OFFLINE, "WANDB_PROJECT": "kill-preempt"}
    job = [*JOB, "--tracker", "mlflow,wandb" if HAVE_WANDB else "mlflow", "--callbacks",
           "callback_plugins:KillWhenTracked"]
    client = MlflowClient(server.uri)

    def tracked(step: int) -> bool:
        return max((m.step for run in _runs(client, experiment)
                    for m in client.get_metric_history(run.info.run_id, "train/loss")), default=0) >= step

    proc = _start(run_dir, env, "--max_restarts", "1", job=job)
    # metrics.jsonl first: the file is cheap to poll, the server is not (it serves the run meanwhile)
    _wait_until(lambda: _trained_to(run_dir, 6), proc, "step 6 in metrics.jsonl", every_s=0.01)
    _wait_until(lambda: tracked(6), proc, "step 6 in MLflow", every_s=0.05)
    (run_dir / "tracked").touch()
    wait_for(run_dir / "checkpoints" / "step-8" / "manifest.json", proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher: a scheduler's preemption
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err
    assert_restarted(proc_result(proc, err), run_dir, from_step=4)
    runs = _runs(client, experiment)
    train(run_dir, *job, "--tracker_log_model", nproc=2, env=env)
    return Rerun(run_dir, experiment, mlflow_runs_when_preempted=tuple(runs))


@pytest.mark.slow
def test_a_killed_preempted_and_rerun_job_is_one_mlflow_run_with_each_step_once(killed_preempted_rerun, server):
    """killed_preempted_rerun's job: MLflow holds ONE run, KILLED and tagged preempted after the preemption; after
    the rerun its params the resolved config, train/loss at every step 1..16 exactly once with metrics.jsonl's
    values, the eval metrics, the model and config as artifacts, and status FINISHED."""
    job, client = killed_preempted_rerun, MlflowClient(server.uri)
    (run,) = job.mlflow_runs_when_preempted
    assert run.info.status == "KILLED" and run.data.tags["ddptrain.status"] == "preempted"

    (run,) = _runs(client, job.experiment)
    run_id = json.loads((job.run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.tags["ddptrain.status"] == "finished" and run.data.tags["ddptrain.world_size"] == "2"
    assert run.data.params["lr"] == "0.1" and run.data.params["grad_accum_steps"] == "2"
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), "each log step exactly once"
    jsonl = {r["step"]: r["loss"] for r in metrics(job.run_dir, "train")}
    assert {m.step: m.value for m in history} == jsonl
    evals = client.get_metric_history(run_id, "eval/loss")
    assert sorted(m.step for m in evals) == [8, 16]  # the epochs' ends, each once
    assert {"eval/accuracy", "train/samples_per_sec", "train/grad_norm"} <= set(run.data.metrics)
    artifacts = {a.path: a.file_size for a in client.list_artifacts(run_id)}
    assert artifacts == {"model.safetensors": (job.run_dir / "model.safetensors").stat().st_size,
                         "config.toml": (job.run_dir / "config.toml").stat().st_size}


# 24 steps: the first attempt is killed at step 12 (--inject_fault), the restart resumes from the step-8
# checkpoint, the test preempts it once it has committed step 12 (12 steps before the end), the rerun finishes.
LONG_JOB = [*JOB, "--epochs", "3"]
LONG_STEPS = 24
# The early-kill job whose killed rank is this one runs W&B offline beside MLflow, for the W&B test.
WANDB_KILLED_RANK = 1
# MLflow's requests to the stopped server give up after one try of a second (ddptrain's default is 10 s with
# one retry): the attempts that meet it end sooner, and send it the same nothing.
UNANSWERED_FAST = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


def _kill_restart_preempt(run_dir: Path, env: dict[str, str], job: list[str], killed_rank: int) -> None:
    """The first attempt SIGKILLs rank `killed_rank` as step 12 starts; the launcher restarts the workers from
    step 8; the restarted attempt is preempted (SIGTERM to the launcher, exit 75) once step 12 has committed."""
    proc = _start(run_dir, env, "--max_restarts", "1", "--inject_fault", f"rank={killed_rank},step=12,kind=sigkill",
                  job=job)
    wait_for(run_dir / "checkpoints" / "step-12" / "manifest.json", proc, limit_s=300)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err
    assert_restarted(proc_result(proc, err), run_dir, from_step=8)


def _early_kill(run_dir: Path, server: SimpleServer, killed_rank: int) -> Rerun:
    """LONG_JOB with MLflow (and W&B offline where rank WANDB_KILLED_RANK is killed). The server is SIGSTOPped
    until the restarted attempt has committed step 12, so whatever the machine's speed the first attempt (rank
    `killed_rank` SIGKILLed at step 12) sends MLflow nothing. Once the job is preempted, the tail of the preempted
    attempt's W&B run file is zero-filled, as a node crash leaves it; then the job is rerun."""
    experiment = f"early-kill-{killed_rank}-{uuid.uuid4().hex[:6]}"
    env = server.env(experiment)
    tracker = "mlflow"
    if killed_rank == WANDB_KILLED_RANK and HAVE_WANDB:
        env, tracker = {**env, **WANDB_OFFLINE, "WANDB_PROJECT": "early-kill"}, "mlflow,wandb"
    job = [*LONG_JOB, "--tracker", tracker]
    server.pause()
    try:
        _kill_restart_preempt(run_dir, {**env, **UNANSWERED_FAST}, job, killed_rank)
    finally:
        server.resume()
    records = []
    if "wandb" in tracker:
        preempted = sorted((run_dir / "wandb").glob(f"offline-run-*-{wandb_run_id(run_dir)}"))[-1]
        records = wandb_inspect(preempted)
        run_file = preempted / f"run-{wandb_run_id(run_dir)}.wandb"
        size = run_file.stat().st_size
        with open(run_file, "r+b") as fh:
            fh.seek(size // 2)
            fh.write(bytes(size - size // 2))
    train(run_dir, *job, nproc=2, env=env)
    return Rerun(run_dir, experiment, wandb_when_preempted=tuple(records))


@pytest.fixture(scope="module")
def early_kill(server, tmp_path_factory):
    """killed rank -> _early_kill's job with that rank killed, run once for the tests that read it."""
    jobs: dict[int, Rerun] = {}

    def job(killed_rank: int) -> Rerun:
        if killed_rank not in jobs:
            jobs[killed_rank] = _early_kill(tmp_path_factory.mktemp(f"early-kill-{killed_rank}"), server, killed_rank)
        return jobs[killed_rank]

    return job


@pytest.mark.slow
@pytest.mark.parametrize("killed_rank", [1, 0])
def test_lines_a_killed_first_attempt_never_sent_reach_mlflow_after_the_restart_and_rerun(early_kill, server,
                                                                                         killed_rank):
    """Issue 35 item 4. _early_kill's job: steps 1..11 are in metrics.jsonl only, as when a first attempt dies
    seconds after it started (the tracker thread still opening, or its queue lost with rank 0). The restart, the
    preemption and the rerun must leave ONE run, FINISHED, with train/loss at every step 1..24 exactly once and
    metrics.jsonl's values."""
    job, client = early_kill(killed_rank), MlflowClient(server.uri)
    (run,) = _runs(client, job.experiment)
    assert run.info.status == "FINISHED" and run.data.tags["ddptrain.status"] == "finished"
    assert run.data.params["lr"] == "0.1"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, LONG_STEPS + 1)), "each log step exactly once"
    assert {m.step: m.value for m in history} == {r["step"]: r["loss"] for r in metrics(job.run_dir, "train")}
    evals = client.get_metric_history(run.info.run_id, "eval/loss")
    assert sorted(m.step for m in evals) == [8, 16, 24]


def wandb_inspect(folder: Path) -> list[dict]:
    """The records of one W&B run folder, read by W&B's own reader (`wandb leet inspect --json`)."""
    exe = shutil.which("wandb", path=str(Path(sys.executable).parent)) or "wandb"
    proc = subprocess.run([exe, "leet", "inspect", "--json", str(folder)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def wandb_ending(records: list[dict]) -> tuple[int | None, str | None]:
    """(exit code, summary ddptrain/status) of a W&B run folder's records."""
    exits = [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"]
    status = [r["summary"]["update"]["ddptrain/status"] for r in records
              if r["type"] == "summary" and "ddptrain/status" in r["summary"].get("update", {})]
    return (exits[-1] if exits else None), (status[-1] if status else None)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WANDB, reason="needs wandb")
def test_a_damaged_earlier_wandb_file_does_not_stop_logging_and_the_newest_offline_run_holds_every_step(early_kill):
    """Issue 35 item 5. W&B offline, the job of the MLflow test above with rank 1 killed (_early_kill: SIGKILLed
    at step 12, restarted, preempted; the tail of the preempted attempt's run file zero-filled; rerun). The
    rerun's folder, read back with W&B's own reader, holds train/loss at every step 1..24 exactly once with
    metrics.jsonl's values, the evals, the config, exit 0 and status finished: every attempt's folder is a whole
    mirror of metrics.jsonl up to its end, so `wandb sync` of the newest is the run. No attempt made more than
    one folder."""
    job = early_kill(WANDB_KILLED_RANK)
    assert wandb_ending(job.wandb_when_preempted) == (75, "preempted")
    run_id = wandb_run_id(job.run_dir)
    folders = sorted((job.run_dir / "wandb").glob("offline-run-*"))
    assert all(f.name.endswith(f"-{run_id}") for f in folders), folders
    assert len(folders) <= 3, f"three attempts, {len(folders)} folders"
    records = wandb_inspect(folders[-1])
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    losses = [(row["_step"], row["train/loss"]) for row in rows if "train/loss" in row]
    assert sorted(step for step, _ in losses) == list(range(1, LONG_STEPS + 1)), "each log step exactly once"
    assert dict(losses) == {r["step"]: r["loss"] for r in metrics(job.run_dir, "train")}
    assert sorted(row["_step"] for row in rows if "eval/loss" in row) == [8, 16, 24]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    config = run["config"]["update"]
    assert run["run_id"] == run_id and config["lr"] == 0.1 and config["ddptrain.world_size"] == "2"
    assert wandb_ending(records) == (0, "finished")


def test_a_missing_tracker_package_names_the_extra_and_an_unknown_tracker_is_refused(tmp_path, monkeypatch):
    line = one_line_error(cli_in_process(["train", *TINY, "--run_dir", str(tmp_path), "--tracker", "comet"]))
    assert "--tracker 'comet'" in line and "mlflow" in line
    for package in ("mlflow", "wandb"):
        with monkeypatch.context() as missing:
            missing.setitem(sys.modules, package, None)  # `import mlflow` fails, as where it is not installed
            line = one_line_error(cli_in_process(["train", *TINY, "--run_dir", str(tmp_path), "--tracker", package]))
        assert f"pip install 'ddptrain[{package}]'" in line, line


def test_mlflow_s_local_default_store_works_with_mlflow_and_is_refused_in_one_line_with_the_client_only(tmp_path,
                                                                                                       monkeypatch):
    """Issue 37 item 9. Without a tracking URI MLflow uses sqlite:///mlflow.db in the working directory: with the
    full mlflow package the run lands there; with mlflow-skinny (no SQLAlchemy: ddptrain[mlflow]) it is refused
    before training, naming both fixes, where it used to fail in the tracker's thread after training began."""
    assert "MLFLOW_TRACKING_URI" not in os.environ
    job = ["train", *TINY, "--run_dir", str(tmp_path / "run"), "--max_steps", "3", "--tracker", "mlflow"]
    with monkeypatch.context() as skinny:
        skinny.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny's: no SQLAlchemy
        line = one_line_error(cli_in_process(job, cwd=tmp_path))
    assert f"sqlite:///{tmp_path / 'mlflow.db'}" in line and "pip install mlflow" in line and "--mlflow_tracking_uri" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    proc = run_cli(job, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run,) = _runs(MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"), "ddptrain")
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3] and run.info.status == "FINISHED"


# Three lines of metrics.jsonl, as a 3-step run writes them.
LINES = [{"time": 1.7e9 + step, "epoch": 0, "step": step, "split": "train", "loss": 2.5 - step / 8}
         for step in (1, 2, 3)]


def _run_dir(path: Path, uri: str, experiment: str = "") -> tuple[Path, ObserveSettings]:
    """A run dir whose metrics.jsonl holds LINES, and the [observe] settings of --tracker mlflow to `uri`."""
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path, TrainConfig(tracker="mlflow", mlflow_tracking_uri=uri, mlflow_experiment=experiment).section("observe")


class Cut(BaseException):
    """The tracker's thread ends at a known SQL statement, as the end of the process ends it: nothing after the
    statement runs (a BaseException, which no handler of ddptrain's or MLflow's takes for a failure)."""


@contextlib.contextmanager
def after_each_sql(action):
    """`action(statement)` after each SQL statement that an engine of this process executes."""
    def listener(conn, cursor, statement, parameters, context, executemany):
        action(statement.lstrip())

    event.listen(Engine, "after_cursor_execute", listener)
    try:
        yield
    finally:
        event.remove(Engine, "after_cursor_execute", listener)


def _whole_run(client: MlflowClient, experiment: str) -> None:
    (run,) = _runs(client, experiment)
    assert run.info.status == "FINISHED" and run.data.tags["ddptrain.status"] == "finished"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == {line["step"]: line["loss"] for line in LINES}


def test_a_run_cut_while_it_creates_mlflow_s_sqlite_store_leaves_no_half_made_store(tmp_path, monkeypatch):
    """Issue 54 defect 5. MLflow creates a new SQLite store by some seventy migrations that commit one at a time;
    on a loaded machine the end of a 3-step run stopped waiting for the tracker's thread part-way, and every
    later open of the store it left failed: `table guardrails already exists`. Here the thread is cut right
    after MLflow committed `CREATE TABLE guardrails`; the next start of the run then creates the store and sends
    it the lines of metrics.jsonl, and MLflow's own client opens it and finds them."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir, observe = _run_dir(tmp_path / "run", uri)
    entry = {MlflowBackend.ID_KEY: uuid.uuid4().hex[:12], "start_byte": 0}
    (run_dir / "trackers.json").write_text(json.dumps({"mlflow": entry}))

    def cut_after_guardrails(statement: str) -> None:
        if statement.startswith("CREATE TABLE guardrails"):
            raise Cut

    with after_each_sql(cut_after_guardrails), pytest.raises(Cut):
        MlflowBackend(run_dir, observe, {"lr": 0.1}, {}, dict(entry)).open()
    monkeypatch.setattr(trackers, "CLOSE_WAIT_S", 600.0)  # a test of the store, not of the end's deadline
    Trackers(["mlflow"], run_dir, observe, {"lr": 0.1}, {}, resume=True).close("finished")

    _whole_run(MlflowClient(uri), "ddptrain")
    assert not list(tmp_path.glob(".mlflow.db.*")), "the cut creation's own file is removed with it"


# Each process starts a run with --tracker mlflow on a store that does not exist yet, and holds MLflow's creation
# of it right after `CREATE TABLE guardrails` until the other process has got there too (or has ended): the two
# are creating the store at the same moment, whatever the machine's speed.
TWO_CREATORS = """
import sys, time
from pathlib import Path
from sqlalchemy import event
from sqlalchemy.engine import Engine
from ddptrain.config import TrainConfig
from ddptrain.observe import trackers
from ddptrain.observe.trackers import Trackers

me, other, work, uri = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
trackers.CLOSE_WAIT_S = 600.0  # a test of the store, not of the end's deadline

def meet(conn, cursor, statement, *args):
    if statement.lstrip().startswith("CREATE TABLE guardrails"):
        (work / f"at-guardrails-{me}").touch()
        deadline = time.monotonic() + 120
        while not any((work / f"{what}-{other}").exists() for what in ("at-guardrails", "ended")):
            assert time.monotonic() < deadline, "the other process never came"
            time.sleep(0.01)

event.listen(Engine, "after_cursor_execute", meet)
try:
    observe = TrainConfig(tracker="mlflow", mlflow_tracking_uri=uri, mlflow_experiment=me).section("observe")
    run = Trackers(["mlflow"], work / me, observe, {"lr": 0.1}, {}, resume=False)
    for line in %r:
        run.log(line)
    run.close("finished")
finally:
    (work / f"ended-{me}").touch()
""" % (LINES,)


def test_two_runs_creating_one_new_mlflow_sqlite_store_at_once_both_land_in_it_whole(tmp_path):
    """Issue 54 defect 5. Two runs start on one SQLite store (as two runs in one working directory do on MLflow's
    default) before it exists, each creating it at the same moment (TWO_CREATORS): neither tracker fails, and
    MLflow's own client opens the store and finds both runs whole. MLflow's own creation in place leaves one of
    them failing and, as often as not, the store half-made for good."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name in ("first", "second"):
        _run_dir(tmp_path / name, uri)
    procs = [subprocess.Popen([sys.executable, "-c", TWO_CREATORS, me, other, str(tmp_path), uri], env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for me, other in (("first", "second"), ("second", "first"))]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "tracker mlflow" not in err, err
    client = MlflowClient(uri)
    for name in ("first", "second"):
        _whole_run(client, name)
    assert not list(tmp_path.glob(".mlflow.db.*"))


@pytest.mark.skipif(not HAVE_WANDB, reason="needs wandb")
def test_a_killed_preempted_and_rerun_job_is_one_offline_wandb_run_each_folder_a_whole_mirror(killed_preempted_rerun):
    """killed_preempted_rerun's job (the MLflow test's), read back with W&B's own reader: every attempt's folder in
    RUN_DIR/wandb/ (one per attempt at most, one run id) holds train/loss at steps 1..k exactly once with
    metrics.jsonl's values, k where the attempt ended, the preempted one past step 8 with exit 75 and status
    preempted; the rerun's folder every step 1..16, the evals, the config, exit 0 and finished."""
    run_dir = killed_preempted_rerun.run_dir
    run_id = wandb_run_id(run_dir)
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert 2 <= len(folders) <= 3 and all(f.name.endswith(f"-{run_id}") for f in folders), folders
    jsonl = {r["step"]: r["loss"] for r in metrics(run_dir, "train")}
    inspected = {folder: wandb_inspect(folder) for folder in folders}
    ends = []
    for folder, records in inspected.items():
        losses = [(row["_step"], row["train/loss"]) for r in records if r["type"] == "history"
                  for row in [r["history"]["item"]] if "train/loss" in row]
        ends.append(len(losses))
        assert sorted(step for step, _ in losses) == list(range(1, len(losses) + 1)), folder
        assert dict(losses) == {step: jsonl[step] for step, _ in losses}, folder
        assert (wandb_ending(records)[0] == 75) == (folder == folders[-2]), folder
    assert ends[-2] >= 8 and wandb_ending(inspected[folders[-2]]) == (75, "preempted")
    records = inspected[folders[-1]]
    assert ends[-1] == STEPS and wandb_ending(records) == (0, "finished")
    assert sorted(r["history"]["item"]["_step"] for r in records
                  if r["type"] == "history" and "eval/loss" in r["history"]["item"]) == [8, 16]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["config"]["update"]["grad_accum_steps"] == 2


def test_the_tracker_server_stopped_mid_run_costs_training_nothing(tmp_path, server):
    """The server is SIGKILLed after the step-4 checkpoint. Training finishes with exit 0, one warning names the
    tracker, metrics.jsonl has every step, and no step stalls on the network: the slowest step is within 10x
    the median (a send on the training thread would wait for MLflow's refused connections and their retry)."""
    experiment = f"server-down-{uuid.uuid4().hex[:6]}"
    proc = _start(tmp_path, server.env(experiment))
    wait_for(tmp_path / "checkpoints" / "step-4" / "manifest.json", proc)
    server.stop()  # this module's last test: the server is gone for good
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "tracker mlflow" in line]
    assert len(warnings) == 1, warnings
    train_lines = metrics(tmp_path, "train")
    assert [r["step"] for r in train_lines] == list(range(1, STEPS + 1))
    times = [r["step_time_s"] for r in train_lines[4:]]
    assert max(times) <= 10 * statistics.median(times), times
