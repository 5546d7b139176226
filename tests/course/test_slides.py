"""The chapters' slides (labsupport.course.slides): one reveal.js section per heading of the learner
notebook, the setup cell skipped, no solution code, solution notebooks refused, an offline build."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from bs4 import BeautifulSoup

from labsupport.course import slides

ROOT = Path(__file__).resolve().parents[2]
LAB = "06_kv_cache"


def _headings(nb) -> list[int]:
    """The level of every heading line in the notebook's markdown cells (outside code fences)."""
    levels = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        fenced = False
        for line in cell.source.splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and (m := re.match(r"^(#{1,6}) \S", line)):
                levels.append(len(m.group(1)))
    return levels


def _solution_lines(source: Path) -> list[str]:
    """The code between BEGIN SOLUTION and END SOLUTION in a lab source, one stripped line each."""
    lines, inside = [], False
    for line in source.read_text().splitlines():
        if "END SOLUTION" in line:
            inside = False
        elif inside and len(line.strip()) > 12:
            lines.append(line.strip())
        elif "BEGIN SOLUTION" in line:
            inside = True
    return lines


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    (page,) = slides.build(out, ROOT / "labs", only=[LAB])
    return out, page


def test_one_section_per_heading(built):
    out, page = built
    nb = nbformat.read(ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    levels = _headings(nb)
    soup = BeautifulSoup(page.read_text(), "html.parser")
    top = soup.select("div.slides > section")
    assert len(top) == sum(level <= 2 for level in levels) >= 5
    nested = soup.select("div.slides > section > section")
    assert len(nested) == len(top) + sum(level > 2 for level in levels)  # each slide wraps its sub-slides
    # each slide opens with its heading, in the notebook's order
    titles = [s.find(re.compile("^h[12]$")).get_text(strip=True).rstrip("¶") for s in top]
    assert titles[0].startswith("Lab 06") and "Exercise" not in titles[0]
    assert (out / "index.html").read_text().count(".slides.html") == 1


def test_no_solution_code_and_no_setup_cell(built):
    _, page = built
    text = BeautifulSoup(page.read_text(), "html.parser").get_text()
    solution = _solution_lines(ROOT / "solutions" / f"{LAB}.py")
    assert len(solution) >= 3
    shown = [line for line in solution if line in text]
    assert not shown, f"solution code on the slides: {shown}"
    assert "NotImplementedError" in text  # the exercise stubs are there
    assert "pip install" not in text and "subprocess" not in text  # the setup cell is skipped


def test_solution_notebooks_are_refused(tmp_path):
    with pytest.raises(slides.SlidesError, match="learner notebooks"):
        slides.build(tmp_path, ROOT / "solutions", only=[LAB])
    nb = nbformat.read(ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    nb.cells[3].source += "\n# BEGIN SOLUTION\n"
    with pytest.raises(slides.SlidesError, match="solution region"):
        slides.refuse_solutions(nb, "edited.ipynb")


def test_a_folder_without_lab_notebooks_is_refused(tmp_path):
    (tmp_path / "notes.ipynb").write_text("{}")
    for folder in (tmp_path, tmp_path / "missing"):
        with pytest.raises(slides.SlidesError, match="no lab notebooks"):
            slides.build(tmp_path / "out", folder)
    assert not (tmp_path / "out").exists()  # nothing written, not even an empty index


def test_headings_inside_a_cell_and_fences():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Title\n\nintro\n\n## One\n\ntext\n```\n# not a heading\n```\n### Deeper"),
        nbformat.v4.new_code_cell("x = 1"),
    ])
    marked = slides.mark_slides(nb)
    kinds = [(c.cell_type, c.metadata["slideshow"]["slide_type"]) for c in marked.cells]
    assert kinds == [("markdown", "slide"), ("markdown", "slide"), ("markdown", "subslide"), ("code", "-")]
    assert "# not a heading" in marked.cells[1].source
    assert nb.cells[0].metadata == {}  # the notebook itself is not changed


def test_offline_and_self_contained(tmp_path):
    reveal = tmp_path / "reveal"
    for name in slides.REVEAL_FILES:
        (reveal / name).parent.mkdir(parents=True, exist_ok=True)
        (reveal / name).write_text(f"/* {name} */ var x = '</script>';")
    out = tmp_path / "out"
    (page,) = slides.build(out, ROOT / "labs", only=["00"], reveal=reveal, inline=True)
    html = page.read_text()
    assert "/* dist/reveal.js */" in html and "/* dist/theme/white.css */" in html
    soup = BeautifulSoup(html, "html.parser")
    linked = [t.get("src") for t in soup.find_all("script") if t.get("src")] + \
        [t.get("href") for t in soup.find_all("link") if t.get("href")]
    assert not linked, f"inline mode left scripts or style sheets outside the file: {linked}"
    with pytest.raises(slides.SlidesError, match="dist/reveal.css"):
        (reveal / "dist" / "reveal.css").unlink()
        slides.build(out, ROOT / "labs", only=["00"], reveal=reveal)
    with pytest.raises(slides.SlidesError, match="no lab notebook .* '99'"):
        slides.build(out, ROOT / "labs", only=["99"])


def test_the_index_keeps_earlier_decks_and_drops_a_gone_lab(tmp_path):
    out = tmp_path / "slides"
    out.mkdir()
    (out / "05_phases.slides.html").write_text("<html></html>")  # from an earlier `make slides 05`
    (out / "99_renamed.slides.html").write_text("<html></html>")  # its lab is no longer in labs/
    slides.build(out, ROOT / "labs", only=[LAB])
    index = (out / "index.html").read_text()
    assert "05_phases.slides.html" in index and f"{LAB}.slides.html" in index
    assert "99_renamed" not in index
