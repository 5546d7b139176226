"""``python -m labsupport.course``: the same commands as ``python -m labsupport``."""

import sys

from .cli import main

sys.exit(main())
