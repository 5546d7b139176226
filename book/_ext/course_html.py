"""Small fixes to the HTML that Jupyter Book 1.x emits, so pages load without console errors.

* sphinx-thebe registers its inline configuration script twice in this stack (once with
  filename None, once with ''), and the second copy throws "Identifier 'THEBE_JS_URL' has
  already been declared". Script entries with the same file and attributes are kept once.
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


def setup(app):
    app.connect("html-page-context", _dedupe_scripts, priority=900)  # after every other handler
    return {"parallel_read_safe": True, "parallel_write_safe": True}
