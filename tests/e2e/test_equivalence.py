"""One global batch, any split: the number of processes and micro-steps must not change what is learned.

Real processes on gloo. Weights are compared at 1e-6 relative to each tensor's scale: a different
split sums the same gradients in a different order, which moves float32 results by rounding only.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pipeline_runs as runs
import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, assert_close_weights, assert_trained, metrics, train, weights
from helpers import initial_weights as initial_weights_of

from ddptrain.config import resolve_config
from ddptrain.loop.plugins import datasets_of, model_of

REL_TOL = 1e-6


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return runs.single(tmp_path_factory)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    return runs.pair(tmp_path_factory)


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert_close_weights(expected, actual, rel=REL_TOL)


def run_config(*extra: str):
    return resolve_config([*TINY, *runs.SHARED, *extra], validate=False)


def initial_weights(*extra: str) -> dict[str, torch.Tensor]:
    """The weights every run of the shared job starts from."""
    return initial_weights_of(*runs.SHARED, *extra)


def train_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in metrics(run_dir, "train")]


def test_two_processes_equal_one_process_with_the_same_global_batch(single: Path, pair: Path):
    one, two = weights(single / "model.safetensors"), weights(pair / "model.safetensors")
    assert_trained(one, initial_weights())
    assert_same_weights(one, two)
    assert (pair / "logs" / "rank-1.log").is_file(), "the pair run did not have a second rank"
    expected_steps = list(range(1, runs.EPOCHS * runs.STEPS_PER_EPOCH + 1))
    assert train_steps(single) == train_steps(pair) == expected_steps


def test_group_norm_resnet_two_processes_equal_one(tmp_path: Path):
    """A convolutional model (MiniResNet with GroupNorm, tiny) through the --nproc launcher."""
    shape = ["--model", "mini_resnet", "--norm", "group", "--width", "4", "--dataset_size", "64",
             "--eval_size", "0", "--epochs", "1"]
    train(tmp_path / "one", *shape, "--batch_size", "32")
    train(tmp_path / "two", *shape, "--batch_size", "16", nproc=2)
    one, two = weights(tmp_path / "one" / "model.safetensors"), weights(tmp_path / "two" / "model.safetensors")
    assert [k for k in one if "running_mean" in k] == [], "GroupNorm model must have no BatchNorm buffers"
    assert_trained(one, initial_weights_of(*shape))
    assert_same_weights(one, two)
    assert train_steps(tmp_path / "two") == [1, 2]
    assert UNSYNCED_BN not in (tmp_path / "two" / "logs" / "rank-0.log").read_text()


UNSYNCED_BN = "BatchNorm layers without sync"
BN_RESNET = ["--model", "mini_resnet", "--norm", "batch", "--width", "4", "--dataset_size", "64", "--eval_size", "0",
             "--max_steps", "1"]


def test_batchnorm_at_world_size_2_warns_once_that_2_processes_do_not_equal_1(tmp_path: Path):
    proc = train(tmp_path / "two", *BN_RESNET, "--batch_size", "16", nproc=2)
    logs = [(tmp_path / "two" / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1)]
    assert logs[0].count(UNSYNCED_BN) == 1 and UNSYNCED_BN not in logs[1]
    line = next(line for line in logs[0].splitlines() if UNSYNCED_BN in line)
    assert "WARNING" in line and "2 processes do not learn exactly what 1" in line
    assert "--sync_batchnorm" in line and "--norm group" in line
    assert (proc.stdout + proc.stderr).count(UNSYNCED_BN) == 1
    alone = train(tmp_path / "one", *BN_RESNET, "--batch_size", "32")
    assert UNSYNCED_BN not in alone.stdout + alone.stderr + (tmp_path / "one" / "logs" / "rank-0.log").read_text()


def test_only_batchnorm_that_normalises_with_batch_statistics_counts_as_unsynced():
    import user_plugins

    from ddptrain.parallel.strategies import unsynced_batchnorm

    resnet = model_of(run_config("--model", "mini_resnet", "--norm", "batch"))
    layers = unsynced_batchnorm(resnet)
    resnet.get_submodule(layers[0]).eval()
    assert unsynced_batchnorm(resnet) == layers[1:], "a layer the user froze normalises with running statistics"
    assert unsynced_batchnorm(model_of(run_config("--model", "mini_resnet", "--norm", "group"))) == []
    assert unsynced_batchnorm(user_plugins.FrozenNormMLP(12, 2, 4)) == [], "frozen: running statistics"
    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
    assert unsynced_batchnorm(synced) == []
    stateless = torch.nn.Sequential(torch.nn.BatchNorm1d(4, track_running_stats=False)).eval()
    assert unsynced_batchnorm(stateless) == ["0"], "no running statistics: batch statistics even in eval"


def test_accumulation_world_2_x_accum_2_equals_world_1_x_accum_4(tmp_path_factory, single: Path):
    run_2x2, report = runs.accum_2x2(tmp_path_factory)
    run_1x4 = runs.accum_1x4(tmp_path_factory)
    assert report["world_size"] == 2
    w_2x2, w_1x4 = weights(run_2x2 / "model.safetensors"), weights(run_1x4 / "model.safetensors")
    assert_trained(w_1x4, initial_weights())
    assert_same_weights(w_1x4, w_2x2)
    # ... and both equal the run that took the 32 samples of each step in one micro-batch.
    assert_same_weights(weights(single / "model.safetensors"), w_1x4)


def test_gradients_are_communicated_on_the_last_micro_step_only(tmp_path_factory):
    _, report = runs.accum_2x2(tmp_path_factory)
    accum, steps = 2, runs.EPOCHS * runs.STEPS_PER_EPOCH
    assert report["steps"] == steps
    assert report["micro_batches"] == steps * accum
    calls_by_micro = Counter(i % accum for i in report["hook_calls"])
    assert calls_by_micro[0] == 0, f"all-reduce ran during a no_sync micro-step: {calls_by_micro}"
    calls_by_step = Counter(i // accum for i in report["hook_calls"])
    assert sorted(calls_by_step) == list(range(steps)), "some optimizer step communicated no gradients"
    assert len(set(calls_by_step.values())) == 1, f"buckets per step vary: {calls_by_step}"


def test_eval_is_exact_when_the_eval_set_does_not_divide_by_the_world_size(single: Path, pair: Path):
    assert runs.EVAL_SIZE % 2 == 1
    evals_one, evals_two = metrics(single, "eval"), metrics(pair, "eval")
    assert [e["step"] for e in evals_one] == [e["step"] for e in evals_two]
    for one, two in zip(evals_one, evals_two):
        assert one["samples"] == two["samples"] == runs.EVAL_SIZE
        assert one["accuracy"] == two["accuracy"]
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)

    # The 2-process number against a plain single-process pass over the same weights and samples.
    cfg = run_config()
    _, eval_ds = datasets_of(cfg)
    model = model_of(cfg)
    model.load_state_dict(weights(pair / "model.safetensors"))
    model.eval()
    inputs = torch.stack([eval_ds[i][0] for i in range(len(eval_ds))])
    targets = torch.tensor([eval_ds[i][1] for i in range(len(eval_ds))])
    with torch.no_grad():
        logits = model(inputs)
    correct = int((logits.argmax(dim=1) == targets).sum())
    assert 0 < correct < len(eval_ds)  # a number that could be miscounted
    assert evals_two[-1]["accuracy"] == correct / len(eval_ds)
    assert evals_two[-1]["loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-5)
