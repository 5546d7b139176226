"""labsupport: the course's own package. Every lab starts with ``labsupport.setup()``.

Importing it chooses where Triton kernels run (GPU, or the interpreter when there is no CUDA
device) before any kernel can be defined.
"""

from .device import configure_triton as _configure_triton

_configure_triton()

from .device import LabSettings, setup  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LabSettings", "setup", "__version__"]
