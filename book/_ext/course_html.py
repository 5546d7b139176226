"""Small fixes to the HTML that Jupyter Book 1.x emits, and the course's own styles.

* sphinx-thebe registers its inline configuration script twice in this stack (once with
  filename None, once with ''), and the second copy throws "Identifier 'THEBE_JS_URL' has
  already been declared". Script entries with the same file and attributes are kept once.
* The launch (rocket) menu is kept on lab pages only. On a chapter page it would open the
  chapter's MyST Markdown source in Colab, which Colab cannot run; the labs are the notebooks.
* One search box: sphinx-book-theme 1.3 with pydata-sphinx-theme 0.17 shows a search button in a
  header row above the sidebar's search field; the header's (``navbar_persistent``) goes.
* ``book/_static/course.css`` on every page (glued numbers at the body's weight, the lab notice).
* Each lab page opens with a notice (``lab_notice.html``): how to open and run it (Colab, the
  notebook file), and that the page shows the notebook unexecuted.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
STATIC = HERE.parent / "_static"


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        attributes = tuple(sorted((k, str(v)) for k, v in getattr(script, "attributes", {}).items()))
        key = (getattr(script, "filename", script) or "", attributes)
        if key in seen:
            continue
        seen.add(key)
        unique.append(script)
    scripts[:] = unique


def _launch_buttons_on_labs_only(app, pagename, templatename, context, doctree):
    buttons = context.get("header_buttons")
    if buttons is None or pagename.startswith("labs/"):
        return
    buttons[:] = [b for b in buttons if b.get("label") != "launch-buttons"]


def _course_styles(app, config):
    config.html_theme_options["navbar_persistent"] = []  # the sidebar's search field stays
    config.html_static_path = [*config.html_static_path, str(STATIC)]


def _colab_url(app, pagename: str) -> str:
    options = app.config.html_theme_options
    repository = urlparse(options.get("repository_url", "")).path.strip("/")
    branch = options.get("repository_branch", "main")
    return f"https://colab.research.google.com/github/{repository}/blob/{branch}/{pagename}.ipynb"


def _lab_notice(app, pagename, templatename, context, doctree):
    if not pagename.startswith("labs/") or "body" not in context:
        return
    notice = (HERE / "lab_notice.html").read_text(encoding="utf-8").format(
        colab=_colab_url(app, pagename),
        download=context["pathto"](f"_sources/{pagename}.ipynb", 1),
    )
    context["body"] = notice + context["body"]


def setup(app):
    app.connect("config-inited", _course_styles)
    app.add_css_file("course.css")
    app.connect("html-page-context", _dedupe_scripts, priority=900)  # after every other handler
    app.connect("html-page-context", _launch_buttons_on_labs_only, priority=900)
    app.connect("html-page-context", _lab_notice)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
