"""The course's tests hand the course's own answers (unguarded) to the checks to show that they
pass, as ``labsupport.bench_attention.run_checks`` does on a GPU, so every test here runs inside
the sanctioned ``course_checks_its_answers`` context. A test of what a learner's submission meets
turns it off with ``course_checks_its_answers(False)``."""

import pytest

from labsupport._answers import course_checks_its_answers


@pytest.fixture(autouse=True)
def _course_checks_its_answers():
    with course_checks_its_answers():
        yield
