"""A weight-only int8 matmul for decode: 16-bit activations times int8 weights, dequantised in registers.

Chapter 09 explains it; lab 09 has the learner write the kernel; :mod:`labsupport.bench_precision`
times the course's kernel against a bf16 matmul on a GPU.

The operation is a linear layer, ``y = x @ W.T``, with ``W`` stored as int8 codes and scales:

* ``x``: ``(M, K)`` activations, float16, bfloat16 or float32 (``M`` is the batch of decode: 1-64);
* ``w_q``: ``(N, K)`` int8 codes, as :func:`labsupport.quantize.quantize_groupwise` returns them
  (``N`` output channels, rows as ``nn.Linear.weight``);
* ``scales``: ``(N, G)`` float32, one per group of ``K // G`` consecutive input channels of a
  row; ``G = 1`` is per channel;
* returns ``(M, N)`` in ``x``'s dtype: ``y[m, n] = sum_k x[m, k] * w_q[n, k] * scales[n, k // (K // G)]``.

The kernel reads each int8 weight once, turns it into the activations' dtype times its scale in
registers, and accumulates in float32: the weights cross memory at one byte each, which is the
whole point at decode, where a step reads every weight for a handful of rows of ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._answers import answer
from ._validate import positive_int, positive_number
from .device import interpreter_mode
from .interpreter_bytes import ByteCount, count_bytes

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def validate_int8_matmul_args(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    """Check the arguments' shapes and dtypes; return ``(M, N, K, group_size)`` or raise ValueError."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError("x must be a 2-D (M, K) tensor of float16, bfloat16 or float32")
    if not isinstance(w_q, torch.Tensor) or w_q.dim() != 2 or w_q.dtype != torch.int8:
        raise ValueError("w_q must be a 2-D (N, K) int8 tensor of codes")
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or not scales.is_floating_point():
        raise ValueError("scales must be a 2-D (N, G) floating-point tensor")
    m, k = x.shape
    n, k_w = w_q.shape
    if k_w != k:
        raise ValueError(f"x is (M, K) = {tuple(x.shape)} but w_q is (N, K) = {tuple(w_q.shape)}: the K differ")
    if scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        raise ValueError(f"scales must be (N, G) with N = {n} and G dividing K = {k}, got {tuple(scales.shape)}")
    return m, n, k, k // scales.shape[1]


@answer
def int8_matmul_spec(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The plain-torch definition: dequantise ``W`` in float32, ``x @ W.T`` in float32, cast to x's dtype."""
    m, n, k, group = validate_int8_matmul_args(x, w_q, scales)
    w = (w_q.float().reshape(n, k // group, group) * scales.float()[..., None]).reshape(n, k)  # (N, K)
    return (x.float() @ w.T).to(x.dtype)  # (M, N)


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def int8_matmul_config(m: int, n: int, k: int, group_size: int, *, interpreter: bool) -> MatmulConfig:
    """Tiles for :func:`int8_matmul_reference` (and the lab's kernel), without autotuning.

    ``BLOCK_K`` divides the group size, so every K tile lies inside one group and needs one scale
    per column. ``BLOCK_M`` is at least 16 (``tl.dot`` needs 16 on NVIDIA GPUs) and covers a
    decode batch up to 64 in one tile. In the interpreter, where a step costs about the same
    whatever its size, the tiles are large: few steps. No split over K: at batch 1 on a narrow
    layer, fewer programs than the GPU has multiprocessors leave bandwidth unused.
    """
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    small = not interpreter and m <= 16  # a decode batch of up to 16 rows on a GPU
    block_k = 1
    limit = 128 if interpreter or small else 64
    while block_k * 2 <= limit and group_size % (block_k * 2) == 0:
        block_k *= 2
    if block_k < 16:
        raise ValueError(f"group size {group_size} must be a multiple of 16 for this kernel")
    # Measured on an NVIDIA H200 (python -m labsupport.bench_precision --configs, 2026-11-30, groups of
    # 128): up to 16 rows, 32 columns, K tiles of 128 and 6 stages ran Llama 3.1 8B's up projection in
    # 33 us instead of 42 us (4 stages, K tiles of 64) and its down projection in 41 us instead of 80 us:
    # narrow column blocks give more programs to stream the weights (the down projection, N = 4,096,
    # is 128 programs at 32 columns), longer K tiles fewer loop steps. A stage is then x 16 x 128 in 16
    # bits plus W 128 x 32 in int8 (4 + 4 KiB): six fit the 64 KiB of shared memory of a T4 (compute
    # capability 7.5). Above 16 rows, 64 x 64 tiles and 4 stages (x 8 KiB + W 4 KiB a stage) stay as
    # they were, because they fit a T4: at batch 64 the H200 ran longer K tiles faster (the down
    # projection in 78 us instead of 149 us at 32 x 128 with 6 stages), but such stages (x 16 KiB
    # each) need more shared memory than a T4 has.
    if small:
        return MatmulConfig(block_m, 32, block_k, num_warps=4, num_stages=6)
    return MatmulConfig(block_m, 64, block_k, num_warps=4, num_stages=1 if interpreter else 4)


@triton.jit
def int8_matmul_kernel(
    x_ptr,  # (M, K) activations, contiguous
    w_ptr,  # (N, K) int8 codes, contiguous
    s_ptr,  # (N, G) float32 scales, contiguous
    out_ptr,  # (M, N) output, x's dtype
    M, N, K,
    GROUPS,  # G
    GROUP_SIZE,  # K // G
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE: one scale per column per K tile
    IEEE: tl.constexpr,  # float32 inputs: full-precision products, not tf32
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + (k0 + offs_k)[:, None],
                    mask=n_ok[None, :], other=0)  # (BLOCK_K, BLOCK_N) int8: W^T's tile
        scale = tl.load(s_ptr + offs_n * GROUPS + k0 // GROUP_SIZE, mask=n_ok, other=0.0)  # (BLOCK_N,)
        w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)  # dequantised in registers
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)  # 16-bit inputs, float32 accumulation
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@answer
def int8_matmul_reference(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The course's kernel: ``x @ dequantise(w_q, scales).T`` in one launch, (M, N) in x's dtype."""
    m, n, k, group = validate_int8_matmul_args(x, w_q, scales)
    x, w_q, scales = x.contiguous(), w_q.contiguous(), scales.float().contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = int8_matmul_config(m, n, k, group, interpreter=interpreter_mode())
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    int8_matmul_kernel[grid](x, w_q, scales, out, m, n, k, scales.shape[1], group,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# --- bytes -------------------------------------------------------------------------------------


def int8_matmul_bytes(m: int, n: int, k: int, groups: int = 1, act_dtype_bytes: float = 2,
                      scale_dtype_bytes: float = 4) -> int:
    """Bytes the weight-only kernel must move at least: ``x`` read once, each int8 weight once,
    ``N * G`` scales, ``y`` written once (the formula; each tile of ``x`` is re-read by every
    column block, from cache on a GPU)."""
    m, n, k, groups = (positive_int(a, v) for a, v in (("m", m), ("n", n), ("k", k), ("groups", groups)))
    act = positive_number("act_dtype_bytes", act_dtype_bytes)
    return int(m * k * act + n * k * 1 + n * groups * scale_dtype_bytes + m * n * act)


def dense_matmul_bytes(m: int, n: int, k: int, dtype_bytes: float = 2) -> int:
    """Bytes a dense ``(M, K) @ (K, N)`` matmul in one dtype moves at least: both inputs read once,
    the output written once."""
    m, n, k = (positive_int(a, v) for a, v in (("m", m), ("n", n), ("k", k)))
    b = positive_number("dtype_bytes", dtype_bytes)
    return int((m * k + n * k + m * n) * b)


def bytes_ratio(m: int, n: int, k: int, groups: int = 1, dtype_bytes: float = 2, scale_dtype_bytes: float = 4) -> float:
    """How many times fewer bytes the int8 kernel moves than a dense matmul in ``dtype_bytes``:
    the speedup a memory-bound kernel could reach at best."""
    return dense_matmul_bytes(m, n, k, dtype_bytes) / int8_matmul_bytes(m, n, k, groups, dtype_bytes, scale_dtype_bytes)


def counted_bytes(fn, x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ByteCount]:
    """Run ``fn(x, w_q, scales)`` (a Triton kernel's wrapper) in the interpreter and return
    ``(result, bytes counted)``: what its kernels loaded and stored, per kernel parameter
    (:func:`labsupport.interpreter_bytes.count_bytes`; raises ``BytesNotCountable`` on a GPU).
    Unlike :func:`int8_matmul_bytes` it sees every re-read: each column block of programs loads
    its own copy of ``x``'s tiles."""
    with count_bytes() as counted:
        result = fn(x, w_q, scales)
    return result, counted
