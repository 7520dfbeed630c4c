"""LoRA under --tp (issue 58): each adapter splits with its base layer (models/lora.py, TP_SPLIT_ADAPTER), so a
(dp, tp) mesh trains the adapters one process trains from the same global batch; its checkpoints hold the
adapters only, continue bitwise, and resume on one process (the frozen base's fingerprint is the same summed over
any split); RUN_DIR/adapter/ holds them whole. What is not split exactly yet is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY, assert_bitwise_equal, cli_in_process, one_line_error, train, weights

pytest.importorskip("peft")

# tests/parallel/test_tensor_parallel.py's GPT job (SGD, constant lr), its linear layers adapted.
GPT = ["--task", "language_model", "--model", "gpt", "--dataset", "pydoc", "--vocab_size", "256", "--seq_len", "32",
       "--width", "32", "--num_layers", "2", "--num_heads", "2", "--lr_schedule", "constant", "--save_every", "0",
       "--save_every_steps", "3", "--lora_rank", "4"]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape for k in a), "whole tensors on both sides"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_adapters_learned(adapters: dict[str, torch.Tensor]) -> None:
    """peft starts every lora_B at zero: each must have moved 10 times the equality tolerance (1e-5) or more, or
    equal runs would prove nothing (an adapter left out of the optimizer, or one whose gradient never arrives,
    stays 0)."""
    lora_b = {name: value.abs().max().item() for name, value in adapters.items() if ".lora_B." in name}
    assert lora_b and min(lora_b.values()) > 1e-4, lora_b
    assert len(lora_b) == len(adapters) / 2, sorted(adapters)


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    """The GPT job on one process (a plain module): the global batch of 16 each step."""
    run_dir = tmp_path_factory.mktemp("one")
    train(run_dir, *GPT, "--batch_size", "16", "--max_steps", "6")
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_gpt_adapters_under_tp_end_where_one_process_ends_and_resume_bitwise_and_on_one_process(one, tmp_path,
                                                                                                 strategy):
    """dp 1 x tp 2: the fused qkv's lora_B split by its heads of q, k and v, proj's and mlp.2's lora_A by their
    inputs, mlp.0's lora_B by its outputs. Ends within 1e-5 of one process (measured 1.5e-8 under fsdp and ddp,
    dp 2 x tp 2 alike); its step-3 checkpoint continued on tp 2 ends bitwise, and on one process where one process
    ends (the frozen base's fingerprint summed over the split is the whole's)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ddptrain.models import lora

    job = [*GPT, "--strategy", strategy, "--batch_size", "16", "--max_steps", "6"]
    tp2, resumed, crossed = tmp_path / "tp2", tmp_path / "resumed", tmp_path / "crossed"
    train(tp2, *job, "--tp", "2", nproc=2)
    final = weights(one / "model.safetensors")
    assert_adapters_learned(final)
    assert all(".lora_" in name for name in final), "model.safetensors holds what trained: the adapters"
    assert max_diff(weights(tp2 / "model.safetensors"), final) <= 1e-5
    # PEFT's layout of the tp run: whole adapters, as one process writes them.
    adapter = Path(lora.ADAPTER_DIR) / "adapter_model.safetensors"
    assert max_diff(weights(tp2 / adapter), weights(one / adapter)) <= 1e-5
    step_3 = tp2 / "checkpoints" / "step-3"
    held = FileSystemReader(str(step_3 / "shards")).read_metadata().state_dict_metadata
    assert any(".lora_B." in k for k in held) and not any(".base_layer." in k for k in held), sorted(held)[:5]
    train(resumed, *job, "--tp", "2", "--resume_from", str(step_3), nproc=2)
    assert "resuming from" in (resumed / "logs" / "rank-0.log").read_text()
    assert_bitwise_equal(weights(resumed / "model.safetensors"), weights(tp2 / "model.safetensors"))
    train(crossed, *job, "--resume_from", str(step_3), "--accept_config_change")
    assert "resuming from" in (crossed / "logs" / "rank-0.log").read_text()
    assert max_diff(weights(crossed / "model.safetensors"), final) <= 1e-5


@pytest.mark.slow
def test_a_transformers_llamas_adapters_split_by_its_own_plan_and_end_where_one_process_ends(tmp_path):
    """--model hf:DIR --tp 2 --lora_rank 4: q/k/v/gate/up colwise (lora_B split), o/down rowwise (lora_A split),
    masked batches, the base read into each rank's split from the save_pretrained files. Measured 3.7e-8."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, bos_token_id=63, eos_token_id=63)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    job = ["--model", f"hf:{tmp_path / 'llama'}", "--task", "language_model", "--dataset", "lm_plugins:masked_lm",
           "--vocab_size", "64", "--seq_len", "24", "--dataset_size", "64", "--eval_size", "0", "--weight_decay", "0",
           "--save_every", "0", "--batch_size", "8", "--max_steps", "4", "--strategy", "fsdp", "--lora_rank", "4",
           "--lr", "0.5"]  # (TINY's SGD: at its lr 0.1 a k_proj's lora_B moved 1.5e-4 in 4 steps)
    train(tmp_path / "one", *job)
    train(tmp_path / "tp2", *job, "--tp", "2", nproc=2)
    final = weights(tmp_path / "one" / "model.safetensors")
    assert_adapters_learned(final)
    assert max_diff(weights(tmp_path / "tp2" / "model.safetensors"), final) <= 1e-5


def gpt_with_adapters(**flags):
    from ddptrain.config import TrainConfig
    from ddptrain.models import GPT as GPTModel
    from ddptrain.models import lora

    torch.manual_seed(0)
    return lora.apply(GPTModel(256, 32, 32, 2, 2), TrainConfig(lora_rank=4, **flags).section("finetune"), "gpt")


def test_the_plan_splits_each_base_layer_and_the_adapter_on_its_split_side():
    """peft moved each adapted layer to `...base_layer`: the plan names it there (FusedColwise and torch's styles
    split an nn.Linear, not peft's layer), with the adapter on the split side beside it, each name one module."""
    from ddptrain.parallel import tensor

    model = gpt_with_adapters(lora_targets="qkv,mlp.2")
    plan = {name: type(style).__name__ for name, style in tensor.plan_for(model, 2).items()}
    assert plan == {"blocks.0.qkv.base_layer": "FusedColwise", "blocks.0.qkv.lora_B.default": "FusedColwise",
                    "blocks.1.qkv.base_layer": "FusedColwise", "blocks.1.qkv.lora_B.default": "FusedColwise",
                    "blocks.0.mlp.2.base_layer": "RowwiseParallel", "blocks.0.mlp.2.lora_A.default": "RowwiseParallel",
                    "blocks.1.mlp.2.base_layer": "RowwiseParallel", "blocks.1.mlp.2.lora_A.default": "RowwiseParallel",
                    "blocks.*.proj": "RowwiseParallel", "blocks.*.mlp.0": "ColwiseParallel"}, plan
    modules = dict(model.named_modules())
    assert all(isinstance(modules[name], torch.nn.Linear) for name in plan if "*" not in name)


def test_a_layer_the_plan_splits_trained_in_full_is_a_usage_error():
    """A --lora_modules_to_save copy of a split layer would be whole beside its split original (reachable where a
    strategy allows modules_to_save with --tp)."""
    from ddptrain.errors import UsageError
    from ddptrain.parallel import tensor

    with pytest.raises(UsageError, match="--lora_modules_to_save") as refused:
        tensor.plan_for(gpt_with_adapters(lora_targets="qkv", lora_modules_to_save="proj"), 2)
    assert "\n" not in str(refused.value) and "--tp 1" in str(refused.value)


@pytest.mark.parametrize("flags, names", [
    # The ranks of a group would draw different dropout masks for one adapter's input.
    (["--lora_dropout", "0.1"], ["--lora_dropout", "--tp 2"]),
    # DoRA's magnitude is of the whole weight: refused under fsdp already (and under --tp on any strategy).
    (["--lora_dora"], ["--lora_dora"]),
])
def test_what_lora_does_not_split_exactly_yet_is_one_line(tmp_path, flags, names):
    line = one_line_error(cli_in_process(["train", *TINY, "--task", "language_model", "--dataset", "pydoc",
                                          "--run_dir", str(tmp_path), "--max_steps", "1", "--model", "gpt",
                                          "--strategy", "fsdp", "--tp", "2", "--lora_rank", "4", *flags]))
    assert all(name in line for name in names), line
