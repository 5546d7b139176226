"""Where kernels run: a CUDA GPU, or Triton's interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so the choice must
be made before any kernel is defined. ``import labsupport`` makes it (see ``__init__``):
with no CUDA device it sets ``TRITON_INTERPRET=1`` unless you set the variable yourself.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from . import _run_all

INTERPRET_VAR = "TRITON_INTERPRET"
PRESET_VAR = "LABSUPPORT_PRESET"


def cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def gpu_limits(index: int | None = None) -> tuple[int, int]:
    """(shared memory one program may use, in bytes; multiprocessors) of a CUDA GPU: the opt-in
    limit torch reports (227 KiB on an H100 or H200, 64 KiB on a T4). Kernels choose their tiles by
    it (:func:`labsupport.int8_matmul.int8_matmul_config`)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    shared = int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)
    return shared, int(props.multi_processor_count)


def gpu_has_bf16() -> bool:
    """True on a CUDA GPU with bfloat16 tensor cores: compute capability 8.0 (Ampere) or newer.

    Older GPUs (Colab's T4, a V100) have float16 tensor cores only: bfloat16 runs there, slowly,
    and neither Triton's ``tl.dot`` nor SDPA's FlashAttention backend accepts it.
    """
    return cuda_available() and torch.cuda.get_device_capability()[0] >= 8


def lab_dtype() -> "torch.dtype":  # noqa: F821
    """The dtype labs measure in: bfloat16 on an Ampere-or-newer GPU, float16 on an older GPU,
    float32 on a CPU (whose 16-bit matmuls are slow and whose ``tl.dot`` in the interpreter
    mishandles bfloat16)."""
    if not cuda_available():
        return torch.float32
    return torch.bfloat16 if gpu_has_bf16() else torch.float16


def interpreter_mode() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


def configure_triton() -> bool:
    """Turn the interpreter on when there is no CUDA device; return whether it is on.

    An explicit ``TRITON_INTERPRET`` set by the user is respected either way.
    """
    if INTERPRET_VAR not in os.environ and not cuda_available():
        os.environ[INTERPRET_VAR] = "1"
    return interpreter_mode()


def device() -> "torch.device":  # noqa: F821
    """The device labs put tensors on: ``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if cuda_available() else "cpu")


@dataclass(frozen=True)
class LabSettings:
    """What a lab needs to know about where it runs."""

    device: str  # "cuda" or "cpu"
    device_name: str
    interpreter: bool  # Triton kernels run in the interpreter
    preset: str  # "small" (CPU / interpreter) or "full" (GPU)
    torch_version: str
    triton_version: str
    preset_source: str = "automatic"  # or "LABSUPPORT_PRESET", or a note on an ignored value
    memory_bytes: int = 0  # GPU memory (0 on a CPU)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def timings_meaningful(self) -> bool:
        """Whether a Triton kernel's timing says anything about performance here."""
        return self.on_gpu and not self.interpreter

    def pick(self, small, full):
        """Return ``small`` under the small preset and ``full`` under the full one."""
        return small if self.preset == "small" else full


def _triton_version() -> str:
    try:
        import triton
    except Exception as exc:  # a broken triton install should not hide the rest of the banner
        return f"not importable ({type(exc).__name__}: {exc})"
    return triton.__version__


def settings() -> LabSettings:
    """Describe the current machine without printing anything."""
    interp = configure_triton()
    on_gpu = cuda_available()
    memory = 0
    if on_gpu:
        name = torch.cuda.get_device_name(0)
        memory = int(torch.cuda.get_device_properties(0).total_memory)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    requested = os.environ.get(PRESET_VAR, "").strip().lower()
    if requested in ("small", "full"):
        preset, source = requested, PRESET_VAR
    else:
        preset = "full" if on_gpu and not interp else "small"
        source = "automatic"
        if requested:
            source = f"automatic; {PRESET_VAR}={os.environ[PRESET_VAR]!r} ignored, use small or full"
    return LabSettings(
        device="cuda" if on_gpu else "cpu",
        device_name=name,
        interpreter=interp,
        preset=preset,
        torch_version=torch.__version__,
        triton_version=_triton_version(),
        preset_source=source,
        memory_bytes=memory,
    )


def banner(s: LabSettings) -> str:
    """The lines ``setup()`` prints: where tensors live, versions, where kernels run, sizes."""
    if s.interpreter:
        mode = "Triton interpreter on the CPU (results exact; timings of Triton kernels are not meaningful)"
    elif s.on_gpu:
        mode = "compiled for the GPU"
    else:
        mode = (f"NONE: no GPU and the interpreter is off ({INTERPRET_VAR}={os.environ.get(INTERPRET_VAR)!r}). "
                f"Triton kernels will fail to launch; unset {INTERPRET_VAR} (or set it to 1) and restart")
    device = f"{s.device} - {s.device_name}"
    if s.memory_bytes:
        device += f" ({s.memory_bytes / 2**30:.1f} GiB)"
    sizes = "small problems sized for a CPU" if s.preset == "small" else "real sizes"
    lines = [
        f"device : {device}",
        f"torch  : {s.torch_version}    triton: {s.triton_version}",
        f"kernels: {mode}",
        f"sizes  : {s.preset} preset, {sizes} ({s.preset_source})",
    ]
    if s.triton_version.startswith("not importable"):
        lines.append("note   : Triton is missing, so no kernel can run. On Linux run `make setup` in the course "
                     "repository; on macOS or Windows use Colab (Triton publishes Linux wheels only)")
    if s.interpreter and s.on_gpu:
        lines.append(f"note   : {INTERPRET_VAR} is set although a GPU is present; unset it and restart to run "
                     f"kernels on the GPU")
    return "\n".join(lines)


def setup(verbose: bool = True) -> LabSettings:
    """Start of every lab: choose where kernels run, print one banner, return the settings."""
    s = settings()
    if verbose:
        print(banner(s))
    _install_error_explainer()
    _run_all.install()  # a cell that fails comes back into view after Run All
    return s


# --- turning raw launch errors into advice -------------------------------------------------

NO_DRIVER_ADVICE = (
    "Triton found no GPU driver, and the interpreter is off. Either run on a machine with a CUDA "
    "GPU, or use the interpreter: restart the kernel and run `import labsupport` (or set the "
    "environment variable TRITON_INTERPRET=1) before any @triton.jit kernel is defined."
)
CPU_TENSOR_ADVICE = (
    "A CPU tensor was passed to a Triton kernel running on the GPU. Move inputs to the GPU with "
    "`.to('cuda')` (labsupport.device.device() gives the right device) before launching."
)


STUB_IN_KERNEL_ADVICE = (
    "A @triton.jit kernel still contains `raise NotImplementedError(...)`: on a GPU Triton compiles "
    "the kernel and cannot compile a `raise`. Replace that line with the kernel's body, run the cell, "
    "and try again."
)
IMPORT_ORDER_ADVICE = (
    "Triton's language functions were set up before the interpreter was switched on (triton was "
    "imported before labsupport on a machine without a GPU). Restart the kernel and run "
    "`import labsupport` before importing triton."
)


def explain_error(exc: BaseException) -> str | None:
    """Return advice for a known Triton/torch launch failure, or None if it is not one."""
    text = str(exc)
    if "active drivers" in text and "There should only be one" in text:
        if INTERPRET_VAR in os.environ and not interpreter_mode():
            return (f"Triton found no GPU driver, and the interpreter is off because {INTERPRET_VAR} is set "
                    f"to {os.environ[INTERPRET_VAR]!r} in your environment. Unset it (or set it to 1), restart "
                    f"the kernel and run the notebook from the top; or run on a machine with a CUDA GPU.")
        return NO_DRIVER_ADVICE
    if "Pointer argument cannot be accessed from Triton" in text or "cpu tensor?" in text:
        return CPU_TENSOR_ADVICE
    if "unsupported AST node type: Raise" in text:
        return STUB_IN_KERNEL_ADVICE
    if "outside of the scope of a kernel" in text:
        return IMPORT_ORDER_ADVICE
    return None


def _install_error_explainer() -> None:
    """In IPython, print advice under the traceback of a known launch failure."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None or getattr(ip, "_labsupport_explainer", False):
        return

    def handler(shell, etype, value, tb, tb_offset=None):
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        advice = explain_error(value)
        if advice:
            print(f"\nWhat to do: {advice}")
        return None

    ip.set_custom_exc((RuntimeError, ValueError), handler)
    ip._labsupport_explainer = True
