"""The environment variable that marks a kernel the grader started (``LABSUPPORT_GRADING``).

On the package's ground floor: it imports nothing of ``labsupport``, so the modules that read it
(``timing``, ``_run_all``, ``checks.framework``, ``course.grade``) can all import it without one
of them importing another that imports it back.
"""

GRADING_ENV = "LABSUPPORT_GRADING"
