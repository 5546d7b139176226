"""The course installed the way a lab's setup cell installs it, then every lab's imports.

A university JupyterHub (or any Python a learner points a lab at) has torch, Triton, numpy,
matplotlib and tqdm and nothing of the course; the lab's first cell runs ``pip install`` of the
course, which brings only its declared dependencies. This test builds the course's wheel, makes a
venv holding exactly those packages (and what they depend on), pip-installs the wheel with no index
(so a dependency the package forgot to declare fails the install, and one it declares but the venv
lacks fails it too), and runs, for every lab, its setup cell and every import statement of its
code cells in a fresh interpreter. A lab that needs more (the server's packages, Hugging Face's
transformers) installs it in a cell of its own with ``install_missing`` before its imports; the
test checks that cell names every such package, then provides them and runs those labs' imports.

To stay cheap (the suite's budget), the packages themselves are not unpacked again from their wheels:
what each distribution installed in the running venv's site-packages (the top-level entries of its
RECORD: its packages, modules, ``.libs`` folders and ``.dist-info``) is linked into the new one, well
under a second where ``pip install torch triton`` takes a minute. ``LABSUPPORT_INSTALL_TEST_PIP=1``
pip-installs them instead (from pip's cache: the same versions). Marked ``install``; it runs once per
``make test`` (the version matrix does not repeat it).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
LABS = sorted((ROOT / "labs").glob("[0-9]*.ipynb"))
BASE = ("torch", "triton", "numpy", "matplotlib", "tqdm")  # what such a Python has, besides the standard library
KERNEL = ("ipykernel",)  # and what makes it a notebook's Python at all (IPython)
pytestmark = pytest.mark.install


def _closure(names) -> list[str]:
    """The distributions ``names`` need, recursively, as this venv has them (extras left out)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        dist = importlib.metadata.distribution(name)
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen)


def _provide(names, venv: Path) -> None:
    """Put the distributions ``names`` (and their dependencies) into ``venv``'s site-packages."""
    dists = _closure(names)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    if os.environ.get("LABSUPPORT_INSTALL_TEST_PIP"):
        pins = [f"{d}=={importlib.metadata.version(d)}" for d in dists]
        subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        "--no-deps", "--disable-pip-version-check", *pins], check=True)
        return
    here = Path(sysconfig.get_paths()["purelib"])
    for name in dists:
        dist = importlib.metadata.distribution(name)
        # what it put in site-packages: its packages, modules, .libs folders and its .dist-info
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            source, target = here / top, site / top
            if source.exists() and not target.exists() and not target.is_symlink():
                os.symlink(source, target)


def _cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _imports(source: str) -> list[str]:
    """The cell's top-level import statements, as source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell with IPython syntax (%env): no imports the test needs
        return []
    return [ast.get_source_segment(source, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]


def _third_party(statements: list[str]) -> set[str]:
    names = set()
    for statement in statements:
        node = ast.parse(statement).body[0]
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif node.level == 0:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in (*BASE, "labsupport", "IPython")}


def _installs(cells: list[str]) -> dict[str, str] | None:
    """What a lab's ``install_missing(...)`` cell installs (module -> requirement), or None without one."""
    from labsupport.serve.process import SERVER_PACKAGES

    for source in cells:
        for node in ast.walk(ast.parse(source)) if "install_missing(" in source else ():
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "install_missing":
                return ast.literal_eval(node.args[0]) if node.args else dict(SERVER_PACKAGES)
    return None


def _script(lab: Path) -> str:
    """The lab's setup cell, then every import statement of its code cells, in order."""
    cells = _cells(lab)
    lines = [f"print('== {lab.stem}', flush=True)", cells[0]]
    for source in cells[1:]:
        lines += _imports(source)
    return "\n".join(lines)


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean_install")
    dist, venv = root / "dist", root / "venv"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(dist), str(ROOT)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _provide(BASE + KERNEL, venv)
    # the course, as a setup cell installs it: its declared dependencies must already be there
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                              "--no-index", "--find-links", str(dist), "--disable-pip-version-check", "labsupport"],
                             capture_output=True, text=True)
    assert install.returncode == 0, f"pip could not install the course with only {BASE}:\n{install.stderr[-3000:]}"
    return venv


def _run(venv: Path, labs: list[Path], cwd: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(MPLBACKEND="Agg", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([venv / "bin" / "python", "-c", "\n".join(_script(lab) for lab in labs)], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=600)


def test_every_lab_imports_with_the_declared_dependencies_or_installs_what_it_needs(clean_venv, tmp_path):
    python = clean_venv / "bin" / "python"
    declared = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.requires('labsupport'))"],
                              capture_output=True, text=True, check=True).stdout
    assert "httpx" not in declared.split("extra")[0]  # the learner's dependencies stay what Colab has
    plain, extra = [], {}
    for lab in LABS:
        cells = _cells(lab)
        needs = _third_party([s for c in cells for s in _imports(c)])
        if not needs:
            plain.append(lab)
            continue
        installs = _installs(cells)
        assert installs is not None, f"{lab.name} imports {sorted(needs)} and installs none of it first"
        assert needs <= set(installs), f"{lab.name} imports {sorted(needs - set(installs))}, not installed first"
        first_install = next(i for i, c in enumerate(cells) if "install_missing(" in c)
        first_use = next(i for i, c in enumerate(cells) if _third_party(_imports(c)))
        assert first_install < first_use, f"{lab.name}: the install cell must come before the imports"
        extra[lab] = installs
    run = _run(clean_venv, plain, tmp_path)
    assert run.returncode == 0, f"a lab's imports failed with only the declared dependencies:\n{run.stdout[-1500:]}" \
                                f"\n{run.stderr[-3000:]}"
    assert run.stdout.count("== ") == len(plain)
    # the labs that install more: what their install cell names, then their imports
    _provide(sorted({re.split(r"[<>=!~ ]", r)[0] for reqs in extra.values() for r in reqs.values()}), clean_venv)
    run = _run(clean_venv, list(extra), tmp_path)
    assert run.returncode == 0, f"{run.stdout[-1500:]}\n{run.stderr[-3000:]}"
    assert run.stdout.count("== ") == len(extra) >= 3
