"""Numerics that long jobs depend on: a skipped update leaves no trace, tied weights survive save and
resume, and the evaluated model is the saved one. Real runs, gloo on CPU."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from helpers import TINY, assert_bitwise_equal, checkpoint_weights, metrics, optimizer_state, run_cli, train, weights
from safetensors.torch import load_file

STEPS = ["--batch_size", "16", "--epochs", "1", "--save_every", "0", "--save_every_steps", "1", "--keep_last", "0",
         "--momentum", "0.9"]


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step}"


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for key, state in a["state"].items():
        for name, tensor in state.items():
            assert torch.equal(tensor, b["state"][key][name]), f"optimizer state {key}/{name} differs"


def initial_weights(*flags: str) -> dict[str, torch.Tensor]:
    """The weights a run with these flags starts from (model init is seeded identically on every rank)."""
    from ddptrain.config import resolve_config
    from ddptrain.loop.plugins import model_of

    cfg = resolve_config([*TINY, *flags])
    torch.manual_seed(cfg.seed)
    return model_of(cfg).state_dict()


def test_a_skipped_first_step_leaves_parameters_and_optimizer_untouched(tmp_path):
    # Fused SGD allocates its momentum buffers on the first step: a skip there must not leave them behind.
    train(tmp_path, *STEPS, "--max_steps", "3", "--inject_fault", "rank=0,step=1,kind=nan")
    assert_bitwise_equal(checkpoint_weights(checkpoint(tmp_path, 1)), initial_weights())
    assert optimizer_state(checkpoint(tmp_path, 1))["state"] == {}, "the skipped step created optimizer state"
    # The next steps are real updates from the untouched start.
    final = weights(tmp_path / "model.safetensors")
    assert all(torch.isfinite(t).all() and t.abs().max() < 10 for t in final.values())
    assert optimizer_state(checkpoint(tmp_path, 3))["state"], "later steps did update"


def test_a_skipped_later_step_equals_not_taking_it(tmp_path):
    skipped, clean = tmp_path / "skipped", tmp_path / "clean"
    train(skipped, *STEPS, "--max_steps", "3", "--inject_fault", "rank=0,step=3,kind=nan", nproc=2)
    train(clean, *STEPS, "--max_steps", "2", nproc=2)
    assert_bitwise_equal(checkpoint_weights(checkpoint(skipped, 3)), checkpoint_weights(checkpoint(clean, 2)))
    assert_same_optimizer_state(optimizer_state(checkpoint(skipped, 3)), optimizer_state(checkpoint(clean, 2)))


TIED = ["--model", "model_plugins:tied_mlp", "--batch_size", "16", "--epochs", "1", "--save_every_steps", "3"]


def test_tied_weights_save_resume_bitwise_and_export(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *TIED, "--max_steps", "6")
    train(resumed, *TIED, "--max_steps", "3")  # sync saves of a model whose state_dict shares memory
    train(resumed, *TIED, "--max_steps", "6")
    assert_bitwise_equal(weights(resumed / "model.safetensors"), weights(straight / "model.safetensors"))

    out = tmp_path / "export" / "model.safetensors"
    proc = run_cli(["export", str(checkpoint(resumed, 6)), str(out)])
    assert proc.returncode == 0, proc.stderr
    # A plain script: build the model, load the file strictly; the two tied names hold one value.
    from model_plugins import TiedMLP

    model = TiedMLP(3 * 8 * 8, 32, 10)
    model.load_state_dict(load_file(str(out)))
    assert model.first.weight is model.second.weight
    assert torch.equal(model.first.weight.detach(), weights(straight / "model.safetensors")["first.weight"])


BN = ["--model", "mini_resnet", "--width", "4", "--norm", "batch", "--batch_size", "16", "--epochs", "2",
      "--save_every", "0"]


@torch.no_grad()
def evaluate_alone(run_dir: Path) -> tuple[float, float]:
    """(loss, accuracy) of RUN_DIR/model.safetensors on the run's eval split, in this one process."""
    from ddptrain.config import resolve_config
    from ddptrain.loop.plugins import datasets_of, model_of

    cfg = resolve_config(["--config", str(run_dir / "config.toml")])
    _, eval_ds = datasets_of(cfg)
    model = model_of(cfg)
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")))
    model.eval()
    inputs = torch.stack([eval_ds[i][0] for i in range(len(eval_ds))])
    targets = torch.tensor([eval_ds[i][1] for i in range(len(eval_ds))])
    logits = model(inputs)
    return F.cross_entropy(logits, targets).item(), int((logits.argmax(1) == targets).sum()) / len(targets)


def test_eval_metrics_are_those_of_the_exported_batchnorm_model(tmp_path):
    # Each rank's BatchNorm statistics follow its own batches; eval, checkpoint and export must agree on one.
    train(tmp_path, *BN, nproc=2)
    final = metrics(tmp_path, "eval")[-1]
    loss, accuracy = evaluate_alone(tmp_path)
    assert final["accuracy"] == accuracy
    assert math.isclose(final["loss"], loss, rel_tol=1e-5), (final["loss"], loss)
