"""``labsupport/lab_checks.json``: each lab's checks and their points.

``release`` writes it from the lab sources (``solutions/NN_name.py``); ``grade`` reads it, so grading
works where the package is installed without the course's sources. It ships as package data. Besides
each lab's checks and points it holds the code cells of each lab's released learner notebook, which the
grader runs with only the learner's exercise cells put in (see :mod:`labsupport.course.splice`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checks import REGISTRY
from .scan import check_calls, python_source
from .sources import parse_source

COURSE_ROOT = Path(__file__).resolve().parents[2]  # the repository, for an editable install
MANIFEST = Path(__file__).resolve().parents[1] / "lab_checks.json"
MANIFEST_IN_REPO = Path("labsupport") / "lab_checks.json"  # relative to the course root


class ManifestError(Exception):
    """labsupport/lab_checks.json is missing or unreadable: grading would not know the labs' checks."""


def load_manifest(path: Path | None = None) -> dict[str, list[tuple[str, float]]]:
    """Each lab's checks and points, from ``lab_checks.json`` (written by ``release``)."""
    path = Path(path or MANIFEST)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {lab: [(c["check"], float(c["points"])) for c in entry["checks"]]
                for lab, entry in data["labs"].items()}
    except FileNotFoundError:
        raise ManifestError(
            f"{path} is missing, so the grader does not know which checks each lab has. In the course "
            f"repository run `python -m labsupport release` (it writes the file; commit it); elsewhere "
            f"reinstall the package from a commit that has it."
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ManifestError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}). In the course repository run "
            f"`python -m labsupport release` to write it again."
        ) from None


def lab_checks(sources: list[Path], course_cells=None) -> dict:
    """What the grader needs to know of each lab: the checks its source calls, with their points, and,
    given ``course_cells`` (:func:`labsupport.course.release.course_cells`, which ``release`` passes),
    the code cells of the learner's notebook."""
    labs = {}
    for source in sources:
        checks: list[dict] = []
        for cell in parse_source(source):
            if cell.kind != "code":
                continue
            for name in check_calls("\n".join(cell.lines)):
                if name in REGISTRY and all(c["check"] != name for c in checks):
                    checks.append({"check": name, "points": REGISTRY[name].points})
        labs[source.stem] = {"source": f"solutions/{source.name}", "checks": checks}
        if course_cells is not None:
            labs[source.stem]["cells"] = course_cells(source)
    return {
        "about": "Written by `python -m labsupport release` from solutions/*.py (do not edit): the checks "
                 "`python -m labsupport grade` scores each lab on, also where the package is installed "
                 "without the course's sources.",
        "labs": labs,
    }


def top_level_names(text: str) -> list[str]:
    """The functions and classes a cell defines at its top level, in order."""
    import ast

    try:
        tree = ast.parse(python_source(text))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def load_course_cells(lab: str, path: Path | None = None) -> list[dict] | None:
    """The course's code cells of ``lab`` (:func:`labsupport.course.release.course_cells`), or None when the manifest predates them."""
    path = Path(path or MANIFEST)
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["labs"][lab].get("cells")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cells if isinstance(cells, list) else None


def render_manifest(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def manifest_drift(manifest: dict, root: Path = COURSE_ROOT) -> str:
    """In a course checkout, a warning when lab_checks.json no longer matches solutions/*.py."""
    sources = sorted((root / "solutions").glob("[0-9]*.py"))
    if not sources:
        return ""  # installed without the sources: the manifest is all there is
    try:
        current = {lab: [(c["check"], float(c["points"])) for c in entry["checks"]]
                   for lab, entry in lab_checks(sources)["labs"].items()}
    except Exception as exc:  # a source that does not parse: release --check says more
        return f"could not compare lab_checks.json with solutions/*.py ({type(exc).__name__}: {exc})"
    if current != manifest:
        return ("labsupport/lab_checks.json does not match solutions/*.py (a lab's checks changed): "
                "grading uses lab_checks.json; run `python -m labsupport release` to update it")
    return ""

