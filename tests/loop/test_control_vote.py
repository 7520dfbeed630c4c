"""The preemption / timed-save vote every --control_interval steps: real 2-process runs on gloo.

A model plug-in sends SIGTERM to one rank's own process in the forward of a chosen step (a notice reaching
that rank alone, mid-step). The vote is cast at the boundaries after steps that are multiples of the
interval and read one boundary later, so the preemption checkpoint's step follows from the signal's step
and the interval alone — the same on every rank, whichever rank got the signal.
"""

from __future__ import annotations

import json
import re

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
    # 75 also when the agent, seeing the first worker exit 75, stops the other while it is exiting (a signal
    # sent to workers alone races their exits): the launcher reads the fresh PREEMPTED marker.
    assert proc.returncode == 75, proc.stderr[-3000:]
    step = acted_at(signal_step, interval)
    assert last_committed(tmp_path).name == f"step-{step}"
    assert json.loads((tmp_path / "PREEMPTED").read_text())["step"] == step
    assert f"checkpoint of step {step} committed; exiting" in (tmp_path / "logs" / "rank-0.log").read_text()
    for rank in (0, 1):  # no rank stopped at another step (rank 1 may be stopped by the agent before it says so)
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert set(re.findall(r"checkpoint of step (\d+) committed; exiting", log)) <= {str(step)}
    assert not (tmp_path / "model.safetensors").exists()


def test_notice_after_the_last_vote_lets_the_run_finish(tmp_path):
    """A signal in the last steps, after the last vote, stops nothing: the run ends, commits and writes its final
    weights as usual, then exits 75 saying the run is complete (the signal asked the job to leave; a rerun finds it
    complete and changes nothing)."""
    proc = train(tmp_path, *JOB, "--control_interval", "4", "--max_steps", "10", nproc=2, check=False,
                 env={"VOTE_SIGNAL_RANK": "1", "VOTE_SIGNAL_STEP": "9"})
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "during the run's end, which finished: the run is complete at step 10" in proc.stderr
    assert last_committed(tmp_path).name == "step-10"
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "FINISHED").exists()
    assert json.loads((tmp_path / "PREEMPTED").read_text())["finished"] is True


def test_a_worker_stopped_by_the_agent_after_a_peer_s_preemption_exit_is_still_a_preemption(tmp_path):
    """The launcher's verdict when rank 0 exited 75 and the agent SIGTERMed rank 1 while it was exiting."""
    import signal
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddptrain.parallel.launch import _failure_outcome

    started = time.time()
    failures = {0: ProcessFailure(local_rank=0, pid=1, exitcode=75, error_file="/nonexistent"),
                1: ProcessFailure(local_rank=1, pid=2, exitcode=-signal.SIGTERM, error_file="/nonexistent")}
    exc = ChildFailedError("ddptrain", failures)
    assert _failure_outcome(exc, tmp_path, started, "training").code == 1, "no marker: not a preemption"
    (tmp_path / "PREEMPTED").write_text(json.dumps({"step": 9, "signal": "SIGTERM", "time": time.time()}))
    assert _failure_outcome(exc, tmp_path, started, "training").code == 75


def test_a_train_line_rides_on_the_vote_cast_at_its_boundary(tmp_path):
    """Where a log step's boundary is also a cast (--log_interval 4 = --control_interval 4), the line's numbers
    go out with the vote's flags: one collective on the control group there, not two, none between; and every
    line is whole (loss, norm, per-rank timings)."""
    from collections import Counter

    from helpers import metrics

    count = tmp_path / "collectives"
    train(tmp_path / "run", "--model", "vote_plugins:counting_mlp", "--dataset_size", "4096", "--save_every", "0",
          "--log_interval", "4", "--control_interval", "4", "--max_steps", "12", nproc=2,
          env={"VOTE_COUNT_FILE": str(count)})
    for rank in (0, 1):
        at = Counter(int(line.split()[0]) for line in (tmp_path / f"collectives.{rank}").read_text().splitlines())
        assert at[4] == at[8] == 1, at  # the vote and the line of step 4 (8): one gather
        assert not any(at[step] for step in (2, 3, 5, 6, 7, 9, 10, 11)), at  # no collective of ddptrain's between
    rows = metrics(tmp_path / "run", "train")
    assert [r["step"] for r in rows] == [4, 8, 12]
    for r in rows:
        assert r["loss"] > 0 and r["grad_norm"] > 0 and len(r["step_time_s_by_rank"]) == 2 and r["nonfinite_steps"] == 0
