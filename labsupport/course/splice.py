"""Grade answers, not notebooks: the notebook the grader runs is the course's, with the learner's
exercise cells put in.

The course's code cells of each lab come from ``labsupport/lab_checks.json`` (``release`` writes
them there from ``solutions/NN_name.py``, exactly as it writes ``labs/NN_name.ipynb``, so they
ship with the package and grading works without the course's sources). Every cell of that list runs
as the course wrote it (setup, imports, measurements, the check cells), except each exercise cell
(a cell with a solution region), which is replaced by the learner's version of it, whole: helpers a
learner defines in an exercise cell are theirs and run with it.

A learner's exercise cell is found by its cell id (``release`` writes ``NN-name-IIII`` ids), when the
cell with that id still defines the exercise's functions; otherwise by those names (a notebook
released before the course inserted a cell has other ids): the last code cell that defines them all,
as running the notebook from the top would leave in effect. What else the learner changed is not
run and is reported: cells they added (``extra``) and course cells they edited (``edited``: the
course's version ran). An exercise cell that cannot be found keeps the course's stub (its check then
scores "not done") and is named in ``missing``; a notebook with no exercise cell found at all is
not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import nbformat

from .manifest import top_level_names
from .notebooks import first_line
from .scan import check_calls, names_used_and_bound


@dataclass
class Splice:
    notebook: nbformat.NotebookNode  # what the grader runs
    learner: list[str] = field(default_factory=list)  # ids of the course's exercise cells filled by the learner
    moved: list[str] = field(default_factory=list)  # of those, found by the names they define (the id differs)
    missing: list[str] = field(default_factory=list)  # "exercise cell <id> missing (...)"
    extra: list[str] = field(default_factory=list)  # the learner's added code cells: not run
    edited: list[str] = field(default_factory=list)  # course cells the learner changed: the course's ran
    roles: dict[int, str] = field(default_factory=dict)  # index in ``notebook`` -> "learner" or "course"

    @property
    def matched(self) -> bool:
        """At least one exercise cell is the learner's (else there is nothing of theirs to grade)."""
        return bool(self.learner)

    def ignored(self) -> str:
        """One line for the report: what of the learner's notebook did not run, and why."""
        parts = []
        if self.missing:
            parts.append("; ".join(self.missing) + (" (the course's stub ran in its place)" if self.matched else ""))
        if self.extra:
            parts.append(f"{len(self.extra)} added cell(s) not run: " + ", ".join(self.extra))
        if self.edited:
            parts.append(f"{len(self.edited)} edited course cell(s) ignored (the course's version ran): "
                         + ", ".join(self.edited))
        return "; ".join(parts)


def _same(a: str, b: str) -> bool:
    return "\n".join(line.rstrip() for line in a.strip().splitlines()) == \
        "\n".join(line.rstrip() for line in b.strip().splitlines())


def _label(cell) -> str:
    cid = cell.get("id") or "?"
    return f"{cid} (`{first_line(cell.source, 40)}`)"


def splice(learner_nb: nbformat.NotebookNode, course: list[dict]) -> Splice:
    """The notebook to run: ``course``'s code cells, each exercise cell the learner's version."""
    code = [c for c in learner_nb.cells if c.get("cell_type") == "code"]
    by_id = {}
    for cell in code:
        by_id.setdefault(cell.get("id"), cell)
    defined = {id(cell): set(top_level_names(cell.source)) for cell in code}
    used: set[int] = set()
    out = Splice(nbformat.v4.new_notebook())
    # of the learner's metadata only what says which kernel it is (not megabytes of anything else)
    out.notebook.metadata = {k: v for k, v in learner_nb.get("metadata", {}).items()
                             if k in ("kernelspec", "language_info") and isinstance(v, dict)}
    theirs: dict[str, object] = {}  # exercise cell id -> the learner's cell (found first, all of them)
    for entry in course:
        if not entry.get("exercise"):
            continue
        cid, names = entry["id"], set(entry.get("defines") or [])
        same_id = by_id.get(cid)
        chosen = None
        if same_id is not None and id(same_id) not in used and names <= defined[id(same_id)]:
            chosen = same_id
        elif names:
            candidates = [c for c in code if id(c) not in used and names <= defined[id(c)]]
            chosen = candidates[-1] if candidates else None
            if chosen is not None:
                out.moved.append(cid)
        if chosen is None:
            what = f"no cell defines {', '.join(sorted(names))}" if names else "no cell has that id"
            out.missing.append(f"exercise cell {cid} missing ({what})")
        else:
            used.add(id(chosen))
            theirs[cid] = chosen
    for entry in course:
        cid, source = entry["id"], entry["source"]
        if cid in theirs:
            out.learner.append(cid)
            new = nbformat.v4.new_code_cell(theirs[cid].source)
            out.roles[len(out.notebook.cells)] = "learner"
        else:
            new = nbformat.v4.new_code_cell(source)
            out.roles[len(out.notebook.cells)] = "course"
            same_id = by_id.get(cid)
            if not entry.get("exercise") and same_id is not None and id(same_id) not in used:
                used.add(id(same_id))
                if not _same(same_id.source, source):
                    out.edited.append(_label(same_id))
        new["id"] = cid
        out.notebook.cells.append(new)
    course_source = {e["id"]: e["source"] for e in course if not e.get("exercise")}
    for cell in code:
        if id(cell) in used or not cell.source.strip():
            continue
        if cell.get("id") in course_source and _same(cell.source, course_source[cell["id"]]):
            continue  # a second, unchanged copy of a course cell (a cell added under a course cell's id is listed)
        out.extra.append(_label(cell))
    return out


def needed(spliced: Splice) -> Splice:
    """``spliced`` without the course cells the checks do not need (measurements, plots, what follows
    the last check): kept are the first cell (setup), the learner's cells, the course's cells that call
    a check, and every earlier course cell that binds a name a kept cell uses. The learner's cells run
    whole, so whatever they use is kept for them."""
    cells = spliced.notebook.cells
    checks = [i for i, c in enumerate(cells) if spliced.roles.get(i) == "course" and check_calls(c.source)]
    if not checks:
        return spliced
    keep: set[int] = set()
    wanted: set[str] = set()
    for i in range(checks[-1], -1, -1):
        used, bound = names_used_and_bound(cells[i].source)
        if i == 0 or i in checks or spliced.roles.get(i) == "learner" or bound & wanted:
            keep.add(i)
            wanted |= used
    nb = nbformat.v4.new_notebook()
    nb.metadata = spliced.notebook.metadata
    roles = {}
    for i in sorted(keep):
        roles[len(nb.cells)] = spliced.roles[i]
        nb.cells.append(cells[i])
    return Splice(nb, spliced.learner, spliced.moved, spliced.missing, spliced.extra, spliced.edited, roles)
