"""--strategy fsdp: the same training as ddp with sharded state, sharded checkpoints that resume onto any world
size and strategy, and a DCP index that cannot run code. Real processes, gloo on CPU.

Reference runs (once per module): ddp and fsdp on 2 processes, 50 steps of 64 samples (1024 training
samples: 16 steps per epoch), a checkpoint every 10 steps, every sample id recorded; and ddp with the same
global batch as 2 micro-steps of 16 per rank.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    TINY,
    RunsCode,
    assert_bitwise_equal,
    cli_in_process,
    metrics,
    one_line_error,
    read_jsonl,
    run_cli,
    run_python,
    train,
    weights,
)
from safetensors.torch import load_file

STEPS = ["--dataset_size", "1024", "--epochs", "4", "--max_steps", "50", "--save_every", "0",
         "--save_every_steps", "10", "--keep_last", "0", "--record_sample_ids", "--grad_clip", "1.0"]
FSDP = ["--strategy", "fsdp"]
ACCUM_2 = ["--batch_size", "16", "--grad_accum_steps", "2"]
REDUCE_EVERY = ["--fsdp_reduce_every_micro_step"]
GRAD_BYTES = 4 * (192 * 32 + 32 + 32 * 10 + 10)  # TINY's MLP: the whole model's fp32 gradients
ROWS_OF_ONE = 4 * (192 + 1 + 32 + 1)  # the rounding remainder of dim-0 shards: one row of each of the 4 parameters


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ddp")
    train(run_dir, *STEPS, nproc=2)
    return run_dir


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fsdp")
    train(run_dir, *STEPS, *FSDP, nproc=2)
    return run_dir


@pytest.fixture(scope="module")
def ddp_accum(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ddp_accum")
    train(run_dir, *STEPS, *ACCUM_2, nproc=2)
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step}"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def samples_by_step(run_dir: Path) -> dict[int, list[int]]:
    """Every sample id a step trained on, over all ranks and micro-steps (the later attempt's, after a resume)."""
    rows = defaultdict(dict)
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for row in read_jsonl(path):
            rows[row["step"]][(path.stem, row["micro"])] = row["ids"]
    return {step: sorted(i for ids in parts.values() for i in ids) for step, parts in rows.items()}


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics(run_dir, "train")}


# --- the same training -----------------------------------------------------------------------------

def test_fsdp_trains_what_ddp_trains_within_1e_5_after_50_steps(ddp, fsdp):
    assert metrics(fsdp, "train")[-1]["step"] == 50
    assert max_diff(weights(ddp / "model.safetensors"), weights(fsdp / "model.safetensors")) <= 1e-5
    assert samples_by_step(ddp) == samples_by_step(fsdp)
    # Clipping at 1.0 acts on the norm over every rank's shards: the same norm ddp computes on whole gradients.
    norms_ddp, norms_fsdp = ([row["grad_norm"] for row in metrics(run, "train")] for run in (ddp, fsdp))
    assert max(norms_ddp) > 1.0, "clipping was active"
    assert norms_fsdp == pytest.approx(norms_ddp, rel=1e-5)
    final_ddp, final_fsdp = metrics(ddp, "eval")[-1], metrics(fsdp, "eval")[-1]
    assert final_fsdp["samples"] == final_ddp["samples"] == 61
    assert final_fsdp["loss"] == pytest.approx(final_ddp["loss"], abs=1e-5)


def counted_fsdp_run(run_dir: Path, *flags: str) -> list[int]:
    """fsdp with ACCUM_2: the real Trainer under torchrun, each FSDP unit's reduce-scatter counted
    (tests/worker_accum_hooks.py). The micro-step (0 or 1) of every reduce-scatter call."""
    report_path = run_dir.parent / f"{run_dir.name}-hooks.json"
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(REPO / "tests" / "worker_accum_hooks.py"), str(report_path), *TINY, *STEPS, *ACCUM_2, *FSDP,
                       *flags, "--run_dir", str(run_dir)], timeout=240)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["steps"] == 50 and report["micro_batches"] == 100
    return [call % 2 for call in report["hook_calls"]]


def test_with_accumulation_fsdp_reduce_scatters_on_the_last_micro_step_only_and_equals_ddp(ddp_accum, tmp_path):
    micro = counted_fsdp_run(tmp_path / "fsdp")
    assert micro.count(0) == 0, "a reduce-scatter ran on a micro-step that only accumulates"
    assert len(micro) == 50 * 2, "MLP: two Linear units reduce-scatter once per step each"
    assert max_diff(weights(ddp_accum / "model.safetensors"), weights(tmp_path / "fsdp" / "model.safetensors")) <= 1e-5


def test_reduce_every_micro_step_reduce_scatters_on_each_micro_step_and_equals_ddp(ddp_accum, tmp_path):
    micro = counted_fsdp_run(tmp_path / "fsdp", *REDUCE_EVERY)
    assert micro.count(0) == micro.count(1) == 50 * 2, "MLP: two Linear units reduce-scatter on every micro-step"
    assert max_diff(weights(ddp_accum / "model.safetensors"), weights(tmp_path / "fsdp" / "model.safetensors")) <= 1e-5


def test_with_accumulation_the_memory_line_states_the_gradients_held_between_micro_steps(ddp_accum, tmp_path):
    """Until the last micro-step's reduce-scatter, fsdp holds the whole model's unsharded gradients on every
    rank (2x its shard at 2 ranks), which no parameter's .grad shows and which are gone by the end of the step;
    --fsdp_reduce_every_micro_step keeps only the shard. ddp holds its replica either way."""
    accum_4 = ["--batch_size", "8", "--grad_accum_steps", "4", "--max_steps", "2", "--save_every", "0"]
    train(tmp_path / "last", *accum_4, *FSDP, nproc=2)
    (last,), (ddp,) = metrics(tmp_path / "last", "memory"), metrics(ddp_accum, "memory")
    assert sum(last["grad_bytes"]) == GRAD_BYTES and max(last["grad_bytes"]) <= GRAD_BYTES / 2 + ROWS_OF_ONE
    assert last["peak_grad_bytes"] == [GRAD_BYTES, GRAD_BYTES], "the unsharded accumulated gradients"
    assert ddp["peak_grad_bytes"] == ddp["grad_bytes"] == [GRAD_BYTES, GRAD_BYTES]
    train(tmp_path / "every", *accum_4, *FSDP, *REDUCE_EVERY, nproc=2)
    (every,) = metrics(tmp_path / "every", "memory")
    assert every["peak_grad_bytes"] == every["grad_bytes"] == last["grad_bytes"], "only the rank's shard"


def test_each_rank_holds_half_of_ddp_state_and_the_metrics_say_so(ddp, fsdp):
    (row_ddp,), (row_fsdp,) = metrics(ddp, "memory"), metrics(fsdp, "memory")
    assert row_ddp["strategy"] == "ddp" and row_fsdp["strategy"] == "fsdp"
    for kind in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        whole, shards = row_ddp[kind], row_fsdp[kind]
        assert whole[0] == whole[1] > 0
        assert sum(shards) == whole[0], f"{kind}: the shards partition each tensor exactly"
        assert max(shards) <= whole[0] / 2 + ROWS_OF_ONE, kind
    # Without accumulation a rank holds the most gradient after the backward: what grad_bytes says.
    assert row_ddp["peak_grad_bytes"] == row_ddp["grad_bytes"] and row_fsdp["peak_grad_bytes"] == row_fsdp["grad_bytes"]


def shard_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from ddptrain.checkpoints.read import read_checkpoint
    from ddptrain.checkpoints.shards import consolidate

    return consolidate(read_checkpoint(checkpoint, torch.device("cpu")))


def test_a_non_finite_step_under_fsdp_is_skipped_on_every_rank(fsdp, tmp_path):
    """Rank 0's loss is NaN at step 12: the step-12 checkpoint holds the weights of step 11 (the guard under
    fsdp is decided on the host from the norm over all shards, so both ranks skip)."""
    run_dir = tmp_path / "nan"
    train(run_dir, *STEPS, *FSDP, "--max_steps", "12", "--save_every_steps", "11",
          "--inject_fault", "rank=0,step=12,kind=nan", nproc=2)
    assert metrics(run_dir, "train")[-1]["nonfinite_steps"] == 1
    clean = tmp_path / "clean"
    train(clean, *STEPS, *FSDP, "--max_steps", "11", nproc=2)
    assert_bitwise_equal(shard_weights(step_dir(run_dir, 12)), shard_weights(step_dir(clean, 11)))


def test_use_amp_under_fsdp_computes_in_bf16_and_keeps_fp32_weights(fsdp, tmp_path):
    run_dir = tmp_path / "amp"
    train(run_dir, *STEPS, *FSDP, "--use_amp", "--max_steps", "20", nproc=2)
    final = weights(run_dir / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.float32}
    reference = shard_weights(step_dir(fsdp, 20))
    diff = max_diff(reference, final)
    assert 0 < diff < 0.05, f"bf16 compute differs from fp32 a little, not wholesale: {diff}"
    assert losses(run_dir)[20] == pytest.approx(losses(fsdp)[20], abs=0.05)


# --- sharded checkpoints ---------------------------------------------------------------------------

def test_a_sharded_checkpoint_lists_every_rank_s_files_with_digests(fsdp):
    manifest = json.loads((step_dir(fsdp, 10) / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp",
                                         "trainer.pt"]
    assert not (step_dir(fsdp, 10) / "model.safetensors").exists()


def test_kill_and_restart_under_fsdp_with_async_saves_is_bitwise(fsdp, tmp_path):
    """Rank 1 is SIGKILLed after step 14, once the async step-10 checkpoint has committed (on a busy machine its
    writer can still be at work five steps later); the restarted job resumes from it."""
    run_dir = tmp_path / "killed"
    train(run_dir, *STEPS, *FSDP, "--max_steps", "20", "--async_checkpoint", "--max_restarts", "1",
          "--callbacks", "callback_plugins:KillOnceCommitted", nproc=2,
          env={"KILL_RANK": "1", "KILL_STEP": "14", "COMMITTED_STEP": "10"})
    assert f"resuming from {step_dir(run_dir, 10)} (step 10)" in (run_dir / "logs" / "rank-0.log").read_text()
    reference = run_cli(["export", str(step_dir(fsdp, 20)), str(tmp_path / "reference.safetensors")])
    assert reference.returncode == 0, reference.stderr
    assert_bitwise_equal(weights(tmp_path / "reference.safetensors"), weights(run_dir / "model.safetensors"))


def resumed(tmp_path: Path, checkpoint: Path, *flags: str, nproc: int = 2) -> Path:
    run_dir = tmp_path / "resumed"
    train(run_dir, *STEPS, "--resume_from", str(checkpoint), *flags, nproc=nproc)
    return run_dir


def assert_continues(reference: Path, run_dir: Path, after: int, rel_loss: float = 1e-4) -> None:
    """Steps after `after` trained on the reference's samples, to losses within `rel_loss` of its."""
    want, got = samples_by_step(reference), samples_by_step(run_dir)
    assert [s for s in got if s > after] == list(range(after + 1, 51))
    assert all(got[s] == want[s] for s in got if s > after), "another sample order after the resume"
    ref_loss, run_loss = losses(reference), losses(run_dir)
    for s in range(after + 1, 51):
        assert run_loss[s] == pytest.approx(ref_loss[s], abs=rel_loss), s
    assert max_diff(weights(reference / "model.safetensors"), weights(run_dir / "model.safetensors")) <= 1e-4


@pytest.mark.parametrize("layout", ["2->1", "2->4", "fsdp->ddp", "ddp->fsdp"])
def test_resharding_resume_continues_sample_exactly(ddp, fsdp, tmp_path, layout):
    """The global batch stays 64: one process accumulates 2 x 32, four take 16 each."""
    if layout == "2->1":
        run_dir = resumed(tmp_path, step_dir(fsdp, 20), *FSDP, "--grad_accum_steps", "2", nproc=0)
    elif layout == "2->4":
        run_dir = resumed(tmp_path, step_dir(fsdp, 20), *FSDP, "--batch_size", "16", nproc=4)
    elif layout == "fsdp->ddp":
        run_dir = resumed(tmp_path, step_dir(fsdp, 20))
    else:
        run_dir = resumed(tmp_path, step_dir(ddp, 20), *FSDP)
    assert_continues(fsdp if layout != "fsdp->ddp" else ddp, run_dir, after=20)


def test_a_one_process_fsdp_checkpoint_resumes_on_two(fsdp, tmp_path):
    one = tmp_path / "one"
    train(one, *STEPS, *FSDP, "--grad_accum_steps", "2", "--max_steps", "20")
    assert json.loads((step_dir(one, 20) / "manifest.json").read_text())["world_size"] == 1
    assert_continues(fsdp, resumed(tmp_path, step_dir(one, 20), *FSDP), after=20)


# --- export and hostile content ------------------------------------------------------------------

def test_export_consolidates_the_shards_into_one_file_a_plain_script_loads(fsdp, tmp_path):
    out = tmp_path / "model.safetensors"
    proc = run_cli(["export", str(step_dir(fsdp, 50)), str(out)])
    assert proc.returncode == 0, proc.stderr
    assert_bitwise_equal(weights(out), weights(fsdp / "model.safetensors"))
    script = ("import sys, torch; from safetensors.torch import load_file; from torch import nn\n"
              "m = nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Linear(32, 10))\n"
              "m.load_state_dict({k.removeprefix('net.'): v for k, v in load_file(sys.argv[1]).items()})\n"
              "print(m(torch.zeros(1, 3, 8, 8)).shape)")
    plain = run_python(["-c", script, str(out)], timeout=60)
    assert plain.stdout.strip() == "torch.Size([1, 10])", plain.stderr


@pytest.fixture
def copied(fsdp, tmp_path) -> tuple[Path, Path]:
    """A run dir holding a copy of the fsdp run's step-10 checkpoint, and a sentinel path."""
    run_dir = tmp_path / "run"
    shutil.copytree(step_dir(fsdp, 10), step_dir(run_dir, 10))
    return run_dir, tmp_path / "pwned"


def resign(checkpoint: Path, name: str) -> None:
    from ddptrain.checkpoints.format import file_digest

    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = file_digest(checkpoint / name)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("path", ["resume", "export"])
def test_a_hostile_dcp_index_is_refused_and_runs_no_code(copied, path):
    """Re-signed, so only the restricted unpickler stands between the file and the payload."""
    run_dir, sentinel = copied
    checkpoint = step_dir(run_dir, 10)
    (checkpoint / "shards" / ".metadata").write_bytes(pickle.dumps(RunsCode(sentinel)))
    resign(checkpoint, "shards/.metadata")
    if path == "export":
        proc = run_cli(["export", str(checkpoint), str(run_dir / "out.safetensors")])
    else:
        proc = train(run_dir, *STEPS, *FSDP, "--resume_from", str(checkpoint), nproc=2, check=False)
    line = one_line_error(proc)
    assert "shards/.metadata refused: it references posix.system" in line, line
    assert not sentinel.exists(), "unpickling ran the payload"


def test_a_corrupted_shard_fails_its_digest_and_resume_falls_back(copied, fsdp):
    """Rank 1 verifies the second shard file: its failure makes every rank fall back to step 10."""
    run_dir, _ = copied
    shutil.copytree(step_dir(fsdp, 20), step_dir(run_dir, 20))
    shard = step_dir(run_dir, 20) / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    train(run_dir, *STEPS, *FSDP, "--max_steps", "22", nproc=2)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "unusable on rank 1: shards/__1_0.distcp fails its sha256 check (corrupted)" in log
    assert f"resuming from {step_dir(run_dir, 10)} (step 10)" in log


# --- what a user brings: a tied-weight language model, and wrong flags ----------------------------

GPT = ["--task", "language_model", "--model", "gpt", "--dataset", "pydoc", "--vocab_size", "256", "--seq_len", "32",
       "--width", "32", "--num_layers", "2", "--num_heads", "2", "--batch_size", "8", "--optimizer", "adamw",
       "--lr", "0.003", "--grad_clip", "1.0", "--save_every", "0", "--save_every_steps", "3",
       "--lr_schedule", "constant"]  # (a run continued to a later --max_steps: the same lr before and after)


def test_a_tied_weight_gpt_under_fsdp_matches_ddp_and_resumes_bitwise(tmp_path):
    straight, twice, ddp_run = tmp_path / "straight", tmp_path / "twice", tmp_path / "ddp"
    train(straight, *GPT, *FSDP, "--max_steps", "6", nproc=2)
    train(twice, *GPT, *FSDP, "--max_steps", "3", nproc=2)
    train(twice, *GPT, *FSDP, "--max_steps", "6", nproc=2)
    train(ddp_run, *GPT, "--max_steps", "6", nproc=2)
    final = weights(straight / "model.safetensors")
    assert_bitwise_equal(weights(twice / "model.safetensors"), final)
    # Adam divides each gradient by its own root mean square: where a gradient is near 0, the other order of
    # ddp's and fsdp's sums can move its update by a share of the lr. Measured 3e-5 on an AVX-512 Xeon (under
    # 1e-5 on the machines before); a tied matrix updated twice, or a shard left out, is the lr's order (3e-3).
    assert max_diff(weights(ddp_run / "model.safetensors"), final) <= 1e-4
    assert torch.equal(final["embed.weight"], final["head.weight"]), "the tied matrix is one matrix"


SPLIT = "split by vocabulary rows over 2 ranks"


@pytest.mark.parametrize("precision", [["--use_amp"], ["--param_dtype", "bf16"], ["--cpu_offload"]])
def test_the_vocabulary_split_trains_as_the_gathered_embedding_and_head_do_in_each_precision(tmp_path, precision):
    """parallel/vocab.py under bf16 compute, bf16 weights and offloaded shards, against the tied matrix as an
    FSDP unit (--no-vocab_parallel): the same losses (fp32 offload: the same weights bitwise as without it)."""
    split, gathered = tmp_path / "split", tmp_path / "gathered"
    train(split, *GPT, *FSDP, *precision, "--max_steps", "6", nproc=2)
    train(gathered, *GPT, *FSDP, *precision, "--no-vocab_parallel", "--max_steps", "6", nproc=2)
    assert SPLIT in (split / "logs" / "rank-0.log").read_text()
    assert SPLIT not in (gathered / "logs" / "rank-0.log").read_text()
    assert list(losses(split).values()) == pytest.approx(list(losses(gathered).values()), rel=1e-2)
    if precision == ["--cpu_offload"]:
        plain = tmp_path / "plain"
        train(plain, *GPT, *FSDP, "--max_steps", "6", nproc=2)
        assert_bitwise_equal(weights(split / "model.safetensors"), weights(plain / "model.safetensors"))


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "hsdp"], "--strategy hsdp needs several nodes"),
    (["--strategy", "fsdp", "--fsdp_blocks", "Nope"], "--fsdp_blocks Nope: the model has no module of that class"),
])
def test_wrong_strategy_flags_are_one_line_errors(tmp_path, flags, message):
    """Found by the training process (the world it joined, the model it built)."""
    line = one_line_error(train(tmp_path, "--max_steps", "1", *flags, check=False))
    assert message in line, line


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "fsdp", "--static_graph"], "--static_graph does not apply to --strategy fsdp"),
    (REDUCE_EVERY, "--fsdp_reduce_every_micro_step applies to --strategy fsdp or hsdp"),
])
def test_strategy_flags_that_contradict_each_other_are_one_line_errors_before_any_process(tmp_path, flags, message):
    line = one_line_error(cli_in_process(["train", *TINY, "--run_dir", str(tmp_path), "--max_steps", "1", *flags]))
    assert message in line, line


def test_fsdp_blocks_from_a_plug_in_function(tmp_path):
    proc = train(tmp_path, "--max_steps", "2", *FSDP, "--fsdp_blocks", "model_plugins:first_linear", "--nproc", "2")
    assert "fsdp over mesh (2,): 2 units" in (tmp_path / "logs" / "rank-0.log").read_text(), proc.stderr
    assert load_file(str(tmp_path / "model.safetensors"))
