"""``python -m labsupport.serve``: start the course server (see :mod:`labsupport.serve`)."""

from .cli import main

raise SystemExit(main())
