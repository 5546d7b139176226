"""How low-precision numbers are scaled: FP8 scales from per-tensor to blocks, MX formats, NVFP4 (chapter 09).

An FP8 E4M3 number reaches 448 and has 3 mantissa bits, so a tensor is stored as ``x / scale`` cast to
FP8 together with its ``scale`` (an fp32 number, or one per row, per block...). Everything below
**fake-quantises**: it returns ``dequantised(quantised(x))`` in fp32, the values a kernel computes
with, so that any two schemes can be compared on the same data with an fp32 matmul. The schemes:

* **per tensor**, one scale for the whole tensor: ``amax(|x|) / 448``. *Dynamic* computes it from
  the tensor itself at run time (an extra reduction over the activations before each matmul);
  *static* takes a scale calibrated beforehand on sample data (no reduction, but a value larger
  than the calibration saw is clipped to 448 times the scale).
* **per token x per channel** (vLLM's and torch's "rowwise"): one scale per row of the activations
  (a token) and one per output channel of the weight (a row of ``W`` in ``x @ W.T``); the matmul's
  result ``[i, j]`` is multiplied by ``scale_x[i] * scale_w[j]`` afterwards, so the kernel stays a
  plain FP8 matmul. ``torch._scaled_mm`` does exactly this on a GPU and, in torch 2.13, on a CPU
  (:func:`scaled_mm_rowwise`).
* **blocks** (DeepSeek-V3, arXiv:2412.19437, section 3.3): a scale per 1 x 128 tile of the
  activations (a token's 128 consecutive features) and per 128 x 128 block of the weights. A scale
  changes along the reduction dimension, so the kernel multiplies each 128-long partial sum by its
  two scales before adding it up (DeepSeek promotes those partial sums to fp32 at that interval).
* **MX formats** (OCP Microscaling Formats specification v1.0, 2023): blocks of 32 elements along
  the reduction share one 8-bit power-of-two scale (E8M0); the elements are FP8 (MXFP8), FP6 or FP4
  (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6). The scale is ``2**(floor(log2(amax)) - emax_elem)``, so the
  largest element lands in the element format's top binade.
* **NVFP4** (NVIDIA, Blackwell): blocks of 16 FP4 (E2M1) elements with an FP8 E4M3 scale each (not
  a power of two: finer), and one fp32 scale per tensor that brings the block scales into E4M3's
  range.

Storage per element, scales included (:func:`bits_per_element`): per-tensor FP8 8 bits; 1 x 128
tiles 8.25 (an fp32 scale per 128); 128 x 128 blocks about 8.002; MXFP8 8.25 and MXFP4 4.25 (an
8-bit scale per 32); NVFP4 4.5 (an 8-bit scale per 16), plus 32 bits per tensor.
"""

from __future__ import annotations

import torch

from .position import default_inv_freq, rope_cos_sin, rotate  # chapter 08's rotation

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "SCHEMES",
    "bits_per_element",
    "fake_quant",
    "matmul_error",
    "outlier_activations",
    "rope_key_quantization_errors",
    "round_e2m1",
    "scaled_mm_rowwise",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 E2M1's non-negative values
E2M1_MAX = 6.0
E4M3_EMAX, E2M1_EMAX = 8, 2  # exponent of the largest binade: 448 = 1.75 * 2**8, 6 = 1.5 * 2**2


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to E4M3's range, rounded to E4M3, and scaled back (fp32)."""
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(torch.float32) * scale


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP4 E2M1 value, ties to the even mantissa (as hardware rounds), saturating
    at +-6: fp32 in, fp32 out."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32)  # (8,)
    odd = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], dtype=torch.float32)  # mantissa bit of each value (0.5: subnormal, odd)
    dist = (x.abs().clamp(max=E2M1_MAX)[..., None] - grid).abs()  # (..., 8)
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    index = torch.where(nearest, odd, torch.full_like(dist, 2.0)).argmin(dim=-1)  # among the nearest, the even one
    return torch.sign(x) * grid[index]


def _blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(M, K) -> (M / rows, K / cols, rows, cols) views of the blocks (both sizes must divide)."""
    m, k = x.shape
    if m % rows or k % cols:
        raise ValueError(f"a ({m}, {k}) tensor does not split into blocks of {rows} x {cols}")
    return x.reshape(m // rows, rows, k // cols, cols).permute(0, 2, 1, 3)


def _unblocks(b: torch.Tensor) -> torch.Tensor:
    mb, kb, rows, cols = b.shape
    return b.permute(0, 2, 1, 3).reshape(mb * rows, kb * cols)


def _per_block_fp8(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    b = _blocks(x, rows, cols)
    scale = b.abs().amax(dim=(-2, -1), keepdim=True) / E4M3_MAX
    return _unblocks(_fp8(b, scale))


def _mx(x: torch.Tensor, element: str, block: int = 32) -> torch.Tensor:
    """OCP MX: blocks of ``block`` along the last dimension share an E8M0 (power of two) scale."""
    b = _blocks(x, 1, block)
    amax = b.abs().amax(dim=-1, keepdim=True)
    emax = E4M3_EMAX if element == "fp8_e4m3" else E2M1_EMAX
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - emax
    scale = torch.exp2(exponent.clamp(-127, 127))
    if element == "fp8_e4m3":
        q = (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(torch.float32)
    else:
        q = round_e2m1(b / scale)
    return _unblocks(q * scale)


def _nvfp4(x: torch.Tensor) -> torch.Tensor:
    """NVFP4: 16-element blocks of E2M1 with an E4M3 scale each, and one fp32 scale per tensor."""
    global_scale = x.abs().amax().clamp(min=torch.finfo(torch.float32).tiny) / (E4M3_MAX * E2M1_MAX)
    b = _blocks(x, 1, 16)
    block_scale = (b.abs().amax(dim=-1, keepdim=True) / E2M1_MAX / global_scale).clamp(max=E4M3_MAX)
    block_scale = block_scale.to(E4M3).to(torch.float32) * global_scale  # the block scale as stored, in E4M3
    return _unblocks(round_e2m1(b / block_scale.clamp(min=torch.finfo(torch.float32).tiny)) * block_scale)


SCHEMES = ("per_tensor_dynamic", "per_tensor_static", "per_token_channel", "blocks_deepseek", "mxfp8", "mxfp4",
           "nvfp4")


def fake_quant(x: torch.Tensor, scheme: str, *, role: str = "activation", static_scale: float | None = None) -> torch.Tensor:
    """``x`` (M, K), the reduction along K, quantised by ``scheme`` and dequantised (fp32). ``role`` is
    ``"activation"`` or ``"weight"`` (a weight is (N, K): an output channel per row); it matters for
    the block scheme (1 x 128 tiles for activations, 128 x 128 blocks for weights). ``static_scale``
    is the calibrated scale of ``per_tensor_static``."""
    x = x.to(torch.float32)
    if x.dim() != 2:
        raise ValueError(f"fake_quant takes a (rows, reduction) matrix, got shape {tuple(x.shape)}")
    if scheme == "per_tensor_dynamic":
        return _fp8(x, x.abs().amax() / E4M3_MAX)
    if scheme == "per_tensor_static":
        if static_scale is None:
            raise ValueError("per_tensor_static needs the calibrated static_scale")
        return _fp8(x, torch.tensor(float(static_scale)))
    if scheme == "per_token_channel":
        return _fp8(x, x.abs().amax(dim=1, keepdim=True) / E4M3_MAX)
    if scheme == "blocks_deepseek":
        return _per_block_fp8(x, 1, 128) if role == "activation" else _per_block_fp8(x, 128, 128)
    if scheme == "mxfp8":
        return _mx(x, "fp8_e4m3")
    if scheme == "mxfp4":
        return _mx(x, "fp4_e2m1")
    if scheme == "nvfp4":
        return _nvfp4(x)
    raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")


def bits_per_element(scheme: str, *, reduction: int = 4096, rows: int = 4096) -> float:
    """Storage bits per element, scales included, of a (rows, reduction) tensor (module docstring)."""
    n = rows * reduction
    return {
        "per_tensor_dynamic": 8 + 32 / n,
        "per_tensor_static": 8 + 32 / n,
        "per_token_channel": 8 + 32 / reduction,
        "blocks_activation": 8 + 32 / 128,
        "blocks_weight": 8 + 32 / (128 * 128),
        "mxfp8": 8 + 8 / 32,
        "mxfp4": 4 + 8 / 32,
        "nvfp4": 4 + 8 / 16 + 32 / n,
    }[scheme]


def matmul_error(x: torch.Tensor, w: torch.Tensor, scheme: str, *, static_scale: float | None = None) -> float:
    """Relative error (Frobenius) of ``x @ w.T`` with both sides fake-quantised by ``scheme`` (the
    static scale applies to the activations; the weights, known in advance, get a dynamic one)."""
    exact = x.double() @ w.double().T
    wq = fake_quant(w, "per_tensor_dynamic" if scheme == "per_tensor_static" else scheme, role="weight")
    xq = fake_quant(x, scheme, static_scale=static_scale)
    return float((xq.double() @ wq.double().T - exact).norm() / exact.norm())


def scaled_mm_rowwise(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x @ w.T`` in FP8 with per-token and per-channel scales through ``torch._scaled_mm`` (torch's
    private FP8 matmul: on a GPU with FP8 tensor cores, sm_89 and later, and in torch 2.13 on a CPU
    too). ``x`` (M, K), ``w`` (N, K)."""
    scale_x = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # (M, 1)
    scale_w = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # (N, 1)
    xq = (x.float() / scale_x).to(E4M3)
    wq = (w.float() / scale_w).to(E4M3)
    # _scaled_mm wants the second operand column-major: w.T of a row-major w is exactly that
    return torch._scaled_mm(xq, wq.T, scale_a=scale_x, scale_b=scale_w.T.contiguous(), out_dtype=out_dtype)


def outlier_activations(tokens: int = 256, features: int = 1024, outlier_channels: int = 4, magnitude: float = 60.0,
                        seed: int = 0) -> torch.Tensor:
    """Activations like an LLM's: unit-variance noise, with a few feature channels ``magnitude`` times
    larger in every token (the systematic outliers of LLM.int8(), Dettmers et al. 2022)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=gen)
    channels = torch.randperm(features, generator=gen)[:outlier_channels]
    x[:, channels] *= magnitude
    return x


def rope_key_quantization_errors(tokens: int = 512, head_dim: int = 128, theta: float = 5e5, bits: int = 4,
                                 outlier_pairs: int = 2, magnitude: float = 20.0, seed: int = 0) -> dict[str, dict]:
    """Keys with a few large channels (as KVQuant and KIVI observe in real models' keys), quantised
    to ``bits``-bit integers per channel (one scale per feature over the tokens, KVQuant's choice for
    keys) and to FP8 per tensor (vLLM's ``k_scale``), before and after RoPE. Returns relative errors of
    the rotated keys, ``{"per_channel_int": {"before": e, "after": e}, "per_tensor_fp8": {...}}``.

    Before RoPE a large channel is large at every position; RoPE turns each pair by an angle that
    grows with the position, so after it the pair's size is spread over both of its channels, in a
    proportion that changes with the position, and a per-channel scale must cover the largest: coarser
    for most tokens. A per-tensor scale does not see the difference."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(tokens, head_dim, generator=gen)
    half = head_dim // 2
    for p in torch.randperm(half, generator=gen)[:outlier_pairs]:
        keys[:, int(p)] = keys[:, int(p)] * 0.2 + magnitude  # channel p large and nearly constant; its partner p + D/2 not
    cos, sin = rope_cos_sin(torch.arange(tokens), default_inv_freq(head_dim, theta))
    rotated = rotate(keys, cos, sin)  # (tokens, D), halves layout

    def per_channel(x):
        q = 2 ** (bits - 1) - 1
        scale = x.abs().amax(dim=0, keepdim=True).clamp(min=1e-12) / q
        return (x / scale).round().clamp(-q, q) * scale

    def per_tensor(x):
        return _fp8(x, x.abs().amax() / E4M3_MAX)

    def err(approx):
        return float((approx - rotated).norm() / rotated.norm())

    return {
        "per_channel_int": {"before": err(rotate(per_channel(keys), cos, sin)), "after": err(per_channel(rotated))},
        "per_tensor_fp8": {"before": err(rotate(per_tensor(keys), cos, sin)), "after": err(per_tensor(rotated))},
    }
