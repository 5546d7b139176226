"""Measuring a device's two ceilings and drawing its roofline.

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 2009) says a kernel that does ``F`` FLOPs and moves ``B``
bytes can run no faster than the slower of its two limits::

    time >= max(F / peak_flops, B / bandwidth)

Dividing by ``B`` gives the roof: attainable FLOP/s = ``min(peak_flops, intensity * bandwidth)``,
where ``intensity = F / B`` is the arithmetic intensity in FLOP per byte. The two pieces meet at
the *ridge point*, ``peak_flops / bandwidth``.

Conventions used here (and in labs 04 and 05):

* a matmul ``(m, k) @ (k, n)`` costs ``2*m*k*n`` FLOPs (:func:`labsupport.costs.matmul_flops`);
* a copy of ``b`` bytes moves ``2*b`` bytes (it reads ``b`` and writes ``b``).

``measure_matmul`` and ``measure_copy`` time with :func:`labsupport.timing.benchmark`, so on a GPU
they use ``triton.testing.do_bench`` (warm-up, synchronisation, L2 flush) and on a CPU a wall clock.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._answers import answer
from ._validate import non_negative_number, positive_int, positive_number
from .costs import matmul_flops
from .device import device as default_device
from .device import lab_dtype
from .hardware import as_gpu
from .timing import benchmark
from .timing import progress as progress_bar


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOP per byte at which the compute roof meets the bandwidth roof: ``peak / bandwidth``."""
    return positive_number("peak_flops", peak_flops) / positive_number("bandwidth", bandwidth)


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roof at ``intensity`` FLOP/byte: ``min(peak_flops, intensity * bandwidth)``."""
    intensity = positive_number("intensity", intensity)
    peak_flops = positive_number("peak_flops", peak_flops)
    bandwidth = positive_number("bandwidth", bandwidth)
    return min(peak_flops, intensity * bandwidth)


def matmul_bytes(m: int, k: int, n: int, dtype_bytes: float) -> float:
    """Bytes moved by ``C = A @ B`` with A ``(m, k)`` and B ``(k, n)``: A and B read once, C written once."""
    m, k, n = (positive_int(name, v) for name, v in (("m", m), ("k", k), ("n", n)))
    dtype_bytes = positive_number("dtype_bytes", dtype_bytes)
    return float(dtype_bytes * (m * k + k * n + m * n))


@answer
def matmul_intensity(m: int, k: int, n: int, dtype_bytes: float) -> float:
    """Arithmetic intensity of ``(m, k) @ (k, n)``: ``2*m*k*n`` FLOPs over :func:`matmul_bytes`."""
    return matmul_flops(m, k, n) / matmul_bytes(m, k, n, dtype_bytes)


def roofline_time(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    """Lower bound on the time of a kernel, in seconds: ``max(flops / peak, bytes / bandwidth)``."""
    return max(
        non_negative_number("flops", flops) / positive_number("peak_flops", peak_flops),
        non_negative_number("bytes_moved", bytes_moved) / positive_number("bandwidth", bandwidth),
    )


# --- measuring ---------------------------------------------------------------------------------


def _shape(size) -> tuple[int, int, int]:
    """``n`` means a square ``(n, n) @ (n, n)``; ``(m, k, n)`` means ``(m, k) @ (k, n)``."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        n = positive_int("size", size)
        return n, n, n
    if isinstance(size, (tuple, list)) and len(size) == 3:
        m, k, n = (positive_int(name, v) for name, v in zip(("m", "k", "n"), size))
        return m, k, n
    raise ValueError(
        f"each matmul size must be an int n (a square n x n @ n x n product) or a tuple (m, k, n), got {size!r}"
    )


def _sizes(sizes, what: str) -> list:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ValueError(f"{what} must be a list of sizes, got {sizes!r}")
    sizes = list(sizes)
    if not sizes:
        raise ValueError(f"{what} must contain at least one size, got an empty list")
    return sizes


def _device(device):
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda' or a torch.device, got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA GPU is available here; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


def _dtype(dtype):
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be a floating-point torch dtype such as torch.float32, torch.float16 or "
            f"torch.bfloat16, got {dtype!r}"
        )
    return dtype


def measure_matmul(sizes, dtype=None, device=None, *, progress: bool = True, **bench) -> list[float]:
    """Achieved FLOP/s of ``A @ B`` for each size, in the order given.

    Each size is an int ``n`` (square ``n x n`` matrices) or a tuple ``(m, k, n)`` for an
    ``(m, k) @ (k, n)`` product. FLOPs are counted as ``2*m*k*n``. ``dtype`` defaults to what the
    device's tensor cores take (:func:`labsupport.device.lab_dtype`: bfloat16 from Ampere on,
    float16 before) on a GPU, and float32 on a CPU; ``device`` defaults to :func:`labsupport.device.device`.
    Extra keyword arguments go to :func:`labsupport.timing.benchmark` (``repeats=``, ...). A
    point whose timing is unstable (a busy machine; :attr:`labsupport.timing.Timing.unstable`)
    prints a warning line.
    """
    shapes = [_shape(s) for s in _sizes(sizes, "sizes")]
    dev = _device(device)
    if dtype is None:
        dtype = lab_dtype() if dev.type == "cuda" else torch.float32
    dtype = _dtype(dtype)

    def rate(m: int, k: int, n: int) -> float:  # the operands are freed when it returns
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        timing = benchmark(lambda: a @ b, gpu=dev.type == "cuda", **bench)
        if timing.unstable:  # say so on screen: a median from a busy machine is not a ceiling
            print(f"matmul ({m}, {k}) @ ({k}, {n}): {timing.warning()}")
        return matmul_flops(m, k, n) / timing.median_s

    return [rate(m, k, n) for m, k, n in progress_bar(shapes, "matmul", progress)]


def measure_copy(sizes_bytes, device=None, *, progress: bool = True, **bench) -> list[float]:
    """Achieved bandwidth in bytes/s of ``dst.copy_(src)`` for each buffer size in bytes.

    A copy of ``b`` bytes reads ``b`` and writes ``b``, so it is credited with ``2*b`` bytes moved.
    Extra keyword arguments go to :func:`labsupport.timing.benchmark`; an unstable point prints a
    warning line.
    """
    sizes = [positive_int("size in bytes", s) for s in _sizes(sizes_bytes, "sizes_bytes")]
    dev = _device(device)

    def rate(size: int) -> float:  # the buffers are freed when it returns
        src = torch.empty(size, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        timing = benchmark(lambda: dst.copy_(src), gpu=dev.type == "cuda", **bench)
        if timing.unstable:
            print(f"copy of {size / 2**20:g} MiB: {timing.warning()}")
        return 2 * size / timing.median_s

    return [rate(size) for size in progress_bar(sizes, "copy", progress)]


# --- drawing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RooflinePoint:
    """A kernel placed on the roofline: its intensity and, if measured, its achieved FLOP/s."""

    label: str
    intensity: float
    flops: float | None = None  # achieved FLOP/s; None places the point on the measured roof


def _points(points) -> list[RooflinePoint]:
    if points is None:
        return []
    if isinstance(points, dict):
        points = [
            (label, *(value if isinstance(value, (tuple, list)) else (value,)))
            for label, value in points.items()
        ]
    out = []
    for p in points:
        if isinstance(p, RooflinePoint):
            out.append(p)
            continue
        if not isinstance(p, (tuple, list)) or len(p) not in (2, 3):
            raise ValueError(
                f"each point must be a RooflinePoint or a tuple (label, intensity) or "
                f"(label, intensity, achieved_flops), got {p!r}"
            )
        label, intensity, *rest = p
        flops = rest[0] if rest else None
        out.append(
            RooflinePoint(
                str(label),
                positive_number(f"intensity of point {label!r}", intensity),
                None if flops is None else positive_number(f"achieved FLOP/s of point {label!r}", flops),
            )
        )
    return out


def _pretty_flops(value: float) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}FLOP/s"
    return f"{value:.3g} FLOP/s"


def _pretty_bandwidth(value: float) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}B/s"
    return f"{value:.3g} B/s"


def plot_roofline(
    ax,
    peak_flops: float,
    bandwidth: float,
    points: Sequence | dict | None = None,
    published=None,
    *,
    label: str = "measured",
    intensity_range: tuple[float, float] | None = None,
):
    """Draw a roofline on the matplotlib axes ``ax`` and return ``ax``.

    ``peak_flops`` (FLOP/s) and ``bandwidth`` (bytes/s) give the solid roof, usually your
    measured values. ``published`` (a :class:`labsupport.hardware.GPU` or a GPU name, or None) adds its
    datasheet roof dashed, so measured and published can be compared side by side. ``points``
    are kernels to place: a list of ``(label, intensity)`` or ``(label, intensity,
    achieved_flops)`` tuples, :class:`RooflinePoint` objects, or a dict ``{label: intensity}``
    / ``{label: (intensity, achieved_flops)}``. A point without achieved FLOP/s is drawn on the
    solid roof (what the roof allows); one with it is drawn where it was measured.
    Both axes are logarithmic; ridge points are marked with dotted vertical lines.
    """
    peak_flops = positive_number("peak_flops", peak_flops)
    bandwidth = positive_number("bandwidth", bandwidth)
    if not hasattr(ax, "loglog"):
        raise ValueError(
            f"ax must be a matplotlib Axes (for example from plt.subplots()), got {type(ax).__name__}"
        )
    published = None if published is None else as_gpu(published)  # a GPU or a GPU name
    pts = _points(points)

    roofs = [(label, peak_flops, bandwidth, "-", "C0")]
    if published is not None:
        roofs.append(
            (f"{published.name} datasheet", published.peak_flops, published.hbm_bandwidth, "--", "0.35")
        )
    ridges = [peak / bw for _, peak, bw, _, _ in roofs]

    if intensity_range is None:
        xs = ridges + [p.intensity for p in pts]
        lo, hi = min(xs) / 8, max(xs) * 8
    else:
        lo, hi = (positive_number("intensity_range", v) for v in intensity_range)
        if not lo < hi:
            raise ValueError(f"intensity_range must be (low, high) with low < high, got {intensity_range!r}")
    x = np.geomspace(lo, hi, 256)

    for (name, peak, bw, style, color), ridge in zip(roofs, ridges):
        text = f"{name}: {_pretty_flops(peak)}, {_pretty_bandwidth(bw)}, ridge {ridge:,.3g} FLOP/B"
        ax.plot(x, np.minimum(peak, x * bw), style, color=color, lw=2, label=text)
        ax.axvline(ridge, ls=":", color=color, lw=1)

    for i, p in enumerate(pts):
        y = p.flops if p.flops is not None else min(peak_flops, p.intensity * bandwidth)
        marker = "o" if p.flops is not None else "D"
        ax.plot([p.intensity], [y], marker, color=f"C{(i + 1) % 10}", ms=7, zorder=5)
        ax.annotate(p.label, (p.intensity, y), textcoords="offset points", xytext=(6, -12), fontsize=8)

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP per byte)")
    ax.set_ylabel("FLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return ax
