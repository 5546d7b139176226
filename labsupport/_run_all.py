"""Where the learner's view is when Run All stops: at the cell that failed.

JupyterLab's Run All sends every cell to the kernel at once and moves the view to the notebook's
last cell; the kernel stops at the first cell that raises and skips the rest (``stop_on_error``),
so the failed cell, usually an exercise's check, ends up far above the view. :func:`install`
(called by ``labsupport.setup()``) registers an IPython ``post_run_cell`` hook that, after a cell
raised, adds an HTML output whose script scrolls that cell back into view
(``notebook_static/show_failed_cell.js``). In another frontend, or once the notebook is reopened,
the script does nothing; untrusted HTML has its scripts removed. Not installed in a graded run.
"""

from __future__ import annotations

import os
import time
from importlib import resources

from ._grading import GRADING_ENV

SCRIPT = "show_failed_cell.js"


def script_html(now_s: float | None = None) -> str:
    """The HTML output written under a failed cell: one script, stamped with the time it was made."""
    code = resources.files("labsupport").joinpath("notebook_static", SCRIPT).read_text(encoding="utf-8")
    stamp = int(1000 * (time.time() if now_s is None else now_s))
    return f"<script>\n{code.replace('EMITTED_MS', str(stamp))}</script>"


def install() -> bool:
    """Register the hook in this IPython kernel (once); False where there is no kernel or in grading."""
    if os.environ.get(GRADING_ENV):
        return False
    try:
        from IPython import get_ipython  # only in a notebook; the package does not depend on IPython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel") or getattr(shell, "_labsupport_run_all", False):
        return False

    def after_cell(result) -> None:
        if result.error_in_exec is None and result.error_before_exec is None:
            return
        from IPython.display import display

        display({"text/html": script_html(), "text/plain": ""}, raw=True)

    shell.events.register("post_run_cell", after_cell)
    shell._labsupport_run_all = True
    return True
