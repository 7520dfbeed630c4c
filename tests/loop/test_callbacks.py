"""Callbacks (docs/callbacks.md): the loop's events, state in checkpoints, a stop every rank agrees on; the
built-ins on it (early stopping) and beside it (--eval_every_steps, --max_time). Real processes, gloo on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import (
    TINY,
    assert_bitwise_equal,
    assert_restarted,
    checkpoint_weights,
    cli_in_process,
    last_committed,
    metrics,
    one_line_error,
    run_cli,
    train,
    weights,
)

from ddptrain.config import parse_duration
from ddptrain.errors import UsageError
from ddptrain.loop.callbacks import EMA, BestCheckpoint, Callbacks, EarlyStopping, run_callbacks

# 4 epochs of 4 steps (global batch 64 of 256 samples); a checkpoint every 3 steps and at each epoch's end.
LEDGER = ["--callbacks", "callback_plugins:Ledger", "--epochs", "4", "--save_every_steps", "3", "--keep_last", "0",
          "--control_interval", "2", "--eval_every_steps", "4"]


def ledgers(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"ledger-rank-{rank}.json").read_text()) for rank in (0, 1)]


def test_a_callbacks_state_survives_a_kill_and_its_stop_reaches_every_rank(tmp_path):
    """Ledger keeps every event and a float64 sum of the weights at each step; rank 1 asks to stop at step 10.
    Killed at step 5 and restarted from the step-4 checkpoint, each rank's ledger ends equal to the
    uninterrupted run's: nothing the restart replayed is there twice, nothing is missing. The stop, asked on
    rank 1 only, is cast at step 10 and read at 11: both ranks stop there, and the run exits 0."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, *LEDGER, nproc=2)
    proc = train(run, *LEDGER, "--max_restarts", "1", nproc=2, env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert_restarted(proc, run, from_step=4)
    for ours, theirs in zip(ledgers(run), ledgers(ref)):
        assert ours["events"] == theirs["events"]
        assert ours["weight_sum"] == theirs["weight_sum"]
    rank0, rank1 = ledgers(ref)
    assert [e for e in rank0["events"] if e[0] == "end"] == [["end", 11]] == [e for e in rank1["events"] if e[0] == "end"]
    assert [e[1] for e in rank0["events"] if e[0] == "step"] == list(range(1, 12))
    assert [e[1] for e in rank0["events"] if e[0] == "checkpoint"] == [3, 4, 6, 8, 9, 11]
    assert [e[1] for e in rank0["events"] if e[0] == "eval"] == [4, 8, 11]  # once each: every-4 and the epochs' ends
    assert [e[1] for e in rank0["events"] if e[0] == "log"] == list(range(1, 12))
    assert not [e for e in rank1["events"] if e[0] == "log"], "on_log is rank 0's"
    assert ledgers(run)[0]["starts_at"] == 4  # the restarted process began at the checkpoint
    assert last_committed(run).name == "step-11"
    assert_bitwise_equal(weights(run / "model.safetensors"), weights(ref / "model.safetensors"))
    log = (run / "logs" / "rank-0.log").read_text()
    assert "stopping at step 11: a callback on another rank asked to stop" in log
    # The stop is in the checkpoint: the same command again trains nothing.
    again = train(run, *LEDGER, nproc=2)
    assert "run stopped early at step 11" in again.stderr + (run / "logs" / "rank-0.log").read_text()
    assert last_committed(run).name == "step-11"


EARLY = ["--lr", "0", "--epochs", "3", "--eval_every_steps", "2", "--early_stop_metric", "loss",
         "--early_stop_patience", "2", "--save_every_steps", "4", "--keep_last", "0"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_early_stopping_stops_every_rank_at_the_same_step_and_keeps_its_patience_through_a_restart(tmp_path, strategy):
    """lr 0: the eval loss never improves after its first value (step 2). Patience 2: evals at 4 and 6 fail to
    improve, so the run stops at step 6 on both ranks. Killed at step 5, the restart resumes from step 4 with
    one eval of patience spent and still stops at 6; a restart that forgot the count would stop at 10."""
    proc = train(tmp_path, *EARLY, "--strategy", strategy, "--max_restarts", "1", nproc=2,
                 env={"DDPTRAIN_FAULT": "rank=0,step=5,kind=sigkill"})
    assert_restarted(proc, tmp_path, from_step=4)
    assert last_committed(tmp_path).name == "step-6"
    assert max(r["step"] for r in metrics(tmp_path, "train")) == 6
    assert [r["step"] for r in metrics(tmp_path, "eval")] == [2, 4, 6]
    for rank in (0, 1):
        assert "stopping at step 6: early stopping: eval loss has not improved" in \
            (tmp_path / "logs" / f"rank-{rank}.log").read_text()


# 4 steps an epoch; the first eval (step 4) sets the best, no later one improves by 10: patience 1 is spent at 8.
STOP_AT_EPOCH_END = ["--epochs", "6", "--early_stop_metric", "loss", "--early_stop_patience", "1",
                     "--early_stop_min_delta", "10"]


def test_a_stop_decided_at_an_epoch_end_eval_ends_the_run_there_and_a_kill_after_it_does_not_undo_it(tmp_path):
    """The eval at the end of epoch 2 (step 8) exhausts the patience: the run stops at step 8, with no step 9.
    Rank 1 SIGKILLed as it hears that step 8's checkpoint committed (after the decision): the restart resumes
    from step 8, knows the run stopped there, trains nothing and ends bitwise as the uninterrupted run."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, *STOP_AT_EPOCH_END, nproc=2)
    assert max(r["step"] for r in metrics(ref, "train")) == 8
    assert [r["step"] for r in metrics(ref, "eval")] == [4, 8]
    assert "stopping at step 8: early stopping" in (ref / "logs" / "rank-0.log").read_text()
    proc = train(run, *STOP_AT_EPOCH_END, "--callbacks", "callback_plugins:KillAfterCheckpoint", "--max_restarts",
                 "1", nproc=2, env={"KILL_RANK": "1", "KILL_STEP": "8"})
    assert_restarted(proc, run, from_step=8)
    assert "run stopped early at step 8 (early stopping" in (run / "logs" / "rank-0.log").read_text()
    assert max(r["step"] for r in metrics(run, "train")) == 8
    assert last_committed(run).name == "step-8"
    assert_bitwise_equal(weights(run / "model.safetensors"), weights(ref / "model.safetensors"))


@pytest.mark.parametrize("asked_at, saves", [(6, "3"), (5, "5")], ids=["voted-before-the-save", "asked-before-the-vote"])
def test_a_stop_in_the_vote_when_a_checkpoint_is_taken_is_made_again_after_a_kill(tmp_path, asked_at, saves):
    """Rank 1 alone asks to stop at step 5 or 6; the vote (every 2 steps) carries it at 6 and is read at 7, so the
    run stops at 7. A checkpoint at the request's step holds it either in the vote in flight (asked at 6: cast
    at that very boundary) or as rank 1's request not yet cast (asked at 5): rank 0 SIGKILLed in step 7, the
    restart resumes from that checkpoint and stops at 7, bitwise as the uninterrupted run. A checkpoint that
    forgot the request would train on to the end (16 steps)."""
    job = ["--epochs", "4", "--callbacks", "callback_plugins:AskToStop", "--control_interval", "2",
           "--save_every", "0", "--save_every_steps", saves, "--keep_last", "0"]
    asked = {"STOP_RANK": "1", "STOP_STEP": str(asked_at)}
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, *job, nproc=2, env=asked)
    assert max(r["step"] for r in metrics(ref, "train")) == 7
    proc = train(run, *job, "--max_restarts", "1", nproc=2,
                 env={**asked, "DDPTRAIN_FAULT": "rank=0,step=7,kind=sigkill"})
    assert_restarted(proc, run, from_step=asked_at)
    assert max(r["step"] for r in metrics(run, "train")) == 7
    assert f"stopping at step 7: asked at step {asked_at}" in (run / "logs" / "rank-1.log").read_text()
    assert_bitwise_equal(weights(run / "model.safetensors"), weights(ref / "model.safetensors"))


# Evals at steps 1 and 2; the second exhausts patience 1: the run stops at step 2.
STOP_AT_2 = ["--epochs", "2", "--eval_every_steps", "1", "--early_stop_metric", "loss", "--early_stop_patience", "1",
             "--early_stop_min_delta", "10", "--control_interval", "1"]


@pytest.mark.parametrize("notice", ["sigterm", "max_time"])
def test_a_preemption_at_the_boundary_of_an_agreed_stop_keeps_the_stop(tmp_path, notice):
    """A SIGTERM in step 1 (rank 1) or --max_time over by the end of step 1 (rank 0 stalls 1 s in it) is read at
    the boundary of step 2, where the eval also decides to stop: the preemption checkpoint holds the stop, so
    the rerun trains nothing and ends bitwise as the run never preempted (which stops at step 2)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    # The model that signals its own process (vote_plugins) is the built-in MLP until its step comes.
    job = [*STOP_AT_2, *(["--model", "vote_plugins:signalling_mlp"] if notice == "sigterm" else [])]
    never = {"VOTE_SIGNAL_RANK": "1", "VOTE_SIGNAL_STEP": "99"}
    train(ref, *job, nproc=2, env=never)
    assert max(r["step"] for r in metrics(ref, "train")) == 2
    if notice == "sigterm":
        first = train(run, *job, nproc=2, check=False, env={"VOTE_SIGNAL_RANK": "1", "VOTE_SIGNAL_STEP": "1"})
    else:
        first = train(run, *job, "--max_time", "1", nproc=2, check=False,
                      env={**never, "DDPTRAIN_FAULT": "rank=0,step=1,kind=stall,seconds=1"})
    assert first.returncode == 75, first.stderr[-3000:]
    assert last_committed(run).name == "step-2"
    train(run, *job, nproc=2, env=never)
    assert "run stopped early at step 2 (early stopping" in (run / "logs" / "rank-0.log").read_text()
    assert max(r["step"] for r in metrics(run, "train")) == 2
    assert_bitwise_equal(weights(run / "model.safetensors"), weights(ref / "model.safetensors"))


def test_max_time_saves_and_exits_75_and_the_rerun_ends_as_an_uninterrupted_run(tmp_path):
    """--max_time 1 is over by the end of step 1 (rank 0 stalls 1 s in it, however fast the launch): the vote
    cast at step 1 is read at step 2, which is saved; exit 75, the run incomplete. The same command without the
    limit finishes it, bitwise equal to a run never stopped."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    job = ["--epochs", "2", "--control_interval", "1"]
    stopped = train(run, *job, "--max_time", "1", nproc=2, check=False,
                    env={"DDPTRAIN_FAULT": "rank=0,step=1,kind=stall,seconds=1"})
    assert stopped.returncode == 75, stopped.stderr
    assert "time limit --max_time 1: checkpoint of step 2 committed; exit 75" in stopped.stderr
    assert last_committed(run).name == "step-2"
    train(run, *job, nproc=2)
    train(ref, *job, nproc=2)
    assert_bitwise_equal(weights(run / "model.safetensors"), weights(ref / "model.safetensors"))


def test_a_metric_the_eval_lacks_is_a_one_line_error(tmp_path):
    # The eval's metrics are known to the training process, which builds the task: a process of its own.
    line = one_line_error(run_cli(["train", *TINY, "--run_dir", str(tmp_path), "--max_steps", "2",
                                   "--early_stop_metric", "bleu"]))
    assert "--early_stop_metric 'bleu'" in line and "loss" in line and "accuracy" in line


def test_a_callback_that_does_not_import_is_a_one_line_error_before_any_process(tmp_path):
    line = one_line_error(cli_in_process(["train", *TINY, "--run_dir", str(tmp_path), "--callbacks",
                                          "no_such_mod:Cb"]))
    assert "--callbacks" in line and "no_such_mod" in line


# --- in one process ------------------------------------------------------------------------------------

def test_early_stopping_counts_evaluations_without_improvement_by_more_than_min_delta():
    stops = []
    run = SimpleNamespace(step=0, request_stop=lambda reason, same_on_every_rank: stops.append((run.step, reason)))
    stopper = EarlyStopping("accuracy", patience=2, mode="max", min_delta=0.01)
    for step, accuracy in [(1, 0.5), (2, 0.6), (3, 0.605), (4, 0.62), (5, 0.62), (6, 0.625)]:
        run.step = step
        stopper.on_eval(run, {"accuracy": accuracy})
    assert [s for s, _ in stops] == [6]  # 0.605 and 0.62 at step 5 do not improve by 0.01; 0.62 at 4 did
    assert stopper.state_dict() == {"best": 0.62, "best_step": 4, "bad_evals": 2}
    restored = EarlyStopping("accuracy", patience=2, mode="max")
    restored.load_state_dict(stopper.state_dict())
    assert restored.state_dict() == stopper.state_dict()


def test_callbacks_are_named_by_class_and_an_object_without_hooks_is_refused():
    class Counter:
        def on_step_end(self, run): ...

        def state_dict(self):
            return {"n": 1}

    callbacks = Callbacks([Counter(), Counter(), EarlyStopping("loss", 1)])
    assert callbacks.names == ["Counter", "Counter-2", "early_stopping"]
    assert set(callbacks.state_dict()) == {"Counter", "Counter-2", "early_stopping"}
    with pytest.raises(UsageError, match="has none of the hooks"):
        Callbacks([object()])


@pytest.mark.parametrize("text, seconds", [("5400", 5400), ("90:00", 5400), ("1:30:00", 5400),
                                           ("2-00:00:00", 172800), ("0.5", 0.5)])
def test_max_time_reads_seconds_and_slurm_times(text, seconds):
    assert parse_duration(text, "--max_time") == seconds


@pytest.mark.parametrize("text", ["x", "-5", "1-30", "0", "1:2:3:4"])
def test_max_time_refuses_what_is_not_a_duration(text):
    with pytest.raises(UsageError, match="--max_time"):
        parse_duration(text, "--max_time")


# --- EMA -------------------------------------------------------------------------------------------------

def test_the_ema_is_the_average_of_the_per_step_weights_computed_by_hand(tmp_path):
    """--ema_decay 0.9 over 4 steps with a checkpoint at each: model_ema.safetensors equals, bit for bit,
    torch.lerp(ema, weights of step s, 1 - 0.9) applied by hand from the initial weights through steps 1..4."""
    import torch
    from helpers import initial_weights

    train(tmp_path, "--epochs", "1", "--save_every_steps", "1", "--keep_last", "0", "--ema_decay", "0.9", nproc=2)
    ema = {k: v.clone() for k, v in initial_weights().items()}
    for step in range(1, 5):
        for name, value in checkpoint_weights(tmp_path / "checkpoints" / f"step-{step}").items():
            ema[name] = torch.lerp(ema[name], value, 1.0 - 0.9)
    exported = weights(tmp_path / "model_ema.safetensors")
    assert_bitwise_equal(exported, ema)
    final = weights(tmp_path / "model.safetensors")
    assert any(not torch.equal(final[k], exported[k]) for k in final), "the average is not the weights"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_ema_of_a_killed_and_restarted_run_is_bitwise_the_uninterrupted_runs(tmp_path, strategy):
    ref, run = tmp_path / "ref", tmp_path / "run"
    job = ["--epochs", "3", "--save_every_steps", "3", "--keep_last", "0", "--ema_decay", "0.8", "--strategy", strategy]
    train(ref, *job, nproc=2)
    proc = train(run, *job, "--max_restarts", "1", nproc=2, env={"DDPTRAIN_FAULT": "rank=1,step=8,kind=sigkill"})
    assert_restarted(proc, run, from_step=6)
    assert_bitwise_equal(weights(run / "model_ema.safetensors"), weights(ref / "model_ema.safetensors"))


def test_ema_eval_evaluates_the_average_and_changes_nothing_in_training(tmp_path):
    """--ema_eval adds ema_<metric> to each eval line. With --lr 0 the average is the weights, so each ema_
    metric equals its plain one bitwise; with --lr 0.1 they differ, and the weights and the average end bitwise
    equal to a run that never evaluated the average (the swap gives the weights back exactly)."""
    job = ["--epochs", "2", "--eval_every_steps", "2", "--ema_decay", "0.9"]
    still, evaluated, plain = tmp_path / "still", tmp_path / "evaluated", tmp_path / "plain"
    train(still, *job, "--ema_eval", "--lr", "0")
    lines = metrics(still, "eval")
    assert len(lines) >= 4 and all(r["step"] % 2 == 0 for r in lines)
    assert all(r["ema_loss"] == r["loss"] and r["ema_accuracy"] == r["accuracy"] for r in lines), lines
    train(evaluated, *job, "--ema_eval")
    train(plain, *job)
    assert all(r["ema_loss"] != r["loss"] for r in metrics(evaluated, "eval"))
    assert not any("ema_loss" in r for r in metrics(plain, "eval"))
    for name in ("model.safetensors", "model_ema.safetensors"):
        assert_bitwise_equal(weights(evaluated / name), weights(plain / name))


BEST = ["--epochs", "2", "--eval_every_steps", "2", "--keep_best", "loss", "--keep_best_mode", "max",
        "--save_every_steps", "4", "--keep_last", "1"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_best_checkpoint_is_kept_apart_from_retention_through_a_restart(tmp_path, strategy):
    """--keep_best loss in mode max: the eval loss falls as the model learns, so the best is the first eval's,
    at step 2. Not a save step (every 4) and outside --keep_last 1, step 2's checkpoint is CHECKPOINT_DIR/best,
    also after rank 1 is killed at step 5 and the restart resumes from step 4 (a restart that forgot the best
    value would keep step 6's); exported, its weights are bitwise a reference run's step-2 checkpoint's. With
    --load_best_at_end the run's final weights are those too, not step 8's."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    proc = train(run, *BEST, "--strategy", strategy, "--max_restarts", "1", "--load_best_at_end", nproc=2,
                 env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert_restarted(proc, run, from_step=4)
    losses = {r["step"]: r["loss"] for r in metrics(run, "eval")}
    assert sorted(losses) == [2, 4, 6, 8] and max(losses, key=losses.get) == 2, losses
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-8"]  # --keep_last 1
    best = run / "checkpoints" / "best"
    assert json.loads((best / "manifest.json").read_text())["step"] == 2
    train(ref, "--epochs", "2", "--save_every_steps", "2", "--keep_last", "0", "--strategy", strategy, nproc=2)
    for source, out in ((best, tmp_path / "best.safetensors"), (ref / "checkpoints" / "step-2", tmp_path / "ref.safetensors")):
        exported = run_cli(["export", str(source), str(out)])
        assert exported.returncode == 0, exported.stderr
    assert_bitwise_equal(weights(tmp_path / "best.safetensors"), weights(tmp_path / "ref.safetensors"))
    assert_bitwise_equal(weights(run / "model.safetensors"), weights(tmp_path / "ref.safetensors"))
    assert "the final weights are those of" in (run / "logs" / "rank-0.log").read_text()
    # The last line says whose weights the files hold beside the last eval's metrics (it showed step 8's loss
    # beside step 2's weights, as if they were one step's).
    done = [line for line in proc.stdout.splitlines() if "done: 8 steps" in line]
    assert done and f"(at step 8). run dir {run}" in done[0], proc.stdout
    assert f"weights of step 2 (best loss {losses[2]:.4f}) {run / 'model.safetensors'}" in done[0], done
    from safetensors import safe_open

    with safe_open(str(run / "model.safetensors"), "pt") as final:
        assert final.metadata()["step"] == "2", "the file says whose weights it holds"


@pytest.mark.parametrize("fault", ["leftover-tmp-file", "enospc-once"])
def test_a_best_checkpoint_that_could_not_be_kept_is_kept_from_retention_and_made_at_the_next_save(tmp_path, fault):
    """The best is step 2's (as above). Making best/ fails there once: a file left as .best.tmp by an earlier
    crash, or a full disk (ENOSPC) in the copy. Retention (--keep_last 1) must not delete step 2 meanwhile: the
    save of step 4 makes it best/, and the run exits 0 with best/ bitwise step 2's."""
    env = {}
    if fault == "leftover-tmp-file":
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / ".best.tmp").write_text("left by a crash")
    else:
        env = {"DDPTRAIN_FAULT": "rank=0,step=2,kind=ioerror,at=best,times=1"}
    train(tmp_path, *BEST, nproc=2, env=env)
    best = tmp_path / "checkpoints" / "best"
    assert json.loads((best / "manifest.json").read_text())["step"] == 2
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-8"]
    assert not (tmp_path / "checkpoints" / ".best.tmp").exists()


def test_a_best_checkpoint_that_could_never_be_kept_fails_the_finished_run_and_keeps_its_step(tmp_path):
    """best/ fails at every try (a disk that stays full): the run trains to the end and writes its weights, then
    exits 1 with one line that names the checkpoint owed to best/, which retention kept (step-2)."""
    proc = train(tmp_path, *BEST, nproc=2, check=False,
                 env={"DDPTRAIN_FAULT": "rank=0,step=2,kind=ioerror,at=best,times=99"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "could not keep the best checkpoint" in proc.stderr and "step-2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-2", "step-8"]
    assert not (tmp_path / "checkpoints" / "best").exists()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_best_chosen_by_an_ema_metric_holds_the_average_and_says_so(tmp_path, strategy):
    """--keep_best ema_loss: the average scored the metric, so best/ is the average's. best/best.json names the
    step, metric and weights ("ema"); `ddptrain export` of best/ gives the average at that step, bitwise the
    model_ema.safetensors of a run that ended there; `--weights trained` still gives the trained weights. With
    --load_best_at_end the run's final weights (and its model_ema) are that average."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    ema = ["--ema_decay", "0.9", "--ema_eval", "--strategy", strategy]
    train(run, *[a if a != "loss" else "ema_loss" for a in BEST], *ema, "--load_best_at_end", nproc=2)
    about = json.loads((run / "checkpoints" / "best" / "best.json").read_text())
    assert about["metric"] == "ema_loss" and about["weights"] == "ema", about
    step = about["step"]
    assert about["value"] == {r["step"]: r["ema_loss"] for r in metrics(run, "eval")}[step]
    train(ref, "--epochs", "2", "--max_steps", str(step), *ema, nproc=2)
    out = tmp_path / "best.safetensors"
    exported = run_cli(["export", str(run / "checkpoints" / "best"), str(out)])
    assert exported.returncode == 0 and "ema weights" in exported.stdout, exported.stderr
    assert_bitwise_equal(weights(out), weights(ref / "model_ema.safetensors"))
    trained = run_cli(["export", str(run / "checkpoints" / "best"), str(tmp_path / "t.safetensors"), "--weights",
                       "trained"])
    assert trained.returncode == 0, trained.stderr
    assert_bitwise_equal(weights(tmp_path / "t.safetensors"), weights(ref / "model.safetensors"))
    assert step < 8
    for final in ("model.safetensors", "model_ema.safetensors"):
        assert_bitwise_equal(weights(run / final), weights(ref / "model_ema.safetensors"))


def test_a_best_owed_when_a_worker_died_is_made_best_by_the_restarted_run(tmp_path):
    """best/ of step 2 fails at every try in the first attempt, then rank 1 is SIGKILLed in step 5. The restart
    (from step 4, whose --keep_last 1 retention kept step 2) learns from its best value that step 2 is owed to
    best/, keeps it from its own retention and makes it best/ at its first save: exit 0, best/ is step 2."""
    # Two faults in the first attempt: best/ fails on rank 0 (the injector), rank 1 dies (a callback).
    proc = train(tmp_path, *BEST, "--max_restarts", "1", "--callbacks", "callback_plugins:KillAfterCheckpoint",
                 nproc=2, env={"DDPTRAIN_FAULT": "rank=0,step=2,kind=ioerror,at=best,times=99",
                               "KILL_RANK": "1", "KILL_STEP": "4"})
    assert_restarted(proc, tmp_path, from_step=4)
    assert json.loads((tmp_path / "checkpoints" / "best" / "manifest.json").read_text())["step"] == 2
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-8"]


def test_the_loop_asks_only_the_built_ins_the_flags_added_for_the_average_and_best():
    """A user's own EMA or BestCheckpoint (fit's callbacks, --callbacks) runs as any callback; the average the
    loop evaluates, exports and restores, and the best/ it owes, are --ema_decay's and --keep_best's alone."""
    from ddptrain.config import TrainConfig

    mine = [EMA(0.5, sharded=False), BestCheckpoint("loss", "min")]
    plain = run_callbacks(TrainConfig().section("eval"), mine, sharded=False)
    assert plain.items == mine and plain.ema is None and plain.best is None
    flagged = run_callbacks(TrainConfig(ema_decay=0.9, keep_best="loss").section("eval"), mine, sharded=False)
    assert flagged.items[:2] == mine and len(flagged.items) == 4
    assert flagged.ema is flagged.items[2] and flagged.ema.decay == 0.9
    assert flagged.best is flagged.items[3] and flagged.best is not mine[1]
