"""What users already have keeps working while the code under it is reshaped (issue 38): a job file of flat keys
and checkpoints written by an earlier ddptrain.

tests/fixtures/compat-2026-12-06/ holds `job.toml` (flat keys, as users write them) and the step-3 checkpoints
that the code of commit 10fde28 (2026-12-06) wrote from it on 2 processes, one full (ddp) and one sharded (fsdp):

    ddptrain train --config job.toml --run_dir RUN --strategy ddp|fsdp

Today's code must resume each and end where a run of today's code that never stopped ends: bitwise on a CPU that
rounds the first three steps as the fixtures' did, within rounding (1e-6) on one that does not. A format or
settings change that breaks this is a break for every user with a run in flight: make it read the old files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_bitwise_equal, assert_close_weights, checkpoint_weights, run_cli, weights

FIXTURES = REPO / "tests" / "fixtures" / "compat-2026-12-06"


def _train(run_dir: Path, strategy: str) -> str:
    proc = run_cli(["train", "--config", str(FIXTURES / "job.toml"), "--run_dir", str(run_dir), "--strategy",
                    strategy, "--max_steps", "6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (run_dir / "logs" / "rank-0.log").read_text()


def _step_3_weights(step: Path) -> dict[str, torch.Tensor]:
    """The weights a fixture's checkpoint holds: an earlier ddp checkpoint's whole file, else DCP's shards."""
    whole = step / "model.safetensors"
    return weights(whole) if whole.is_file() else checkpoint_weights(step)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_written_by_an_earlier_version_resumes_and_ends_as_an_unbroken_run(tmp_path, strategy):
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    shutil.copytree(FIXTURES / strategy / "step-3", resumed / "checkpoints" / "step-3")
    log = _train(resumed, strategy)
    assert f"resuming from {resumed / 'checkpoints' / 'step-3'} (step 3)" in log
    assert "changed training settings" not in log
    _train(straight, strategy)
    final_resumed, final_straight = weights(resumed / "model.safetensors"), weights(straight / "model.safetensors")
    if _same(_step_3_weights(FIXTURES / strategy / "step-3"), checkpoint_weights(straight / "checkpoints" / "step-3")):
        assert_bitwise_equal(final_resumed, final_straight)
    else:
        # This CPU rounds the first three steps otherwise than the one that wrote the fixtures (seen: ~1e-8 apart
        # on an AVX-512 Xeon), so no run here can end on their bits. A resume that lost any state (momentum, RNG,
        # the data's position) ends 1e-4 or more away; the rounding alone stays within 1e-6.
        assert_close_weights(final_straight, final_resumed, rel=1e-6)
    # Today's checkpoints hold what the earlier ones held, key for key: the state's parts split the dicts, not
    # the format (loop/checkpointed.py). One change: ddp's model and optimizer state are DCP's shards now, as
    # fsdp's were, and trainer.pt holds the optimizer's param_groups beside them.
    old, new = (torch.load(step / "trainer.pt", weights_only=True)
                for step in (FIXTURES / strategy / "step-3", straight / "checkpoints" / "step-6"))
    assert sorted(new) == sorted({*old, "param_groups"})
    assert [sorted(rank) for rank in new["rng"]] == [sorted(rank) for rank in old["rng"]]
