"""Hangs and failures that name the rank, two-tier timeouts, NCCL diagnostics, stragglers."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY, metrics, pid_of_rank, start_cli, train
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddptrain.parallel.distributed import DistributedContext
from ddptrain.parallel.launch import _every_failure, _failure_text, _root_cause
from ddptrain.parallel.watchdog import DONE, Watchdog, _process_state, _Watched

HOST = socket.gethostname()


def _context(rank: int, tp: int = 1, world: int = 2) -> DistributedContext:
    """Rank `rank` of a job of `world` ranks, rank r on host hr, in this process (no process group)."""
    return DistributedContext(rank=rank, local_rank=rank, world_size=world, local_world_size=world, backend="gloo",
                              device=torch.device("cpu"), host=f"h{rank}", hosts=[f"h{r}" for r in range(world)],
                              tp_size=tp)


def test_hang_dumps_stacks_and_names_rank_host_step_phase(tmp_path):
    """Rank 1 stalls before reading step 3's batch; the others wait in its all-reduce."""
    # The collectives' own timeout (300 s) outlasts the test's safety timeout: only the watchdog can end the job.
    proc = train(tmp_path, "--max_steps", "6", "--hang_timeout_s", "3", "--inject_fault", "rank=1,step=3,kind=hang",
                 nproc=2, check=False, timeout=150)
    assert proc.returncode == 1, proc.stderr
    output = proc.stdout + proc.stderr
    assert re.search(r"hang: rank \d on host \S+ made no progress for \d+ s at step 3", output), output
    assert "timed out" not in output.lower(), output  # gloo: "Timed out waiting ... for recv"
    # Whichever rank's watchdog fires first, the stuck rank is named with its host, step and phase.
    assert re.search(rf"rank 1 on host {re.escape(HOST)}\b.*step 3.*phase data", output), output
    summary = [line for line in proc.stderr.splitlines() if line.startswith("ddptrain: training failed")]
    assert summary and "hang:" in summary[0] and "rank 1 on host" in summary[0], proc.stderr
    stuck_log = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "stacks of every thread of rank 1" in stuck_log
    assert "in at_micro_step" in stuck_log and "in train_step" in stuck_log, stuck_log  # the main thread's stack


def test_a_rank_that_raises_stops_every_rank_and_is_named(tmp_path):
    # Neither the watchdog nor a collective timeout may be what stops the others: both outlast the safety timeout.
    proc = train(tmp_path, "--max_steps", "6", "--hang_timeout_s", "0", "--inject_fault", "rank=1,step=3,kind=raise",
                 nproc=3, check=False, timeout=150)
    assert proc.returncode == 1, proc.stderr
    assert "hang:" not in proc.stderr and "timed out" not in proc.stderr.lower(), proc.stderr
    summary = [line for line in proc.stderr.splitlines() if line.startswith("ddptrain: training failed")]
    assert len(summary) == 1, proc.stderr
    assert f"rank 1 on host {HOST}: InjectedFault: injected fault kind=raise at step 3" in summary[0], summary
    # The others stopped because of it, not a timeout: each reports the lost connection.
    for rank in (0, 2):
        assert re.search(rf"ddptrain: rank {rank} on host .* failed at step 2: .*(closed|reset) by peer", proc.stderr)
    assert not (tmp_path / "model.safetensors").exists()


def test_persistent_straggler_is_named_and_metrics_carry_skew(tmp_path):
    """Rank 2's data is slow: in synchronous DDP everyone's step takes as long, its own time does not."""
    train(tmp_path, "--max_steps", "8", "--dataset", "multinode_plugins:slow_rank_synthetic", "--eval_size", "0",
          nproc=3, env={"DDPTRAIN_TEST_SLOW_RANK": "2", "DDPTRAIN_TEST_SLOW_S": "0.004"})
    rows = metrics(tmp_path, "train")
    assert len(rows) == 8
    for row in rows:
        assert isinstance(row["slowest_rank"], int) and row["slowest_host"] == HOST
        assert row["step_time_skew"] >= 1.0
    late = rows[2:]  # past the first steps' warm-up noise
    assert all(row["slowest_rank"] == 2 for row in late), [r["slowest_rank"] for r in rows]
    assert min(row["step_time_skew"] for row in late) > 2, [r["step_time_skew"] for r in rows]
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert re.search(rf"straggler: rank 2 on host {re.escape(HOST)} .* for 3 log intervals", log), log


def test_timeouts_switch_from_init_to_collective_after_the_first_step(tmp_path, monkeypatch):
    """In-process world of 1: the plug-in dataset reads the group's timeout as each sample is loaded."""
    import multinode_plugins

    from ddptrain.cli import run_worker
    from ddptrain.config import resolve_config

    monkeypatch.setattr(multinode_plugins, "TIMEOUTS_SEEN", [])
    cfg = resolve_config([*TINY, "--run_dir", str(tmp_path), "--dataset", "multinode_plugins:timeout_probe_synthetic",
                          "--batch_size", "64", "--max_steps", "3", "--init_timeout_s", "77",
                          "--collective_timeout_s", "11", "--hang_timeout_s", "0"])
    assert run_worker(cfg) == 0
    steps = multinode_plugins.TIMEOUTS_SEEN[-3 * 64:]  # before them: a sample read to count FLOPs
    assert steps == [77.0] * 64 + [11.0] * 128, (steps[:1], steps[63:66], steps[-1:])


def test_nccl_diagnostics_are_on_by_default_and_user_settings_win(tmp_path, monkeypatch):
    from ddptrain.parallel.distributed import _enable_nccl_diagnostics

    names = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
             "TORCH_FR_DUMP_TEMP_FILE")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "5")
    _enable_nccl_diagnostics(tmp_path)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "5"
    dump_prefix = Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"])
    assert dump_prefix.parent == tmp_path / "flight_recorder" and dump_prefix.parent.is_dir()


@pytest.mark.parametrize("peers, mine, behind", [
    # Same step: the rank still reading data is behind the ranks waiting in the all-reduce, however idle.
    ([(1, 3, "data", 5.0), (2, 3, "backward+all-reduce", 5.1)], (3, "backward+all-reduce", 4.9), 1),
    # An earlier step beats any phase.
    ([(1, 2, "sync", 4.0), (2, 3, "data", 9.0)], (3, "backward+all-reduce", 9.0), 1),
    # This rank is the one behind: no one else is named.
    ([(1, 3, "backward+all-reduce", 4.0)], (3, "data", 4.1), None),
])
def test_furthest_behind_is_the_earliest_step_then_phase(peers, mine, behind):
    dog = Watchdog(_context(rank=0, world=3), Path("unused.log"), 3.0, 60.0, 60.0, store=object())  # no threads
    dog.step, dog._phase, idle = mine
    dog._peers = lambda: [{"rank": r, "step": s, "phase": p, "idle_s": i, "host": f"h{r}", "age_s": 0.1}
                          for r, s, p, i in peers]
    line = dog.describe(idle)
    assert "stopped responding" not in line, line  # every peer beat 0.1 s ago: all alive
    if behind is None:
        assert "furthest behind" not in line, line
    else:
        assert f"; rank {behind} on host h{behind} is furthest behind" in line, line


def test_launcher_names_the_cause_not_the_ranks_that_lost_it(tmp_path):
    """Whole-second timestamps tie; the rank whose error only says its peer vanished is not the cause."""
    def failure(rank: int, message: str) -> ProcessFailure:
        path = tmp_path / f"error-{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1700000000"}}}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))

    failures = {0: failure(0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4567"),
                1: failure(1, "InjectedFault: injected fault kind=raise at step 3 micro-batch 0"),
                2: failure(2, "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:4568: Connection reset by peer")}
    rank, cause = _root_cause(failures)
    assert rank == 1 and _failure_text(cause).startswith("InjectedFault: injected fault")


def test_a_rank_that_recorded_its_error_is_named_before_one_the_agent_found_without_a_record(tmp_path):
    """Seen in CI: rank 1's watchdog recorded its hang and exited; rank 0, losing it, failed before its own error
    was written, and the agent's stand-in for it (no record, stamped earlier) was named as the cause."""
    hang = tmp_path / "error-1.json"
    later = str(int(time.time()) + 100)
    hang.write_text(json.dumps({"message": {"message": "hang: rank 1 on host h1 made no progress for 3 s at step 3",
                                            "extraInfo": {"timestamp": later}}}))
    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(tmp_path / "none.json")),
                1: ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(hang))}
    assert failures[0].timestamp < failures[1].timestamp  # the stand-in is the earlier one
    rank, cause = _root_cause(failures)
    assert rank == 1 and _failure_text(cause).startswith("hang: rank 1"), _failure_text(cause)


def test_launcher_names_a_cause_the_agent_stopped_before_it_exited(tmp_path):
    """The agent reports the workers it found failed at its first look: here only rank 0, which lost its
    peer, while rank 1, which raised first and recorded its error, was still aborting its process groups."""
    def record(rank: int, message: str) -> Path:
        path = tmp_path / "attempt_0" / str(rank) / "error.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1700000000"}}}))
        return path

    lost = record(0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4567")
    record(1, "InjectedFault: injected fault kind=raise at step 3 micro-batch 0")
    (tmp_path / "attempt_0" / "2").mkdir()  # a rank stopped before it recorded anything
    reported = {0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(lost))}
    failures = _every_failure(ChildFailedError("ddptrain", reported))
    assert sorted(failures) == [0, 1]
    rank, cause = _root_cause(failures)
    assert rank == 1 and _failure_text(cause).startswith("InjectedFault: injected fault")


def test_heartbeat_survives_a_failing_store_and_says_so_once(tmp_path):
    """The store refuses 4 beats, takes 2, refuses 3 more: one warning naming the error, beats go on."""
    class Ctx:
        rank, host, world_size = 1, "h1", 2

    class FlakyStore:
        def __init__(self, refuse: list[bool]):
            self.refuse, self.keys, self.done = refuse, [], threading.Event()

        def set(self, key: str, value: str) -> None:
            if not self.refuse:
                self.done.set()
                return
            self.keys.append(key)
            if self.refuse.pop(0):
                raise ConnectionError("store host 10.0.0.9 went away")

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    store, records = FlakyStore([True] * 4 + [False] * 2 + [True] * 3), Records()
    dog = Watchdog(Ctx(), tmp_path / "rank-1.log", 1.0, 60.0, 60.0, store=store)  # 0.2 s between beats
    dog.step, dog._phase = 3, "data"
    heartbeat = threading.Thread(target=dog._heartbeat, name="ddptrain-heartbeat", daemon=True)
    logger = logging.getLogger("ddptrain")
    logger.addHandler(records)
    try:
        heartbeat.start()
        assert store.done.wait(timeout=60), store.keys  # safety only: 10 beats 0.2 s apart
        assert heartbeat.is_alive()
    finally:
        dog._stop.set()
        heartbeat.join(timeout=10)
        logger.removeHandler(records)
    assert not heartbeat.is_alive()  # ended by the stop event, not by the failures
    assert store.keys == ["ddptrain/heartbeat/1"] * 9
    warnings = [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "rank 1 cannot publish its heartbeat" in warnings[0], warnings
    assert "ConnectionError: store host 10.0.0.9 went away" in warnings[0], warnings


# --- a rank that stopped (SIGSTOP: nothing in it runs, its heartbeat neither) -------------------------------
HANG_S = 3  # --hang_timeout_s of these runs; the job must fail within it + 10 s of the freeze


def _time_to_failure(proc, pid: int, freeze: Callable[[], None]) -> tuple[str, float]:
    """Wait until `pid` is stopped (by `freeze`, or by its own fault), then for the job's end: (stderr, seconds
    from the freeze to the end). Ends both if the job outlives the test's patience."""
    try:
        deadline = time.monotonic() + 120
        freeze()
        while (_process_state(pid) or ("gone",))[0] != "T":
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"rank process {pid} never stopped"
            time.sleep(0.01)
        frozen = time.monotonic()
        try:
            _, err = proc.communicate(timeout=HANG_S + 60)
        except Exception:
            raise AssertionError(f"the job still ran {HANG_S + 60} s after the freeze") from None
        return err, time.monotonic() - frozen
    finally:
        if proc.poll() is None:
            proc.kill()  # its workers follow the launcher out (parallel.launch), all but a stopped one
            proc.communicate(timeout=60)
        if (_process_state(pid) or ("gone",))[0] == "T":
            os.kill(pid, signal.SIGKILL)


def _assert_named(err: str, seconds: float, rank: int) -> None:
    print(f"rank {rank} stopped: the job failed {seconds:.1f} s later")  # (shown with pytest -s)
    assert seconds < HANG_S + 10, (seconds, err)
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("ddptrain: training failed"), err
    assert f"rank {rank} on host {HOST} stopped responding (" in last, err


@pytest.mark.parametrize("rank, fault, extra, phase", [
    # As its Trainer starts to build (its watchdog runs from the worker's first log line): the other rank waits in
    # a collective of the build, under the start-up limit (--init_timeout_s, 900 s).
    (1, "rank=1,step=0,kind=stop,at=startup", [], "startup"),
    # As the model's weights come in: the other waits in the first collective after the build.
    (1, "rank=1,step=0,kind=stop,at=load", [], "load"),
    # Mid-step, before its first micro-batch: the other rank waits in the gradient all-reduce.
    (1, "rank=1,step=3,kind=stop", [], None),
    # During an eval: the other waits in the eval's reduction.
    (1, "rank=1,step=2,kind=stop,at=eval", ["--eval_every_steps", "2"], "eval"),
    # Writing a checkpoint, as rank 0, which also serves the job's store: rank 1 waits in the checkpoint phase,
    # whose own limit (--checkpoint_timeout_s, 900 s) is far off, and no read of the store answers (nor tells
    # rank 0's phase since its last beat read).
    (0, "rank=0,step=2,kind=stop,at=save", ["--save_every_steps", "2"], None),
    # Taking its state for a checkpoint: rank 0 waits for it in the checkpoint phase.
    (1, "rank=1,step=2,kind=stop,at=snapshot", ["--save_every_steps", "2"], "checkpoint"),
    # The final save, after the last checkpoint committed: rank 0 waits for its part of the weights. Before, the
    # watchdog had ended with the loop, and nothing named it.
    (1, "rank=1,step=6,kind=stop,at=final", [], "final save"),
], ids=["startup", "load", "mid-step", "eval", "rank0-checkpoint-write", "checkpoint-snapshot", "final-save"])
def test_a_stopped_rank_fails_the_job_within_the_hang_timeout_and_is_named(tmp_path, rank, fault, extra, phase):
    proc = start_cli(["train", *TINY, "--run_dir", str(tmp_path), "--nproc", "2", "--max_steps", "6",
                      "--hang_timeout_s", str(HANG_S), "--inject_fault", fault, *extra])
    err, seconds = _time_to_failure(proc, pid_of_rank(tmp_path, rank, proc), freeze=lambda: None)
    assert proc.returncode == 1, err
    _assert_named(err, seconds, rank)
    if phase is not None:  # a phase entered a few times a run is published as it is entered
        assert re.search(rf"stopped responding \(last heartbeat \d+ s ago at step \d+, phase {phase}\)", err), err
    assert "injected fault" not in err, err  # (the fault stops the process; it says nothing)


def test_an_external_sigstop_after_start_up_is_named(tmp_path):
    """SIGSTOP from outside, wherever rank 1 is once the run has trained two steps (a step, an eval, a
    checkpoint write: each epoch is 4 steps, with an eval and a checkpoint at its end)."""
    proc = start_cli(["train", *TINY, "--run_dir", str(tmp_path), "--nproc", "2", "--epochs", "100000",
                      "--hang_timeout_s", str(HANG_S)])
    pid, trained = pid_of_rank(tmp_path, 1, proc), tmp_path / "metrics.jsonl"

    def freeze() -> None:
        deadline = time.monotonic() + 120
        while not (trained.exists() and trained.read_text().count('"split": "train"') >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never trained two steps"
            time.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)

    err, seconds = _time_to_failure(proc, pid, freeze)
    assert proc.returncode == 1, err
    _assert_named(err, seconds, 1)


@pytest.mark.parametrize("beat, changed_ago, read_ago, reading_for, named", [
    # Alive: its beat changed within the timeout (a slow phase on it changes nothing: beats come from a thread).
    ({"seq": 9, "phase": "checkpoint"}, 2.0, 0.1, None, False),
    # Its beat has not changed for longer than the timeout, in any phase.
    ({"seq": 9, "phase": "checkpoint"}, 4.0, 0.1, None, True),
    # It left its watchdog (the end of its run): silent from then on, not stuck.
    ({"seq": 9, "phase": DONE}, 60.0, 0.1, None, False),
    # The store stopped answering reads (its server exited at the end of the run): silence is judged only up
    # to the last read that answered.
    ({"seq": 9, "phase": "data"}, 60.0, 59.0, None, False),
    # A read in flight for longer than the timeout: the store's server, rank 0 here, is stopped.
    ({"seq": 9, "phase": "data"}, 1.0, 1.0, 4.0, True),
])
def test_a_peer_is_stopped_when_its_beat_is_unchanged_for_the_timeout(beat, changed_ago, read_ago, reading_for,
                                                                      named):
    dog = Watchdog(_context(rank=1), Path("unused.log"), 3.0, 60.0, 60.0, store=object())
    now = 1000.0
    dog._store_on_rank0 = True
    dog._watched = {0: _Watched({**beat, "step": 5, "host": "h0"}, now - changed_ago, now - read_ago)}
    dog._reading_since = None if reading_for is None else now - reading_for
    verdict = dog._stopped_peer(now)
    if named:
        assert verdict is not None and verdict[0] == 0 and verdict[1].startswith("rank 0 on host h0 stopped"), verdict
    else:
        assert verdict is None, verdict




def test_a_peer_that_never_beat_is_named_after_the_start_up_limit():
    dog = Watchdog(_context(rank=0), Path("unused.log"), 3.0, 60.0, 60.0, store=object())
    dog._entered = 1000.0
    dog._watched = {1: _Watched(None, 0.0, 1059.0)}
    assert dog._stopped_peer(1059.0) is None  # a peer still starting up (rendezvous, first compile) may be slow
    dog._watched = {1: _Watched(None, 0.0, 1061.0)}
    verdict = dog._stopped_peer(1061.0)
    assert verdict is not None and verdict[0] == 1, verdict
    assert verdict[1].startswith("rank 1 on host h1 stopped responding (no heartbeat in 61 s"), verdict


def test_under_tp_a_hung_rank_is_named_with_its_data_parallel_rank_and_place_in_its_group():
    """Issue 58: a report names the tensor-parallel group's member, not a bare rank."""
    dog = Watchdog(_context(rank=0, tp=2), Path("unused.log"), 3.0, 60.0, 60.0, store=object())
    dog._entered = 1000.0
    dog._watched = {1: _Watched(None, 0.0, 1061.0)}
    assert dog._stopped_peer(1061.0)[1].startswith("rank 1 on host h1 (dp 0, tp 1) stopped responding")
    line, _ = dog._describe(70.0, [{"rank": 1, "host": "h1", "step": 4, "phase": "data", "idle_s": 70.0,
                                     "age_s": 30.0}])
    assert line.startswith("hang: rank 1 on host h1 (dp 0, tp 1) stopped responding") and \
        line.endswith("rank 0 on host h0 (dp 0, tp 0) made no progress for 70 s at step 0 (phase startup)"), line
