"""What users already have keeps working while the code under it is reshaped (issue 38): a job file of flat keys
and checkpoints written by an earlier ddptrain.

tests/fixtures/compat-2026-12-06/ holds `job.toml` (flat keys, as users write them) and the step-3 checkpoints
that the code of commit 10fde28 (2026-12-06) wrote from it on 2 processes, one full (ddp) and one sharded (fsdp):

    ddptrain train --config job.toml --run_dir RUN --strategy ddp|fsdp

Today's code must resume each and end where a run of today's code that never stopped ends, bitwise. A format or
settings change that breaks this is a break for every user with a run in flight: make it read the old files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_bitwise_equal, run_cli, weights

FIXTURES = REPO / "tests" / "fixtures" / "compat-2026-12-06"


def _train(run_dir: Path, strategy: str) -> str:
    proc = run_cli(["train", "--config", str(FIXTURES / "job.toml"), "--run_dir", str(run_dir), "--strategy",
                    strategy, "--max_steps", "6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_written_by_an_earlier_version_resumes_and_ends_as_an_unbroken_run(tmp_path, strategy):
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    shutil.copytree(FIXTURES / strategy / "step-3", resumed / "checkpoints" / "step-3")
    log = _train(resumed, strategy)
    assert f"resuming from {resumed / 'checkpoints' / 'step-3'} (step 3)" in log
    assert "changed training settings" not in log
    _train(straight, strategy)
    assert_bitwise_equal(weights(resumed / "model.safetensors"), weights(straight / "model.safetensors"))
    # Today's checkpoints hold what the earlier ones held, key for key: the state's parts split the dicts, not
    # the format (loop/checkpointed.py). One change: ddp's model and optimizer state are DCP's shards now, as
    # fsdp's were, and trainer.pt holds the optimizer's param_groups beside them.
    old, new = (torch.load(step / "trainer.pt", weights_only=True)
                for step in (FIXTURES / strategy / "step-3", straight / "checkpoints" / "step-6"))
    assert sorted(new) == sorted({*old, "param_groups"})
    assert [sorted(rank) for rank in new["rng"]] == [sorted(rank) for rank in old["rng"]]
