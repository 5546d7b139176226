"""The checks' diagnosis tables (labsupport.course.diagnoses): read statically from the check
modules, never empty, following a newly named mistake, and agreeing with what the checks hand the
Checker at run time."""

from __future__ import annotations

import re
import textwrap
import time

import pytest

from labsupport._answers import ANSWERS, course_checks_its_answers, unguarded
from labsupport.checks import framework
from labsupport.course import diagnoses

LABS = list(diagnoses.check_modules())


def test_every_lab_has_checks_and_diagnoses():
    assert len(LABS) >= 14, LABS
    for key in LABS:
        table = diagnoses.diagnose_lab(key)
        assert table, f"{key}: no @graded check found"
        for check in table:
            assert check.points and check.points > 0, (key, check.name)
            assert check.doc, (key, check.name)
        # every lab names mistakes or gives hints somewhere: the table is not empty
        assert sum(len(c.mistakes) + len(c.hints) for c in table) > 0, key


def test_the_table_follows_the_checks_registry():
    """Every graded check the package registers appears in its lab's table, with its points."""
    import labsupport.checks  # noqa: F401  (registers every check)

    static = {c.name: c.points for key in LABS for c in diagnoses.diagnose_lab(key)}
    registered = {name: check.points for name, check in framework.REGISTRY.items()
                  if check.__module__.rpartition(".")[2].startswith("lab")}
    assert static == registered


MODULE = '''
from .framework import Case, graded

RULE = "multiply the width by " + "the number of heads"


def _wrong(x):
    return {
        "the heads are counted twice (a planted mistake)": 2 * x,
        "the width is left out entirely": 1,
        "short": 3,
    }


@graded(points=7, bans=())
def check_width(fn, checker):
    """fn(x) must return the width."""
    for x in (1, 2):
        case = Case(x=x)
        mistakes = {d: v for d, v in _wrong(x).items() if v != x}
        mistakes[f"the width of {x} is squared"] = x * x
        checker.expect_number(checker.call(fn, x, case=case), x, case=case, hint=RULE, mistakes=mistakes)
        if x > 9:
            checker.fail(case, f"the width {x} is far too large.", "return x itself, not a multiple.")
'''


def test_a_newly_named_mistake_appears(tmp_path):
    (tmp_path / "lab42_width.py").write_text(MODULE)
    (check,) = diagnoses.diagnose_lab("42_width", tmp_path)
    assert (check.name, check.points, check.doc) == ("check_width", 7, "fn(x) must return the width.")
    assert set(check.mistakes) == {"the heads are counted twice (a planted mistake)",
                                   "the width is left out entirely", "the width of ⟨x⟩ is squared"}
    assert check.hints == ["multiply the width by the number of heads", "return x itself, not a multiple."]
    assert check.failures == ["the width ⟨x⟩ is far too large."]
    # a mistake added to the source shows in the next table
    (tmp_path / "lab42_width.py").write_text(MODULE.replace(
        '"short": 3,', '"short": 3,\n        "the width is given in bits, not bytes": 8 * x,'))
    (check,) = diagnoses.diagnose_lab("42_width", tmp_path)
    assert "the width is given in bits, not bytes" in check.mistakes
    md = diagnoses.markdown("42_width", tmp_path)
    assert "the width is given in bits, not bytes" in md and "**`check_width`** (7 points)" in md


def test_pairs_and_hint_defaults(tmp_path):
    (tmp_path / "lab43_pairs.py").write_text(textwrap.dedent('''
        from .framework import graded
        NO_COPY = ("the block is written in place", "copy the block before writing to it.")

        class _Driver:
            def fail(self, problem, hint="keep a reference count per block."):
                self.checker.fail(None, problem + f" This matches what happens when {NO_COPY[0]}.", NO_COPY[1])

        @graded(points=3)
        def check_blocks(cls, checker):
            """cls is the allocator."""
            _Driver().fail("the table changed after a failed call.", "leave the table as it was.")
    '''))
    (check,) = diagnoses.diagnose_lab("43_pairs", tmp_path)
    assert check.mistakes == ["the block is written in place (fix: copy the block before writing to it.)"]
    assert "keep a reference count per block." in check.hints and "leave the table as it was." in check.hints
    assert "the table changed after a failed call." in check.failures


def test_run_time_values_read_as_their_expressions_and_constants_as_their_text(tmp_path):
    (tmp_path / "lab44_values.py").write_text(textwrap.dedent('''
        from .framework import graded
        IN_PLACE = ("the block is written in place", "copy it first.")

        @graded(points=2)
        def check_values(fn, checker):
            """Like :func:`~labsupport.kvcache.kv_bytes` by :data:`RULE`."""
            checker.fail(None, f"block {n} of {total - 1} holds {sorted(set(a) - set(b))[:3]}; as when {IN_PLACE[0]}.")
    '''))
    (check,) = diagnoses.diagnose_lab("44_values", tmp_path)
    assert check.failures == ["block ⟨n⟩ of ⟨total - 1⟩ holds …; as when the block is written in place."]
    md = diagnoses.markdown("44_values", tmp_path)
    assert "Like `labsupport.kvcache.kv_bytes` by `RULE`." in md and ":func:" not in md
    assert "⟨n⟩ stands for a value the check fills in" in md


def test_markdown_escapes_outside_code_only():
    assert diagnoses._escape("costs $5 and ``a_b * c`` or n_kv * 2") == r"costs \$5 and ``a_b * c`` or n\_kv \* 2"


def test_unknown_lab_is_named():
    with pytest.raises(ValueError, match="no check module for lab '99_nothing'.*06_kv_cache"):
        diagnoses.diagnose_lab("99_nothing")


def test_all_tables_are_fast():
    start = time.perf_counter()
    for key in LABS:
        diagnoses.markdown(key)
    assert time.perf_counter() - start < 5.0


# --- agreement with the run-time tables --------------------------------------------------------

# The labs whose checks run in well under a second on a CPU: their checks are run on the course's
# own answers, recording every mistake description and hint they hand the Checker.
RUNTIME = ["03_journey", "04_roofline", "06_kv_cache", "12_engines"]


def _pattern(entry: str) -> re.Pattern:
    """An entry of the static table as a pattern: ``…`` and ``⟨expression⟩`` stand for any run-time text."""
    entry = entry.split(" (fix: ")[0]
    parts = re.split("(…|⟨[^⟩]*⟩)", entry)
    return re.compile("".join(".*?" if i % 2 else re.escape(part) for i, part in enumerate(parts)), re.S)


@pytest.mark.parametrize("key", RUNTIME)
def test_runtime_mistakes_and_hints_are_in_the_table(key, monkeypatch):
    import labsupport.checks  # noqa: F401

    seen = {"mistakes": set(), "hints": set()}
    real_number, real_tensor = framework.Checker.expect_number, framework.Checker.expect_tensor

    def record(kwargs):
        seen["mistakes"].update(kwargs.get("mistakes") or {})
        if kwargs.get("hint"):
            seen["hints"].add(kwargs["hint"])

    def number(self, *args, **kwargs):
        record(kwargs)
        return real_number(self, *args, **kwargs)

    def tensor(self, *args, **kwargs):
        record(kwargs)
        return real_tensor(self, *args, **kwargs)

    monkeypatch.setattr(framework.Checker, "expect_number", number)
    monkeypatch.setattr(framework.Checker, "expect_tensor", tensor)
    monkeypatch.setattr(framework, "_intact", lambda name: None)  # the recorder replaces a Checker method
    table = diagnoses.diagnose_lab(key)
    for check in table:
        registered = framework.REGISTRY[check.name]
        passed = []
        for ban in registered.bans:  # the answer among what the check bans (a helper that calls it too)
            with course_checks_its_answers():
                try:
                    registered(unguarded(ANSWERS[ban]))
                    passed.append(ban)
                    break
                except framework.CheckFailed:
                    continue
        assert passed, f"{check.name}: none of its banned answers {registered.bans} passes it"
    assert seen["mistakes"], f"{key}: the checks named no mistakes at run time"
    static_mistakes = [_pattern(m) for c in table for m in c.mistakes]
    static_hints = [_pattern(h) for c in table for h in c.hints]
    for description in seen["mistakes"]:
        text = " ".join(description.split())
        assert any(p.fullmatch(text) for p in static_mistakes), f"{key}: {text!r} is not in the static table"
    for hint in seen["hints"]:
        text = " ".join(hint.split())
        # a hint shown only in its longer variant (RULE and RULE + " With no dtype_bytes given, ...")
        longer = any(h.startswith(text) for c in table for h in c.hints)
        assert longer or any(p.fullmatch(text) for p in static_hints), f"{key}: hint {text!r} is not in the table"
