"""`ddptrain export`: verified checkpoint -> one safetensors file + config JSON; the documented snippets load it."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers import REPO, checkpoint_weights, last_committed, run_python, weights
from observed_run import observed_run
from safetensors import safe_open

from ddptrain import cli
from ddptrain.checkpoints.read import read_checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return observed_run(tmp_path_factory)


def export(capsys, *args: str) -> tuple[int, str, str]:
    """`ddptrain export ARGS` in this process: (exit code, stdout, stderr)."""
    code = cli.main(["export", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def export_error(capsys, *args: str) -> str:
    """The one stderr line of a refused export (exit 2)."""
    code, _, err = export(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    return lines[0]


def python_block(page: str, section: str) -> str:
    """The one Python block of a `<!-- section:NAME -->` in a markdown page, exactly as users read it."""
    text = (REPO / page).read_text()
    body = text.split(f"<!-- section:{section} -->", 1)[1].split(f"<!-- /section:{section} -->", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 1, f"{page}'s {section} section should hold exactly one python block"
    return blocks[0]


def export_snippet() -> str:
    """The Python block of docs/checkpoints.md's "Exporting weights" section."""
    return python_block("docs/checkpoints.md", "export")


def test_export_writes_weights_and_config_that_the_documented_snippet_loads(run, tmp_path, capsys):
    checkpoint = last_committed(run.run_dir)
    code, _, err = export(capsys, str(checkpoint), str(tmp_path / "model.safetensors"))
    assert code == 0, err
    exported = weights(tmp_path / "model.safetensors")
    saved = checkpoint_weights(checkpoint)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in exported)
    manifest = read_checkpoint(checkpoint, torch.device("cpu")).manifest
    assert json.loads((tmp_path / "model.json").read_text()) == manifest["config"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        meta = fh.metadata()
    assert meta["step"] == "12" and meta["model"] == "mini_resnet" and meta["format"] == "ddptrain-export/1"

    # The snippet runs as written, in the directory holding the two files; strict loading checks every key.
    snippet = run_python(["-c", export_snippet()], cwd=tmp_path, timeout=120)
    assert snippet.returncode == 0, snippet.stderr
    assert "torch.Size([1, 10])" in snippet.stdout


def test_the_readme_python_example_loads_a_finished_run_dir(run, tmp_path):
    """README's Python example, exactly as printed, against a finished run dir placed where it looks."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "quickstart").symlink_to(run.run_dir, target_is_directory=True)
    snippet = run_python(["-c", python_block("README.md", "python")], cwd=tmp_path, timeout=120)
    assert snippet.returncode == 0, snippet.stderr
    assert "torch.Size([1, 10])" in snippet.stdout


def test_export_of_a_run_dir_takes_its_newest_checkpoint(run, tmp_path, capsys):
    code, out, err = export(capsys, str(run.run_dir), str(tmp_path / "w.safetensors"))
    assert code == 0, err
    assert str(last_committed(run.run_dir)) in out
    assert (tmp_path / "w.json").is_file()


def test_export_refuses_corrupted_uncommitted_and_missing_checkpoints(run, tmp_path, capsys):
    bad = tmp_path / "step-12"
    shutil.copytree(last_committed(run.run_dir), bad)
    blob = bytearray((bad / "shards" / "__0_0.distcp").read_bytes())
    blob[-1] ^= 0xFF
    (bad / "shards" / "__0_0.distcp").write_bytes(bytes(blob))
    line = export_error(capsys, str(bad), str(tmp_path / "out.safetensors"))
    assert "sha256" in line and str(bad) in line
    (bad / "manifest.json").unlink()
    assert "not a committed checkpoint" in export_error(capsys, str(bad), str(tmp_path / "o.safetensors"))
    assert "no such directory" in export_error(capsys, str(tmp_path / "nope"), str(tmp_path / "o.safetensors"))
    assert ".safetensors" in export_error(capsys, str(last_committed(run.run_dir)), str(tmp_path / "o.pt"))
    assert not (tmp_path / "out.safetensors").exists()
