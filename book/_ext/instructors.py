"""Directives for the instructors' part of the book (``book/instructors/``), rendered at build time
without a notebook kernel:

* ``{check-diagnoses} 06_kv_cache``: the lab's graded checks, their points and docstrings, and the
  mistakes, hints and failures each one reports (:mod:`labsupport.course.diagnoses`, read from the
  check modules' source, so the page follows the checks);
* ``{session-outline}``: rows of ``minutes | what happens``, shown as a table with each row's start
  and end; the build fails unless the minutes add up to the session's 90;
* ``{lab-checks}``: every lab's checks and points.

The instructors' pages are read again on every build (their content comes from the checks, which
Sphinx does not track).
"""

from __future__ import annotations

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

from labsupport.course import diagnoses, sessions

PAGES = "book/instructors/"


class _Markdown(SphinxDirective):
    def markdown(self) -> str:
        raise NotImplementedError

    def run(self):
        try:
            text = self.markdown()
        except ValueError as exc:
            raise self.error(f"{self.name}: {exc}") from exc
        container = nodes.container()
        self.state.nested_parse(StringList(text.splitlines(), source=self.get_source_info()[0]),
                                self.content_offset, container)
        for node in container.children:
            # generated from the checks' messages, which quote code ('utf-8', "ignore"): straight quotes
            node["support_smartquotes"] = False
        return container.children


class CheckDiagnoses(_Markdown):
    required_arguments = 1

    def markdown(self) -> str:
        return diagnoses.markdown(self.arguments[0])


class SessionOutline(_Markdown):
    has_content = True

    def markdown(self) -> str:
        return sessions.outline_markdown(sessions.parse_outline(list(self.content)))


class LabChecks(_Markdown):
    def markdown(self) -> str:
        return sessions.labs_markdown()


def _always_read(app, env, added, changed, removed):
    return [doc for doc in env.found_docs if doc.startswith(PAGES)]


def setup(app):
    app.add_directive("check-diagnoses", CheckDiagnoses)
    app.add_directive("session-outline", SessionOutline)
    app.add_directive("lab-checks", LabChecks)
    app.connect("env-get-outdated", _always_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
