"""Stored outputs: what the solution notebooks' deterministic cells printed, kept in git.

The notebook tests (nbval, ``make test``) compare every cell tagged ``nbval-check-output`` with
the output stored in the notebook, so a change that moves a graded result or a computed table
fails with a diff. Those outputs are recorded, not typed: ``python -m labsupport release --record``
(``make record-outputs``) runs each solution notebook in Triton's interpreter on the CPU and
writes, per lab, ``solutions/outputs/NN_name.json``; ``release`` then copies them into
``solutions/NN_name.ipynb``. Learner notebooks never carry outputs.

A recording is keyed by the digest of the cell's source (and which occurrence of that source it
is), so moving a cell keeps its output and editing it drops it: ``release --check`` then fails
until the outputs are recorded again.

Which cells are compared: every cell that calls a graded check (its ``PASSED`` line), and the
cells a lab source tags on its marker line, ``# %% tags=["nbval-check-output"]``. Timings and
anything machine-dependent must stay untagged.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHECK_OUTPUT = "nbval-check-output"  # nbval compares these cells' outputs (also with --nbval-lax)
RAISES = "raises-exception"  # nbval accepts an error from this cell (older learner notebooks)
SKIP = "nbval-skip"  # nbval does not run this cell (older learner notebooks)
# A learner notebook's metadata (``labsupport``) names the cell where a fresh notebook stops: the
# first that fails until an exercise is done. The nbval plugin expects it to fail and skips the rest.
STOPS_AT = "stops_at"
FOLDER = Path("solutions") / "outputs"  # relative to the course root
# Kept from each output: what nbval compares, and nothing that changes from run to run.
_KEEP = {"stream": ("name", "text"), "execute_result": ("data",), "display_data": ("data",),
         "error": ("ename", "evalue")}


def path_for(root: Path, lab: str) -> Path:
    return root / FOLDER / f"{lab}.json"


def source_digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _keys(cells) -> list[tuple[str, int]]:
    """(source digest, occurrence) for each cell, so two identical cells keep their own outputs."""
    seen: dict[str, int] = {}
    keys = []
    for cell in cells:
        digest = source_digest(cell["source"])
        seen[digest] = seen.get(digest, 0) + 1
        keys.append((digest, seen[digest]))
    return keys


def compared_cells(nb) -> list[int]:
    """Indices of the code cells whose output nbval compares."""
    return [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and CHECK_OUTPUT in c.get("metadata", {}).get("tags", [])]


def clean(outputs) -> list[dict]:
    """The parts of a cell's outputs worth storing: text and data, no metadata or counters."""
    kept = []
    for out in outputs:
        fields = _KEEP.get(out.get("output_type"))
        if fields is None:
            continue
        entry = {"output_type": out["output_type"]}
        for field in fields:
            if field in out:
                value = out[field]
                entry[field] = dict(value) if field == "data" else value
        if "data" in fields:
            entry["metadata"] = {}  # nbformat requires it on data outputs; nbval does not compare it
        kept.append(entry)
    return kept


def load(path: Path) -> dict[tuple[str, int], list[dict]]:
    """A lab's recording: (source digest, occurrence) -> outputs. Empty when there is none."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {(c["source_digest"], c.get("occurrence", 1)): c["outputs"] for c in data.get("cells", [])}


def render(nb, environment: dict[str, str]) -> str:
    """The recording of an executed solution notebook (its compared cells only), as JSON text."""
    keys = _keys(nb.cells)
    cells = []
    for i in compared_cells(nb):
        digest, occurrence = keys[i]
        first = next((line for line in nb.cells[i].source.splitlines() if line.strip()), "")
        cells.append({"first_line": first[:80], "source_digest": digest, "occurrence": occurrence,
                      "outputs": clean(nb.cells[i].get("outputs", []))})
    data = {
        "about": "Written by `python -m labsupport release --record` (make record-outputs); do not edit. "
                 "The outputs nbval compares in the solution notebook's tagged cells.",
        "recorded_with": environment,
        "cells": cells,
    }
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def apply(nb, recording: dict[tuple[str, int], list[dict]]) -> list[int]:
    """Put the recorded outputs into ``nb``'s compared cells; returns the cells left without one.

    A cell with stored outputs gets an execution count (its number among the code cells): nbval
    compares only cells that have one.
    """
    import nbformat

    keys = _keys(nb.cells)
    missing = []
    code_number = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        code_number += 1
        if i not in compared_cells(nb):
            continue
        outputs = recording.get(keys[i])
        if outputs is None:
            missing.append(i)
            continue
        cell["outputs"] = [nbformat.from_dict(o) for o in outputs]
        for out in cell["outputs"]:
            if out["output_type"] == "execute_result":
                out["execution_count"] = code_number
        cell["execution_count"] = code_number
    return missing


def is_recorded(cell) -> bool:
    """True for a cell whose outputs are the course's stored ones (not someone's run)."""
    return CHECK_OUTPUT in cell.get("metadata", {}).get("tags", [])
