"""Published peak numbers for the GPUs learners are likely to meet.

``peak_flops`` is the dense (no sparsity) bf16 tensor-core peak in FLOP/s, except where a card has
no bf16 tensor cores (T4): there it is the fp16 peak, and ``notes`` says so. ``hbm_bandwidth`` is
the memory bandwidth in bytes/s, in decimal units as the datasheets give it (3.35 TB/s is
3.35e12 bytes/s). Each row names its source. Published peaks are ceilings, never measurements:
the labs measure your own device and show both side by side.

Memory capacities are binary, whatever the product name's "GB" says: an "A100 80GB" has 80 GiB
(80 x 2**30 = 85.9e9 bytes) of HBM, and ``nvidia-smi`` reports exactly 81,920 MiB for it.
``memory_bytes`` is the capacity in the name, read as GiB. ``reported_bytes`` is ``memory.total``
as ``nvidia-smi`` reports it, the memory software can actually allocate (before the CUDA context
and the engine's own reserve); on some cards it is a little less than the name (an H100 SXM
reports 81,559 MiB, 79.6 GiB, of its 80 GiB; an H200 143,771 MiB, 140.4 GiB, of its 141).
Capacity planning uses it; ``memory_bytes`` serves the worked examples that use the name.

``fp8_peak_flops`` is the dense FP8 tensor-core peak, 0 on a card without FP8 tensor cores (A100,
T4). The datasheets give it "with sparsity", twice the dense figure, as they do bf16's; dense, it
is twice the dense bf16 peak on Hopper (H100 SXM5: 3,958 TFLOPS with sparsity against 1,979 for
bf16) and on Ada (L4: 485 against 242).

``host_link_bandwidth`` is the link to the host's memory, one direction, in bytes/s: the
datasheets give PCIe's rate with both directions added (H100 and H200: "PCIe Gen5: 128 GB/s"; A100
and L4: Gen4, 64 GB/s; T4: Gen3, 32 GB/s), so half of it flows each way. A copy of the KV cache to
CPU memory and back (chapter 10's swap) is bounded by it.

``compute_capability`` and ``shared_memory_per_block`` (the opt-in maximum one thread block may
use) come from the CUDA C++ Programming Guide's table of technical specifications per compute
capability: 64 KiB on 7.5, 163 KiB on 8.0, 99 KiB on 8.6 and 8.9, 227 KiB on 9.0. The attention
kernel's launch configuration is chosen to fit them (``labsupport.attention.kernel_config``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._validate import positive_int

TERA = 1e12
GIB = 2**30  # memory capacities are binary
MIB = 2**20
KIB = 2**10


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    source: str
    notes: str = ""
    reported_bytes: float = 0.0  # nvidia-smi memory.total; 0 when unknown
    compute_capability: tuple[int, int] = (0, 0)  # (major, minor); (0, 0) when unknown
    shared_memory_per_block: int = 0  # bytes one thread block (Triton program) may use, opt-in limit
    fp8_peak_flops: float = 0.0  # dense FP8 tensor-core peak in FLOP/s; 0 without FP8 tensor cores
    host_link_bandwidth: float = 0.0  # PCIe to the host, bytes/s in one direction; 0 when unknown

    @property
    def usable_bytes(self) -> float:
        """Memory to plan with: what the card reports, else the datasheet's figure."""
        return self.reported_bytes or self.memory_bytes

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP per byte) where the compute and bandwidth limits meet."""
        return self.peak_flops / self.hbm_bandwidth

    def times(self, count: int) -> "GPU":
        """``count`` of these cards treated as one device (peak, bandwidth and memory all scale)."""
        count = positive_int("count", count)
        return GPU(
            name=f"{count}x {self.name}",
            peak_flops=self.peak_flops * count,
            hbm_bandwidth=self.hbm_bandwidth * count,
            memory_bytes=self.memory_bytes * count,
            source=self.source,
            notes=self.notes,
            reported_bytes=self.reported_bytes * count,
            compute_capability=self.compute_capability,
            shared_memory_per_block=self.shared_memory_per_block,
            fp8_peak_flops=self.fp8_peak_flops * count,
            host_link_bandwidth=self.host_link_bandwidth * count,
        )


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU("H100 SXM", 989.4 * TERA, 3.35e12, 80 * GIB, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
            reported_bytes=81_559 * MIB, compute_capability=(9, 0), shared_memory_per_block=227 * KIB,
            fp8_peak_flops=3958 / 2 * TERA, host_link_bandwidth=128e9 / 2),
        GPU("H200", 989.4 * TERA, 4.8e12, 141 * GIB, "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
            reported_bytes=143_771 * MIB, compute_capability=(9, 0), shared_memory_per_block=227 * KIB,
            fp8_peak_flops=3958 / 2 * TERA, host_link_bandwidth=128e9 / 2),
        GPU("A100 40GB", 312 * TERA, 1.555e12, 40 * GIB, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)",
            reported_bytes=40_960 * MIB, compute_capability=(8, 0), shared_memory_per_block=163 * KIB,
            host_link_bandwidth=64e9 / 2),
        GPU("A100 80GB", 312 * TERA, 2.039e12, 80 * GIB, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",
            reported_bytes=81_920 * MIB, compute_capability=(8, 0), shared_memory_per_block=163 * KIB,
            host_link_bandwidth=64e9 / 2),
        GPU("L4", 121 * TERA, 300e9, 24 * GIB, "NVIDIA L4 Tensor Core GPU datasheet (242 TFLOP/s is with sparsity)",
            reported_bytes=23_034 * MIB, compute_capability=(8, 9), shared_memory_per_block=99 * KIB,
            fp8_peak_flops=485 / 2 * TERA, host_link_bandwidth=64e9 / 2),
        GPU(
            "T4",
            65 * TERA,
            320e9,
            16 * GIB,
            "NVIDIA T4 Tensor Core GPU datasheet",
            notes="no bf16 tensor cores: peak is fp16 with fp32 accumulation",
            reported_bytes=15_360 * MIB,
            compute_capability=(7, 5),
            shared_memory_per_block=64 * KIB,
            host_link_bandwidth=32e9 / 2,
        ),
    )
}

_ALIASES = {
    "h100": "H100 SXM",
    "h100-sxm": "H100 SXM",
    "h100 sxm": "H100 SXM",
    "h200": "H200",
    "a100": "A100 80GB",
    "a100-40gb": "A100 40GB",
    "a100 40gb": "A100 40GB",
    "a100-80gb": "A100 80GB",
    "a100 80gb": "A100 80GB",
    "l4": "L4",
    "t4": "T4",
}


def get_gpu(name: str) -> GPU:
    """Look up a GPU by name ("H100 SXM", "h100", "A100 40GB", "a100-40gb", ...)."""
    if not isinstance(name, str):
        raise ValueError(f"GPU name must be a string, got {type(name).__name__}")
    key = name.strip()
    if key in GPUS:
        return GPUS[key]
    alias = _ALIASES.get(key.lower())
    if alias is None:
        raise ValueError(f"unknown GPU {name!r}; accepted names: {', '.join(GPUS)}")
    return GPUS[alias]


def as_gpu(gpu) -> GPU:
    """The GPU ``gpu`` stands for: a :class:`GPU` as it is (several cards as one too,
    ``GPU.times(n)``), or a name for :func:`get_gpu`. Every function of the course that takes a GPU
    goes through this one."""
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, str):
        return get_gpu(gpu)
    raise ValueError(
        f"gpu must be a labsupport.hardware.GPU (for example get_gpu('H100 SXM'), or get_gpu('H100 SXM').times(4) "
        f"for four cards) or a GPU name ({', '.join(GPUS)}), got {type(gpu).__name__}"
    )


def list_gpus() -> list[str]:
    return list(GPUS)


def match_device_name(device_name: str) -> GPU | None:
    """Match ``torch.cuda.get_device_name()`` to a table row, or None when no row fits.

    Only the variants the table describes match: an "H100 PCIe", "H100 NVL", "H200 NVL",
    "GH200" or "A100 80GB PCIe" has other peaks or bandwidth than the SXM rows, so it gets None
    rather than a wrong datasheet line.
    """
    text = device_name.lower()
    if "gh200" in text or "pcie" in text and ("h100" in text or "80gb" in text) or "nvl" in text:
        return None
    if "h200" in text:
        return GPUS["H200"]
    if "h100" in text:
        return GPUS["H100 SXM"]
    if "a100" in text:
        return GPUS["A100 40GB"] if "40gb" in text.replace(" ", "") else GPUS["A100 80GB"]
    if re.search(r"\bl4\b", text):  # not the L40 or L40S, which are other cards
        return GPUS["L4"]
    if re.search(r"\bt4\b", text):
        return GPUS["T4"]
    return None
