"""Instructor tooling: the course's command line, lab sources and their release, the checks manifest,
code scanning, grading and its report, the notebook runner, and the book's helpers.

Learners never import it, and nothing else in :mod:`labsupport` does: domain modules and checks
stand on their own, and this package builds on them.

* :mod:`.cli` (``python -m labsupport release|grade``, also ``python -m labsupport.course``);
* :mod:`.sources` (the lab sources and the setup cell), :mod:`.release` (two notebooks per source);
* :mod:`.manifest` (``labsupport/lab_checks.json``: each lab's checks and points);
* :mod:`.scan` (which checks a notebook calls, and the grader's flags);
* :mod:`.grade` (running and scoring submissions), :mod:`.report` (the table and the CSV);
* :mod:`.notebooks` (the headless notebook runner); :mod:`.book` (glue and number formats for pages).
* :mod:`.diagnoses` (each check's mistakes and hints, read from its source) and :mod:`.sessions` (outlines),
  for the instructors' session plans; :mod:`.slides` (``make slides``: reveal.js decks from the learner notebooks).
"""
