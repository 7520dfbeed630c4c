"""LoRA adapters through peft (--lora_rank): a Llama with weights on disk (built here from a config), padded LM
batches; 2 processes must train the adapters 1 process trains, a killed run must end bitwise, checkpoints hold
the adapters only, and RUN_DIR/adapter/ must load with peft's own PeftModel.from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, assert_close_weights, assert_restarted, last_committed, metrics, one_line_error, \
    run_cli, train, weights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64
LM = ["--task", "language_model", "--dataset", "lm_plugins:masked_lm", "--vocab_size", str(VOCAB), "--seq_len", "24",
      "--dataset_size", "128", "--eval_size", "24", "--epochs", "1", "--lr", "0.3", "--weight_decay", "0",
      "--momentum", "0", "--save_every", "0"]
LORA = ["--lora_rank", "4", "--lora_alpha", "8"]


def llama(directory: Path, seed: int = 0, width: int = 32) -> Path:
    """A 2-layer Llama saved with its weights (save_pretrained), as a fine-tuner's base model is."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def whole(base, tmp_path_factory) -> Path:
    """1 process, the whole global batch of 32 sequences each step."""
    run_dir = tmp_path_factory.mktemp("whole")
    train(run_dir, "--model", f"hf:{base}", *LM, *LORA, "--batch_size", "32", timeout=300)
    return run_dir


def trained_model(base: Path, run_dir: Path) -> torch.nn.Module:
    """The base with the run's adapters, as the run ended (its model.safetensors holds the adapters)."""
    from types import SimpleNamespace

    from ddptrain.models import lora

    model = transformers.LlamaForCausalLM.from_pretrained(base)
    lora.apply(model, SimpleNamespace(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_targets=""), f"hf:{base}")
    missing, unexpected = model.load_state_dict(weights(run_dir / "model.safetensors"), strict=False)
    assert not unexpected and all(".lora_" not in name for name in missing)
    return model.eval()


def test_lora_on_two_processes_trains_the_adapters_one_process_trains_and_loads_in_peft(base, whole, tmp_path):
    train(tmp_path, "--model", f"hf:{base}", *LM, *LORA, "--batch_size", "8", "--grad_accum_steps", "2", nproc=2,
          timeout=300)
    final = weights(whole / "model.safetensors")
    assert final and all(".lora_A." in k or ".lora_B." in k for k in final), sorted(final)[:4]
    assert_close_weights(final, weights(tmp_path / "model.safetensors"), rel=1e-5)
    assert any(v.abs().max() > 0 for k, v in final.items() if ".lora_B." in k), "B starts at zero: it trained"
    # peft's own loader gives the trained model's logits.
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = trained_model(base, tmp_path)(ids).logits
        loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base),
                                                tmp_path / "adapter").eval()
        assert torch.equal(loaded(ids).logits, ours)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                                                      "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_holds_the_adapters_only_and_a_killed_lora_run_ends_bitwise(tmp_path, strategy):
    """Rank 8 on a Llama of width 256 (1.3M parameters): a checkpoint, trainer state and all, is at most 10 % of
    the model's weights on disk. With dropout in the adapters, killed and restarted, the run ends bitwise."""
    base = llama(tmp_path / "wide", width=256)
    job = ["--model", f"hf:{base}", *LM, "--lora_rank", "8", "--lora_dropout", "0.1", "--batch_size", "8",
           "--save_every_steps", "2", "--keep_last", "0", "--strategy", strategy]
    train(tmp_path / "straight", *job, nproc=2, timeout=300)
    proc = train(tmp_path / "killed", *job, "--max_restarts", "1", nproc=2, timeout=400,
                 env={"DDPTRAIN_FAULT": "rank=1,step=5,kind=sigkill"})
    assert_restarted(proc, tmp_path / "killed", from_step=4)
    assert_bitwise_equal(weights(tmp_path / "straight" / "model.safetensors"),
                         weights(tmp_path / "killed" / "model.safetensors"))
    checkpoint = last_committed(tmp_path / "killed")
    held = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    model_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    assert held <= 0.1 * model_bytes, (held, model_bytes)


def test_a_lora_checkpoint_refuses_another_base_model(base, tmp_path):
    """Resumed on a base whose weights differ (same architecture, another seed): one line, exit 2."""
    job = [*LM, *LORA, "--batch_size", "8", "--max_steps", "2", "--save_every_steps", "2"]
    train(tmp_path / "run", "--model", f"hf:{base}", *job)
    other = llama(tmp_path / "other", seed=1)
    proc = run_cli(["train", "--run_dir", str(tmp_path / "run"), "--model", f"hf:{other}", *job, "--max_steps", "4",
                    "--accept_config_change", "--num_workers", "0", "--no-progress"])
    line = one_line_error(proc)  # no transformers loading bar before it
    assert "other frozen weights" in line and "--model" in line


def test_lora_flags_without_a_rank_and_unknown_targets_are_one_line_errors(base, tmp_path):
    line = one_line_error(run_cli(["train", "--run_dir", str(tmp_path), "--model", f"hf:{base}", *LM,
                                   "--lora_targets", "q_proj"]))
    assert "--lora_rank" in line
    line = one_line_error(run_cli(["train", "--run_dir", str(tmp_path), "--model", f"hf:{base}", *LM, *LORA,
                                   "--lora_targets", "q_proj,qkv", "--num_workers", "0", "--no-progress"]))
    assert "--lora_targets" in line and "qkv" in line and "q_proj" in line


def test_export_merge_writes_the_base_with_the_adapters_merged_for_from_pretrained(base, whole, tmp_path):
    """`ddptrain export --hf OUT --merge`: a save_pretrained directory whose plain Llama gives the trained model's
    logits (up to the merge's rounding); without --merge, --hf is one line naming it."""
    checkpoint = last_committed(whole)
    line = one_line_error(run_cli(["export", str(checkpoint), "--hf", str(tmp_path / "nomerge")]))
    assert "--merge" in line
    done = run_cli(["export", str(checkpoint), "--hf", str(tmp_path / "merged"), "--merge"])
    assert done.returncode == 0, done.stderr
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert not any(".lora_" in name for name in merged.state_dict())
        expected = trained_model(base, whole)(ids).logits
        assert torch.allclose(merged(ids).logits, expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(transformers.LlamaForCausalLM.from_pretrained(base).eval()(ids).logits, expected,
                                  rtol=1e-4, atol=1e-5), "the adapters changed the model"


def test_lora_under_fsdp_trains_what_one_process_trains_and_resumes_on_another_world_size(base, whole, tmp_path):
    """FSDP2 over a frozen base built on the meta device: 2 processes equal 1 (1e-5); the sharded checkpoint holds the adapters only (no
    frozen tensor in its index), and a 1-process ddp run continues it from step 2 (the fingerprint of the frozen
    weights summed over the shards matches the whole tensors')."""
    job = ["--model", f"hf:{base}", *LM, *LORA, "--save_every_steps", "2", "--keep_last", "0"]
    train(tmp_path / "two", *job, "--batch_size", "8", "--grad_accum_steps", "2", "--strategy", "fsdp", nproc=2,
          timeout=300)
    # The base read into each rank's shards, the adapters' init replayed: no rank built the whole model.
    assert "fsdp: built on the meta device, each rank's shards filled from" in (
        tmp_path / "two" / "logs" / "rank-0.log").read_text()
    assert_close_weights(weights(whole / "model.safetensors"), weights(tmp_path / "two" / "model.safetensors"),
                         rel=1e-5)
    step_2 = tmp_path / "two" / "checkpoints" / "step-2"
    from torch.distributed.checkpoint import FileSystemReader

    held = FileSystemReader(str(step_2 / "shards")).read_metadata().state_dict_metadata
    assert any(".lora_A." in k for k in held) and not any(".base_layer." in k for k in held), sorted(held)[:5]
    proc = train(tmp_path / "one", *job, "--batch_size", "32", "--resume_from", str(step_2), timeout=300)
    assert proc.returncode == 0
    assert "resuming from" in (tmp_path / "one" / "logs" / "rank-0.log").read_text()
    assert_close_weights(weights(whole / "model.safetensors"), weights(tmp_path / "one" / "model.safetensors"),
                         rel=1e-5)


def test_lora_on_a_bf16_base_under_fsdp_learns_and_peft_loads_its_adapter(base, tmp_path):
    """--param_dtype bf16 with --lora_rank (issue 37 item 1): the frozen base and the adapters are held in bf16, the
    adapters learn and are saved in bf16, and RUN_DIR/adapter loads onto the base read in bf16."""
    train(tmp_path, "--model", f"hf:{base}", *LM, *LORA, "--batch_size", "8", "--max_steps", "6", "--strategy", "fsdp",
          "--param_dtype", "bf16", nproc=2, timeout=300)
    losses = [row["loss"] for row in metrics(tmp_path, "train")]
    assert losses[-1] < losses[0], losses
    adapter = weights(tmp_path / "model.safetensors")
    assert {t.dtype for t in adapter.values()} == {torch.bfloat16}
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
                                            str(tmp_path / "adapter"))
    assert loaded(input_ids=torch.arange(8)[None]).logits.dtype == torch.bfloat16


def test_the_adapters_of_an_fsdp_run_are_gathered_without_its_frozen_base(tmp_path):
    """At the end of an fsdp run only the adapters come together on rank 0 (model.safetensors, RUN_DIR/adapter),
    a tensor at a time: the frozen base stays in its shards. A deep, narrow Llama (48 blocks of 2.5 MiB, 120
    MiB in all). Gathering the whole model first raised rank 0's peak by about the base's size between its last
    step and the end of the run."""
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=48,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "deep")
    base_mib = sum(t.numel() * t.element_size() for t in weights(tmp_path / "deep" / "model.safetensors").values())
    base_mib /= 2**20
    train(tmp_path / "run", "--model", f"hf:{tmp_path / 'deep'}", *LM, *LORA, "--batch_size", "2", "--max_steps",
          "2", "--strategy", "fsdp", "--callbacks", "callback_plugins:RecordPeak", nproc=2, timeout=300)
    peaks = json.loads((tmp_path / "run" / "peak-rank-0.json").read_text())
    grew = peaks["end"] - peaks["step"]
    # Measured: 8 MiB; gathering the whole model first: 52 MiB (training's own peak hides the rest of it).
    assert grew < base_mib / 4, f"writing the final weights raised rank 0's peak {grew:.0f} MiB (base {base_mib:.0f})"
    adapters = weights(tmp_path / "run" / "model.safetensors")
    assert adapters and all(".lora_" in name for name in adapters)
