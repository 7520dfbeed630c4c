"""Exact resume: a run that is killed, restarted, preempted or resized ends bitwise where an uninterrupted
run ends. Real processes, gloo on CPU.

The job: a BatchNorm-free MLP with dropout, on synthetic data with random augmentation from the global
RNG, 2 processes x micro-batch 8 x accumulation 2 (global batch 32), 8 steps per epoch, 2 epochs,
checkpoints every 3 steps and every epoch. Dropout and augmentation make RNG restore observable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    TINY,
    assert_bitwise_equal,
    last_committed,
    metrics,
    optimizer_state,
    pid_of_rank,
    processes_holding,
    start_cli,
    train,
    wait_for,
    weights,
)

JOB = ["--model", "fault_plugins:dropout_mlp", "--dataset", "fault_plugins:augmented_synthetic",
       "--batch_size", "8", "--grad_accum_steps", "2", "--epochs", "2", "--save_every_steps", "3",
       "--keep_last", "0", "--num_workers", "2"]
STEPS = 16


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir, "train")}


def assert_same_result(run: Path, ref: Path) -> None:
    assert_bitwise_equal(weights(run / "model.safetensors"), weights(ref / "model.safetensors"))
    final, ref_final = last_committed(run), last_committed(ref)
    assert final.name == ref_final.name == f"step-{STEPS}"
    opt, ref_opt = optimizer_state(final), optimizer_state(ref_final)
    for key, state in ref_opt["state"].items():
        for name, tensor in state.items():
            assert (opt["state"][key][name] == tensor).all(), f"optimizer state {key}/{name} differs"
    assert losses(run) == losses(ref)
    assert sorted(losses(run)) == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    train(run_dir, *JOB, nproc=2)
    return run_dir


@pytest.mark.parametrize("fault", [
    "rank=1,step=5,kind=sigkill",             # mid-epoch, a non-zero rank
    "rank=0,step=6,micro=1,kind=sigkill",     # between the two micro-batches of an accumulation step
    "rank=1,step=9,kind=sigkill",             # first step of epoch 2, right after the epoch checkpoint
    "rank=0,step=6,kind=sigkill,at=save",     # while rank 0 writes the checkpoint of step 6
], ids=["mid-epoch", "micro-step", "epoch-boundary", "during-save"])
def test_killed_rank_restarts_and_ends_bitwise_equal(tmp_path, reference, fault):
    proc = train(tmp_path, *JOB, "--max_restarts", "1", nproc=2, env={"DDPTRAIN_FAULT": fault})
    assert_same_result(tmp_path, reference)
    assert "resuming from" in (tmp_path / "logs" / "rank-0.log").read_text()
    assert proc.returncode == 0


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return start_cli(["train", *TINY, *JOB, "--run_dir", str(run_dir), "--nproc", "2", *extra])


SLOW = ["--dataset", "fault_plugins:slow_augmented_synthetic"]


@pytest.fixture(scope="module")
def slow_reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("slow-reference")
    train(run_dir, *JOB, *SLOW, nproc=2)
    return run_dir


def test_whole_job_killed_then_rerun_resumes_bitwise(tmp_path, slow_reference):
    proc = _start(tmp_path, *SLOW)
    wait_for(tmp_path / "checkpoints" / "step-6" / "manifest.json", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, with no chance to stop its workers
    proc.wait()
    # Its workers (in sessions of their own) notice and stop; before, they trained on and then waited forever.
    deadline = time.monotonic() + 30
    while processes_holding(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_holding(tmp_path), "the killed launcher's workers are still running"
    assert not (tmp_path / "model.safetensors").exists(), "the run finished before it could be killed"
    assert "the launcher (pid" in (tmp_path / "logs" / "rank-0.log").read_text()
    train(tmp_path, *JOB, *SLOW, nproc=2)
    assert_same_result(tmp_path, slow_reference)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_preemption_signal_commits_checkpoint_and_exits_75(tmp_path, slow_reference, sig):
    proc = _start(tmp_path, *SLOW)
    wait_for(tmp_path / "checkpoints" / "step-3" / "manifest.json", proc)
    proc.send_signal(sig)  # to the launcher only: torch's agent forwards it to the workers
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, (out, err)
    assert "preempted" in err
    preempt_ckpt = last_committed(tmp_path)
    assert int(preempt_ckpt.name.split("-")[1]) > 3, "the preemption did not save a new checkpoint"
    assert not (tmp_path / "model.safetensors").exists()
    train(tmp_path, *JOB, *SLOW, nproc=2)
    assert_same_result(tmp_path, slow_reference)


@pytest.mark.parametrize("to", ["launcher", "rank 1"])
def test_a_signal_during_the_final_save_finishes_it_exits_75_and_a_rerun_changes_nothing(tmp_path, to):
    """SIGTERM to the launcher (which forwards it to every worker) or SIGUSR1 to one rank, while the final save is
    in progress: the signal stays a flag, the save goes on to the end, and the job exits 75 saying the run is
    complete. Before, the workers died mid-save: exit 143 "stopped by SIGTERM before a checkpoint committed", or
    exit 1 "Signal 10 received". The save is held open by a stall that the signal itself ends (faults.py), so
    the signal lands inside it however fast the machine. The rerun of the complete run reads what it recorded and
    writes nothing: before, it evaluated the last step again (a second line) and wrote the final weights again."""
    rank = 0 if to == "launcher" else 1
    proc = start_cli(["train", *TINY, "--run_dir", str(tmp_path), "--nproc", "2", "--epochs", "2",
                      "--save_every_steps", "3", "--inject_fault", f"rank={rank},step=8,kind=stall,at=final,seconds=600"])
    pid = pid_of_rank(tmp_path, rank, proc)
    wait_for(tmp_path / "checkpoints" / "step-8" / "manifest.json", proc)  # the last: the final save is next
    os.kill(proc.pid, signal.SIGTERM) if to == "launcher" else os.kill(pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    signal_name = "SIGTERM" if to == "launcher" else "SIGUSR1 on rank 1"
    assert (f"preempted by {signal_name} during the run's end, which finished: the run is complete at step 8 (final "
            "weights written); exit 75") in err, err
    assert weights(tmp_path / "model.safetensors").keys()
    record = (tmp_path / "metrics.jsonl").read_text()
    assert [(r["step"], r["epoch"]) for r in metrics(tmp_path, "eval")] == [(4, 0), (8, 1)]
    written = (tmp_path / "model.safetensors").stat().st_mtime_ns
    rerun = train(tmp_path, "--epochs", "2", "--save_every_steps", "3", nproc=2)
    assert "run already complete at step 8 (2 epochs)" in rerun.stdout and "nothing changed" in rerun.stdout, rerun.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == record
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == written
    assert last_committed(tmp_path).name == "step-8"


def test_a_rerun_of_a_run_stopped_early_after_its_last_save_changes_nothing(tmp_path):
    """Early stopping decides at the epoch-end eval of step 8, after the step's own save (--save_every_steps 4): the
    newest checkpoint holds no stop, and training would go on to step 12. The run's record holds it: the same
    command again says the run stopped early and writes nothing (before: a second eval of step 8, the final
    weights written again)."""
    job = ["--epochs", "3", "--save_every", "0", "--save_every_steps", "4", "--early_stop_metric", "loss",
           "--early_stop_patience", "1", "--early_stop_min_delta", "10"]
    train(tmp_path, *job, nproc=2)
    assert [r["step"] for r in metrics(tmp_path, "eval")] == [4, 8] and last_committed(tmp_path).name == "step-8"
    record, written = (tmp_path / "metrics.jsonl").read_text(), (tmp_path / "model.safetensors").stat().st_mtime_ns
    rerun = train(tmp_path, *job, nproc=2)
    assert "run stopped early at step 8 (" in rerun.stdout and "nothing changed" in rerun.stdout, rerun.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == record
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == written


def test_async_checkpoint_gives_the_same_result(tmp_path, reference):
    train(tmp_path, *JOB, "--async_checkpoint", nproc=2)
    assert_same_result(tmp_path, reference)


def test_failed_background_write_is_not_committed(tmp_path):
    proc = train(tmp_path, *JOB, "--async_checkpoint", nproc=2, check=False,
                 env={"DDPTRAIN_FAULT": "rank=0,step=3,kind=raise,at=save"})
    assert proc.returncode == 1, proc.stderr
    assert not (tmp_path / "checkpoints" / "step-3" / "manifest.json").exists()
    assert "checkpoint of step 3 failed" in proc.stderr
    assert "injected fault" in proc.stderr


def test_failed_sync_write_fails_every_rank_alike(tmp_path):
    proc = train(tmp_path, *JOB, nproc=2, check=False, env={"DDPTRAIN_FAULT": "rank=0,step=3,kind=raise,at=save"})
    assert proc.returncode == 1, proc.stderr
    assert not (tmp_path / "checkpoints" / "step-3" / "manifest.json").exists()
    for rank in (0, 1):
        assert "checkpoint of step 3 failed on rank 0" in (tmp_path / "logs" / f"rank-{rank}.log").read_text()


# --- resume at a different world size --------------------------------------------------------------

PLAIN = ["--epochs", "2", "--keep_last", "0", "--record_sample_ids"]


def step_samples(run_dir: Path) -> dict[int, list[int]]:
    """The sorted sample ids of each global step, across ranks and micro-batches (last attempt wins)."""
    from helpers import read_jsonl

    by_attempt: dict[int, dict[tuple[int, int], list[int]]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for row in read_jsonl(path):
            by_attempt.setdefault(row["step"], {})[(rank, row["micro"])] = row["ids"]
    return {step: sorted(i for ids in parts.values() for i in ids) for step, parts in by_attempt.items()}


@pytest.fixture(scope="module")
def resize_reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("resize-reference")
    train(run_dir, *PLAIN, "--batch_size", "16", nproc=2)
    return run_dir


@pytest.mark.parametrize("first,second", [
    (("--batch_size", "16", "--nproc", "2"), ("--batch_size", "16", "--grad_accum_steps", "2")),
    (("--batch_size", "16", "--grad_accum_steps", "2"), ("--batch_size", "16", "--nproc", "2")),
], ids=["2to1", "1to2"])
def test_resume_on_other_world_size_sees_the_same_samples(tmp_path, resize_reference, first, second):
    train(tmp_path, *PLAIN, *first, "--max_steps", "5")
    train(tmp_path, *PLAIN, *second)
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "world size changed on resume" in log
    assert step_samples(tmp_path) == step_samples(resize_reference)
    ref_losses, got = losses(resize_reference), losses(tmp_path)
    assert sorted(got) == sorted(ref_losses)
    for step, loss in ref_losses.items():
        assert abs(got[step] - loss) <= 1e-5 * max(1.0, abs(loss)), (step, got[step], loss)


def test_changing_the_global_batch_on_resume_warns(tmp_path):
    train(tmp_path, *PLAIN, "--batch_size", "16", "--max_steps", "3")
    train(tmp_path, *PLAIN, "--batch_size", "32")
    assert "global batch changed on resume: 16 -> 32" in (tmp_path / "logs" / "rank-0.log").read_text()
    # The cursor is in samples: 3 steps x 16 consumed, so epoch 0 continues at sample 48.
    samples = step_samples(tmp_path)
    assert len(samples[4]) == 32
    assert set(samples[4]).isdisjoint(i for s in (1, 2, 3) for i in samples[s])


# --- non-finite values ---------------------------------------------------------------------------

def test_nan_on_one_rank_is_skipped_on_every_rank(tmp_path):
    train(tmp_path, "--epochs", "1", nproc=2, env={"DDPTRAIN_FAULT": "rank=1,step=3,kind=nan"})
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "non-finite gradient norm at step(s) [3] (non-finite loss on rank(s) [1])" in log
    rows = {r["step"]: r for r in metrics(tmp_path, "train")}
    assert rows[3]["nonfinite_steps"] == 1 and rows[4]["nonfinite_steps"] == 0
    assert "replicas identical" in log  # the end-of-run check that ranks did not diverge


def test_nan_with_stop_fails_every_rank_naming_step_and_rank(tmp_path):
    proc = train(tmp_path, "--epochs", "1", "--on_nonfinite", "stop", nproc=2, check=False,
                 env={"DDPTRAIN_FAULT": "rank=1,step=3,kind=nan"})
    assert proc.returncode == 1
    assert "non-finite gradient norm at step 3 (non-finite loss on rank(s) [1])" in proc.stderr


def test_a_resume_inside_a_log_window_logs_what_the_uninterrupted_run_logs(tmp_path):
    # Log every 4 steps, save every 3: the checkpoint of step 3 holds a window of 3 unlogged steps per rank.
    job = [*JOB, "--log_interval", "4"]
    train(tmp_path / "straight", *job, nproc=2)
    train(tmp_path / "killed", *job, "--max_restarts", "1", nproc=2, env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    assert sorted(losses(tmp_path / "straight")) == [4, 8, 12, 16]


def test_sample_ids_of_a_killed_run_cover_every_step_once_its_restart_is_done(tmp_path):
    """The sample-id log is buffered and flushed at log steps and before each save: with log steps far apart
    (10), a SIGKILL at step 5 loses at most the lines after the step-3 checkpoint, which the restart records
    again. Every step 1..16 is in the log, and each epoch covers the 256 samples exactly once."""
    from collections import defaultdict

    from helpers import read_jsonl

    train(tmp_path, *JOB, "--record_sample_ids", "--log_interval", "10", "--max_restarts", "1", nproc=2,
          env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    by_step: dict[int, dict] = defaultdict(dict)
    for path in sorted((tmp_path / "samples").glob("rank-*.jsonl")):
        for row in read_jsonl(path):
            by_step[row["step"]][(path.stem, row["micro"])] = row["ids"]  # the later attempt's line wins
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for epoch in (range(1, 9), range(9, 17)):
        ids = sorted(i for step in epoch for part in by_step[step].values() for i in part)
        assert ids == list(range(256)), f"steps {epoch.start}-{epoch.stop - 1} do not cover the epoch once"


def test_a_resume_keeps_the_optimizer_settings_it_finds_and_loads_the_checkpoints_state(tmp_path):
    """The config decides momentum, weight decay, ...: what the optimizer holds when the checkpoint is read
    wins over what the checkpoint holds, whenever a user's code set it (after the Trainer was built, too)."""
    from types import SimpleNamespace

    import torch

    from ddptrain.checkpoints.format import Loaded
    from ddptrain.loop.checkpointed import ModelState

    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # momentum buffers: the state a checkpoint carries
    saved = Loaded(tmp_path, {"config": {"optimizer": "sgd"}}, {k: v.clone() for k, v in module.state_dict().items()},
                   optimizer.state_dict(), {})
    momentum = optimizer.state[module.weight]["momentum_buffer"].clone()
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    part = ModelState(fresh, fresh_optimizer, SimpleNamespace(sharded=False), SimpleNamespace(is_main=True),
                      lambda: None, "sgd", "linear", 0)
    fresh_optimizer.param_groups[0]["weight_decay"] = 0.123  # set by a user's code after the part was built
    part.load_state_dict({"checkpoint": saved})
    assert fresh_optimizer.param_groups[0]["weight_decay"] == 0.123
    assert torch.equal(fresh.weight, module.weight)
    assert torch.equal(fresh_optimizer.state[fresh.weight]["momentum_buffer"], momentum)
