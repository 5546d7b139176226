"""The instructors' part of the book: a session plan for every lab with checks, in the table of
contents, each outline filling the session, and the directives that render the checks' diagnosis
tables and the outlines (book/_ext/instructors.py) in a real Sphinx build."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from labsupport.course import diagnoses, sessions

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "book" / "instructors"
OUTLINE = re.compile(r"```\{session-outline\}\n(.*?)```", re.S)


def _page(key: str) -> Path:
    """The session plan of lab ``key``: the page whose check-diagnoses directive names it."""
    found = [p for p in PAGES.glob("*.md") if f"{{check-diagnoses}} {key}\n" in p.read_text()]
    assert len(found) == 1, f"lab {key}: expected one session plan naming it, found {found}"
    return found[0]


@pytest.mark.parametrize("key", list(diagnoses.check_modules()))
def test_every_lab_has_a_session_plan(key):
    page = _page(key)
    text = page.read_text()
    for section in ("## Goals", "## Outline", "## The live demonstration", "## Questions for discussion"):
        assert section in text, f"{page.name}: no {section!r}"
    (body,) = OUTLINE.findall(text)
    rows = sessions.parse_outline(body.splitlines())
    assert sessions.outline_markdown(rows).count("\n") == len(rows) + 1  # fills the session exactly
    toc = (ROOT / "_toc.yml").read_text()
    assert f"file: book/instructors/{page.stem}\n" in toc
    assert f"/labs/{key}`" in text, f"{page.name} does not link its lab"


SECTIONS = re.compile(r"\b(?:sections?|parts?) (\d+)((?:(?:,| and| to) \d+)*)", re.I)


@pytest.mark.parametrize("key", list(diagnoses.check_modules()))
def test_the_lab_sections_a_plan_names_exist(key):
    """"section 3 of the lab" in a session plan is a numbered section of that lab's notebook."""
    text = " ".join(_page(key).read_text().split())
    numbered = set(re.findall(r"^# ## (\d+)\. ", (ROOT / "solutions" / f"{key}.py").read_text(), re.M))
    named = [(m.group(0), n) for m in SECTIONS.finditer(text) for n in re.findall(r"\d+", m.group(0))]
    missing = [(phrase, n) for phrase, n in named if n not in numbered]
    assert not missing, f"{key}: the plan names lab sections the lab does not have: {missing} (it has {sorted(numbered)})"


def test_outline_rules():
    rows = sessions.parse_outline(["10 | Recap", "", "80 | Lab"])
    assert rows == [(10, "Recap"), (80, "Lab")]
    table = sessions.outline_markdown(rows)
    assert "| 0:00–0:10 | 10 | Recap |" in table and "| 0:10–1:30 | 80 | Lab |" in table
    with pytest.raises(ValueError, match="add up to 85 minutes, not the session's 90"):
        sessions.outline_markdown([(10, "Recap"), (75, "Lab")])
    with pytest.raises(ValueError, match="outline row 2 is 'ten | Lab'"):
        sessions.parse_outline(["10 | Recap", "ten | Lab"])


def test_the_labs_table_lists_every_lab():
    table = sessions.labs_markdown()
    for key in diagnoses.check_modules():
        assert f"| {key} |" in table
    assert "`check_flash_attention` (25)" in table


def test_directives_in_a_sphinx_build(tmp_path):
    """The real session plan of lab 06 and a page whose outline is short, through Sphinx + MyST."""
    from sphinx.application import Sphinx

    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
        "extensions = ['myst_parser', 'instructors']\nmyst_enable_extensions = ['colon_fence', 'dollarmath']\n"
        "suppress_warnings = ['myst.xref_missing', 'ref.doc']\n")
    shutil.copy(PAGES / "06_kv_cache.md", src / "index.md")
    (src / "short.md").write_text("# Short\n\n```{session-outline}\n10 | Recap\n```\n")
    warnings = tmp_path / "warnings.txt"
    with warnings.open("w") as stream:
        app = Sphinx(str(src), str(src), str(tmp_path / "out"), str(tmp_path / "doctrees"), "html",
                     status=None, warning=stream, freshenv=True)
        app.build()
    html = (tmp_path / "out" / "index.html").read_text()
    for check in diagnoses.diagnose_lab("06_kv_cache"):
        assert f"{check.name}</span></code></strong> ({check.points:g} points)" in html
        assert check.mistakes[0].split(" (")[0].replace("_", "") in html.replace("_", "")
    assert "0:00–0:10" in html and "1:25–1:30" in html  # the outline's clock, computed
    assert "the outline's rows add up to 10 minutes, not the session's 90" in warnings.read_text()
    sys.modules.pop("instructors", None)
