"""``python -m labsupport release`` and ``python -m labsupport grade``: the instructor commands, which
live in :mod:`labsupport.course.cli`."""

import sys

from .course.cli import main

if __name__ == "__main__":
    sys.exit(main())
