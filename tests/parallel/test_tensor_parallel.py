"""--tp N (issue 58, first slice): the built-in GPT's blocks split over a tensor-parallel group, FSDP2 over the
data-parallel dimension of the (dp, tp) mesh. The ranks of a group read one micro-batch, so N processes learn
what one process learns from the same global batch; its checkpoints resume bitwise; what is not combined with it
yet is refused with one line."""

from __future__ import annotations

import fnmatch

import pytest
import torch
from helpers import TINY, assert_bitwise_equal, assert_restarted, assert_trained, cli_in_process, initial_weights, \
    one_line_error, train, weights

# SGD (TINY's), a constant lr: the runs differ in how the work is spread only.
GPT = ["--task", "language_model", "--model", "gpt", "--dataset", "pydoc", "--vocab_size", "256", "--seq_len", "32",
       "--width", "32", "--num_layers", "2", "--num_heads", "2", "--lr_schedule", "constant", "--save_every", "0",
       "--save_every_steps", "3", "--strategy", "fsdp"]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_gpt_under_fsdp_and_tp_ends_where_one_process_ends_and_resumes_bitwise(tmp_path):
    one, tp2, mesh, twice = (tmp_path / name for name in ("one", "tp2", "mesh", "twice"))
    train(one, *GPT, "--batch_size", "16", "--max_steps", "6")
    # dp 1 x tp 2, its blocks recomputed in backward (--activation_checkpointing wraps a block's forward, around
    # the split layers' own hooks)
    train(tp2, *GPT, "--batch_size", "16", "--max_steps", "6", "--tp", "2", "--activation_checkpointing", nproc=2)
    train(mesh, *GPT, "--batch_size", "8", "--max_steps", "6", "--tp", "2", nproc=4)  # dp 2 x tp 2
    final = weights(one / "model.safetensors")
    assert_trained(final, initial_weights(*GPT))
    # Measured 7e-9 (tp 2) and 3e-8 (2 x 2): the split layers sum their products in another order.
    assert max_diff(weights(tp2 / "model.safetensors"), final) <= 1e-5
    assert max_diff(weights(mesh / "model.safetensors"), final) <= 1e-5
    log = (mesh / "logs" / "rank-0.log").read_text()
    assert "built on the meta device" in log  # each rank filled its part
    assert "split by vocabulary rows over 4 ranks" in log  # over the world, across dp and tp
    # A checkpoint of 2 x 2 (DCP; the fused qkv saved whole) continues bitwise.
    train(twice, *GPT, "--batch_size", "8", "--max_steps", "3", "--tp", "2", nproc=4)
    train(twice, *GPT, "--batch_size", "8", "--max_steps", "6", "--tp", "2", nproc=4)
    assert_bitwise_equal(weights(twice / "model.safetensors"), weights(mesh / "model.safetensors"))


@pytest.mark.parametrize("flags, names", [
    (["--strategy", "fsdp", "--tp", "2"], "has no tensor-parallel plan"),  # TINY's mlp
    (["--model", "gpt", "--num_heads", "3", "--width", "48", "--strategy", "fsdp", "--tp", "2"], "--num_heads"),
    (["--model", "gpt", "--strategy", "fsdp", "--tp", "2", "--nproc", "3"], "--nproc"),
])
def test_what_tp_does_not_combine_with_yet_is_one_line(tmp_path, flags, names):
    line = one_line_error(cli_in_process(["train", *TINY, "--task", "language_model", "--dataset", "pydoc",
                                          "--run_dir", str(tmp_path), "--max_steps", "1", *flags]))
    assert "--tp" in line and names in line, line


@pytest.mark.slow
def test_a_tp_checkpoint_resumes_onto_other_shapes_and_a_killed_tp_run_restarts_bitwise(tmp_path):
    """Issue 58's checkpoints: a 2 x 2 (dp x tp) checkpoint resumed as dp 4, as tp 4 and on one process ends where
    the unbroken run ends; killed between its save points and restarted, it ends bitwise."""
    job = [*GPT, "--num_heads", "4", "--max_steps", "6"]  # 4 heads: tp 4 splits them
    mesh, killed = tmp_path / "mesh", tmp_path / "killed"
    train(mesh, *job, "--batch_size", "8", "--tp", "2", nproc=4)
    step_3 = mesh / "checkpoints" / "step-3"
    final = weights(mesh / "model.safetensors")
    # The same global batch of 16 on each shape: dp 4 x 4, dp 1 x 16 (tp 4), one process x 16.
    for name, flags, nproc in (("dp4", ["--batch_size", "4"], 4), ("tp4", ["--batch_size", "16", "--tp", "4"], 4),
                               ("one", ["--batch_size", "16"], 1)):
        train(tmp_path / name, *job, *flags, "--resume_from", str(step_3), "--accept_config_change", nproc=nproc)
        assert "resuming from" in (tmp_path / name / "logs" / "rank-0.log").read_text()
        assert max_diff(weights(tmp_path / name / "model.safetensors"), final) <= 1e-6, name
    proc = train(killed, *job, "--batch_size", "8", "--tp", "2", "--max_restarts", "1", nproc=4,
                 env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert_restarted(proc, killed, from_step=3)
    assert_bitwise_equal(weights(killed / "model.safetensors"), final)


def llama(tmp_path, plan: dict[str, str] | None = None):
    """A tiny transformers Llama (4 query heads, 2 key/value heads) saved with its weights in `tmp_path`; `plan`
    replaces its config's base_model_tp_plan (on the live model: config.json does not keep it)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, bos_token_id=63, eos_token_id=63)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "llama")
    if plan is not None:
        model.config.base_model_tp_plan = plan
    return model


@pytest.mark.slow
def test_a_transformers_llama_splits_by_its_own_plan_and_ends_where_one_process_ends(tmp_path):
    """--model hf:DIR --tp 2: the Llama's base_model_tp_plan (q/k/v/gate/up colwise, o/down rowwise), masked
    batches; 2 processes (dp 1 x tp 2) and 4 (dp 2 x tp 2) end where 1 process ends on the same global batch."""
    llama(tmp_path)
    job = ["--model", f"hf:{tmp_path / 'llama'}", "--task", "language_model", "--dataset", "lm_plugins:masked_lm",
           "--vocab_size", "64", "--seq_len", "24", "--dataset_size", "64", "--eval_size", "0", "--weight_decay", "0",
           "--save_every", "0", "--batch_size", "8", "--max_steps", "4", "--strategy", "fsdp"]
    one, tp2, mesh = tmp_path / "one", tmp_path / "tp2", tmp_path / "mesh"
    train(one, *job, nproc=1)
    train(tp2, *job, "--tp", "2", nproc=2)
    train(mesh, *job, "--tp", "2", "--batch_size", "4", nproc=4)
    final = weights(one / "model.safetensors")
    assert_trained(final, weights(tmp_path / "llama" / "model.safetensors"))
    # Measured 7.5e-9, tp 2 and 2 x 2 alike.
    assert max_diff(weights(tp2 / "model.safetensors"), final) <= 1e-5
    assert max_diff(weights(mesh / "model.safetensors"), final) <= 1e-5
    # Built on the meta device, each rank reading its tp part's FSDP shard of the files (test_tp_meta.py: bitwise
    # what the whole build splits to).
    assert "built on the meta device" in (mesh / "logs" / "rank-0.log").read_text()
    # A transformers model whose config has no plan (GPT-2's) is refused by the workers in one line.
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=63,
                                   eos_token_id=63)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    proc = train(tmp_path / "gpt2_run", *job, "--model", f"hf:{tmp_path / 'gpt2'}", "--tp", "2", nproc=2, check=False)
    assert "has no tensor-parallel plan" in one_line_error(proc)


def test_a_transformers_plan_with_a_style_not_applied_is_refused_in_one_line(tmp_path):
    from ddptrain.errors import UsageError
    from ddptrain.parallel.tensor import plan_of

    model = llama(tmp_path, {"embed_tokens": "embedding_rowwise", "layers.*.mlp.up_proj": "colwise"})
    with pytest.raises(UsageError, match="embedding_rowwise") as refused:
        plan_of(model)
    assert "\n" not in str(refused.value) and "--tp 1" in str(refused.value)
    model = llama(tmp_path)
    plan = plan_of(model)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and len(plan) == 7
    names = [name for name, _ in model.named_modules()]
    assert all(fnmatch.filter(names, key) for key in plan), "each name of the plan is a module of the model"
