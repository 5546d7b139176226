"""labsupport: the course's own package. Every lab starts with ``labsupport.setup()``.

Importing it chooses where Triton kernels run (GPU, or the interpreter when there is no CUDA
device) before any kernel can be defined.
"""

import sys as _sys

try:
    import torch as _torch  # noqa: F401
except ModuleNotFoundError as _missing:
    # An ImportError, not a ModuleNotFoundError: a lab's setup cell answers a missing *labsupport*
    # by pip-installing the course, which would not help here.
    raise ImportError(
        f"labsupport needs PyTorch, and this Python ({_sys.executable}) cannot import it ({_missing}). "
        "On your own machine run `make lab` in the course repository (or pick the course's .venv as "
        "the notebook kernel); on Colab choose a runtime that has PyTorch (all standard ones do)."
    ) from None

from .device import configure_triton as _configure_triton

_configure_triton()

from .device import LabSettings, setup  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LabSettings", "setup", "__version__"]
