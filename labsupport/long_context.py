"""Long-context RoPE as engines serve it: YaRN and LongRoPE (chapter 08).

Both rules stretch a model's rotary frequencies so that positions beyond the context it was trained
on land on angles it has seen, and both scale the rotated queries and keys by an **attention
factor** (the cosines and sines are multiplied by it, so every score ``q . k`` is multiplied by its
square). What differs is how the frequencies change, and when.

**YaRN** (Peng, Quesnelle, Fan and Shippole, arXiv:2309.00071, 2023; Hugging Face ``rope_type:
"yarn"``) sorts the pairs by how many turns they make within the original context ``L``. Pair ``i``
turns ``L / wavelength_i`` times. Pairs that turn more than ``beta_fast`` (32) times are kept;
pairs that turn fewer than ``beta_slow`` (1) times are interpolated, their frequency divided by the
factor ``s``; between them a linear **ramp** over the pair index blends the two. The boundaries are
the (fractional) pair indices where the number of turns is ``beta_fast`` and ``beta_slow``, rounded
outwards (``truncate``). The attention factor is ``0.1 * ln(s) + 1`` (the paper's
``sqrt(1 / t)``).

**LongRoPE** (Ding et al., arXiv:2402.13753, 2024; ``rope_type: "longrope"``, Phi-3) divides every
pair's frequency by its own factor, found by a search rather than a formula: a list of
``head_dim / 2`` **short factors** for sequences within the original context and one of **long
factors** beyond it, with the attention factor ``sqrt(1 + ln(s) / ln(L))``. Which list applies is
where engines differ. Hugging Face picks it from the current sequence length, so a sequence that
grows past ``L`` switches frequencies under keys already cached with the other list (the same
mismatch as dynamic NTK scaling, chapter 08). vLLM decides once, from the engine's
``max_model_len``: beyond ``L`` every position of every request uses the long factors.

**Static scaling on short inputs.** vLLM and SGLang apply YaRN's frequencies and factor at every
position, whatever the prompt's length (the cosines and sines are tabled once, when the model is
built). So a server started with YaRN for long contexts also changes every short request: its slow
pairs turn ``s`` times slower and its scores are sharpened. Qwen's model cards say so, and advise
adding ``rope_scaling`` only when long contexts are needed, with the smallest factor that covers
them. :func:`short_context_change` measures how far a score at a short distance moves.

:func:`yarn_inv_freq` and :func:`longrope_inv_freq` reproduce ``transformers``'
``ROPE_INIT_FUNCTIONS["yarn"]`` and ``["longrope"]`` (tested), and vLLM's
``YaRNScalingRotaryEmbedding`` and ``Phi3LongRoPEScaledRotaryEmbedding``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._validate import positive_int, positive_number
from .position import default_inv_freq, rope_cos_sin, rotate

__all__ = [
    "longrope_attention_factor",
    "longrope_inv_freq",
    "short_context_change",
    "yarn_attention_factor",
    "yarn_correction_range",
    "yarn_inv_freq",
    "yarn_ramp",
]


def _turns_dim(turns: float, head_dim: int, theta: float, original_max: int) -> float:
    """The (fractional) pair index whose wavelength fits ``turns`` times into ``original_max`` positions:
    pair ``i`` has wavelength ``2 pi theta**(2i / D)``, so ``i = D ln(L / (2 pi turns)) / (2 ln theta)``."""
    return head_dim * math.log(original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))


def yarn_correction_range(head_dim: int, theta: float, original_max: int, beta_fast: float = 32,
                          beta_slow: float = 1, truncate: bool = True) -> tuple[float, float]:
    """(low, high): pairs below ``low`` turn more than ``beta_fast`` times in the original context and
    are kept; pairs above ``high`` turn fewer than ``beta_slow`` times and are interpolated."""
    low = _turns_dim(beta_fast, head_dim, theta, original_max)
    high = _turns_dim(beta_slow, head_dim, theta, original_max)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def yarn_ramp(low: float, high: float, pairs: int) -> torch.Tensor:
    """YaRN's ramp over the pair index: 0 up to ``low``, 1 from ``high``, linear between (fp32)."""
    if low == high:
        high += 0.001  # as the reference implementations do, to avoid dividing by zero
    return torch.clamp((torch.arange(pairs, dtype=torch.float32) - low) / (high - low), 0, 1)


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(factor) + 1`` (1 for a factor of 1 or less): what YaRN multiplies the
    cosines and sines by, so the scores grow by its square."""
    factor = positive_number("factor", factor)
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(head_dim: int, theta: float, factor: float, original_max: int, *, beta_fast: float = 32,
                  beta_slow: float = 1, truncate: bool = True) -> torch.Tensor:
    """YaRN's frequencies, ``(head_dim / 2,)`` fp32 (module docstring): kept below the ramp,
    divided by ``factor`` above it, blended on it."""
    head_dim = positive_int("head_dim", head_dim)
    factor = positive_number("factor", factor)
    original_max = positive_int("original_max", original_max)
    pos_freqs = positive_number("theta", theta) ** (torch.arange(0, head_dim, 2).float() / head_dim)  # (D/2,)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)  # as transformers and vLLM compute them
    low, high = yarn_correction_range(head_dim, theta, original_max, beta_fast, beta_slow, truncate)
    keep = 1 - yarn_ramp(low, high, head_dim // 2)  # 1: keep the pair, 0: interpolate it
    return interpolated * (1 - keep) + extrapolated * keep  # in this order, as transformers and vLLM do


def longrope_attention_factor(factor: float, original_max: int) -> float:
    """``sqrt(1 + ln(factor) / ln(original_max))`` (1 for a factor of 1 or less)."""
    factor = positive_number("factor", factor)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(positive_int("original_max", original_max)))


def longrope_inv_freq(head_dim: int, theta: float, short_factor: Sequence[float], long_factor: Sequence[float], *,
                      original_max: int, seq_len: int | None = None, max_model_len: int | None = None) -> torch.Tensor:
    """LongRoPE's frequencies: every pair's default frequency divided by its factor, from the long
    list when the length that decides is beyond ``original_max``. Give ``seq_len`` for Hugging Face's
    choice (the current sequence) or ``max_model_len`` for vLLM's (the engine's limit, once)."""
    head_dim = positive_int("head_dim", head_dim)
    if (seq_len is None) == (max_model_len is None):
        raise ValueError("give seq_len (Hugging Face: the current length decides) or max_model_len (vLLM: the "
                         "engine's limit decides), not both")
    deciding = seq_len if seq_len is not None else max_model_len
    factors = long_factor if deciding > original_max else short_factor
    if len(factors) != head_dim // 2:
        raise ValueError(f"LongRoPE needs one factor per pair, {head_dim // 2}, got {len(factors)}")
    return default_inv_freq(head_dim, theta) / torch.tensor(list(factors), dtype=torch.float32)


def short_context_change(head_dim: int, theta: float, inv_freq: torch.Tensor, attention_factor: float, *,
                         distance: int = 8, pairs: int = 256, seed: int = 0) -> float:
    """How far scaled RoPE moves the score of a query and a key ``distance`` apart (at positions
    ``distance`` and 0: a short prompt) from plain RoPE's, relative to the scores' spread: the root
    mean square of the difference over ``pairs`` random unit-variance vectors, over the root mean
    square of plain RoPE's scores. The attention factor (applied to cos and sin, so squared in the
    score) is included: it is part of what a static rule changes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(pairs, head_dim, generator=gen)
    k = torch.randn(pairs, head_dim, generator=gen)
    plain = default_inv_freq(head_dim, theta)

    def scores(freq: torch.Tensor, scale: float) -> torch.Tensor:
        cos_q, sin_q = rope_cos_sin(torch.tensor([distance]), freq)
        cos_k, sin_k = rope_cos_sin(torch.tensor([0]), freq)
        qr = rotate(q, cos_q * scale, sin_q * scale)
        kr = rotate(k, cos_k * scale, sin_k * scale)
        return (qr * kr).sum(-1) / math.sqrt(head_dim)

    base = scores(plain, 1.0)
    changed = scores(inv_freq, attention_factor)
    return float((changed - base).pow(2).mean().sqrt() / base.pow(2).mean().sqrt())
