"""The worked examples run as their docs say (examples/)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import REPO, run_python

transformers = pytest.importorskip("transformers")


def test_the_fine_tuning_example_trains_on_two_processes_and_reloads_with_from_pretrained(tmp_path):
    run_dir = tmp_path / "finetune"
    proc = run_python([str(REPO / "examples" / "finetune_hf.py"), "--run_dir", str(run_dir), "--records", "96",
                       "--epochs", "2"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss_line = next(line for line in proc.stdout.splitlines() if line.startswith("eval loss"))
    assert float(loss_line.split()[2]) < math.log(512), "it learnt something (uniform over 512 tokens: 6.24)"
    assert "->" in proc.stdout  # the reloaded model generated a response
    logs = (run_dir / "logs" / "rank-1.log").read_text()
    assert "world size" in (run_dir / "logs" / "rank-0.log").read_text() and logs, "2 processes trained"
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    from safetensors.torch import load_file

    final = load_file(str(run_dir / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, final[name]), name
