"""A user's own code and data: no silent wrong result. Real runs on gloo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch
from helpers import REPO, cli_env, metrics, one_line_error, run_python, train, weights

JOB = ["--max_steps", "40", "--dataset_size", "2048", "--epochs", "1", "--save_every", "0"]


def test_a_run_that_skips_every_update_fails_naming_the_steps(tmp_path):
    proc = train(tmp_path, *JOB, "--model", "user_plugins:nan_model", "--log_interval", "10", nproc=2, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "25 updates in a row skipped (steps 1-25: non-finite loss on rank(s) [0, 1])" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "model.safetensors").exists()


def test_the_last_line_counts_the_updates_applied(tmp_path):
    proc = train(tmp_path, "--max_steps", "6", "--inject_fault", "rank=0,step=2,kind=nan")
    assert "done: 6 steps, 5 updates (1 skipped: non-finite)" in proc.stdout + proc.stderr


def test_a_submodule_frozen_with_eval_stays_frozen_through_training_and_eval(tmp_path):
    # The FLOP count at start (rank 0) and every eval used to put the whole model back in train mode: the
    # frozen BatchNorm then updated its statistics, on rank 0 first, so the ranks computed different functions.
    train(tmp_path, *JOB[:2], "--model", "user_plugins:frozen_norm_model", "--epochs", "2", "--max_steps", "0",
          "--dataset_size", "256", nproc=2)
    final = weights(tmp_path / "model.safetensors")
    assert torch.equal(final["norm.running_mean"], torch.zeros_like(final["norm.running_mean"]))
    assert torch.equal(final["norm.running_var"], torch.ones_like(final["norm.running_var"]))
    assert final["norm.num_batches_tracked"].item() == 0


def test_a_datasets_own_collate_fn_makes_its_batches(tmp_path):
    # Items of (image, label) that the dataset's collate_fn turns into a dict: the task fails without it.
    train(tmp_path, "--dataset", "user_plugins:tagged_pairs", "--task", "user_plugins:dict_only", "--num_classes", "4",
          "--in_channels", "1", "--max_steps", "4", "--num_workers", "2", nproc=2)
    assert (tmp_path / "model.safetensors").exists()
    # The FLOP count (MFU) reads a batch the same collate_fn made (issue 37 item 10: it tried ddptrain's own).
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "training FLOPs per sample" in log and "FLOP count unavailable" not in log, log


# --- resume: only what the user means to continue --------------------------------------------------

def test_a_resume_with_changed_training_settings_is_refused_and_touches_nothing(tmp_path):
    train(tmp_path, "--max_steps", "4", "--save_every_steps", "2")
    before = {name: (tmp_path / name).read_bytes() for name in ("config.toml", "model.safetensors", "metrics.jsonl")}
    line = one_line_error(train(tmp_path, "--max_steps", "6", "--lr", "0.2", check=False))
    assert "lr 0.1 -> 0.2" in line and "--accept_config_change" in line and "--no-auto_resume" in line, line
    assert {name: (tmp_path / name).read_bytes() for name in before} == before, "the refused run wrote something"
    # Forced: it goes on from step 4, and the config the first 4 steps saw is kept beside the new one.
    train(tmp_path, "--max_steps", "6", "--lr", "0.2", "--accept_config_change")
    assert "lr = 0.1" in (tmp_path / "config-until-step-4.toml").read_text()
    assert "lr = 0.2" in (tmp_path / "config.toml").read_text()
    assert "resuming from" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_more_steps_is_not_a_changed_setting(tmp_path):
    train(tmp_path, "--max_steps", "2", "--save_every_steps", "2")
    train(tmp_path, "--max_steps", "4")
    assert [r["step"] for r in metrics(tmp_path, "train")] == [1, 2, 3, 4]


def test_runs_without_a_config_file_get_a_run_dir_per_training():
    from ddptrain.config import resolve_config

    base = resolve_config(["--model", "mlp"]).run_dir
    assert base.startswith("runs/default-")
    assert resolve_config(["--model", "mlp", "--max_steps", "9", "--nproc", "2"]).run_dir == base  # same training
    assert resolve_config(["--model", "mlp", "--lr", "0.5"]).run_dir != base


def run_fit(cwd, *args: str) -> subprocess.CompletedProcess:
    return run_python([str(REPO / "tests" / "fit_script.py"), *args], cwd=cwd, timeout=300)


def test_fit_resumes_only_a_run_dir_it_was_given(tmp_path):
    # Unnamed: every call starts fresh in runs/fit_script (older checkpoints moved aside, never lost).
    first = run_fit(tmp_path, "-", "4")
    second = run_fit(tmp_path, "-", "6")
    assert first.returncode == second.returncode == 0, second.stderr[-2000:]
    assert json.loads(second.stdout.splitlines()[-1])["step"] == 6
    own = tmp_path / "runs" / "fit_script"
    assert "resuming from" not in (own / "logs" / "rank-0.log").read_text()
    assert (own / "checkpoints" / "abandoned").is_dir()
    # Named: it continues.
    run_fit(tmp_path, str(tmp_path / "named"), "4")
    run_fit(tmp_path, str(tmp_path / "named"), "6")
    assert "resuming from" in (tmp_path / "named" / "logs" / "rank-0.log").read_text()


def test_fit_with_nproc_restarts_a_killed_worker_as_the_cli_does(tmp_path):
    killed = {"DDPTRAIN_FAULT": "rank=1,step=3,kind=sigkill"}
    proc = run_python([str(REPO / "tests" / "fit_script.py"), str(tmp_path / "one"), "6", "2", "1"], env=killed,
                      cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in proc.stderr  # the CLI's agent
    assert json.loads(proc.stdout.splitlines()[-1])["step"] == 6
    assert "resuming from" in (tmp_path / "one" / "logs" / "rank-0.log").read_text()
    proc = run_python([str(REPO / "tests" / "fit_script.py"), str(tmp_path / "two"), "6", "2"], env=killed,
                      cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout
    # The CLI's line, raised, naming the killed rank: whether the agent found its death first, or rank 0's
    # "connection closed" error first (rank 0 then recorded rank 1's end in rank 1's error file).
    line = proc.stdout.splitlines()[-1]
    assert line.startswith(f"failed: TrainingError: training failed: rank 1 on host {os.uname().nodename}: "), line
    assert re.search(r": (Signal 9 \(SIGKILL\)|killed by SIGKILL|its process \(pid \d+\) ended without an error)", line), line
    assert line.endswith(f"; its log: {tmp_path / 'two' / 'logs' / 'rank-1.log'}"), line


FIT_A_MODULE = """
import json, sys

import torch
from safetensors.torch import save_file

import ddptrain
from ddptrain.data.pipeline import SyntheticImages
from ddptrain.models import MLP

if __name__ == "__main__":  # fit(nproc=2) spawns workers that import this file
    model = MLP(64, 4, hidden=16)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, "before.safetensors")
    config = ddptrain.TrainConfig(num_classes=4, in_channels=1, image_size=8, batch_size=16, max_steps=4,
                                  save_every=0, num_workers=0, progress=False, nproc=2, run_dir=sys.argv[1])
    summary = ddptrain.fit(model=model, train_data=SyntheticImages(256, num_classes=4, channels=1, image_size=8,
                                                                    seed=3), config=config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, "after.safetensors")
    print(json.dumps({"step": summary["step"], "weights": summary["weights"]}))
"""


def test_fit_with_nproc_gives_the_trained_weights_back_to_the_module_passed_in(tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "fit_module.py").write_text(FIT_A_MODULE)
    proc = subprocess.run([sys.executable, "fit_module.py", "run"], capture_output=True, text=True, env=cli_env(),
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["step"] == 4 and summary["weights"] == "run/model.safetensors"
    before, after = load_file(tmp_path / "before.safetensors"), load_file(tmp_path / "after.safetensors")
    final = load_file(tmp_path / "run" / "model.safetensors")
    assert after.keys() == final.keys()
    assert all(torch.equal(after[k], final[k]) for k in final), "the module holds the run's final weights"
    assert not all(torch.equal(after[k], before[k]) for k in before), "and they are trained, not the initial ones"


FIT_TWICE = """
import json, os, signal

import ddptrain
from ddptrain.data.pipeline import SyntheticImages


def caller_state():
    return dict(os.environ), {sig: signal.getsignal(sig) for sig in signal.valid_signals()
                              if sig not in (signal.SIGKILL, signal.SIGSTOP)}


if __name__ == "__main__":
    before = caller_state()
    data = SyntheticImages(256, num_classes=4, channels=1, image_size=8, seed=3)
    steps = []
    for run_dir, nproc in (("a", 2), ("b", 2), ("c", 0)):
        config = ddptrain.TrainConfig(model="mlp", num_classes=4, in_channels=1, image_size=8, width=16,
                                      batch_size=16, max_steps=2, save_every=0, num_workers=0, progress=False,
                                      nproc=nproc, run_dir=run_dir)
        steps.append(ddptrain.fit(train_data=data, config=config)["step"])
        assert caller_state() == before, run_dir
    print(json.dumps(steps))
"""


def test_fit_with_nproc_leaves_the_callers_process_as_it_found_it(tmp_path):
    """`fit(nproc=N)` runs the CLI's launcher in the user's process: the agent's signal handlers and the
    launcher's environment (whose LOCAL_LAUNCH_ENV would tell a later in-process `fit` that a launcher wrote
    its config) must not outlive the call; a second call reuses the workers' server."""
    (tmp_path / "fit_twice.py").write_text(FIT_TWICE)
    proc = run_python([str(tmp_path / "fit_twice.py")], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [2, 2, 2]
    assert all((tmp_path / run / "config.toml").is_file() for run in "abc")  # written by the launcher, then rank 0
