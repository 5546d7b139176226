"""reveal.js slides for each chapter, from the learner notebooks (``python -m labsupport.course.slides``,
``make slides``).

The slides are the learner notebook of each lab (``labs/NN_topic.ipynb``, which ``release`` writes
with every solution replaced by its stub), converted by nbconvert's ``SlidesExporter``. Slide
boundaries come from the notebook's own headings: :func:`mark_slides` splits each markdown cell at
its headings, makes every ``#`` or ``##`` heading a new slide and every deeper heading a sub-slide
(reveal.js's vertical slides), leaves the cells after a heading on its slide, and skips the setup
cell. A notebook that is not a learner notebook, or that still holds a solution region, is refused.

Where reveal.js and MathJax come from:

* MathJax: always a local copy, ``_static/mathjax/tex-svg.js`` next to the slides, taken from the
  offline MathJax the book already installs (``sphinx-mathjax-offline``); SVG output needs no fonts.
* reveal.js: by default from a CDN (:data:`REVEAL_CDN`), so the slides need the network once per
  browser. ``--reveal DIR`` (``make slides REVEAL=DIR``) copies a local reveal.js 4 distribution
  (``npm pack reveal.js@4``, unpacked; it needs ``dist/`` and ``plugin/notes/``) to
  ``_static/reveal.js`` beside the slides, so the folder works offline.
  ``--inline`` (with ``--reveal``) writes each slide deck as one self-contained HTML file, with
  reveal.js, its theme and MathJax inlined (about 2.5 MB each; the theme's web fonts fall back to
  the system's).
"""

from __future__ import annotations

import argparse
import copy
import html
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import nbformat

from .sources import SETUP_CELL

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_DIR = Path(__file__).resolve().parent / "slides_template"
REVEAL_CDN = "https://unpkg.com/reveal.js@4.0.2"
MATHJAX_CDN = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-svg.js"
REVEAL_FILES = ("dist/reveal.js", "dist/reveal.css", "dist/theme/white.css", "plugin/notes/notes.js")
HEADING = re.compile(r"^(#{1,6})\s+\S")
FENCE = re.compile(r"^\s*(```|~~~)")
SOLUTION_MARKERS = ("BEGIN SOLUTION", "END SOLUTION")


class SlidesError(Exception):
    """A notebook that cannot be made into slides, or a reveal.js copy that is incomplete."""


def _split_at_headings(source: str) -> list[str]:
    """A markdown cell's text, cut before every heading line (not inside a fenced code block)."""
    parts: list[list[str]] = [[]]
    fenced = False
    for line in source.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and HEADING.match(line) and any(x.strip() for x in parts[-1]):
            parts.append([])
        parts[-1].append(line)
    return ["\n".join(p).strip("\n") for p in parts if any(x.strip() for x in p)]


def heading_level(source: str) -> int | None:
    """The level of the heading a cell's text starts with (``## x`` -> 2), or None."""
    found = HEADING.match(source.lstrip("\n"))
    return len(found.group(1)) if found else None


def refuse_solutions(nb, name: str) -> None:
    """Stop unless ``nb`` is a learner notebook with no solution region left in it."""
    version = nb.metadata.get("labsupport", {}).get("version")
    if version != "student":
        raise SlidesError(f"{name}: slides are made from learner notebooks (labs/NN_topic.ipynb, metadata "
                          f"labsupport.version 'student'); this one says {version!r}. Run `make release` and "
                          f"use the notebook in labs/.")
    for cell in nb.cells:
        if any(marker in cell.source for marker in SOLUTION_MARKERS):
            raise SlidesError(f"{name}: cell {cell.get('id', '?')} still holds a solution region "
                              f"({' / '.join(SOLUTION_MARKERS)}); slides never show solutions.")


def mark_slides(nb):
    """A copy of ``nb`` with reveal.js slide metadata set from its headings (see the module docstring)."""
    out = copy.deepcopy(nb)
    cells = []
    for cell in out.cells:
        if cell.cell_type == "markdown":
            for i, part in enumerate(_split_at_headings(cell.source)):
                new = nbformat.v4.new_markdown_cell(part)
                new.id = cell.get("id", "cell") + (f"-{i}" if i else "")
                cells.append(new)
        else:
            cells.append(cell)
    for index, cell in enumerate(cells):
        level = heading_level(cell.source) if cell.cell_type == "markdown" else None
        if cell.cell_type == "code" and cell.source.startswith(SETUP_CELL.splitlines()[0]):
            kind = "skip"
        elif index == 0 or (level is not None and level <= 2):
            kind = "slide"
        elif level is not None:
            kind = "subslide"
        else:
            kind = "-"
        cell.metadata["slideshow"] = {"slide_type": kind}
    out.cells = cells
    return out


def _mathjax_copy() -> Path | None:
    """The offline MathJax (SVG output) the book's ``sphinx-mathjax-offline`` installs, if there."""
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "tex-svg.js"
    return path if path.is_file() else None


def _check_reveal(reveal: Path) -> None:
    missing = [f for f in REVEAL_FILES if not (reveal / f).is_file()]
    if missing:
        raise SlidesError(f"{reveal} is not a reveal.js 4 distribution: {', '.join(missing)} missing. Get one "
                          f"with `npm pack reveal.js@4` and unpack it (the folder called package/).")


def _inline(page: str, folder: Path) -> str:
    """``page`` with every local script and style sheet it links put inside it."""
    def script(match):
        body = (folder / match.group(1)).read_text(encoding="utf-8").replace("</script", "<\\/script")
        return f"<script>{body}</script>"

    def style(match):
        return f"<style>{(folder / match.group(1)).read_text(encoding='utf-8')}</style>"

    page = re.sub(r'<script src="(_static/[^"]+)">\s*</script>', script, page)
    return re.sub(r'<link (?=[^>]*rel="stylesheet")[^>]*href="(_static/[^"]+)"[^>]*>', style, page)


def lab_notebooks(labs_dir: Path, only: list[str] | None = None) -> list[Path]:
    """The learner notebooks in ``labs_dir``, or those whose name starts with one of ``only``."""
    found = sorted(labs_dir.glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise SlidesError(f"no lab notebooks (NN_topic.ipynb) in {labs_dir}; give the folder of learner "
                          f"notebooks (labs/, which `make release` writes)")
    if only:
        found = [p for p in found if any(p.stem.startswith(o) for o in only)]
        unknown = [o for o in only if not any(p.stem.startswith(o) for p in found)]
        if unknown:
            raise SlidesError(f"no lab notebook in {labs_dir} starts with {', '.join(map(repr, unknown))}; "
                              f"the labs are: {', '.join(p.stem for p in sorted(labs_dir.glob('*.ipynb')))}")
    return found


def build(out_dir: Path, labs_dir: Path = ROOT / "labs", only: list[str] | None = None,
          reveal: Path | None = None, inline: bool = False) -> list[Path]:
    """Write one ``NN_topic.slides.html`` per lab (and ``index.html``) into ``out_dir``; return them."""
    from nbconvert import SlidesExporter  # only the slides need nbconvert

    if inline and reveal is None:
        raise SlidesError("--inline needs a local reveal.js (--reveal DIR) to put inside each file.")
    notebooks = lab_notebooks(labs_dir, only)
    out_dir.mkdir(parents=True, exist_ok=True)
    static = out_dir / "_static"
    mathjax = _mathjax_copy()
    mathjax_url = MATHJAX_CDN
    if mathjax is not None:
        (static / "mathjax").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(mathjax, static / "mathjax" / "tex-svg.js")
        mathjax_url = "_static/mathjax/tex-svg.js"
    prefix = REVEAL_CDN
    if reveal is not None:
        _check_reveal(reveal)
        target = static / "reveal.js"
        for sub in ("dist", "plugin/notes"):
            shutil.copytree(reveal / sub, target / sub, dirs_exist_ok=True)
        prefix = "_static/reveal.js"
    exporter = SlidesExporter(template_file="course.html.j2", extra_template_paths=[str(TEMPLATE_DIR)],
                              reveal_url_prefix=prefix, reveal_theme="white", mathjax_url=mathjax_url,
                              exclude_input_prompt=True, exclude_output_prompt=True)
    written = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        refuse_solutions(nb, str(path))
        nb.metadata["title"] = _title(nb, path)
        page, _ = exporter.from_notebook_node(mark_slides(nb), resources={"metadata": {"name": path.stem}})
        if inline:
            page = _inline(page, out_dir)
        target = out_dir / f"{path.stem}.slides.html"
        target.write_text(page, encoding="utf-8")
        written.append(target)
    # decks of earlier runs (`make slides 06` writes one) stay listed; a deck whose lab is gone does not
    labs = {p.stem for p in labs_dir.glob("*.ipynb")}
    decks = [p for p in sorted(out_dir.glob("*.slides.html")) if p.name.removesuffix(".slides.html") in labs]
    links = "\n".join(f'<li><a href="{p.name}">{html.escape(p.name.removesuffix(".slides.html"))}</a></li>'
                      for p in decks)
    (out_dir / "index.html").write_text(
        f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Slides</title></head>\n"
        f"<body><h1>Slides, one deck per lab</h1>\n<ul>\n{links}\n</ul></body></html>\n", encoding="utf-8")
    return written


def _title(nb, path: Path) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and heading_level(cell.source) == 1:
            return cell.source.lstrip("\n").splitlines()[0].lstrip("#").strip()
    return path.stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsupport.course.slides", description=__doc__.split("\n")[0])
    parser.add_argument("labs", nargs="*", help="lab keys or prefixes (06, 07_attention); default: every lab")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "slides", help="default: _build/slides")
    parser.add_argument("--labs-dir", type=Path, default=ROOT / "labs")
    parser.add_argument("--reveal", type=Path, help="a local reveal.js 4 distribution, copied beside the slides")
    parser.add_argument("--inline", action="store_true", help="one self-contained HTML file per lab (needs --reveal)")
    args = parser.parse_args(argv)
    try:
        written = build(args.out, args.labs_dir, args.labs or None, args.reveal, args.inline)
    except SlidesError as exc:
        print(f"slides: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} slide deck(s) to {args.out}/ (open index.html)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
