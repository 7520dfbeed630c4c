"""The house's limits (docs/development.md "Layout"): the loop's main file stays readable in one sitting and
no class grows into a bag of state. Read from the source: nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ddptrain"
MAX_ATTRIBUTES = 30
MAX_TRAINER_LINES = 400


def instance_attributes(cls: ast.ClassDef) -> set[str]:
    """The names a class's methods assign on `self` (self.x = ..., self.x, self.y = ..., self.x += ...)."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name)
                        and element.value.id == "self"):
                    names.add(element.attr)
    return names


def test_no_class_holds_more_than_30_attributes():
    counts = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                counts[f"{path.relative_to(SRC)}:{node.name}"] = len(instance_attributes(node))
    assert counts["loop/trainer.py:Trainer"] > 10  # the count sees the Trainer's attributes at all
    too_many = {name: n for name, n in counts.items() if n > MAX_ATTRIBUTES}
    assert not too_many, f"classes with more than {MAX_ATTRIBUTES} attributes: {too_many}"


def test_the_trainer_module_stays_under_400_lines():
    lines = len((SRC / "loop" / "trainer.py").read_text().splitlines())
    assert lines <= MAX_TRAINER_LINES, f"loop/trainer.py has {lines} lines; move a component out"


def test_the_instance_attribute_count_sees_every_form_of_assignment():
    tree = ast.parse("class A:\n    def f(self):\n        self.a = 1\n        self.b, self.c = 2, 3\n"
                     "        self.d: int = 4\n        self.a += 1\n        other.e = 5\n")
    assert instance_attributes(tree.body[0]) == {"a", "b", "c", "d"}


# What may see the whole TrainConfig (docs/development.md, "Settings by section"): what makes it and writes it
# (the faces, the launcher), checks it whole (preflight, the changed-settings check), hands each component its
# section (the Trainer) or calls a plug-in, whose contract is fn(cfg) (loop/plugins.py, through which the tools
# build a saved run's model and task too); the callbacks' documented `run.config` (loop/callbacks.py). Every
# other component is built from its own section.
WHOLE_CONFIG = {"__init__.py", "api.py", "cli.py", "config.py", "config_table.py", "preflight.py",
                "checkpoints/format.py", "loop/callbacks.py", "loop/plugins.py", "loop/trainer.py", "tools/export.py",
                "tools/memplan.py", "tools/plan.py"}


def test_only_the_assembly_sees_the_whole_config():
    seen = set()
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imports = any(isinstance(node, ast.ImportFrom) and node.module == "ddptrain.config"
                      and any(alias.name == "TrainConfig" for alias in node.names) for node in ast.walk(tree))
        takes = any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and any(arg.arg == "cfg" for arg in node.args.args + node.args.kwonlyargs)
                    for node in ast.walk(tree))
        reaches = any(isinstance(node, ast.Attribute) and node.attr == "cfg" for node in ast.walk(tree))  # trainer.cfg
        if imports or takes or reaches:
            seen.add(str(path.relative_to(SRC)))
    assert {"loop/trainer.py", "loop/plugins.py"} <= seen  # the check sees the assembly at all
    assert seen <= WHOLE_CONFIG, f"components that take the whole config, not their section: {seen - WHOLE_CONFIG}"


def test_the_tests_mirror_the_package():
    """tests/<subpackage>/ per subpackage of src/ddptrain that has tests, e2e/ for whole jobs; at the top only the
    tests of the top-level modules and of the house itself."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    subpackages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert folders - {"e2e"} <= subpackages, folders - subpackages
    top = {p.stem for p in tests.glob("test_*.py")}
    assert top == {"test_bad_input", "test_config", "test_docs", "test_house", "test_packaging", "test_zygote"}, top
