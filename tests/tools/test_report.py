"""`ddptrain report`: pictures and report.md from a finished 2-process run, a running one, and none."""

from __future__ import annotations

import re
import shutil
import sys

import pytest
from helpers import cli_in_process, one_line_error
from observed_run import observed_run
from PIL import Image

from ddptrain import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PICTURES = ("loss", "accuracy", "throughput", "step_time", "ranks", "overview")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return observed_run(tmp_path_factory)


def _assert_real_picture(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.width >= 300 and img.height >= 200
        low, high = img.convert("L").getextrema()
        assert high - low > 100, f"{path.name} is blank"


def test_report_of_a_finished_two_process_run(run, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["report", str(run.run_dir), "--out", str(out)]) == 0
    for name in PICTURES:
        _assert_real_picture(out / f"{name}.png")
    text = (out / "report.md").read_text()
    assert "status: finished" in text
    for name in PICTURES:
        assert f"({name}.png)" in text
    assert re.search(r"^\| eval accuracy \(step 12\) +\| ", text, re.M) and re.search(r"^\| MFU +\| ", text, re.M)
    assert 'model = "mini_resnet"' in text  # the run's config.toml
    assert "report.md" in capsys.readouterr().out


def test_report_of_a_run_still_being_written(run, tmp_path):
    """No final weights yet, and the writer is in the middle of a line."""
    running = tmp_path / "running"
    running.mkdir()
    shutil.copy(run.run_dir / "config.toml", running / "config.toml")
    lines = (run.run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (running / "metrics.jsonl").write_text("".join(lines[:7]) + lines[7][:40])
    assert cli.main(["report", str(running)]) == 0
    text = (running / "report" / "report.md").read_text()
    assert "status: running or stopped" in text
    _assert_real_picture(running / "report" / "loss.png")


def test_report_of_a_dir_without_metrics_exits_2(tmp_path):
    line = one_line_error(cli_in_process(["report", str(tmp_path)]))
    assert "no metrics yet" in line and str(tmp_path) in line
    assert "no such run dir" in one_line_error(cli_in_process(["report", str(tmp_path / "missing")]))


def test_report_without_matplotlib_says_how_to_install_it(run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["report", str(run.run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'ddptrain[report]'" in err[0]
