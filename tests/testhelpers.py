"""Helpers tests import by name: load_script (scripts/ modules), and the stack's tests' copy_solutions and
plant_part (tests/test_stack.py, tests/test_stack_engine.py).

A module of its own, not conftest.py: with several conftest.py files in the tree, which one
``import conftest`` finds depends on the order pytest's workers collected them (a CI run found
tests/course/conftest.py)."""

import importlib.util
import re
import shutil
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """A module from scripts/ (not a package), imported by path."""
    spec = importlib.util.spec_from_file_location(f"course_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_solutions(labs_dir: Path, labs) -> Path:
    """The solution notebooks of ``labs`` (lab keys) copied into a new folder ``labs_dir``: a learner's
    folder with every exercise done (the stack's tests)."""
    labs_dir.mkdir(parents=True)
    for lab in labs:
        shutil.copy(ROOT / "solutions" / f"{lab}.ipynb", labs_dir / f"{lab}.ipynb")
    return labs_dir


def plant_part(labs_dir: Path, lab: str, kind: str, name: str, code: str) -> None:
    """In ``labs_dir``'s notebook of ``lab``, rename the solution's ``name`` (a ``def`` or a ``class``,
    ``kind``) in its cell to ``_solution_<name>`` and append ``code``, a planted part of that name."""
    path = labs_dir / f"{lab}.ipynb"
    nb = nbformat.read(path, as_version=4)
    pattern = re.compile(rf"^{kind} {name}(?=[(:])", re.MULTILINE)
    cells = [c for c in nb.cells if c.cell_type == "code" and pattern.search(c.source)]
    assert len(cells) == 1, f"{name} is defined in {len(cells)} cells of {lab}"
    cells[0].source = pattern.sub(f"{kind} _solution_{name}", cells[0].source) + "\n\n" + code
    nbformat.write(nb, path)
