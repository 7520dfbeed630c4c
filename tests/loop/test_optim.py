"""Optimizers the way fine-tuning needs them: no weight decay on biases, norms and embeddings for AdamW, the LM
schedules, and a user's own optimizer and scheduler through `ddptrain.fit` with their state resumed exactly."""

from __future__ import annotations

import subprocess

import pytest
import torch
from helpers import REPO, assert_bitwise_equal, metrics, optimizer_state, run_python, weights

from ddptrain.config import TrainConfig
from ddptrain.loop.optim import lr_factor, parameter_groups
from ddptrain.models import GPT


def names_in(groups, module) -> list[set[str]]:
    by_id = {id(p): n for n, p in module.named_parameters()}
    return [{by_id[id(p)] for p in group["params"]} for group in groups]


def test_adamw_decays_weights_but_not_biases_norms_or_embeddings():
    model = GPT(vocab_size=32, seq_len=8, width=16, num_layers=1, num_heads=2)
    decay, exempt = names_in(parameter_groups(TrainConfig(optimizer="adamw", weight_decay=0.1), model), model)
    assert decay == {"blocks.0.qkv.weight", "blocks.0.proj.weight", "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight"}
    assert {"embed.weight", "position.weight", "norm.weight", "norm.bias", "blocks.0.qkv.bias"} <= exempt
    assert len(decay) + len(exempt) == len(list(model.parameters()))  # the tied head is the embedding: once
    built = torch.optim.AdamW(parameter_groups(TrainConfig(optimizer="adamw"), model), weight_decay=0.1)
    assert [g["weight_decay"] for g in built.param_groups] == [0.1, 0.0]


def test_decay_all_and_sgd_decay_every_parameter():
    model = GPT(vocab_size=32, seq_len=8, width=16, num_layers=1, num_heads=2)
    for cfg in (TrainConfig(optimizer="adamw", decay_all=True), TrainConfig(optimizer="sgd")):
        groups = parameter_groups(cfg, model)
        assert isinstance(groups[0], torch.nn.Parameter) and len(groups) == len(list(model.parameters()))


def test_transformers_convention_on_a_gpt2():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                 n_positions=8))
    decay, exempt = names_in(parameter_groups(TrainConfig(optimizer="adamw"), model), model)
    assert all(name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")) for name in decay), decay
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= exempt


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 0.7, 0.4]),       # warmup 2, then down to the floor 0.1 at step 5
    ("cosine", [0.5, 1.0, 1.0, 0.775, 0.325]),
])
def test_schedules_warm_up_then_hold_or_decay_to_the_floor(schedule, expected):
    got = [lr_factor(step, warmup_steps=2, total_steps=5, schedule=schedule, min_ratio=0.1) for step in range(5)]
    assert got == pytest.approx(expected, abs=1e-9)
    assert lr_factor(5, 2, 5, schedule, 0.1) == pytest.approx(1.0 if schedule == "constant" else 0.1)


def fit_script(run_dir, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_python([str(REPO / "tests" / "optim_script.py"), str(run_dir), *extra], timeout=240)
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_users_optimizer_and_scheduler_train_and_resume_bitwise(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    fit_script(straight)
    lrs = [row["lr"] for row in metrics(straight, "train")]
    assert lrs == pytest.approx([0.02, 0.01, 0.01, 0.005, 0.005, 0.0025])  # StepLR, stepped once per step
    state = optimizer_state(straight / "checkpoints" / "step-6")
    assert all(set(s) == {"step", "square_avg"} for s in state["state"].values()), "RMSprop's state is saved"
    assert state["state"] and state["param_groups"][0]["alpha"] == 0.9
    failed = fit_script(killed, "--fail-at", "4", check=False)
    assert failed.returncode != 0 and "injected fault" in failed.stderr
    fit_script(killed)
    assert "resuming from" in (killed / "logs" / "rank-0.log").read_text()
    assert [row["lr"] for row in metrics(killed, "train")] == pytest.approx(lrs)
    assert_bitwise_equal(weights(straight / "model.safetensors"), weights(killed / "model.safetensors"))


def test_an_optimizer_whose_state_holds_python_numbers_resumes_bitwise(tmp_path):
    """A hand-written optimizer may keep plain ints in its state (a step count). The shards hold tensors only
    (DCP would pickle anything else, which no checkpoint may need unpickled): such values ride in trainer.pt."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    fit_script(straight, "--counting")
    saved = torch.load(straight / "checkpoints" / "step-6" / "trainer.pt", weights_only=True)
    counts = saved["optim_values"]
    assert counts and all(value == {"updates": 6} for value in counts.values()), counts
    failed = fit_script(killed, "--counting", "--fail-at", "4", check=False)
    assert failed.returncode != 0 and "injected fault" in failed.stderr
    fit_script(killed, "--counting")
    assert "resuming from" in (killed / "logs" / "rank-0.log").read_text()
    assert_bitwise_equal(weights(straight / "model.safetensors"), weights(killed / "model.safetensors"))
