"""Lab sources: one percent-format Python file per lab, ``solutions/NN_name.py``.

Cells start with ``# %%`` (code) or ``# %% [markdown]`` (prose, each line starting with ``# ``);
a marker line may give the notebook cell tags, jupytext's way: ``# %% tags=["nbval-check-output"]``.
Solution regions are marked inside code cells (``# BEGIN SOLUTION: what to do`` ... ``# END
SOLUTION``) and inside markdown (``<!-- BEGIN SOLUTION -->`` ... ``<!-- END SOLUTION -->``).

The setup cell is written once, here (:data:`SETUP_CELL`): a source marks where it goes with a
cell ``# %% [setup]`` and ``release`` fills it in, with the course's repository address read from
``_config.yml`` (``repository.url``), the address the book's launch buttons use. In the source
that cell holds only :data:`SETUP_STANDIN` (two lines that define ``labsupport`` and ``settings``
for linters and for running the source as a script); release replaces it whole.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

CELL_MARKER = re.compile(r"^# %%(?P<rest>.*)$")
TAGS = re.compile(r"\btags\s*=\s*(?P<tags>\[.*?\])")  # jupytext's spelling: # %% tags=["a", "b"]
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<what>.*))?\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
MD_BEGIN = "<!-- BEGIN SOLUTION -->"
MD_END = "<!-- END SOLUTION -->"
SETUP_MARKER = "[setup]"
SETUP_STANDIN = ["import labsupport", "", "settings = labsupport.setup()"]  # the source's setup cell

# The first code cell of every lab. On Colab (or wherever the course is not installed) it installs the
# course package from its repository; it never replaces the torch and triton already there.
SETUP_CELL = """\
# Setup. On Colab (or any machine without the course installed) this installs the course
# package first; it never replaces the torch and triton that are already there.
try:
    import labsupport
except ModuleNotFoundError:
    import subprocess
    import sys

    course = "git+{repository}"  # your course's repository
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", course], capture_output=True, text=True)
    if pip.returncode:
        raise RuntimeError(f"could not install the course from {{course}}: check the address above and that "
                           f"this runtime can reach the internet. pip said:\\n{{pip.stderr[-1500:]}}") from None
    import labsupport

settings = labsupport.setup()"""


class ReleaseError(Exception):
    """A source file is malformed, or a release would overwrite a learner's work."""


@dataclass
class SourceCell:
    kind: str  # "code", "markdown" or "setup" (where release puts SETUP_CELL)
    lines: list[str]
    line_no: int  # where the cell starts in the source, for error messages
    tags: list[str] = field(default_factory=list)  # from the marker line: # %% tags=["..."]


def parse_source(path: Path) -> list[SourceCell]:
    """Split a percent-format file into cells."""
    cells: list[SourceCell] = []
    current: SourceCell | None = None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        marker = CELL_MARKER.match(raw)
        if marker:
            rest = marker.group("rest").strip()
            kind = "markdown" if rest.startswith("[markdown]") else "setup" if rest == SETUP_MARKER else "code"
            current = SourceCell(kind, [], number, marker_tags(rest, path, number))
            cells.append(current)
            continue
        if current is None:
            continue  # header comment before the first cell
        if current.kind == "markdown":
            if raw.strip() and not raw.startswith("#"):
                raise ReleaseError(f"{path}:{number}: markdown lines must start with '#', got {raw!r}")
            raw = raw[2:] if raw.startswith("# ") else raw[1:]
        current.lines.append(raw)
    for cell in cells:
        while cell.lines and not cell.lines[0].strip():
            cell.lines.pop(0)
        while cell.lines and not cell.lines[-1].strip():
            cell.lines.pop()
    if not cells:
        raise ReleaseError(f"{path}: no cells found (cells start with a line '# %%')")
    setups = [c for c in cells if c.kind == "setup"]
    for cell in setups:
        if cell.lines and cell.lines != SETUP_STANDIN:
            raise ReleaseError(
                f"{path}:{cell.line_no}: the '# %% {SETUP_MARKER}' cell must hold only the lines "
                f"{SETUP_STANDIN!r} (or nothing): release replaces it with SETUP_CELL from "
                f"labsupport/course/sources.py, so edit the setup there")
    if len(setups) > 1:
        raise ReleaseError(f"{path}:{setups[1].line_no}: a second '# %% {SETUP_MARKER}' cell; a lab has one "
                           f"setup cell, where its first code cell goes")
    return [c for c in cells if c.lines or c.kind == "setup"]


def marker_tags(rest: str, path: Path, number: int) -> list[str]:
    """The notebook cell tags a marker line declares (``# %% tags=["nbval-check-output"]``)."""
    found = TAGS.search(rest)
    if not found:
        return []
    try:
        tags = json.loads(found.group("tags"))
    except json.JSONDecodeError:
        tags = None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ReleaseError(f'{path}:{number}: write cell tags as a JSON list of strings: # %% tags=["name"]')
    return tags


def course_repository(root: Path) -> str:
    """The course's repository address, ``repository.url`` in ``_config.yml`` (the book's launch buttons
    use it too), for the setup cell's install line."""
    config = Path(root) / "_config.yml"
    try:
        text = config.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReleaseError(f"{config}: cannot read it ({exc}); the setup cell takes the course's address from "
                           f"its repository.url") from None
    # a plain reading of the two lines needed (no YAML library in the package's dependencies)
    block = re.search(r"^repository:[ \t]*\n((?:[ \t]+.*\n?|[ \t]*\n)*)", text, re.MULTILINE)
    url = re.search(r"^[ \t]+url:[ \t]*[\"']?([^\s\"'#]+)", block.group(1), re.MULTILINE) if block else None
    if not url:
        raise ReleaseError(f"{config}: no repository.url (the address of the course's git repository, such as "
                           f"https://github.com/OWNER/REPO); the setup cell installs the course from it")
    return url.group(1)


def setup_cell(repository: str) -> str:
    """The setup cell's code, installing the course from ``repository`` where it is missing."""
    return SETUP_CELL.format(repository=repository)


STUB_WIDTH = 96  # what an editor pane shows without scrolling (JupyterLab beside its file browser)
STUB_SHORT = "Exercise: write what the comment above says"


def stub_lines(indent: str, what: str | None) -> list[str]:
    """What replaces a solution region in the learner's copy: ``raise NotImplementedError(...)`` at
    the marker's indentation, saying what to write. When that line would be wider than
    :data:`STUB_WIDTH`, what to write goes into comment lines above it and the raise stays short,
    so the learner replaces one line and no line runs off the editor."""
    what = what or "replace this line with your code"
    line = f'{indent}raise NotImplementedError("Exercise: {what}")'
    if len(line) <= STUB_WIDTH:
        return [line]
    text = textwrap.wrap(f"Exercise: {what}", width=STUB_WIDTH - len(indent) - 2, break_on_hyphens=False)
    return [f"{indent}# {piece}" for piece in text] + [f'{indent}raise NotImplementedError("{STUB_SHORT}")']


def strip_code_lines(cell: SourceCell, path: Path, student: bool) -> list[tuple[str, int]]:
    """The cell's lines for one version, each with the source line it comes from."""
    out: list[tuple[str, int]] = []
    inside: re.Match | None = None
    begin_line = 0
    for offset, line in enumerate(cell.lines):
        number = cell.line_no + offset + 1
        begin = BEGIN.match(line)
        if begin:
            if inside:
                raise ReleaseError(f"{path}:{number}: nested '# BEGIN SOLUTION'")
            inside, begin_line = begin, number
            if student:
                out.extend((line, number) for line in stub_lines(begin.group("indent"), begin.group("what")))
            continue
        if END.match(line):
            if not inside:
                raise ReleaseError(f"{path}:{number}: '# END SOLUTION' without a BEGIN")
            inside = None
            continue
        if not (student and inside):
            out.append((line, number))
    if inside:
        raise ReleaseError(f"{path}:{begin_line}: '# BEGIN SOLUTION' is never closed")
    return out


def strip_markdown(cell: SourceCell, path: Path, student: bool) -> list[str]:
    out, inside = [], False
    for offset, line in enumerate(cell.lines):
        if line.strip() == MD_BEGIN:
            inside = True
            continue
        if line.strip() == MD_END:
            if not inside:
                raise ReleaseError(f"{path}:{cell.line_no + offset + 1}: {MD_END} without a BEGIN")
            inside = False
            continue
        if not (student and inside):
            out.append(line)
    if inside:
        raise ReleaseError(f"{path}:{cell.line_no}: {MD_BEGIN} is never closed")
    return out


