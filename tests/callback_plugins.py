"""Callbacks that tests load with `--callbacks` (test_callbacks.py: a user's callback with state; others: what a
test records of a run)."""

from __future__ import annotations

import json
import os
import signal
import time

import torch

import ddptrain


class Ledger(ddptrain.Callback):
    """Writes down every event it hears, keeps the sum of the weights it saw at each step boundary (a float64
    tensor: its bits show a replayed or missed step), and asks to stop on rank 1 only, at step 10: the stop
    must reach rank 0 through the vote. At the end, its state goes to RUN_DIR/ledger-rank-R.json."""

    def __init__(self):
        self.events: list[list] = []
        self.weight_sum = torch.zeros((), dtype=torch.float64)

    def on_train_start(self, run):
        self.starts_at = run.step  # not state: where this process began

    def on_step_end(self, run):
        self.weight_sum += sum(p.detach().double().sum() for p in run.model.parameters())
        self.events.append(["step", run.step])
        if run.rank == 1 and run.step == 10:
            run.request_stop("the ledger is full")

    def on_log(self, run, record):
        assert run.is_main
        self.events.append(["log", record["step"], record["loss"]])

    def on_eval(self, run, metrics):
        self.events.append(["eval", run.step, metrics["loss"]])

    def on_checkpoint(self, run, step):
        self.events.append(["checkpoint", step])

    def on_train_end(self, run, summary):
        self.events.append(["end", summary["step"]])
        out = {"events": self.events, "weight_sum": self.weight_sum.item(), "starts_at": self.starts_at}
        (run.run_dir / f"ledger-rank-{run.rank}.json").write_text(json.dumps(out))

    def state_dict(self):
        return {"events": self.events, "weight_sum": self.weight_sum}

    def load_state_dict(self, state):
        self.events, self.weight_sum = state["events"], state["weight_sum"]


class KillWhenTracked(ddptrain.Callback):
    """A fault for tests/observe/test_trackers.py: in the first incarnation, rank 1 waits at the boundary after step 7
    until the test has seen the tracker hold the line of step 6 (the file RUN_DIR/tracked), then SIGKILLs
    itself. The launcher's restart from the step-4 checkpoint then trains steps 5 and 6 again, whose lines the
    tracker already has."""

    def on_step_end(self, run):
        if run.rank != 1 or run.step != 7 or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        flag = run.run_dir / "tracked"
        deadline = time.monotonic() + 300
        while not flag.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the test never saw the tracker hold step 6")
            time.sleep(0.05)
        flag.unlink()
        os.kill(os.getpid(), signal.SIGKILL)


class AskToStop(ddptrain.Callback):
    """Rank $STOP_RANK asks to stop at the boundary of step $STOP_STEP, through the vote (a decision one rank
    takes alone). No state of its own: a restart from a later checkpoint never asks again, so a request that the
    checkpoint forgot is lost."""

    def on_step_end(self, run):
        if run.rank == int(os.environ["STOP_RANK"]) and run.step == int(os.environ["STOP_STEP"]):
            run.request_stop(f"asked at step {run.step}")


class KillAfterCheckpoint(ddptrain.Callback):
    """A fault right after a decision: in the first incarnation, rank $KILL_RANK SIGKILLs itself as it hears that
    the checkpoint of step $KILL_STEP committed."""

    def on_checkpoint(self, run, step):
        if (run.rank == int(os.environ["KILL_RANK"]) and step == int(os.environ["KILL_STEP"])
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)


class KillOnceCommitted(ddptrain.Callback):
    """A kill after an async checkpoint, whatever the machine's speed: in the first incarnation, rank $KILL_RANK
    waits at the boundary after step $KILL_STEP until checkpoints/step-$COMMITTED_STEP has committed (its
    manifest written by the writer thread, which runs on), then SIGKILLs itself."""

    def on_step_end(self, run):
        if (run.rank != int(os.environ["KILL_RANK"]) or run.step != int(os.environ["KILL_STEP"])
                or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
            return
        manifest = run.run_dir / "checkpoints" / f"step-{os.environ['COMMITTED_STEP']}" / "manifest.json"
        deadline = time.monotonic() + 300
        while not manifest.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{manifest} never appeared")
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)


class SignalLauncherAtEnd(ddptrain.Callback):
    """A SIGTERM in a finished job's teardown: rank 0 sends it to the `--nproc` launcher as training ends
    (after the final weights), then waits to be stopped with the other workers."""

    def on_train_end(self, run, summary):
        if run.rank == 0:
            os.kill(int(os.environ["DDPTRAIN_LAUNCHER_PID"]), signal.SIGTERM)
            time.sleep(60)  # the launcher's agent stops this worker


class RecordProcessName(ddptrain.Callback):
    """Writes what ps and top show for this worker (its command line and short name) to
    RUN_DIR/process-rank-R.json."""

    def on_train_start(self, run):
        cmdline = open("/proc/self/cmdline", "rb").read().split(b"\0")[0].decode()
        comm = open("/proc/self/comm").read().strip()
        (run.run_dir / f"process-rank-{run.rank}.json").write_text(json.dumps({"cmdline": cmdline, "comm": comm}))


class RecordPeak(ddptrain.Callback):
    """Writes RUN_DIR/peak-rank-R.json: this rank's peak resident memory (ru_maxrss, MiB) when training starts,
    after any resume (what building the model and reading a checkpoint cost); after each step ("step": the
    last one's); and when it ends, after the final weights were written."""

    def __init__(self):
        self.peaks = {}

    def _record(self, run, when):
        import resource

        self.peaks[when] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        (run.run_dir / f"peak-rank-{run.rank}.json").write_text(json.dumps(self.peaks))

    def on_train_start(self, run):
        self._record(run, "start")

    def on_step_end(self, run):
        self._record(run, "step")

    def on_train_end(self, run, summary):
        self._record(run, "end")


class Boundaries(ddptrain.Callback):
    """Writes RUN_DIR/boundaries.json: each boundary the loop handed the checkpoint manager (what it said of it)
    and whether the manager saved there. Reaches into the trainer: what it records is the loop's own traffic."""

    def on_train_start(self, run):
        manager, self.seen = run._trainer.checkpoints, []
        handed = manager.save

        def save(**when):
            saved = handed(**when)
            self.seen.append([run.step, sorted(when.items()), saved])
            return saved

        manager.save = save

    def on_train_end(self, run, summary):
        (run.run_dir / "boundaries.json").write_text(json.dumps(self.seen))
