"""N processes learn what one process learns when batches are padded and masked: a LossSum is divided by the
count of units of the whole step, over every rank and micro-batch. Real runs, gloo on CPU, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_close_weights, metrics, train, weights

# 256 variable-length sequences (4..24 tokens, a masked prompt of random length), 8 steps of 32 sequences.
JOB = ["--model", "gpt", "--task", "language_model", "--dataset", "lm_plugins:masked_lm", "--vocab_size", "64",
       "--seq_len", "24", "--width", "32", "--num_layers", "2", "--num_heads", "2", "--dataset_size", "256",
       "--eval_size", "40", "--epochs", "1", "--lr", "0.5", "--weight_decay", "0", "--momentum", "0",
       "--save_every", "0"]
SPLITS = {"1x32": (1, 32, 1), "2x8x2": (2, 8, 2), "1x4x8": (1, 4, 8)}
# One split reads through loader workers: 512 tensors of variable length cross to them, padded in the workers.
WORKERS = {"2x8x2": ["--num_workers", "2"]}


def run(factory: pytest.TempPathFactory, name: str, *extra: str) -> Path:
    nproc, batch, accum = SPLITS[name]
    run_dir = factory.mktemp(name)
    train(run_dir, *JOB, "--batch_size", str(batch), "--grad_accum_steps", str(accum), *WORKERS.get(name, []), *extra,
          nproc=nproc if nproc > 1 else 0)
    return run_dir


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    return run(tmp_path_factory, "1x32")


@pytest.mark.parametrize("split", ["2x8x2", "1x4x8"])
def test_padded_masked_batches_learn_the_same_at_any_split(whole, tmp_path_factory, split):
    other = run(tmp_path_factory, split)
    reference = weights(whole / "model.safetensors")
    initial = weights(run(tmp_path_factory, "1x32", "--max_steps", "1", "--lr", "0") / "model.safetensors")
    assert max((reference[k] - initial[k]).abs().max().item() for k in reference) > 1e-2, "the weights moved"
    assert_close_weights(reference, weights(other / "model.safetensors"), rel=1e-5)
    # The logged train loss is the same token-weighted mean at every split.
    assert [r["loss"] for r in metrics(other, "train")] == pytest.approx(
        [r["loss"] for r in metrics(whole, "train")], rel=1e-5)


def test_padded_masked_batches_under_fsdp_learn_what_one_process_learns(whole, tmp_path_factory):
    other = run(tmp_path_factory, "2x8x2", "--strategy", "fsdp")
    assert_close_weights(weights(whole / "model.safetensors"), weights(other / "model.safetensors"), rel=1e-5)


def test_a_plain_mean_weighs_every_micro_batch_alike_and_so_differs(whole, tmp_path_factory):
    # What the contract says a task returning a plain mean computes: the mean of per-micro-batch means, which
    # is not the token-weighted mean over the global batch when micro-batches count different numbers of tokens.
    mean_whole = run(tmp_path_factory, "1x32", "--task", "lm_plugins:mean_loss")
    mean_split = run(tmp_path_factory, "1x4x8", "--task", "lm_plugins:mean_loss")
    a, b = weights(mean_whole / "model.safetensors"), weights(mean_split / "model.safetensors")
    assert max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a) > 1e-3
