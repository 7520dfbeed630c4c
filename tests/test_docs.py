"""README's config table is generated from TrainConfig; this fails when the two drift apart."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from helpers import REPO
from ddptrain import docs
from ddptrain.config import TrainConfig

README = REPO / "README.md"


def test_readme_config_table_is_the_generated_one():
    assert docs.readme_table(README) == docs.config_table(), \
        "README's config table is stale: run `python -m ddptrain.docs --write README.md`"


def test_table_has_one_row_per_field_inside_the_config_section():
    text = README.read_text()
    section = text[text.index("<!-- section:config -->"):text.index("<!-- /section:config -->")]
    assert docs.BEGIN in section and docs.END in section
    rows = [line for line in docs.config_table().splitlines() if line.startswith("| `--")]
    assert [row.split("`")[1] for row in rows] == [f"--{f.name}" for f in dataclasses.fields(TrainConfig)]


def test_check_fails_on_a_stale_table_and_write_repairs_it(tmp_path: Path):
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{docs.BEGIN}\n| `--lr` | `1` | old |\n{docs.END}\nrest\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "ddptrain.docs", *args],  # noqa: E731
                                       capture_output=True, text=True)
    assert run("--check", str(stale)).returncode == 1
    assert run("--write", str(stale)).returncode == 0
    assert run("--check", str(stale)).returncode == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{docs.END}\nrest\n")
