"""How a run ends when something goes wrong: a failed rank aborts its process groups, and a slow
checkpoint write does not trip the collective timeout; either way no process-group thread outlives training.
Real processes, gloo on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pipeline_runs as runs
from helpers import REPO, TINY, train

JOB = ["--batch_size", "16", "--epochs", "1", "--max_steps", "4"]


def teardown_lines(run_dir: Path, rank: int) -> list[str]:
    text = (run_dir / "logs" / f"rank-{rank}.log").read_text()
    return [line for line in text.splitlines() if "the process groups" in line]


def test_a_failed_rank_aborts_and_a_finished_one_destroys(tmp_path):
    failed, finished = tmp_path / "failed", tmp_path / "finished"
    proc = train(failed, *JOB, nproc=2, env={"DDPTRAIN_FAULT": "rank=1,step=2,kind=raise"}, check=False)
    assert proc.returncode == 1, proc.stderr
    assert any("aborting the process groups after a failure" in line for line in teardown_lines(failed, 1))
    train(finished, *JOB, nproc=2)
    for rank in (0, 1):
        assert [line.split("DEBUG ")[1] for line in teardown_lines(finished, rank)] == ["destroying the process groups"]


def test_a_checkpoint_write_slower_than_the_collective_timeout_is_waited_for(tmp_path):
    # Rank 0 spends 8 s writing the checkpoint of step 2 while rank 1 waits for the outcome; collectives
    # time out after 3 s, the checkpoint wait has --checkpoint_timeout_s (900 s).
    proc = train(tmp_path, *JOB, "--save_every_steps", "2", "--collective_timeout_s", "3", nproc=2,
                 env={"DDPTRAIN_FAULT": "rank=0,step=2,kind=stall,at=save,seconds=8"}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "checkpoints" / "step-2" / "manifest.json").is_file()


@pytest.mark.parametrize("fault", [[], ["--inject_fault", "rank=1,step=2,kind=raise"], ["--strategy", "fsdp"]],
                         ids=["finished", "failed", "fsdp"])
def test_no_process_group_thread_outlives_training(tmp_path, fault):
    # A gloo thread still running when the interpreter finalizes can abort a worker that has finished its
    # work ("terminate called without an active exception", SIGABRT), and the agent then stops the job.
    # Building DDP used to pin the default group, so destroying or aborting it left its threads running; and
    # the Trainer's reference cycles held its groups until a garbage collection that, in `fit`'s spawned
    # workers, came only at finalization. No gc here: train_worker must leave nothing running by itself.
    runs.torchrun([str(REPO / "tests" / "worker_teardown.py"), str(tmp_path / "threads"), *TINY,
                   "--run_dir", str(tmp_path / "run"), *JOB, *fault])
    for rank in (0, 1):
        left = json.loads((tmp_path / "threads" / f"threads-{rank}.json").read_text())
        assert not [name for name in left if "gloo" in name], f"rank {rank} still runs threads {left}"


def test_a_teardown_that_does_not_return_is_left_behind_loudly(tmp_path):
    # destroy_process_group waiting forever on work left in a backend's queue (cf. pytorch/pytorch#75097) after
    # the run's outputs are all written: train_worker returns after the teardown limit (2 s here) and says why.
    runs.torchrun([str(REPO / "tests" / "worker_teardown.py"), str(tmp_path / "out"), "--stuck-destroy", *TINY,
                   "--run_dir", str(tmp_path / "run"), *JOB])
    for rank in (0, 1):
        assert json.loads((tmp_path / "out" / f"returned-{rank}.json").read_text())["step"] == 4
        log = (tmp_path / "run" / "logs" / f"rank-{rank}.log").read_text()
        assert (f"teardown: rank {rank} on host" in log and "destroying the process groups did not return in 2 s; "
                "the run's outputs are all written" in log), log[-2000:]
        assert "stacks of every thread" in log and "in stuck_destroy" in log  # the stuck call, named


def test_a_worker_killed_while_recording_its_error_leaves_no_half_written_error_file(tmp_path):
    """The agent reads a failed worker's error file as it exits and crashes on one cut short (a JSON error that
    ends the whole launch). A worker stopped mid-write (here: the write is cut after 10 bytes, then the
    process exits at once) must leave either no file or a whole one."""
    import subprocess
    import sys

    target = tmp_path / "error.json"
    script = ("import json, os, sys\n"
              "real_dump = json.dump\n"
              "def cut(obj, fp, **kw):\n"
              "    fp.write(json.dumps(obj)[:10]); fp.flush(); os._exit(9)\n"
              "json.dump = cut\n"
              "from ddptrain.observe.watchdog import record_for_launcher\n"
              "record_for_launcher(RuntimeError('boom'))\n")
    env = {"TORCHELASTIC_ERROR_FILE": str(target), "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert not target.exists() or json.loads(target.read_text())
    # Uninterrupted, the file is torch's format, whole.
    done = subprocess.run([sys.executable, "-c", "from ddptrain.observe.watchdog import record_for_launcher\n"
                           "record_for_launcher(RuntimeError('boom'))"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(target.read_text())["message"]["message"] == "RuntimeError: boom"
