"""Rotary position embeddings (RoPE): frequencies, the two layouts, context extension.

Chapter 08 explains all of it. RoPE (Su et al., 2021, "RoFormer") rotates each pair of a
query's or key's features by an angle proportional to the token's position, so that the dot
product of a query at position ``m`` with a key at ``n`` depends on ``m - n`` only.

Conventions used throughout:

* ``head_dim`` is ``D`` (even); a head has ``D / 2`` pairs, pair ``i`` turning at the inverse
  frequency ``theta ** (-2 i / D)`` radians per position (pair 0 fastest).
* Two **layouts** place a pair's two features differently in the head vector:
  ``"halves"`` pairs feature ``i`` with ``i + D/2`` (Hugging Face's Llama, and the course
  model), ``"interleaved"`` pairs ``2i`` with ``2i + 1`` (Meta's original Llama code, GPT-J,
  RoFormer). They compute the same thing on weights permuted by :func:`interleaved_to_halves`.
* Angles are computed in float32 (``positions * inv_freq``), as Hugging Face and Meta do, and
  the rotation is applied in float32 before the result is cast back to the input's dtype (as
  Meta's reference does; Hugging Face's Llama rounds cos and sin to the model's dtype first).
* ``scaling`` is a Hugging Face ``rope_scaling`` dict as found in a model's ``config.json``
  (``{"rope_type": "llama3", "factor": 8.0, ...}``); ``None`` means no scaling.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from ._answers import answer
from ._validate import positive_int, positive_number

ROFORMER_THETA = 10_000.0  # Su et al. 2021, the base of the original sinusoidal and rotary embeddings
LLAMA3_THETA = 500_000.0  # rope_theta in the config.json of every Llama 3 and 3.1 model
# rope_scaling in the config.json of meta-llama/Llama-3.1-8B (and -70B, -405B) on the Hugging Face Hub
LLAMA31_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31_MAX_POSITIONS = 131_072  # max_position_embeddings in the same config.json
LAYOUTS = ("halves", "interleaved")
ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# --- arguments ---------------------------------------------------------------------------------


def _head_dim(head_dim) -> int:
    head_dim = positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs of features), got {head_dim}")
    return head_dim


def _layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _rope_type(scaling: Mapping) -> str:
    # config.json files written before transformers 4.43 spell the key "type"
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        raise ValueError(f"rope_scaling {dict(scaling)!r} names no rope_type; expected one of {ROPE_TYPES}")
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported here; supported: {', '.join(ROPE_TYPES)} "
            f"(chapter 08 describes the others, such as NTK-aware scaling and YaRN, in prose)"
        )
    return kind


def _scaling_number(scaling: Mapping, key: str) -> float:
    if key not in scaling:
        raise ValueError(f"rope_scaling of type {_rope_type(scaling)!r} needs {key!r}; got keys {sorted(scaling)}")
    value = scaling[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"rope_scaling[{key!r}] must be a positive number, got {value!r}")
    return float(value)


# --- frequencies -------------------------------------------------------------------------------


@answer
def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoFormer's inverse frequencies ``theta ** (-2i / D)`` for ``i = 0 .. D/2 - 1``: (D/2,) float32,
    computed as Hugging Face does (in float32), so the course model matches it bit for bit. Part of
    the course's answer to lab 08's exercise 1 (banned inside that check)."""
    head_dim = _head_dim(head_dim)
    theta = positive_number("theta", theta)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # (D/2,) = 2i / D
    return 1.0 / (theta ** exponent)


@answer
def llama3_inv_freq(head_dim: int, theta: float, scaling: Mapping) -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies (D/2,) float32, the course's answer to lab 08's
    exercise 3.

    With ``L = original_max_position_embeddings`` (8,192 for Llama 3.1), each pair's wavelength
    ``2 pi / inv_freq`` decides: shorter than ``L / high_freq_factor``, the pair is kept; longer
    than ``L / low_freq_factor``, its frequency is divided by ``factor``; in between, it is
    interpolated linearly in ``L / wavelength`` between the two. Meta's ``apply_scaling``
    (llama-models) and transformers' ``_compute_llama3_parameters`` compute the same.
    """
    factor = _scaling_number(scaling, "factor")
    low = _scaling_number(scaling, "low_freq_factor")
    high = _scaling_number(scaling, "high_freq_factor")
    original = _scaling_number(scaling, "original_max_position_embeddings")
    if not high > low:
        raise ValueError(f"rope_scaling needs high_freq_factor > low_freq_factor, got {high} and {low}")
    inv_freq = default_inv_freq.__wrapped__(head_dim, theta)
    wavelength = 2 * math.pi / inv_freq  # (D/2,) positions per full turn
    low_freq_wavelength = original / low  # longer than this: slowed down by `factor`
    high_freq_wavelength = original / high  # shorter than this: left alone
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)  # 0 at the low end, 1 at the high end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping | None = None) -> torch.Tensor:
    """The inverse frequencies (D/2,) float32 a model with this ``rope_theta`` and ``rope_scaling``
    rotates by: ``positions * rope_inv_freq(...)`` are the angles. Chapter 08.

    ``scaling`` is the ``rope_scaling`` dict of a Hugging Face ``config.json`` or None. Supported
    ``rope_type`` values: ``"default"`` (no scaling), ``"linear"`` (position interpolation: every
    frequency divided by ``factor``) and ``"llama3"`` (:func:`llama3_inv_freq`). Any other type is
    a ValueError.
    """
    head_dim = _head_dim(head_dim)
    theta = positive_number("theta", theta)
    # the answers' own functions, so that a learner's RoPE calling this is refused by the check
    if scaling is None:
        return default_inv_freq.__wrapped__(head_dim, theta)
    if not isinstance(scaling, Mapping):
        raise ValueError(f"scaling must be a rope_scaling dict or None, got {type(scaling).__name__}")
    kind = _rope_type(scaling)
    if kind == "default":
        return default_inv_freq.__wrapped__(head_dim, theta)
    if kind == "linear":
        return default_inv_freq.__wrapped__(head_dim, theta) / _scaling_number(scaling, "factor")
    return llama3_inv_freq.__wrapped__(head_dim, theta, scaling)


def rope_wavelengths(head_dim: int, theta: float, scaling: Mapping | None = None) -> torch.Tensor:
    """Positions per full turn of each pair, ``2 pi / inv_freq``: (D/2,) float64, shortest first."""
    return 2 * math.pi / rope_inv_freq(head_dim, theta, scaling).double()


def ntk_aware_theta(theta: float, factor: float, head_dim: int) -> float:
    """NTK-aware scaling's new base (bloc97, 2023): ``theta * factor ** (D / (D - 2))``, which
    stretches the slowest pair's wavelength by exactly ``factor`` and leaves the fastest (pair 0,
    one radian per position) unchanged."""
    head_dim = _head_dim(head_dim)
    theta, factor = positive_number("theta", theta), positive_number("factor", factor)
    return theta * factor ** (head_dim / (head_dim - 2))


# --- rotating ----------------------------------------------------------------------------------


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions[:, None] * inv_freq[None, :]``, each (S, D/2) float32."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    return angles.cos(), angles.sin()


def _pairs(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members of every pair, each (..., D/2)."""
    if layout == "halves":
        half = x.shape[-1] // 2
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def _unpairs(a: torch.Tensor, b: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "halves":
        return torch.cat([a, b], dim=-1)
    return torch.stack([a, b], dim=-1).flatten(-2)  # (..., D/2, 2) -> (..., D): a0 b0 a1 b1 ...


@answer
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "halves") -> torch.Tensor:
    """Rotate every pair of ``x`` (..., S, D) by the angles whose cos and sin are (S, D/2) (or any shape
    that broadcasts against (..., S, D/2), such as (B, 1, S, D/2) for positions per sequence); in float32,
    returned in ``x.dtype``. The core of the course's answer to lab 08's exercises 1 and 3 (banned
    inside those checks)."""
    layout = _layout(layout)
    a, b = _pairs(x.float(), layout)
    return _unpairs(a * cos - b * sin, a * sin + b * cos, layout).to(x.dtype)


@answer
def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float = LLAMA3_THETA,
                         layout: str = "halves") -> torch.Tensor:
    """RoPE of ``x`` (..., S, D) at ``positions`` (S,), in either layout: the course's answer to
    lab 08's exercise 1 (and the spec of exercise 4). Angles and rotation in float32; the result
    in ``x.dtype``."""
    if x.dim() < 2 or positions.dim() != 1 or positions.shape[0] != x.shape[-2]:
        raise ValueError(
            f"x must be (..., S, D) and positions (S,); got x {tuple(x.shape)} and positions {tuple(positions.shape)}"
        )
    cos, sin = rope_cos_sin(positions, default_inv_freq.__wrapped__(x.shape[-1], theta).to(x.device))
    return rotate.__wrapped__(x, cos, sin, layout)


def rope_with_inv_freq(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                       layout: str = "halves") -> torch.Tensor:
    """RoPE of ``x`` (..., S, D) at ``positions`` (S,) with given inverse frequencies (D/2,)."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    return rotate.__wrapped__(x, cos, sin, layout)


# --- converting weights between the layouts ----------------------------------------------------


def halves_order(head_dim: int) -> torch.Tensor:
    """The index that turns an interleaved head vector into the halves layout:
    ``x_halves = x_interleaved[..., halves_order(D)]`` = ``[0, 2, 4, ..., 1, 3, 5, ...]``."""
    head_dim = _head_dim(head_dim)
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a query or key projection ``weight`` (n_heads * D, d_model) from
    Meta's interleaved layout to the halves layout, head by head. This is the ``permute`` of
    transformers' ``convert_llama_weights_to_hf.py``; queries and keys both get it (the scores
    are unchanged, since both sides are permuted alike), values and the output projection do not."""
    n_heads = positive_int("n_heads", n_heads)
    rows, cols = weight.shape
    if rows % (2 * n_heads):
        raise ValueError(f"weight has {rows} rows, not a multiple of 2 * n_heads = {2 * n_heads}")
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_halves`."""
    n_heads = positive_int("n_heads", n_heads)
    rows, cols = weight.shape
    if rows % (2 * n_heads):
        raise ValueError(f"weight has {rows} rows, not a multiple of 2 * n_heads = {2 * n_heads}")
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# --- the score depends on the distance only -----------------------------------------------------


def score_drift(head_dim: int = 128, theta: float = LLAMA3_THETA, distance: int = 16,
                starts=(0, 1_000, 10_000, 100_000), dtype: torch.dtype = torch.float32,
                pairs: int = 256, seed: int = 0) -> list[tuple[int, float]]:
    """How far the score of a query and a key ``distance`` apart moves as both slide along.

    ``pairs`` random unit-variance queries and keys of ``head_dim`` features, in ``dtype``, are
    rotated to positions ``start + distance`` and ``start`` (angles in float32, each rotated
    vector cast to ``dtype``), and their scores ``q.k / sqrt(D)`` (summed in float32) compared with
    the same pairs at positions ``distance`` and 0. Returns ``[(start, largest |difference|), ...]``
    over the pairs; the scores themselves have a standard deviation near 1. In exact arithmetic
    every difference is 0: float32 leaves the rounding of the angle ``position * inv_freq``, and a
    16-bit dtype adds the rounding of the rotated vectors.
    """
    head_dim = _head_dim(head_dim)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(pairs, 1, head_dim, generator=gen).to(dtype)  # (N, S=1, D)
    k = torch.randn(pairs, 1, head_dim, generator=gen).to(dtype)
    inv_freq = default_inv_freq.__wrapped__(head_dim, theta)

    def scores(m: int, n: int) -> torch.Tensor:
        qm = rope_with_inv_freq(q, torch.tensor([m]), inv_freq)  # (N, 1, D) in dtype
        kn = rope_with_inv_freq(k, torch.tensor([n]), inv_freq)
        return (qm.float() * kn.float()).sum(dim=(-2, -1)) / math.sqrt(head_dim)  # (N,)

    base = scores(distance, 0)
    return [(int(s), float((scores(s + distance, s) - base).abs().max())) for s in starts]


# --- bytes ---------------------------------------------------------------------------------------


def rope_kernel_bytes(batch: int, n_heads: int, n_kv_heads: int, seq_len: int, head_dim: int,
                      dtype_bytes: int, programs: int = 0, position_dtype_bytes: int = 8,
                      inv_freq_dtype_bytes: int = 4) -> int:
    """Bytes a fused RoPE kernel for q (B, H, S, D) and k (B, Hkv, S, D) moves: every element of q
    and k read once and written once, the (B * S,) positions (one per token) read once each (of
    ``position_dtype_bytes``; 0 leaves them out), and the D/2 inverse frequencies read once by each
    of ``programs`` programs (0 leaves them out: a kernel that computes them from theta reads none).
    A kernel that loads anything twice moves more. Chapter 08 compares it with the bytes counted in
    the interpreter (:mod:`labsupport.interpreter_bytes`), which counts lanes, not distinct
    addresses."""
    for name, value in (("batch", batch), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads),
                        ("seq_len", seq_len), ("dtype_bytes", dtype_bytes)):
        positive_int(name, value)
    head_dim = _head_dim(head_dim)
    positive_int("programs", programs, allow_zero=True)
    elements = batch * (n_heads + n_kv_heads) * seq_len * head_dim
    return (2 * elements * dtype_bytes + batch * seq_len * position_dtype_bytes
            + programs * (head_dim // 2) * inv_freq_dtype_bytes)
