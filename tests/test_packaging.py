"""The package metadata builds without the deprecations that stop working in setuptools after 2027-02-18; imports
sit where docs/development.md says."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import REPO, cli_env


def test_the_license_is_an_spdx_string_not_a_deprecated_table():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


# --- imports inside functions (docs/development.md, "Imports") ------------------------------------------

def _lazy_import_kinds() -> dict[str, list[str]]:
    """The table of docs/development.md's "Imports": kind -> the modules its second column names."""
    text = (REPO / "docs" / "development.md").read_text()
    table = text.split("### Imports", 1)[1].split("\n## ", 1)[0]
    kinds = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("kind", "---"):
            kinds[cells[0]] = re.findall(r"`([\w.]+)`", cells[1])
    return kinds


def _imports_inside_functions(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function of `path`; `from P import m` names P.m where m is a
    submodule of a ddptrain package."""
    found = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.update((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    where = REPO / "src" / name.replace(".", "/")
                    submodule = name.startswith("ddptrain.") and (where.with_suffix(".py").is_file() or where.is_dir())
                    found.add((node.lineno, name if submodule else node.module))
    return sorted(found)


def test_every_import_inside_a_function_is_of_a_documented_kind():
    kinds = _lazy_import_kinds()
    assert set(kinds) == {"optional", "torch-free", "sharded checkpoints", "progress bar", "command line"}, kinds
    torch_free = set(kinds["torch-free"])
    always = tuple(kinds["optional"] + kinds["sharded checkpoints"] + kinds["progress bar"] + kinds["command line"])
    src = REPO / "src"
    wrong = []
    for path in sorted((src / "ddptrain").rglob("*.py")):
        module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for line, name in _imports_inside_functions(path):
            if any(name == m or name.startswith(m + ".") for m in always):
                continue
            heavy = name.split(".")[0] not in sys.stdlib_module_names and name not in torch_free
            if module in torch_free and heavy:
                continue
            wrong.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not wrong, "move these to the top of their module, or document the cost they save:\n" + "\n".join(wrong)


def test_the_torch_free_modules_import_no_torch():
    modules = _lazy_import_kinds()["torch-free"]
    probe = f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n" \
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
