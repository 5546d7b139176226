"""``python -m labsupport release``, ``grade``, ``grade-merge`` and ``ledger``: the instructor commands,
which live in :mod:`labsupport.course.cli`."""

import sys

from .course.cli import main

if __name__ == "__main__":
    sys.exit(main())
