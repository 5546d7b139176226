"""Quantising weights to integers: symmetric and asymmetric, per tensor, per channel and per group.

Chapter 09 explains it; lab 09 has the learner write :func:`quantize_groupwise` and
:func:`dequantize_groupwise`.

Conventions (the lab states them too):

* A weight matrix is ``(N, K)``: ``N`` output channels (rows, as ``nn.Linear.weight`` stores
  them), ``K`` input channels. Groups are ``group_size`` consecutive elements of one row (along
  ``K``); ``group_size == K`` is per channel. ``K`` must be a multiple of ``group_size``.
* Symmetric quantisation to ``bits`` bits uses the codes ``-qmax .. qmax`` with
  ``qmax = 2**(bits - 1) - 1`` (127 for int8, 7 for int4): ``scale = max|w| / qmax`` per group,
  ``q = clamp(round(w / scale), -qmax, qmax)``, ``w ~ q * scale``. Rounding is to nearest (ties to
  even, as ``torch.round``). An all-zero group gets scale 0 and codes 0. Scales are float32,
  shape ``(N, K // group_size)``.
* int8 codes are returned as an ``int8`` tensor ``(N, K)``. int4 codes are packed two to a byte in
  a ``uint8`` tensor ``(N, K // 2)``: element ``2j`` of a row in the low nibble (bits 0-3) of byte
  ``j``, element ``2j + 1`` in the high nibble (bits 4-7), each as a 4-bit two's complement
  (``-1`` is ``0xF``). Released formats differ: GPTQ packs eight unsigned codes (offset by a zero
  point) into an int32 in this order, AWQ interleaves them (elements 0, 2, 4, 6, 1, 3, 5, 7 from
  the low nibble up) and llama.cpp's Q4_0 stores code + 8 with elements 0-15 of a block in the
  low nibbles and 16-31 in the high ones; a kernel must know which layout it reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ._answers import answer
from ._validate import positive_int, positive_number

SUPPORTED_BITS = (4, 8)


def qmax(bits: int) -> int:
    """Largest code of symmetric ``bits``-bit quantisation: ``2**(bits - 1) - 1`` (127, 7)."""
    return 2 ** (positive_int("bits", bits) - 1) - 1


def _validate(w: torch.Tensor, bits: int, group_size: int) -> tuple[int, int]:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D floating-point tensor (N, K), got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    group_size = positive_int("group_size", group_size)
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K = {k} (w.shape[1]) must be a multiple of group_size = {group_size}")
    if bits == 4 and k % 2:
        raise ValueError(f"int4 packs two codes per byte: K = {k} must be even")
    return n, k


# --- int4 packing ---------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in ``-8..7``, ``(N, K)`` (K even) -> ``uint8`` ``(N, K // 2)``: even elements in the
    low nibble, odd elements in the high nibble, two's complement."""
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(f"codes must be (N, K) with K even, got {tuple(codes.shape)}")
    if bool(((codes < -8) | (codes > 7)).any()):
        raise ValueError("int4 codes must lie in -8..7")
    nibbles = codes.to(torch.int16) & 0xF  # two's complement in 4 bits
    low, high = nibbles[:, 0::2], nibbles[:, 1::2]
    return (low | (high << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8`` ``(N, K // 2)`` -> ``int8`` codes ``(N, K)``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    p = packed.to(torch.int16)
    low, high = p & 0xF, (p >> 4) & 0xF
    codes = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)  # (N, K): low nibble first
    return torch.where(codes >= 8, codes - 16, codes).to(torch.int8)  # sign-extend 4-bit two's complement


# --- the exercise's answers -----------------------------------------------------------------


@answer
def quantize_groupwise(w: torch.Tensor, bits: int = 8, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise quantisation of ``w`` (N, K): returns ``(codes, scales)``.

    ``codes`` is ``int8`` (N, K) for ``bits=8`` and packed ``uint8`` (N, K // 2) for ``bits=4``;
    ``scales`` is float32 (N, K // group_size). See the module docstring for the conventions.
    """
    n, k = _validate(w, bits, group_size)
    top = qmax(bits)
    groups = w.float().reshape(n, k // group_size, group_size)  # (N, G, group)
    scales = groups.abs().amax(dim=-1) / top  # (N, G): the group's largest magnitude maps to qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: codes 0
    codes = torch.round(groups / safe[..., None]).clamp(-top, top).reshape(n, k).to(torch.int8)
    return (pack_int4(codes) if bits == 4 else codes), scales


@answer
def dequantize_groupwise(codes: torch.Tensor, scales: torch.Tensor, bits: int = 8,
                         group_size: int = 128) -> torch.Tensor:
    """Inverse of :func:`quantize_groupwise`: float32 (N, K), each code times its group's scale."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    q = unpack_int4(codes) if bits == 4 else codes
    n, k = q.shape
    group_size = positive_int("group_size", group_size)
    if scales.shape != (n, k // group_size) or k % group_size:
        raise ValueError(f"scales must have shape (N, K // group_size) = ({n}, {k // group_size}), "
                         f"got {tuple(scales.shape)}")
    return (q.float().reshape(n, k // group_size, group_size) * scales.float()[..., None]).reshape(n, k)


# --- the error of each choice -----------------------------------------------------------------


def fake_quantize(w: torch.Tensor, bits: int = 8, group_size: int | str = "channel",
                  symmetric: bool = True) -> torch.Tensor:
    """``w`` (N, K) quantised and dequantised, float32: what the model sees after quantisation.

    ``group_size`` is a number, ``"channel"`` (one scale per row) or ``"tensor"`` (one scale for
    all of ``w``). Asymmetric quantisation maps ``[min, max]`` of each group onto ``0 .. 2**bits - 1``
    with ``scale = (max - min) / (2**bits - 1)`` and an integer zero point ``round(-min / scale)``,
    so that 0.0 is exactly a code. The range is widened to include 0 first (``min <= 0 <= max``, as
    GPTQ's quantiser does), which keeps the zero point within ``0 .. 2**bits - 1``, storable in
    ``bits`` bits. Rounding the zero point moves the grid by up to half a step, so the error stays
    within ``scale / 2`` at the ends of the range as inside it.
    """
    n, k = w.shape
    if group_size == "tensor":
        flat = w.float().reshape(1, n * k)
        return fake_quantize(flat, bits, n * k, symmetric).reshape(n, k)
    if group_size == "channel":
        group_size = k
    _validate(w, bits, group_size)
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        top = qmax(bits)
        scale = g.abs().amax(dim=-1, keepdim=True) / top
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out = torch.round(g / scale).clamp(-top, top) * scale
    else:
        levels = 2**bits - 1
        lo = g.amin(dim=-1, keepdim=True).clamp(max=0.0)  # 0 inside the range: the zero point is a code
        hi = g.amax(dim=-1, keepdim=True).clamp(min=0.0)
        scale = (hi - lo) / levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo / scale)
        out = (torch.round(g / scale + zero).clamp(0, levels) - zero) * scale
    return out.reshape(n, k)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius norms)."""
    exact = exact.float()
    return float((approx.float() - exact).norm() / exact.norm())


def outlier_weight(n: int = 256, k: int = 1024, outliers: int = 8, magnitude: float = 20.0,
                   seed: int = 0) -> torch.Tensor:
    """A seeded ``(N, K)`` matrix of N(0, 1) weights with ``outliers`` input channels (whole
    columns) scaled by ``magnitude``: the pattern that makes per-tensor and per-channel scales
    coarse for every other weight. Chapter 09 quantises it."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    cols = torch.randperm(k, generator=gen)[:outliers]
    w[:, cols] *= magnitude
    return w


def granularity_errors(w: torch.Tensor, bits: int, group_size: int = 128) -> dict[str, float]:
    """Relative error of symmetric and asymmetric quantisation per tensor, per channel and per group."""
    out = {}
    for label, gs in (("per tensor", "tensor"), ("per channel", "channel"), (f"per group of {group_size}", group_size)):
        for sym in (True, False):
            out[f"{label}, {'symmetric' if sym else 'asymmetric'}"] = relative_error(
                fake_quantize(w, bits, gs, sym), w)
    return out


def weight_dtype_bytes_with_scales(bits: int, group_size: int, scale_dtype_bytes: float = 2) -> float:
    """Bytes per weight once the scales are counted: ``bits / 8 + scale_dtype_bytes / group_size``
    (a 16-bit scale per group of 128 adds 1/64 of a byte). Feed it to
    :func:`labsupport.costs.decode_step_bytes` as ``weight_dtype_bytes``."""
    return positive_int("bits", bits) / 8 + scale_dtype_bytes / positive_int("group_size", group_size)


def projection_params(cfg) -> int:
    """Weights in the projections of every block (attention's q, k, v, o and the feed-forward's
    three matrices; biases excluded): what weight-only schemes quantise."""
    from .models import as_model

    cfg = as_model(cfg)
    d = cfg.d_model
    return cfg.n_layers * (2 * d * cfg.q_width + 2 * d * cfg.kv_width + 3 * d * cfg.d_ff)


def weight_only_bytes_per_param(cfg, bits: int, group_size: int = 128, scale_dtype_bytes: float = 2,
                                other_dtype_bytes: float = 2) -> float:
    """Bytes per parameter, averaged over the whole model, when the projections
    (:func:`projection_params`) are quantised to ``bits`` with a scale per ``group_size`` and
    everything else (embedding table, output head, norms, biases) stays at ``other_dtype_bytes``,
    as weight-only releases (GPTQ, AWQ) leave them. Feed it to
    :func:`labsupport.costs.decode_step_bytes` as ``weight_dtype_bytes``; chapter 09 does."""
    from .costs import param_count

    total, quantised = param_count(cfg), projection_params(cfg)
    other = positive_number("other_dtype_bytes", other_dtype_bytes)
    per_weight = weight_dtype_bytes_with_scales(bits, group_size, scale_dtype_bytes)
    return (quantised * per_weight + (total - quantised) * other) / total


# --- the course model, quantised ----------------------------------------------------------------


LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # every projection of every block


def quantize_model_weights(model: nn.Module, bits: int = 8, group_size: int | str = 128) -> nn.Module:
    """A copy of a :class:`labsupport.transformer.Transformer` whose projection weights (attention's
    q, k, v, o and the feed-forward's three) are replaced by their quantised-then-dequantised values
    (weight-only, symmetric, group-wise; ``group_size="channel"`` gives one scale per output channel).
    Embeddings, the output head and the norms stay as they
    are, as weight-only schemes usually leave them. The original is not changed."""
    quantised = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in quantised.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LINEAR_WEIGHTS:
                w = module.weight
                gs = w.shape[1] if group_size == "channel" else min(group_size, w.shape[1])
                if w.shape[1] % gs:
                    raise ValueError(f"{name}.weight has K = {w.shape[1]} inputs, not a multiple of group_size = "
                                     f"{gs}; pick a group size that divides every layer's width")
                codes, scales = quantize_groupwise(w.float(), bits, gs)
                module.weight.copy_(dequantize_groupwise(codes, scales, bits, gs).to(w.dtype))
    return quantised


@dataclass(frozen=True)
class Agreement:
    """How closely a quantised model's next-token distributions follow the reference's."""

    top1: float  # fraction of positions whose most likely token is the same
    kl_mean: float  # mean KL(reference || quantised), nats per position
    kl_max: float
    positions: int


def output_agreement(reference: nn.Module, other: nn.Module, prompts: torch.Tensor) -> Agreement:
    """Compare the next-token logits of two models on ``prompts`` (B, P): one position per prompt
    (the last), top-1 agreement and KL(reference || other) in nats, computed in float64."""
    with torch.no_grad():
        a = reference.forward_no_cache(prompts).double()  # (B, V)
        b = other.forward_no_cache(prompts).double()
    log_p, log_q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B,)
    top1 = (a.argmax(-1) == b.argmax(-1)).double().mean()
    return Agreement(float(top1), float(kl.mean()), float(kl.max()), int(a.shape[0]))


def logit_margin(model: nn.Module, prompts: torch.Tensor) -> float:
    """Median gap between the two largest logits: how easily a small perturbation flips top-1."""
    with torch.no_grad():
        top2 = model.forward_no_cache(prompts).topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).median())


def half_step_bound(scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-element bound on ``|dequantised - w|`` for round-to-nearest: half a step, ``scale / 2``,
    broadcast to (N, K)."""
    return (scales.float() / 2).repeat_interleave(group_size, dim=1)

