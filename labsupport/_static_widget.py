"""What the book's two static widgets are built from: chapter 05's phase explainer
(:mod:`labsupport.explainer`) and chapter 14's capacity planner (:mod:`labsupport.planner_widget`).

Each is one self-contained HTML snippet: its styles and script are package files inlined, its
tables and starting setting JSON blocks the script reads, and its controls plain form elements.
The number formatting both scripts use is one file, ``explainer_static/number_format.js``, inlined
in front of each widget's own script.
"""

from __future__ import annotations

import html
import json
import uuid
from importlib import resources

NUMBER_FORMAT = ("explainer_static", "number_format.js")


def package_text(folder: str, name: str) -> str:
    """A file of ``labsupport/<folder>/`` (package data), as text."""
    return resources.files("labsupport").joinpath(folder, name).read_text(encoding="utf-8")


def element_id(given: str | None, prefix: str) -> str:
    """The widget's element id: ``given``, checked, or a fresh ``prefix-xxxxxxxx``."""
    chosen = given or f"{prefix}-{uuid.uuid4().hex[:8]}"
    if not chosen.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"element_id must be letters, digits, '-' or '_', got {chosen!r}")
    return chosen


def json_block(attribute: str, name: str, value) -> str:
    """A JSON block the widget's script finds by ``data-<attribute>="<name>"``."""
    text = json.dumps(value).replace("</", "<\\/")  # JSON allows "\/"; "</script>" must not appear
    return f'<script type="application/json" data-{attribute}="{name}">{text}</script>'


def script(folder: str, name: str, start: str, element: str) -> str:
    """One ``<script>``: the shared number formatting, the widget's own file, then ``start(element)``."""
    return (f"<script>{package_text(*NUMBER_FORMAT)}\n{package_text(folder, name)}\n"
            f"{start}(document.getElementById({json.dumps(element)}));</script>")


def options(values, selected, label=str) -> str:
    return "".join(
        f'<option value="{html.escape(str(v))}"{" selected" if v == selected else ""}>{html.escape(label(v))}</option>'
        for v in values
    )


def select(key: str, title: str, options: str) -> str:
    return f'<label>{title}<select data-control="{key}" aria-label="{title}">{options}</select></label>'


def metric(prefix: str, key: str, name: str, text: dict[str, str]) -> str:
    """One result: its name, its value (``text[key]``) and its note (``text[key + "-note"]``), each
    marked for the script to refresh."""
    return (
        f'<div class="{prefix}-metric"><div class="{prefix}-name">{name}</div>'
        f'<div class="{prefix}-value {prefix}-text" data-out="{key}">{html.escape(text[key])}</div>'
        f'<div class="{prefix}-note {prefix}-text" data-out="{key}-note">{html.escape(text[key + "-note"])}</div></div>'
    )
