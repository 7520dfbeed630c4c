"""Experiment trackers (docs/trackers.md) against a real MLflow tracking server on loopback (SQLite backend in a
temporary directory), read back through MLflow's own client, and W&B offline, read back from its run files in
the run dir. The last test stops the MLflow server mid-run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from helpers import TINY, assert_restarted, cli_env, metrics, one_line_error, run_cli, start_cli, train, wait_for

from ddptrain.parallel.procenv import free_port

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

# 16 steps of 2 micro-batches, checkpoints every 4; the slow dataset leaves time to signal the launcher mid-run,
# and the control vote every step acts on the signal at the next.
JOB = ["--model", "fault_plugins:dropout_mlp", "--dataset", "fault_plugins:slow_augmented_synthetic",
       "--batch_size", "8", "--grad_accum_steps", "2", "--epochs", "2", "--save_every_steps", "4", "--keep_last", "0",
       "--num_workers", "2", "--control_interval", "1"]
MLFLOW = [*JOB, "--tracker", "mlflow"]
STEPS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` with a SQLite store, on a free loopback port; its URI."""
    work = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    log = open(work / "server.log", "w")
    proc = subprocess.Popen([exe, "server", "--backend-store-uri", f"sqlite:///{work / 'store.db'}",
                             "--default-artifact-root", str(work / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None, (work / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "mlflow server did not start"
        time.sleep(0.5)
    yield SimpleServer(uri, proc)
    SimpleServer(uri, proc).stop()
    log.close()


class SimpleServer:
    def __init__(self, uri: str, proc: subprocess.Popen):
        self.uri, self.proc = uri, proc

    def stop(self) -> None:
        """SIGKILL the server and its workers (uvicorn runs in a child process of `mlflow server`)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def env(self, experiment: str) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.uri, "MLFLOW_EXPERIMENT_NAME": experiment}


def _start(run_dir: Path, env: dict[str, str], *extra: str, job: list[str] = MLFLOW) -> subprocess.Popen:
    return start_cli(["train", *TINY, *job, "--run_dir", str(run_dir), "--nproc", "2", *extra], env=env)


def proc_result(proc: subprocess.Popen, stderr: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def _runs(client: MlflowClient, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


@pytest.mark.slow
def test_a_killed_preempted_and_rerun_job_is_one_mlflow_run_with_each_step_once(tmp_path, server):
    """Rank 1 SIGKILLed after step 7 once MLflow holds the line of step 6 (callback_plugins.KillWhenTracked),
    so the launcher's restart from the step-4 checkpoint trains steps 5 and 6 again; the job then preempted by
    SIGTERM after the step-8 checkpoint (exit 75), and the same command run again: MLflow holds ONE run, its
    params the resolved config, train/loss at every step 1..16 exactly once with metrics.jsonl's values, the
    eval metrics, and status FINISHED."""
    experiment = f"kill-preempt-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(server.uri)
    proc = _start(tmp_path, server.env(experiment), "--max_restarts", "1", "--callbacks",
                  "callback_plugins:KillWhenTracked")
    deadline = time.monotonic() + 180
    while max((m.step for run in _runs(client, experiment)
               for m in client.get_metric_history(run.info.run_id, "train/loss")), default=0) < 6:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    (tmp_path / "tracked").touch()
    wait_for(tmp_path / "checkpoints" / "step-8" / "manifest.json", proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher: a scheduler's preemption
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err
    assert_restarted(proc_result(proc, err), tmp_path, from_step=4)
    (run,) = _runs(client, experiment)
    assert client.get_run(run.info.run_id).info.status == "KILLED"
    assert run.data.tags["ddptrain.status"] == "preempted"
    train(tmp_path, *MLFLOW, "--callbacks", "callback_plugins:KillWhenTracked", "--tracker_log_model", nproc=2,
          env=server.env(experiment))

    (run,) = _runs(client, experiment)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.tags["ddptrain.status"] == "finished" and run.data.tags["ddptrain.world_size"] == "2"
    assert run.data.params["lr"] == "0.1" and run.data.params["grad_accum_steps"] == "2"
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), "each log step exactly once"
    jsonl = {r["step"]: r["loss"] for r in metrics(tmp_path, "train")}
    assert {m.step: m.value for m in history} == jsonl
    evals = client.get_metric_history(run_id, "eval/loss")
    assert sorted(m.step for m in evals) == [8, 16]  # the epochs' ends, each once
    assert {"eval/accuracy", "train/samples_per_sec", "train/grad_norm"} <= set(run.data.metrics)
    artifacts = {a.path: a.file_size for a in client.list_artifacts(run_id)}
    assert artifacts == {"model.safetensors": (tmp_path / "model.safetensors").stat().st_size,
                         "config.toml": (tmp_path / "config.toml").stat().st_size}


def test_a_missing_tracker_package_names_the_extra_and_an_unknown_tracker_is_refused(tmp_path):
    line = one_line_error(run_cli(["train", *TINY, "--run_dir", str(tmp_path), "--tracker", "comet"]))
    assert "--tracker 'comet'" in line and "mlflow" in line
    script = ("import sys; sys.modules['mlflow'] = None; from ddptrain.cli import main; "
              f"sys.exit(main(['train', *{TINY!r}, '--run_dir', {str(tmp_path)!r}, '--tracker', 'mlflow']))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=120)
    line = one_line_error(proc)
    assert "pip install 'ddptrain[mlflow]'" in line
    proc = subprocess.run([sys.executable, "-c", script.replace("mlflow", "wandb")], capture_output=True, text=True,
                          env=cli_env(), timeout=120)
    assert "pip install 'ddptrain[wandb]'" in one_line_error(proc)


def test_a_killed_preempted_and_rerun_job_is_one_offline_wandb_run_with_each_step_once(tmp_path):
    """The MLflow test's job with --tracker wandb and WANDB_MODE=offline: W&B's run files in RUN_DIR/wandb/ (one
    per attempt, the same run id) hold train/loss at every step 1..16 exactly once with metrics.jsonl's values,
    the eval lines, the config; the preempted attempt exited 75 and the last one 0 with status finished."""
    pytest.importorskip("wandb")
    from ddptrain.observe.trackers import wandb_history, wandb_records, wandb_rows, wandb_run_files

    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "kill-preempt", "WANDB_SILENT": "true"}
    job = [*JOB, "--tracker", "wandb", "--callbacks", "callback_plugins:KillWhenTracked"]
    # W&B writes its run file in buffered pieces, so the test cannot watch it mid-run: rank 1 kills itself after
    # step 7 unasked, and rank 0, stopped by the launcher, closes its W&B run with what it had (checked below).
    (tmp_path / "tracked").touch()
    proc = _start(tmp_path, env, "--max_restarts", "1", job=job)
    wait_for(tmp_path / "checkpoints" / "step-8" / "manifest.json", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err
    assert_restarted(proc_result(proc, err), tmp_path, from_step=4)
    train(tmp_path, *job, nproc=2, env=env)

    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]["run_id"]
    attempts = wandb_run_files(tmp_path, run_id)
    assert sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*")) == [p.parent.name for p in attempts]
    assert len(attempts) == 3, "the first incarnation, its restart and the rerun: one run id"
    records = {path: list(wandb_records(path)) for path in attempts}
    # The killed incarnation's file has lines past the step-4 checkpoint, so the restart replayed steps W&B had.
    killed = [row["_step"] for row in wandb_rows(attempts[0]) if "train/loss" in row]
    assert max(killed, default=0) >= 5, killed
    rows = wandb_history(tmp_path, run_id)
    losses = [(row["_step"], row["train/loss"]) for row in rows if "train/loss" in row]
    assert sorted(step for step, _ in losses) == list(range(1, STEPS + 1)), "each log step exactly once"
    assert dict(losses) == {r["step"]: r["loss"] for r in metrics(tmp_path, "train")}
    assert sorted(row["_step"] for row in rows if "eval/loss" in row) == [8, 16]
    first = [r for r in records[attempts[0]] if r.WhichOneof("record_type") == "run"][0].run
    config = {item.key: json.loads(item.value_json) for item in first.config.update}
    assert config["lr"] == 0.1 and config["grad_accum_steps"] == 2 and config["ddptrain.world_size"] == "2"

    def ending(path: Path) -> tuple[int | None, str | None]:
        exits = [r.exit.exit_code for r in records[path] if r.WhichOneof("record_type") == "exit"]
        status = [json.loads(item.value_json) for r in records[path] if r.WhichOneof("record_type") == "summary"
                  for item in r.summary.update if item.key == "ddptrain/status"]
        return (exits[-1] if exits else None), (status[-1] if status else None)

    assert ending(attempts[1]) == (75, "preempted") and ending(attempts[2]) == (0, "finished")


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
