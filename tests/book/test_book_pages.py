"""The built book, opened in headless Chromium: every page exists, math is typeset (no raw TeX),
no JavaScript errors, glue resolved, and lab pages carry a working Colab launch link.
Screenshots are saved under _build/screenshots/ for a person to look at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "_build" / "screenshots"
pytestmark = pytest.mark.book


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return files


PAGES = toc_files()
CHAPTERS = [p for p in PAGES if re.fullmatch(r"book/\d\d_\w+", p) and p not in ("book/05_explainer", "book/14_planner")]
RAW_TEX = ("\\frac", "\\(", "\\)", "\\[", "$$", "\\text{", "\\times")
# glued numbers (myst-nb's span.pasted-text) whose computed weight is above their parent's
GLUED_HEAVIER = """Array.from(document.querySelectorAll('article span.pasted-text'))
  .filter(e => Number(getComputedStyle(e).fontWeight) > Number(getComputedStyle(e.parentElement).fontWeight))
  .map(e => e.textContent)"""
# search boxes and buttons a reader can see (the header's and the sidebar's were both shown)
VISIBLE_SEARCHES = """Array.from(document.querySelectorAll('.search-button-field, .bd-search, form.bd-search, #searchbox input'))
  .filter(e => e.offsetParent !== null && e.getBoundingClientRect().width > 0).length"""


LINKS = "Array.from(document.querySelectorAll('a')).map(a => a.href)"
_LINKS_SEEN: dict[str, list[str]] = {}  # each page's links, read while test_page_renders had it open


def _links(source: str, page, book_url: str) -> list[str]:
    """The page's links: as test_page_renders read them, or from the page opened now (a test run alone)."""
    if source not in _LINKS_SEEN:
        page.goto(f"{book_url}/{source}.html", wait_until="load")
        _LINKS_SEEN[source] = page.evaluate(LINKS)
    return _LINKS_SEEN[source]


def test_toc_lists_only_existing_sources():
    for f in PAGES:
        assert any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb")), f"{f} is in _toc.yml but missing"


@pytest.mark.parametrize("source", PAGES)
def test_page_renders(source, page, book_url):
    html = ROOT / "_build" / "html" / f"{source}.html"
    assert html.exists(), f"{source}: no built page at {html}"
    response = page.goto(f"{book_url}/{source}.html", wait_until="load")
    assert response is not None and response.ok, f"{source}: HTTP {response and response.status}"
    has_math = page.evaluate("document.querySelectorAll('.math').length") > 0
    if has_math:
        page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=15000)
        page.evaluate("MathJax.startup.promise")
        untypeset = page.evaluate(
            "Array.from(document.querySelectorAll('.math')).filter(e => !e.querySelector('mjx-container')).length"
        )
        assert untypeset == 0, f"{source}: {untypeset} math elements were not typeset"
    article = page.inner_text("article")
    prose = page.evaluate(
        "Array.from(document.querySelectorAll('article p, article li, article td, article h1, article h2'))"
        ".filter(e => !e.closest('pre, code, .cell, mjx-container')).map(e => e.innerText).join('\\n')"
    )
    leftovers = [t for t in RAW_TEX if t in prose]
    assert not leftovers, f"{source}: raw TeX visible in the prose: {leftovers}"
    assert "{glue" not in article, f"{source}: an unresolved glue reference is visible"
    # glued numbers read at the weight of the text around them (myst-nb's own style makes them bold)
    heavier = page.evaluate(GLUED_HEAVIER)
    assert not heavier, f"{source}: glued numbers heavier than their text: {heavier[:5]}"
    searches = page.evaluate(VISIBLE_SEARCHES)
    assert searches == 1, f"{source}: {searches} search boxes visible, expected one"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{source.replace('/', '__')}.png"), full_page=False)
    _LINKS_SEEN[source] = page.evaluate(LINKS)  # the launch-link tests below read them
    assert not page.js_errors, f"{source}: JavaScript errors: {page.js_errors}"


@pytest.mark.parametrize("source", [p for p in PAGES if p.startswith("labs/")])
def test_lab_pages_have_a_colab_launch_link(source, page, book_url):
    links = _links(source, page, book_url)
    colab = [link for link in links if "colab.research.google.com" in link]
    assert colab, f"{source}: no Colab launch link"
    assert any(link.endswith(f"/{source}.ipynb") for link in colab), f"{source}: Colab link does not open the notebook: {colab}"


def test_math_renders_offline(page, book_url):
    """MathJax must come from the build itself, not a CDN: block every non-local request."""
    page.route("**/*", lambda route: route.abort() if "127.0.0.1" not in route.request.url else route.continue_())
    target = next((p for p in PAGES if (ROOT / f"{p}.md").exists() and "$" in (ROOT / f"{p}.md").read_text()), None)
    if target is None:
        pytest.skip("no page with math yet")
    page.goto(f"{book_url}/{target}.html", wait_until="load")
    page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=15000)
    page.evaluate("MathJax.startup.promise")
    assert page.evaluate("document.querySelectorAll('mjx-container').length") > 0


def test_attention_results_show_what_was_measured(page, book_url):
    """Chapter 07 shows the GPU table from results/gpu_attention.json with its device and date, or
    says plainly that nothing was measured: never an empty or half-rendered section."""
    from labsupport.bench_attention import load_results

    page.goto(f"{book_url}/book/07_attention.html", wait_until="load")
    section = page.locator("section#results-on-a-gpu")
    text = section.inner_text()
    tables = section.locator("table").count()
    results = load_results()
    if results is None:
        assert "Not yet measured." in text and tables == 0
    else:
        assert results["device"] in text and results["date"] in text and tables == 1
        raw_rows = [line for line in text.splitlines() if line.strip().startswith("|")]
        assert not raw_rows, f"the results table was not rendered as a table: {raw_rows[:2]}"


@pytest.mark.parametrize("source", [p for p in PAGES if p.startswith("book/")])
def test_chapter_pages_offer_no_launch_button(source, page, book_url):
    """A chapter's launch button would open its MyST source in Colab, which cannot run it."""
    links = _links(source, page, book_url)
    assert not [link for link in links if "colab.research.google.com" in link], source


@pytest.mark.parametrize("source", CHAPTERS)
def test_every_chapter_has_a_figure_and_its_screenshot(source, page, book_url):
    """Each chapter shows at least one figure drawn at build time (two image pixels per CSS pixel, so
    it stays sharp); a screenshot of the view at its first figure is kept for a person to look at."""
    page.goto(f"{book_url}/{source}.html", wait_until="load")
    images = page.evaluate("""Array.from(document.querySelectorAll('article img'))
      .filter(i => i.complete && i.naturalWidth > 0)
      .map(i => ({src: i.getAttribute('src'), natural: i.naturalWidth, shown: i.getBoundingClientRect().width}))""")
    figures = [i for i in images if i["natural"] >= 300]
    assert figures, f"{source}: no figure"
    if source >= "book/09":  # the figures of labsupport.course.figures
        assert all(i["natural"] >= 1.9 * i["shown"] for i in figures), f"{source}: a figure below 2x: {figures}"
    page.locator(f"article img[src='{figures[0]['src']}']").first.scroll_into_view_if_needed()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"figure__{source.replace('/', '__')}.png"))
