"""Which checkpoints a run keeps, and where it resumes, when its history is not a straight line.

A run that resumes from an older step than the newest committed one (after a fallback, an explicit
`--resume_from`, or `--no-auto_resume`) starts a new line: the newer checkpoints of the abandoned line are
moved to `checkpoints/abandoned/`, never deleted and never resumed from again, and retention keeps the new
line's saves. `--resume_from` chooses the start of the first attempt only. Real runs, 1 process (retention
and resume choice happen on rank 0 and are agreed on through the same code at any world size) and, for
restarts, 2 processes under the elastic agent.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import assert_bitwise_equal, one_line_error, optimizer_state, train, weights

# 16 steps per epoch; checkpoints every 2 steps.
JOB = ["--batch_size", "16", "--epochs", "1", "--save_every", "0", "--save_every_steps", "2"]


def committed(run_dir: Path) -> list[int]:
    from ddptrain.checkpoints.format import committed_steps

    return sorted(step for step, _ in committed_steps(run_dir / "checkpoints"))


def abandoned(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints" / "abandoned"
    return sorted(p.name for p in root.glob("*/step-*") if (p / "manifest.json").is_file())


def resumed_from(proc) -> str:
    line = next(line for line in proc.stdout.splitlines() if "resuming from" in line)
    return line.split("resuming from ", 1)[1]


def history(run_dir: Path, max_steps: int) -> None:
    """Committed step-2, step-4, ... step-`max_steps`, all kept."""
    train(run_dir, *JOB, "--max_steps", str(max_steps), "--keep_last", "0")
    assert committed(run_dir) == list(range(2, max_steps + 1, 2))


def corrupt(checkpoint: Path) -> None:
    target = checkpoint / "shards" / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_after_a_fallback_the_new_save_is_kept_and_the_unusable_one_moved_aside(tmp_path):
    history(tmp_path, 6)
    corrupt(tmp_path / "checkpoints" / "step-6")
    # Falls back past step-6 to step-4 and ends at step 5: keep_last 1 must keep step-5, the only save of
    # this run, not the unusable step-6 that sorts higher.
    proc = train(tmp_path, *JOB, "--max_steps", "5", "--keep_last", "1")
    assert resumed_from(proc).endswith("step-4 (step 4)")
    assert committed(tmp_path) == [5]
    assert abandoned(tmp_path) == ["step-6"]
    later = train(tmp_path, *JOB, "--max_steps", "7", "--keep_last", "1")
    assert resumed_from(later).endswith("step-5 (step 5)")
    assert committed(tmp_path) == [7] and abandoned(tmp_path) == ["step-6"]


def test_an_explicit_older_resume_starts_a_line_that_later_attempts_continue(tmp_path):
    history(tmp_path, 6)
    start = str(tmp_path / "checkpoints" / "step-2")
    train(tmp_path, *JOB, "--resume_from", start, "--max_steps", "3", "--keep_last", "1")
    assert committed(tmp_path) == [3], "retention deleted the new line's save"
    assert abandoned(tmp_path) == ["step-4", "step-6"]
    # The same command again (a requeue, a rerun): step-2 itself is gone (retention), and the run continues
    # its own line from step-3 instead of going back to step-2 or failing.
    proc = train(tmp_path, *JOB, "--resume_from", start, "--max_steps", "5", "--keep_last", "1")
    assert resumed_from(proc).endswith("step-3 (step 3)")
    assert committed(tmp_path) == [5]
    manifest = json.loads((tmp_path / "checkpoints" / "step-5" / "manifest.json").read_text())
    assert manifest["origin"] == str(Path(start).resolve())
    # Deterministic training: the line from step-2 ends where a straight run to step 5 ends.
    straight = tmp_path.parent / (tmp_path.name + "-straight")
    train(straight, *JOB, "--max_steps", "5")
    assert_bitwise_equal(weights(tmp_path / "model.safetensors"), weights(straight / "model.safetensors"))


def test_an_elastic_restart_does_not_go_back_to_resume_from(tmp_path):
    history(tmp_path, 4)
    start = str(tmp_path / "checkpoints" / "step-2")
    # Two processes, 8 steps per epoch; rank 1 dies in step 7, after step-6 committed. The restarted
    # workers carry the same --resume_from and must continue from step-6.
    proc = train(tmp_path, *JOB, "--resume_from", start, "--max_steps", "8", "--batch_size", "8",
                 "--max_restarts", "1", nproc=2, env={"DDPTRAIN_FAULT": "rank=1,step=7,kind=sigkill"})
    starts = [line.split("resuming from ", 1)[1] for line in proc.stdout.splitlines() if "resuming from" in line]
    assert len(starts) == 2 and starts[0].endswith("step-2 (step 2)"), proc.stdout
    assert starts[1].endswith("step-6 (step 6)"), proc.stdout
    assert committed(tmp_path)[-1] == 8


def test_a_fresh_start_moves_the_old_line_aside(tmp_path):
    history(tmp_path, 6)
    train(tmp_path, *JOB, "--no-auto_resume", "--max_steps", "2", "--keep_last", "1")
    assert committed(tmp_path) == [2]
    assert abandoned(tmp_path) == ["step-2", "step-4", "step-6"]
    proc = train(tmp_path, *JOB, "--max_steps", "4", "--keep_last", "1")
    assert resumed_from(proc).endswith("step-2 (step 2)")


def test_a_changed_optimizer_is_a_usage_error_and_moves_nothing(tmp_path):
    history(tmp_path, 2)
    line = one_line_error(train(tmp_path, *JOB, "--optimizer", "adamw", "--max_steps", "4", check=False))
    assert "optimizer 'sgd' -> 'adamw'" in line and "--accept_config_change" in line
    assert committed(tmp_path) == [2] and abandoned(tmp_path) == []
    # Forced, the optimizer's state still cannot be carried from sgd to adamw: refused, naming both.
    line = one_line_error(train(tmp_path, *JOB, "--optimizer", "adamw", "--max_steps", "4", "--accept_config_change",
                                check=False))
    assert "--optimizer adamw" in line and "sgd" in line
    assert committed(tmp_path) == [2] and abandoned(tmp_path) == []


def test_on_resume_the_config_sets_the_optimizer_hyperparameters(tmp_path):
    history(tmp_path, 2)
    proc = train(tmp_path, *JOB, "--momentum", "0.5", "--weight_decay", "0.003", "--max_steps", "4",
                 "--accept_config_change")
    assert "momentum 0.9 -> 0.5" in proc.stdout and "weight_decay 0.0001 -> 0.003" in proc.stdout
    groups = optimizer_state(tmp_path / "checkpoints" / "step-4")["param_groups"]
    assert all(g["momentum"] == 0.5 and g["weight_decay"] == 0.003 for g in groups)
    # The optimizer's state (momentum buffers) still comes from the checkpoint.
    state = optimizer_state(tmp_path / "checkpoints" / "step-4")["state"]
    assert state and all(torch.isfinite(s["momentum_buffer"]).all() for s in state.values())
