"""Test setup. TRITON_INTERPRET must be decided before any kernel is defined, and notebook
kernels started by the tests inherit the environment, so it is set here, first."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")

import labsupport  # noqa: E402,F401  (sets TRITON_INTERPRET=1 when there is no CUDA device)
