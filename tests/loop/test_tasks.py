"""Tasks beyond classification, structured batches, token streams and the Python API, on real processes.

For each built-in task: 2 processes equal 1 process with the same global batch, and a killed-and-restarted
run ends bitwise where an uninterrupted one ends (classification: tests/e2e/test_equivalence.py and
tests/e2e/test_resume.py). A plug-in model that takes a dict and a plug-in task train on 2 processes with eval
metrics equal to a single-process evaluation of the exported weights.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    TINY,
    assert_bitwise_equal,
    assert_close_weights,
    assert_restarted,
    assert_trained,
    cli_env,
    cli_in_process,
    initial_weights,
    metrics,
    one_line_error,
    read_jsonl,
    run_cli,
    train,
    weights,
)
from safetensors.torch import load_file

REGRESSION = ["--task", "regression", "--model", "task_plugins:regressor", "--dataset", "task_plugins:regression_data",
              "--width", "8", "--dataset_size", "256", "--eval_size", "64", "--epochs", "2"]
LM = ["--task", "language_model", "--model", "gpt", "--width", "16", "--num_layers", "1", "--num_heads", "2",
      "--seq_len", "16", "--max_steps", "8"]
PYDOC = ["--dataset", "pydoc", *LM]
KILL = {"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"}


def final(run_dir: Path) -> dict[str, torch.Tensor]:
    return weights(run_dir / "model.safetensors")


@pytest.mark.parametrize("job", [REGRESSION, PYDOC], ids=["regression", "language_model"])
def test_two_processes_equal_one(tmp_path, job):
    train(tmp_path / "one", *job, "--batch_size", "32")
    train(tmp_path / "two", *job, "--batch_size", "16", nproc=2)
    assert_trained(final(tmp_path / "one"), initial_weights(*job))
    assert_close_weights(final(tmp_path / "one"), final(tmp_path / "two"), rel=1e-6)
    one, two = metrics(tmp_path / "one", "eval")[-1], metrics(tmp_path / "two", "eval")[-1]
    assert one["samples"] == two["samples"]
    assert math.isclose(one["loss"], two["loss"], rel_tol=1e-5)


def test_regression_reports_mse_mae_rmse_and_restarts_bitwise(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(straight, *REGRESSION, "--batch_size", "16", "--save_every_steps", "3", nproc=2)
    proc = train(killed, *REGRESSION, "--batch_size", "16", "--save_every_steps", "3", "--max_restarts", "1", nproc=2,
                 env=KILL)
    assert_restarted(proc, killed, from_step=3)
    assert_bitwise_equal(final(killed), final(straight))
    last = metrics(straight, "eval")[-1]
    assert last["rmse"] == pytest.approx(math.sqrt(last["mse"])) and last["loss"] == last["mse"]
    assert 0 < last["mae"] and last["mse"] < metrics(straight, "eval")[0]["mse"], "the regressor learned"


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> Path:
    """pydoc's first 60k bytes as token files in shards of 7,000 tokens (windows never cross a shard)."""
    from ddptrain.data.text import pydoc_tokens

    root = tmp_path_factory.mktemp("tokens")
    (root / "corpus.txt").write_bytes(pydoc_tokens()[:60_000].tobytes())
    proc = cli_in_process(["prepare-text", str(root / "data"), str(root / "corpus.txt"), "--shard_tokens", "7000"])
    assert proc.returncode == 0, proc.stderr
    return root / "data"


def test_prepare_text_writes_shards_that_read_back_as_the_text(token_dir):
    import numpy as np

    meta = json.loads((token_dir / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and len(meta["train"]) == 8
    tokens = np.concatenate([np.fromfile(token_dir / n, dtype=np.uint16) for n in meta["train"] + meta["eval"]])
    assert (token_dir.parent / "corpus.txt").read_bytes() == tokens.astype(np.uint8).tobytes()


@pytest.mark.parametrize("args, words", [
    (["missing.txt"], "missing.txt: no such file; pass text files"),
    (["corpus.txt", "--eval_fraction", "1"], "--eval_fraction must be in [0, 1) (got 1.0)"),
    (["corpus.txt", "--shard_tokens", "1"], "--shard_tokens must be >= 2 (got 1)"),
    (["corpus.txt", "--shard_tokens", "many"], "--shard_tokens"),
], ids=["missing-file", "eval-fraction", "shard-tokens", "not-a-number"])
def test_prepare_text_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, args, words):
    (tmp_path / "corpus.txt").write_text("some text")
    proc = cli_in_process(["prepare-text", str(tmp_path / "out"), *args], cwd=tmp_path)
    assert words in one_line_error(proc)
    assert not (tmp_path / "out").exists()


def test_a_usage_error_ends_the_prepare_text_process_with_exit_2_and_one_line(tmp_path):
    """The cases above run the CLI's `main` in this process; `python -m ddptrain prepare-text` itself keeps the
    contract."""
    proc = run_cli(["prepare-text", str(tmp_path / "out"), str(tmp_path / "missing.txt")])
    assert "missing.txt: no such file" in one_line_error(proc)


def test_token_files_are_read_once_per_epoch_across_ranks_and_workers(tmp_path, token_dir):
    from ddptrain.config import resolve_config
    from ddptrain.data.text import build

    flags = ["--dataset", "tokens", "--data_dir", str(token_dir), *LM, "--max_steps", "0", "--epochs", "2",
             "--num_workers", "2", "--batch_size", "16", "--record_sample_ids", "--eval_size", "0"]
    train(tmp_path, *flags, nproc=2)
    num_windows = len(build(resolve_config([*TINY, *flags]))[0])
    steps_per_epoch = num_windows // 32
    for epoch in range(2):
        seen = [i for rank in (0, 1) for row in read_jsonl(tmp_path / "samples" / f"rank-{rank}.jsonl")
                if (row["step"] - 1) // steps_per_epoch == epoch for i in row["ids"]]
        assert len(seen) == len(set(seen)) == steps_per_epoch * 32, "a window was read twice or skipped"
        assert set(seen) <= set(range(num_windows))


def test_token_files_resume_bitwise_after_a_kill(tmp_path, token_dir):
    job = ["--dataset", "tokens", "--data_dir", str(token_dir), *LM, "--batch_size", "8", "--num_workers", "2",
           "--save_every_steps", "3"]
    train(tmp_path / "straight", *job, nproc=2)
    proc = train(tmp_path / "killed", *job, "--max_restarts", "1", nproc=2, env=KILL)
    assert_restarted(proc, tmp_path / "killed", from_step=3)
    assert_bitwise_equal(final(tmp_path / "killed"), final(tmp_path / "straight"))
    losses = lambda d: [(r["step"], r["loss"]) for r in metrics(d, "train")]  # noqa: E731
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    line = metrics(tmp_path / "straight", "train")[-1]  # windows of 32: every input token is trained
    assert line["train_tokens_per_sec"] > 0
    assert line["train_tokens_per_sec"] == pytest.approx(line["input_tokens_per_sec"])
    assert "perplexity" in metrics(tmp_path / "straight", "eval")[-1]


DICT_JOB = ["--model", "task_plugins:dict_model", "--dataset", "task_plugins:paired_data", "--task",
            "task_plugins:weighted_pair_task", "--width", "6", "--dataset_size", "512", "--eval_size", "101",
            "--epochs", "2", "--batch_size", "16", "--num_workers", "1"]


def test_a_dict_model_and_a_task_of_its_own_train_and_evaluate_exactly(tmp_path):
    import task_plugins

    from ddptrain.data.batch import collate

    train(tmp_path, *DICT_JOB, "--record_sample_ids", nproc=2)
    # Training used each sample's weight: step 1's loss is the weighted loss of the initial model on its samples.
    step_1 = [i for rank in (0, 1) for row in read_jsonl(tmp_path / "samples" / f"rank-{rank}.jsonl")
              if row["step"] == 1 for i in row["ids"]]
    train_ds = task_plugins.PairedImages(512, 6, seed=42)
    torch.manual_seed(42)
    initial = task_plugins.dict_model(type("Cfg", (), {"width": 6})())
    with torch.no_grad():
        first, _ = task_plugins.WeightedPairTask().loss(initial, collate([train_ds[i] for i in step_1]))
    assert len(step_1) == 32
    assert metrics(tmp_path, "train")[0]["loss"] == pytest.approx(first.item(), rel=1e-5)
    logged = metrics(tmp_path, "eval")[-1]
    model = task_plugins.dict_model(type("Cfg", (), {"width": 6})())
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    model.eval()
    eval_ds = task_plugins.PairedImages(101, 6, seed=42, offset=512)
    batch = collate([eval_ds[i] for i in range(len(eval_ds))])
    with torch.no_grad():
        _, sums = task_plugins.WeightedPairTask().loss(model, batch)
        _, unweighted = task_plugins.WeightedPairTask().loss(model, {**batch, "weight": torch.ones(len(eval_ds))})
    alone = {name: (total / count).item() for name, (total, count) in sums.items()}
    assert logged["samples"] == 101
    assert logged["error"] == pytest.approx(alone["error"], abs=1e-12)  # counts: exact
    assert math.isclose(logged["loss"], alone["loss"], rel_tol=1e-6)
    # The weights vary per sample, so the loss above is not the one an evaluation that lost them reports.
    lost = (unweighted["loss"][0] / unweighted["loss"][1]).item()
    assert not math.isclose(alone["loss"], lost, rel_tol=1e-2), (alone["loss"], lost)
    assert math.isclose(logged["margin"], alone["margin"], rel_tol=1e-5)
    assert logged["error"] < 0.2, "the plug-in task learned"


def test_the_python_api_example_runs_spawned_and_under_torchrun(tmp_path):
    script = REPO / "examples" / "python_api.py"
    spawned = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                             env=cli_env(), cwd=tmp_path)
    assert spawned.returncode == 0, spawned.stderr
    assert "replicas identical across 2 ranks" in spawned.stdout
    mae = float(spawned.stdout.split("python_api: eval mae ")[1].split()[0])
    assert mae < 0.15
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               "2", str(script)], capture_output=True, text=True, timeout=180, env=cli_env(),
                              cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.count("python_api: eval mae ") == 1, "only rank 0 returns the summary"
    assert float(launched.stdout.split("python_api: eval mae ")[1].split()[0]) == pytest.approx(mae, rel=1e-5)


@pytest.mark.slow
def test_the_char_level_lm_config_learns_well_below_the_unigram_baseline(tmp_path):
    """configs/charlm.toml as docs/tasks.md states it, for its first epoch (the whole schedule over 102 steps; the
    4 epochs of the config take minutes): eval loss 2.30 nats/byte measured; unigram 3.26."""
    import numpy as np

    from ddptrain.data.text import EVAL_FRACTION, pydoc_tokens

    tokens = pydoc_tokens()
    counts = np.bincount(tokens[:int(len(tokens) * (1 - EVAL_FRACTION))], minlength=256)
    p = counts[counts > 0] / counts.sum()
    assert float(-(p * np.log(p)).sum()) == pytest.approx(3.26, abs=0.005)
    proc = run_cli(["train", "--config", str(REPO / "configs" / "charlm.toml"), "--run_dir", str(tmp_path),
                    "--no-progress", "--epochs", "1"], timeout=600)  # 54 s of training alone
    assert proc.returncode == 0, proc.stderr
    final_eval = metrics(tmp_path, "eval")[-1]
    assert final_eval["step"] == 102 and final_eval["loss"] <= 2.45, final_eval


def test_an_unknown_task_is_a_usage_error():
    line = one_line_error(cli_in_process(["train", *TINY, "--task", "segmentation"]))
    assert "--task 'segmentation'" in line


def test_a_task_without_a_loss_is_a_usage_error(tmp_path):
    # Found when the training process builds the task: a process of its own.
    line = one_line_error(run_cli(["train", *TINY, "--run_dir", str(tmp_path), "--task", "builtins:str"]))
    assert "--task builtins:str" in line and "loss(model, batch)" in line  # returns a str: no loss()


def test_train_lines_count_trained_and_input_tokens_apart(tmp_path):
    """A fine-tune's masked prompts are read, not trained: the train line's input_tokens_per_sec over its
    train_tokens_per_sec is the input tokens (padding aside) over the labels that count, and pad_fraction the
    share of padded positions. One line over the whole epoch of a plug-in's masked rows, in this process."""
    import ddptrain
    from ddptrain.config import resolve_config
    from lm_plugins import MaskedSequences

    run = tmp_path / "run"
    ddptrain.fit(config=resolve_config([
        "--task", "language_model", "--model", "gpt", "--dataset", "lm_plugins:masked_lm", "--vocab_size", "64",
        "--seq_len", "24", "--width", "16", "--num_layers", "1", "--num_heads", "2", "--dataset_size", "48",
        "--eval_size", "0", "--batch_size", "16", "--epochs", "1", "--log_interval", "3", "--num_workers", "0",
        "--no-progress", "--save_every", "0", "--run_dir", str(run)]))
    line = metrics(run, "train")[-1]
    rows = MaskedSequences(48, 64, 24, 42)  # (--seed 42, the default)
    inputs = sum(len(rows[i]["input_ids"]) for i in range(48))
    trained = sum(int((rows[i]["labels"][1:] != -100).sum()) for i in range(48))
    assert trained < inputs
    assert line["input_tokens_per_sec"] / line["train_tokens_per_sec"] == pytest.approx(inputs / trained, rel=1e-9)
    assert 0 < line["pad_fraction"] < 1
