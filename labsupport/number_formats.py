"""Number formats for weights, activations and caches: their bits, range and spacing, and FP8 casts.

Chapter 09 explains them. Every figure is read from torch where torch has the format
(``torch.finfo``, ``torch.iinfo``, including the FP8 dtypes ``torch.float8_e4m3fn`` and
``torch.float8_e5m2``); tf32 and int4 have no torch dtype, so their figures are computed from their
definitions (:data:`TF32` and :data:`INT4`), and the table says so.

Conventions: ``max`` is the largest finite value; ``smallest_normal`` the smallest positive normal
value; ``eps`` is ``torch.finfo``'s: the gap between 1 and the next larger representable value,
``2**-mantissa_bits``, which is also the spacing (one ulp) of every number in ``[1, 2)``; round to
nearest errs by at most half of it relative to the value (the "unit roundoff", ``eps / 2``). For
the integer formats the spacing is 1. ``mantissa_bits`` counts the stored fraction bits, not the
implicit leading 1. ``has_inf`` says whether the format can hold an infinity, read from torch by
casting ``inf`` (``float8_e4m3fn`` cannot: "fn" is finite, with NaN, which is how it reaches 448
instead of the 240 an IEEE-style E4M3 would).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NumberFormat:
    """One row of the chapter's format table."""

    name: str
    bits: int  # storage bits per element
    exponent_bits: int  # 0 for integers
    mantissa_bits: int  # stored fraction bits (0 for integers)
    max: float  # largest finite value
    min: float  # most negative finite value
    smallest_normal: float  # smallest positive normal (1 for integers)
    eps: float  # spacing just above 1 (1 for integers)
    source: str  # where the figures come from
    has_inf: bool = True  # can hold +-infinity (False for float8_e4m3fn and the integers)

    @property
    def relative_rounding_error(self) -> float:
        """Largest relative error of rounding to nearest, ``eps / 2`` (floats, normal range)."""
        return self.eps / 2

    @property
    def is_float(self) -> bool:
        return self.exponent_bits > 0


def _float_format(name: str, dtype: torch.dtype) -> NumberFormat:
    info = torch.finfo(dtype)
    mantissa = round(-torch.log2(torch.tensor(info.eps, dtype=torch.float64)).item())
    has_inf = bool(torch.isinf(torch.tensor([float("inf")]).to(dtype).float()).item())
    return NumberFormat(name, info.bits, info.bits - 1 - mantissa, mantissa, float(info.max), float(info.min),
                        float(info.smallest_normal), float(info.eps), f"torch.finfo({dtype})", has_inf)


def _int_format(name: str, dtype: torch.dtype) -> NumberFormat:
    info = torch.iinfo(dtype)
    return NumberFormat(name, info.bits, 0, 0, float(info.max), float(info.min), 1.0, 1.0, f"torch.iinfo({dtype})",
                        has_inf=False)


def _tf32() -> NumberFormat:
    """TensorFloat-32 (NVIDIA, from Ampere on): fp32's 8 exponent bits with 10 mantissa bits, 19 bits
    in all, held in 32-bit registers. Not a torch dtype: computed from that definition."""
    exponent, mantissa = 8, 10
    bias = 2 ** (exponent - 1) - 1
    largest = (2 - 2.0**-mantissa) * 2.0**bias
    return NumberFormat("tf32", 1 + exponent + mantissa, exponent, mantissa, largest, -largest,
                        2.0 ** (1 - bias), 2.0**-mantissa, "computed: 1 sign, 8 exponent, 10 mantissa bits")


def _int4() -> NumberFormat:
    """Signed 4-bit two's complement, -8 to 7. Not a torch dtype: computed from that definition."""
    bits = 4
    return NumberFormat("int4", bits, 0, 0, float(2 ** (bits - 1) - 1), float(-(2 ** (bits - 1))), 1.0, 1.0,
                        "computed: 4-bit two's complement", has_inf=False)


TF32 = _tf32()
INT4 = _int4()


def number_formats() -> list[NumberFormat]:
    """The formats chapter 09 compares, widest first: fp32, tf32, bf16, fp16, fp8 E4M3 and E5M2,
    int8, int4."""
    return [
        _float_format("fp32", torch.float32),
        TF32,
        _float_format("bf16", torch.bfloat16),
        _float_format("fp16", torch.float16),
        _float_format("fp8 E4M3", torch.float8_e4m3fn),
        _float_format("fp8 E5M2", torch.float8_e5m2),
        _int_format("int8", torch.int8),
        INT4,
    ]


def get_format(name: str) -> NumberFormat:
    """One format of :func:`number_formats` by name (``"bf16"``, ``"fp8 E4M3"``, ``"int4"``...)."""
    formats = {f.name.lower(): f for f in number_formats()}
    key = str(name).strip().lower()
    if key not in formats:
        raise ValueError(f"unknown format {name!r}; accepted: {', '.join(f.name for f in number_formats())}")
    return formats[key]


def format_table_markdown() -> str:
    """The formats as a Markdown table (the book glues it)."""
    lines = ["| format | bits | exponent | mantissa | largest | smallest normal | spacing at 1 (eps) | infinities "
             "| from |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in number_formats():
        inf = "yes" if f.has_inf else "no"
        if f.is_float:
            lines.append(f"| {f.name} | {f.bits} | {f.exponent_bits} | {f.mantissa_bits} | {_exact(f.max)} "
                         f"| {f.smallest_normal:.3g} | {f.eps:.3g} | {inf} | {f.source} |")
        else:
            lines.append(f"| {f.name} | {f.bits} | - | - | {f.max:.0f} (min {f.min:.0f}) | - | 1 | {inf} "
                         f"| {f.source} |")
    return "\n".join(lines)


def _exact(value: float) -> str:
    """A format's largest value: exact when it is a whole number below a million (448, 57,344,
    65,504), else four significant figures."""
    return f"{value:,.0f}" if value < 1e6 and value == int(value) else f"{value:.4g}"


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back to float32 (round to nearest even, as torch casts)."""
    return x.to(dtype).to(torch.float32)


def relative_rounding_error(x: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest ``|round(x) - x| / |x|`` over the non-zero elements of ``x`` after rounding to ``dtype``."""
    x = x.float()
    nonzero = x != 0
    err = (round_to(x, dtype) - x).abs()[nonzero] / x.abs()[nonzero]
    return float(err.max()) if err.numel() else 0.0


# --- FP8 ------------------------------------------------------------------------------------------

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8Result:
    """A tensor cast to FP8 and back: what was lost."""

    values: torch.Tensor  # the dequantised float32 values (scale applied back)
    scale: float  # x was divided by this before the cast (1.0 when unscaled)
    saturated: int  # elements clamped to the format's largest magnitude
    flushed: int  # non-zero elements that became exactly 0 (underflow)
    max_abs_error: float
    mean_relative_error: float  # over the non-zero elements


def to_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, scaled: bool = True) -> Fp8Result:
    """Cast ``x`` to an FP8 ``dtype`` and back, per tensor.

    ``scaled=True`` divides by ``scale = amax(|x|) / max(dtype)`` first, so the largest magnitude
    lands on the format's largest value (the per-tensor scaling FP8 recipes use). Values beyond the
    format's range are clamped to ``+-max`` before the cast in both modes: torch's own cast does not
    behave the same way in every version (see :func:`torch_cast_of`), so the course states its rule.
    """
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x must be a floating-point torch.Tensor")
    xf = x.float()
    top = torch.finfo(dtype).max
    amax = float(xf.abs().max()) if xf.numel() else 0.0
    scale = amax / top if scaled and amax > 0 else 1.0
    y = xf / scale
    saturated = int((y.abs() > top * (1 + 2**-20)).sum())  # not the amax itself, rounded in the division
    y8 = y.clamp(-top, top).to(dtype)
    back = y8.float() * scale
    flushed = int(((back == 0) & (xf != 0)).sum())
    nonzero = xf != 0
    rel = ((back - xf).abs()[nonzero] / xf.abs()[nonzero]).mean() if bool(nonzero.any()) else torch.tensor(0.0)
    return Fp8Result(back, scale, saturated, flushed, float((back - xf).abs().max()), float(rel))


def torch_cast_of(value: float, dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """What this torch's plain ``.to(dtype)`` makes of ``value`` (saturate, NaN or inf: it has varied)."""
    return float(torch.tensor([value], dtype=torch.float32).to(dtype).float())
