"""A user's own code and data: no silent wrong result. Real runs on gloo."""

from __future__ import annotations

import torch

from helpers import train, weights

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
