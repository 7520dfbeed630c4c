"""The preemption / timed-save vote every --control_interval steps: real 2-process runs on gloo.

A model plug-in sends SIGTERM to one rank's own process in the forward of a chosen step (a notice reaching
that rank alone, mid-step). The vote is cast at the boundaries after steps that are multiples of the
interval and read one boundary later, so the preemption checkpoint's step follows from the signal's step
and the interval alone — the same on every rank, whichever rank got the signal.
"""

from __future__ import annotations

import json

import pytest

from helpers import last_committed, train

JOB = ["--model", "vote_plugins:signalling_mlp", "--dataset_size", "4096", "--save_every", "0",
       "--log_interval", "5"]


def acted_at(signal_step: int, interval: int) -> int:
    """The first cast at or after the signal's step boundary, read one boundary later."""
    return -(-signal_step // interval) * interval + 1


@pytest.mark.parametrize("interval,signal_rank,signal_step", [(4, 1, 5), (4, 0, 4), (1, 1, 5)],
                         ids=["after-a-cast", "at-a-cast", "every-step"])
def test_preemption_is_decided_at_the_next_vote(tmp_path, interval, signal_rank, signal_step):
    proc = train(tmp_path, *JOB, "--control_interval", str(interval), "--max_steps", "20", nproc=2, check=False,
                 env={"VOTE_SIGNAL_RANK": str(signal_rank), "VOTE_SIGNAL_STEP": str(signal_step)})
    # 75, or 1 when the launcher's agent, seeing the first worker exit 75, stops the other with SIGTERM while
    # it tears down: a signal sent to workers alone, not to the launcher, races their exits (launch.py).
    assert proc.returncode == 75 or "SIGTERM" in proc.stderr, proc.stderr[-3000:]
    step = acted_at(signal_step, interval)
    assert last_committed(tmp_path).name == f"step-{step}"
    assert json.loads((tmp_path / "PREEMPTED").read_text())["step"] == step
    for rank in (0, 1):  # both ranks stopped at the same step
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert f"checkpoint of step {step} committed; exiting" in log
    assert not (tmp_path / "model.safetensors").exists()


def test_notice_after_the_last_vote_lets_the_run_finish(tmp_path):
    """A signal in the last steps, after the last vote, is not acted on: the run ends and commits as usual."""
    proc = train(tmp_path, *JOB, "--control_interval", "4", "--max_steps", "10", nproc=2, check=False,
                 env={"VOTE_SIGNAL_RANK": "1", "VOTE_SIGNAL_STEP": "9"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_committed(tmp_path).name == "step-10"
    assert (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / "PREEMPTED").exists()
