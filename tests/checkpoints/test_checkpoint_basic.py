"""Checkpoints of a 2-process run resume and finish; a checkpoint file carrying code is refused unexecuted.

(Exact-resume and fault-tolerance behaviour is tested in test_resume.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pipeline_runs as runs
import pytest
import torch
from helpers import (REPO, RunsCode, assert_bitwise_equal, metrics, one_line_error, plant_hostile, read_jsonl, train,
                     weights)

from ddptrain.checkpoints.format import MANIFEST, CheckpointError, committed_steps
from ddptrain.checkpoints.read import read_checkpoint

COMPAT = REPO / "tests" / "fixtures" / "compat-2026-12-06"  # checkpoints an earlier version wrote (test_compat)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    return runs.pair(tmp_path_factory)


def test_checkpoint_of_a_two_process_run_resumes_and_finishes(pair: Path, tmp_path: Path):
    steps = runs.STEPS_PER_EPOCH
    saved = dict(committed_steps(pair / "checkpoints"))
    assert sorted(saved) == [steps, 2 * steps], "--save_every 1 commits one checkpoint per epoch"
    manifest = json.loads((saved[steps] / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == steps and manifest["epoch"] == 1
    # One write path for every strategy (DCP): under ddp each rank holds every tensor, and DCP has each
    # written once, the ranks sharing the writing.
    assert sorted(manifest["files"]) == ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp",
                                         "trainer.pt"]
    assert manifest["layout"] == "sharded"
    assert all(manifest["files"][f"shards/__{rank}_0.distcp"]["size"] > 1000 for rank in (0, 1))

    resumed = tmp_path / "resumed"
    proc = train(resumed, *runs.SHARED, "--batch_size", "16", "--resume_from", str(saved[steps]), nproc=2)
    assert f"resuming from {saved[steps]}" in proc.stdout
    assert [r["step"] for r in metrics(resumed, "train")] == list(range(steps + 1, 2 * steps + 1))
    assert committed_steps(resumed / "checkpoints")[0][0] == 2 * steps
    # The second epoch read the samples the uninterrupted run read, and ended at the same weights.
    for rank in (0, 1):
        name = f"samples/rank-{rank}.jsonl"
        assert read_jsonl(resumed / name) == [r for r in read_jsonl(pair / name) if r["step"] > steps]
    final, uninterrupted = weights(resumed / "model.safetensors"), weights(pair / "model.safetensors")
    for key in final:
        torch.testing.assert_close(final[key], uninterrupted[key], rtol=1e-6, atol=1e-7)


def test_ddp_ranks_share_the_writing_and_a_rank_with_nothing_to_write_still_commits_and_resumes(tmp_path: Path):
    """Each tensor a ddp checkpoint holds is written by one rank (share_of_replicas); with one tensor and two
    ranks the second writes nothing, and the checkpoint still commits, resumes and ends as the unbroken run."""
    flags = ["--model", "model_plugins:one_matrix", "--momentum", "0", "--save_every_steps", "2", "--keep_last", "0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *flags, "--max_steps", "4", nproc=2)
    shutil.copytree(straight / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    manifest = json.loads((resumed / "checkpoints" / "step-2" / MANIFEST).read_text())
    sizes = {name: entry["size"] for name, entry in manifest["files"].items() if name.endswith(".distcp")}
    assert sizes["shards/__0_0.distcp"] > 1000 and sizes["shards/__1_0.distcp"] == 0, sizes
    proc = train(resumed, *flags, "--max_steps", "4", nproc=2)
    assert f"resuming from {resumed / 'checkpoints' / 'step-2'}" in proc.stdout
    assert_bitwise_equal(weights(resumed / "model.safetensors"), weights(straight / "model.safetensors"))


def test_the_share_of_replicas_gives_each_tensor_to_one_rank_balancing_bytes():
    from ddptrain.checkpoints.shards import share_of_replicas

    state = {"model": {"a": torch.zeros(100), "b": torch.zeros(10), "c": torch.zeros(60), "d": torch.zeros(50)},
             "optim": {"state": {"a": {"m": torch.zeros(100)}, "e": {"step": torch.tensor(1.0)}}}}
    def leaves(node, prefix=""):
        for key, value in node.items():
            yield from leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]

    whole = dict(leaves(state))
    parts = [dict(leaves(share_of_replicas(state, rank, 2))) for rank in (0, 1)]
    # In order, to the rank with the fewest bytes: a (400 B) to 0, b, c and d to 1 (40, 280, 480 B), a's
    # momentum to 0 (800 B), the 0-d step to 1.
    assert sorted(parts[0]) == ["model.a", "optim.state.a.m"]
    assert sorted(parts[1]) == ["model.b", "model.c", "model.d", "optim.state.e.step"]
    assert all(value is whole[name] for part in parts for name, value in part.items())  # the tensors themselves
    assert dict(leaves(share_of_replicas(state, 0, 1))).keys() == whole.keys()


def test_a_ddp_rank_snapshots_only_its_share_of_the_replicated_state():
    """share_of_replicas wired in: what a ddp rank stages and writes at a save is its share alone (the shares of
    the ranks split the whole); an fsdp rank's is all it holds."""
    from types import SimpleNamespace

    from torch import nn

    from ddptrain.checkpoints.shards import share_of_replicas
    from ddptrain.loop.checkpointed import ModelState

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(2, 8)).sum().backward()
    optimizer.step()

    def names(node, prefix=""):
        return {name for key, value in node.items()
                for name in (names(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key])}

    def snapshot(rank, sharded):
        ctx, parallel = SimpleNamespace(rank=rank, world_size=2, is_main=rank == 0), SimpleNamespace(sharded=sharded)
        return ModelState(module, optimizer, parallel, ctx, lambda: None, "sgd", "mlp", 0).weights()[0]

    whole = snapshot(0, sharded=True)
    shares = [names(snapshot(rank, sharded=False)) for rank in (0, 1)]
    assert shares == [names(share_of_replicas(whole, rank, 2)) for rank in (0, 1)]
    assert shares[0] and shares[1] and not shares[0] & shares[1] and shares[0] | shares[1] == names(whole)


def hostile_copy(pair: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A copy of a checkpoint with `name` replaced by a pickle that runs code: of the pair's newest, or for
    optimizer.pt, which only the full layout has, of the ddp checkpoint an earlier version wrote."""
    step, source = committed_steps(pair / "checkpoints")[0]
    if name == "optimizer.pt":
        step, source = 3, COMPAT / "ddp" / "step-3"
    checkpoint = tmp_path / "checkpoints" / f"step-{step}"
    shutil.copytree(source, checkpoint)
    sentinel = tmp_path / f"pwned-{name}"
    plant_hostile(checkpoint, name, sentinel)
    return checkpoint, sentinel


def test_the_planted_payload_is_live(tmp_path: Path):
    """Control: an unsafe load of the same bytes does run the code, so the refusals below mean something."""
    sentinel = tmp_path / "pwned"
    torch.save({"state": RunsCode(sentinel)}, tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert sentinel.exists()


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer.pt"])
def test_loader_refuses_a_pickle_that_runs_code(pair: Path, tmp_path: Path, name: str, monkeypatch):
    checkpoint, sentinel = hostile_copy(pair, tmp_path, name)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch's own default no longer protects
    with pytest.raises(CheckpointError, match=f"{name} refused by the safe loader: it references posix.system"):
        read_checkpoint(checkpoint, torch.device("cpu"))
    assert not sentinel.exists(), "the checkpoint's code ran"


def test_resume_from_a_hostile_checkpoint_exits_2_without_running_it(pair: Path, tmp_path: Path):
    checkpoint, sentinel = hostile_copy(pair, tmp_path, "trainer.pt")
    proc = train(tmp_path / "run", *runs.SHARED, "--resume_from", str(checkpoint), check=False,
                 env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    line = one_line_error(proc)
    assert "--resume_from" in line and "trainer.pt refused" in line, line
    assert not sentinel.exists(), "the checkpoint's code ran"
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_the_launcher_does_not_import_dcp():
    """torch.distributed.checkpoint (DCP), 0.7 s of CPU after bare torch (docs/performance.md): the trainer, which
    writes every checkpoint with it, imports it (0.04 s there: torch.optim has imported most of what it needs),
    the launcher and the tools that read no sharded checkpoint do not."""
    import subprocess
    import sys

    from helpers import cli_env

    probe = ("import importlib, sys\n"
             "for name in ['ddptrain.cli', 'ddptrain.api', 'ddptrain.parallel.launch', 'ddptrain.tools.doctor', "
             "'ddptrain.checkpoints.read']:\n"
             "    importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_mapped_model_file_reads_rows_of_each_tensor_and_0_d_tensors_whole(tmp_path: Path):
    """What a rank of a sharded run reads of a full checkpoint's model.safetensors (MappedWeights): the rows its
    shard holds, or a whole tensor; a 0-d tensor (a scalar parameter, a step count) has no rows to slice."""
    from safetensors.torch import save_file

    from ddptrain.checkpoints.format import MappedWeights

    saved = {"scale": torch.tensor(2.5), "weight": torch.arange(12.0).view(4, 3), "bias": torch.arange(4.0)}
    save_file(saved, str(tmp_path / "model.safetensors"))
    mapped = MappedWeights(tmp_path / "model.safetensors")
    assert set(mapped) == set(saved) and mapped.shapes() == {k: tuple(v.shape) for k, v in saved.items()}
    assert torch.equal(mapped.rows("weight", slice(2, 4)), saved["weight"][2:4])
    assert torch.equal(mapped.rows("bias", slice(None)), saved["bias"])
    assert torch.equal(mapped.rows("scale", slice(None)), saved["scale"])
    assert torch.equal(mapped["weight"], saved["weight"])


def test_the_save_schedule_decides_each_boundary():
    """checkpoints.manager.SaveSchedule: what the manager asks of each boundary the loop hands it."""
    from ddptrain.checkpoints.manager import SaveSchedule

    every = SaveSchedule(every_epochs=2, every_steps=5, every_minutes=0)
    assert [s for s in range(1, 16) if every.due(s)] == [5, 10, 15]
    assert every.due(3, timed=True) and every.due(3, best=True)
    # At an epoch's end only --save_every (and a wanted best) count, not the step.
    assert [e for e in range(1, 6) if every.due(10, epoch_end=e)] == [2, 4]
    assert every.due(7, epoch_end=1, best=True)
    never = SaveSchedule()
    assert not any(never.due(s) or never.due(s, epoch_end=s) for s in range(1, 20)) and not never.minutes_up()
    timed = SaveSchedule(every_minutes=0.5)
    assert not timed.minutes_up()
    timed.last_save -= 31  # seconds
    assert timed.minutes_up()
    timed.start_clock()
    assert not timed.minutes_up()


def test_the_loop_hands_every_boundary_to_the_manager_which_decides(tmp_path: Path):
    """The loop does not decide whether to save: it hands checkpoints.save each step's boundary (with the vote's
    timed flag), each epoch's end and the end; the manager saves where its schedule says. 2 epochs of 8 steps,
    --save_every_steps 3, --save_every 2: steps 3, 6, 9, 12, 15 and the second epoch's end; the end's save
    finds step 16 saved already. Each boundary comes with a callback's best request (none here)."""
    train(tmp_path, "--callbacks", "callback_plugins:Boundaries", "--epochs", "2", "--save_every_steps", "3",
          "--save_every", "2", "--keep_last", "0")
    seen = json.loads((tmp_path / "boundaries.json").read_text())
    assert all(dict(when)["best"] is None for _, when, _ in seen)
    steps = [[step, {key: value for key, value in when if key != "best"}, saved] for step, when, saved in seen]
    assert [s for s, when, _ in steps if when == {"timed": False}] == list(range(1, 17))  # once per step
    assert [(s, when) for s, when, _ in steps if "timed" not in when] == [
        (8, {"epoch_end": 1}), (16, {"epoch_end": 2}), (16, {"now": True})]
    assert [(s, next(iter(when))) for s, when, saved in steps if saved] == [
        (3, "timed"), (6, "timed"), (9, "timed"), (12, "timed"), (15, "timed"), (16, "epoch_end")]
    assert sorted(step for step, _ in committed_steps(tmp_path / "checkpoints")) == [3, 6, 9, 12, 15, 16]
