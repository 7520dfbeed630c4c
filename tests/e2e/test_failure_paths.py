"""How a run ends when something goes wrong: a failed rank aborts its process groups, and a slow
checkpoint write does not trip the collective timeout; either way no process-group thread outlives training.
Real processes, gloo on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pipeline_runs as runs
import pytest
from helpers import REPO, TINY, cli_env, run_cli, train

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
    # A gloo thread still running when the interpreter finalizes aborts a worker that has finished its work
    # ("terminate called without an active exception": it waits for the GIL to free a collective's tensors
    # and is ended by pthread_exit inside a noexcept destructor). Whatever holds a group must let go of it
    # before train_worker returns: the Trainer's reference cycles, DDP's reducer, FSDP's mesh, torch's
    # caches. And the Trainer must go first, while the groups are registered: a group whose last reference
    # is DDP's reducer is freed with the GIL held and deadlocks with its own gloo threads.
    runs.torchrun([str(REPO / "tests" / "worker_teardown.py"), str(tmp_path / "out"), *TINY,
                   "--run_dir", str(tmp_path / "run"), *JOB, *fault])
    for rank in (0, 1):
        report = json.loads((tmp_path / "out" / f"teardown-{rank}.json").read_text())
        left = [name for name in report["threads"] if "gloo" in name]
        assert not left, f"rank {rank} still runs threads {report['threads']}"
        assert report["groups_registered_when_trainer_freed"] is True, report
        log = (tmp_path / "run" / "logs" / f"rank-{rank}.log").read_text()
        assert "outlived their destruction" not in log


def test_a_peer_gone_after_the_last_collective_costs_the_survivor_nothing(tmp_path):
    # Rank 1 exits as its teardown begins, right after training's last collective. Teardown needs nothing
    # from a peer after a finished run: rank 0 destroys its groups at once and leaves no gloo thread behind.
    runs.torchrun([str(REPO / "tests" / "worker_teardown.py"), str(tmp_path / "out"), "--peer-exits", *TINY,
                   "--run_dir", str(tmp_path / "run"), *JOB], timeout=120)
    report = json.loads((tmp_path / "out" / "teardown-0.json").read_text())
    assert report["summary"]["step"] == 4
    assert not [name for name in report["threads"] if "gloo" in name], report["threads"]
    assert not (tmp_path / "out" / "teardown-1.json").exists()  # rank 1 did exit where it was told to
    lines = [line.split("DEBUG ")[1] for line in teardown_lines(tmp_path / "run", 0)]
    assert lines == ["destroying the process groups"]


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
              "from ddptrain.parallel.watchdog import record_for_launcher\n"
              "record_for_launcher(RuntimeError('boom'))\n")
    env = {"TORCHELASTIC_ERROR_FILE": str(target), "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert not target.exists() or json.loads(target.read_text())
    # Uninterrupted, the file is torch's format, whole.
    done = subprocess.run([sys.executable, "-c", "from ddptrain.parallel.watchdog import record_for_launcher\n"
                           "record_for_launcher(RuntimeError('boom'))"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(target.read_text())["message"]["message"] == "RuntimeError: boom"


def test_the_process_group_setup_never_makes_torch_a_local_name():
    # `import torch.distributed.nn` inside `distributed()` once bound `torch` as a local of the function, so its
    # CUDA lines (`torch.cuda.is_available()` for nccl, `torch.cuda.set_device`) raised UnboundLocalError on
    # every GPU run, a path no CPU run takes.
    from ddptrain.parallel.distributed import distributed

    code = distributed.__wrapped__.__code__
    assert "torch" not in code.co_varnames + code.co_cellvars


def test_the_launcher_keeps_the_agent_s_restart_notice_and_drops_its_per_process_chatter(caplog):
    """The workers are forked (torch.multiprocessing): when one fails, torch logs that it terminates the others.
    A usage error of every worker must still be one line on stderr, so the launcher drops that chatter (a
    stream test saw the line once in a while, depending on which worker exited first)."""
    import logging

    from ddptrain.parallel.launch import quiet_agent_logs

    quiet_agent_logs()
    with caplog.at_level(logging.INFO):
        logging.getLogger("torch.multiprocessing.spawn").warning("Terminating process %s via signal SIGTERM", 1)
        logging.getLogger("torch.distributed.elastic.agent.server.api").warning(
            "[default_role] Worker group FAILED. 1/1 attempts left; will restart worker group")
    assert [r.getMessage() for r in caplog.records] == [
        "[default_role] Worker group FAILED. 1/1 attempts left; will restart worker group"]


def test_a_usage_error_reaches_the_terminal_in_one_write(monkeypatch):
    # Under torchrun every rank writes the same line to one terminal; a line written in two pieces (print's text,
    # then its newline) interleaves with a peer's into `...--run_dirddptrain: error: ...` (seen in CI).
    from ddptrain import cli

    writes: list[str] = []

    class Terminal:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr("sys.stderr", Terminal())
    monkeypatch.delenv("DDPTRAIN_LOCAL_LAUNCH", raising=False)
    assert cli.main(["no-such-command"]) == 2
    assert len(writes) == 1 and writes[0].startswith("ddptrain: error: unknown command") and writes[0].endswith("\n")


def test_a_forkserver_ends_without_the_interpreters_teardown():
    """parallel.forkserver, the first import of every forkserver ddptrain starts, makes its exit skip the
    teardown (seconds of garbage collection over torch's objects, while the job's output pipe stays open),
    after the other exit handlers ran."""
    script = ("import atexit, gc\n"
              "import ddptrain.parallel.forkserver\n"
              "atexit.register(lambda: print('exit handler ran', flush=True))\n"
              "class Teardown:\n"
              "    def __del__(self):\n"
              "        print('teardown ran', flush=True)\n"
              "kept = Teardown()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "exit handler ran\n"


def test_a_sigterm_in_the_teardown_of_a_finished_run_exits_0_and_workers_are_named(tmp_path):
    """Issue 35 item 9: a SIGTERM that reaches the launcher once training ended was reported as "stopped by
    SIGTERM before a checkpoint committed", exit 143, for a run whose final weights were written.
    Item 10: the workers showed in ps and top as `python3 -B -c from multiprocessing.forkserver import main`."""
    proc = run_cli(["train", *TINY, *JOB, "--run_dir", str(tmp_path), "--nproc", "2", "--no-progress",
                    "--callbacks", "callback_plugins:RecordProcessName,callback_plugins:SignalLauncherAtEnd"],
                   fresh=True)  # a fork of the suite's zygote has the zygote's command line, which setproctitle keeps
    assert proc.returncode == 0, proc.stderr
    assert "SIGTERM after the run finished at step 4 (final weights written); exit 0" in proc.stderr
    assert (tmp_path / "model.safetensors").is_file()
    assert json.loads((tmp_path / "FINISHED").read_text())["step"] == 4
    for rank in (0, 1):
        shown = json.loads((tmp_path / f"process-rank-{rank}.json").read_text())
        assert shown == {"cmdline": f"ddptrain rank {rank}/2: {tmp_path}", "comm": f"ddptrain rank {rank}"}
