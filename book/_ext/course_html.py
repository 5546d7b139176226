"""Small fixes to the HTML that Jupyter Book 1.x emits, so pages load without console errors.

* sphinx-thebe registers its inline configuration script twice in this stack (once with
  filename None, once with ''), and the second copy throws "Identifier 'THEBE_JS_URL' has
  already been declared". Script entries with the same file and attributes are kept once.
* The launch (rocket) menu is kept on lab pages only. On a chapter page it would open the
  chapter's MyST Markdown source in Colab, which Colab cannot run; the labs are the notebooks.
"""

from __future__ import annotations


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


def setup(app):
    app.connect("html-page-context", _dedupe_scripts, priority=900)  # after every other handler
    app.connect("html-page-context", _launch_buttons_on_labs_only, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
