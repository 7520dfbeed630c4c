"""--param_dtype, --reduce_dtype, --reshard_after_forward and --cpu_offload under --strategy fsdp: what each trains
and what each rank holds. Real processes, gloo on CPU, the tiny MLP, a few steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, cli_in_process, metrics, one_line_error, train, weights

STEPS = ["--max_steps", "8", "--epochs", "1", "--save_every", "0", "--eval_size", "0"]
FSDP = ["--strategy", "fsdp"]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fsdp")
    train(run_dir, *STEPS, *FSDP, nproc=2)
    return run_dir


@pytest.mark.parametrize("flag", ["--no-reshard_after_forward", "--cpu_offload"])
def test_reshard_and_offload_change_where_state_lives_not_what_is_trained(fsdp, tmp_path, flag):
    """Both move the same fp32 values to other places (kept gathered; on the host): bitwise the default run."""
    train(tmp_path, *STEPS, *FSDP, flag, nproc=2)
    assert_bitwise_equal(weights(fsdp / "model.safetensors"), weights(tmp_path / "model.safetensors"))
    (row,), (default,) = metrics(tmp_path, "memory"), metrics(fsdp, "memory")
    held = [p + g + o for p, g, o in zip(row["param_bytes"], row["grad_bytes"], row["optimizer_bytes"])]
    assert row["offloaded_bytes"] == (held if flag == "--cpu_offload" else [0, 0])
    assert default["offloaded_bytes"] == [0, 0]


def test_bf16_weights_train_are_saved_bf16_and_hold_half_the_bytes(fsdp, tmp_path):
    train(tmp_path / "two", *STEPS, *FSDP, "--param_dtype", "bf16", nproc=2)
    final, fp32 = weights(tmp_path / "two" / "model.safetensors"), weights(fsdp / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.bfloat16}, "the weights' own dtype, as saved"
    losses = [row["loss"] for row in metrics(tmp_path / "two", "train")]
    assert losses[-1] < losses[0], "bf16 weights learn"
    # bf16 rounding (2^-8 relative) per step: close to fp32 training, not equal to it.
    assert max((final[k].float() - fp32[k]).abs().max().item() for k in final) < 2e-2
    (row,), (default,) = metrics(tmp_path / "two", "memory"), metrics(fsdp, "memory")
    for kind in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert [2 * b for b in row[kind]] == default[kind], kind
    # 2 processes = 1 under bf16 weights: the gradient is reduced in fp32 and rounded to bf16 once, so the
    # two-rank run differs from one rank only by the rounding of each rank's partial gradient.
    train(tmp_path / "one", *STEPS, *FSDP, "--param_dtype", "bf16", "--grad_accum_steps", "2")
    one = weights(tmp_path / "one" / "model.safetensors")
    assert max((final[k].float() - one[k].float()).abs().max().item() for k in final) <= 1e-2


@pytest.mark.parametrize("flag", [["--cpu_offload"], ["--param_dtype", "bf16"], ["--reduce_dtype", "bf16"],
                                  ["--no-reshard_after_forward"]])
def test_fsdp_only_flags_under_ddp_are_one_line_exit_2(tmp_path, flag):
    proc = cli_in_process(["train", "--run_dir", str(tmp_path), *flag])
    assert proc.returncode == 2
    assert f"--{flag[0].lstrip('-')}".split()[0] in one_line_error(proc) and "--strategy fsdp" in one_line_error(proc)
