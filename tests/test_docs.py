"""The docs cannot drift: docs/configuration.md's config table is generated from the settings sections, every relative
link in README.md and docs/ points at a file that exists, and README stays a ten-minute read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO

from ddptrain import config_table as docs
from ddptrain.settings import FIELDS

README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def test_config_table_is_the_generated_one():
    assert docs.file_table(CONFIGURATION) == docs.config_table(), \
        "docs/configuration.md's config table is stale: run `python -m ddptrain.config_table --write docs/configuration.md`"


def test_table_has_one_row_per_field_inside_the_config_section():
    text = CONFIGURATION.read_text()
    section = text[text.index("<!-- section:config -->"):text.index("<!-- /section:config -->")]
    assert docs.BEGIN in section and docs.END in section
    rows = [line for line in docs.config_table().splitlines() if line.startswith("| `--")]
    assert [row.split("`")[1] for row in rows] == [f"--{name}" for name in FIELDS]


def test_check_fails_on_a_stale_table_and_write_repairs_it(tmp_path: Path):
    stale = tmp_path / "configuration.md"
    stale.write_text(f"intro\n{docs.BEGIN}\n| `--lr` | `1` | old |\n{docs.END}\nrest\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "ddptrain.config_table", *args],  # noqa: E731
                                       capture_output=True, text=True)
    assert run("--check", str(stale)).returncode == 1
    assert run("--write", str(stale)).returncode == 0
    assert run("--check", str(stale)).returncode == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{docs.END}\nrest\n")


def relative_links(page: Path) -> list[str]:
    """Link targets of a markdown page outside code blocks, without URLs and pure #anchors."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_in_readme_and_docs_resolves():
    assert len(PAGES) > 1
    broken = [f"{page.relative_to(REPO)}: {target}" for page in PAGES for target in relative_links(page)
              if not (page.parent / target.split("#", 1)[0]).exists()]
    assert not broken, broken


def test_readme_is_short_and_reaches_every_docs_page_in_one_link():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    linked = {(REPO / t.split("#", 1)[0]).resolve() for t in relative_links(README)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"
    text = README.read_text()
    assert "make run    #" in text and "make test   #" in text  # the two commands


def test_the_top_package_exports_what_the_docs_name_and_imports_no_torch_until_asked():
    # A fresh interpreter: this one has torch already. LossSum's module imports torch, so it is a lazy export.
    code = """
import sys
import ddptrain
assert "torch" not in sys.modules, "import ddptrain imported torch"
from ddptrain import TrainingError, UsageError, fit, TrainConfig
import ddptrain.errors
assert ddptrain.UsageError is ddptrain.errors.UsageError and ddptrain.TrainingError is ddptrain.errors.TrainingError
assert "torch" not in sys.modules
import ddptrain.loop.tasks
assert ddptrain.LossSum is ddptrain.loop.tasks.LossSum and set(ddptrain.__all__) <= set(dir(ddptrain))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO / "src")
    assert proc.returncode == 0, proc.stderr
