"""``python -m labsupport release``, ``grade`` and ``grade-merge``: the instructor commands, which
live in :mod:`labsupport.course.cli`."""

import sys

from .course.cli import main

if __name__ == "__main__":
    sys.exit(main())
