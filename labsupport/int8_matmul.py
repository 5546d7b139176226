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

Two kernels do it. :func:`int8_matmul_reference` is the lab's design (one ``tl.dot`` tile of
outputs per program, the whole K loop inside), with its tiles chosen by the device
(:func:`int8_matmul_config`: a configuration the H200's sweep found fastest where its pipeline
stages fit the device's shared memory, else one that fits a T4's 64 KiB). :func:`int8_linear` is the
course's tuned path for decode: a matrix-vector kernel for batches of 1 to 4 rows
(:func:`int8_gemv_kernel`: no ``tl.dot``, whose smallest tile is 16 rows, so no padding of a single
row to 16), and for more rows the tiles with **split-K** when a layer has few output tiles (each of
``split_k`` programs sums one range of K; a second, small reduction adds the partial sums), so that
a narrow layer still gives every multiprocessor work (:func:`int8_launch_plan` decides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._answers import answer
from ._validate import positive_int, positive_number
from .device import gpu_limits, interpreter_mode
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


T4_SHARED_MEMORY = 64 * 1024  # the smallest shared memory per program of any GPU the course names
# Tiles for more than 16 rows, best first, from the H200 sweep (python -m labsupport.bench_precision
# --configs, 2026-11-30, groups of 128; results/gpu_logs/precision_configs.md): (BLOCK_N, BLOCK_K,
# warps, stages). At batch 64 the up projection (N = 14,336) ran fastest with 64 columns and 4
# stages (48 us against 57 us with the T4-sized tiles), the down projection (N = 4,096) with 32
# columns and 6 stages (78 us against 149 us): narrow layers want more, narrower programs. A stage
# of 64 rows x 128 of K in 16 bits plus 128 x BLOCK_N int8 weights is 20-24 KiB, so these need an
# A100's or a Hopper's shared memory; the last entry fits a T4.
WIDE_TILES = {True: ((64, 128, 4, 4), (32, 128, 4, 6)), False: ((32, 128, 4, 6), (64, 128, 4, 4))}
T4_TILES = (64, 64, 4, 4)


def _stage_bytes(block_m: int, block_n: int, block_k: int, act_dtype_bytes: int = 2) -> int:
    """Shared memory of one pipeline stage: a tile of x in 16 bits and a tile of W in int8."""
    return block_m * block_k * act_dtype_bytes + block_k * block_n


def int8_matmul_config(m: int, n: int, k: int, group_size: int, *, interpreter: bool,
                       shared_memory: int | None = None) -> MatmulConfig:
    """Tiles for :func:`int8_matmul_reference` (and the lab's kernel), chosen by the device, without
    autotuning.

    ``BLOCK_K`` divides the group size, so every K tile lies inside one group and needs one scale
    per column. ``BLOCK_M`` is at least 16 (``tl.dot`` needs 16 on NVIDIA GPUs) and covers a
    decode batch up to 64 in one tile. In the interpreter, where a step costs about the same
    whatever its size, the tiles are large: few steps. On a GPU the configuration depends on the
    device's shared memory per program (``shared_memory`` bytes to plan for another GPU; default
    the current GPU's, or a T4's 64 KiB without one): up to 16 rows, 32 columns, K tiles of 128 and
    6 stages (the H200 sweep's best, and it fits a T4); above 16 rows the sweep's best for the
    layer's width where it fits (:data:`WIDE_TILES`), else 64 x 64 tiles and 4 stages.
    """
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    small = not interpreter and m <= 16  # a decode batch of up to 16 rows on a GPU
    block_k = 1
    limit = 128 if interpreter or small else 64
    while block_k * 2 <= limit and group_size % (block_k * 2) == 0:
        block_k *= 2
    if block_k < 16:
        raise ValueError(f"group size {group_size} must be a multiple of 16 for this kernel")
    # Up to 16 rows (measured on an NVIDIA H200, 2026-11-30): 32 columns, K tiles of 128 and 6 stages ran
    # Llama 3.1 8B's up projection in 33 us instead of 42 us (4 stages, K tiles of 64) and its down
    # projection in 41 us instead of 80 us; a stage is x 16 x 128 in 16 bits plus W 128 x 32 in int8
    # (4 + 4 KiB): six fit the 64 KiB of a T4.
    if small:
        return MatmulConfig(block_m, 32, block_k, num_warps=4, num_stages=6)
    if interpreter:
        return MatmulConfig(block_m, 64, block_k, num_warps=4, num_stages=1)
    if shared_memory is None:
        shared_memory = gpu_limits()[0] if torch.cuda.is_available() else T4_SHARED_MEMORY
    k_wide = 1
    while k_wide * 2 <= 128 and group_size % (k_wide * 2) == 0:
        k_wide *= 2
    for bn, bk, warps, stages in WIDE_TILES[n >= 8192]:
        bk = min(bk, k_wide)
        if _stage_bytes(block_m, bn, bk) * stages <= shared_memory:
            return MatmulConfig(block_m, bn, bk, num_warps=warps, num_stages=stages)
    bn, bk, warps, stages = T4_TILES
    return MatmulConfig(block_m, bn, block_k, num_warps=warps, num_stages=stages)


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


# --- the tuned path: a matrix-vector kernel for 1-4 rows, split-K tiles for few output tiles -------

GEMV_ROWS = 4  # batches of up to this many rows take the matrix-vector kernel


@dataclass(frozen=True)
class LaunchPlan:
    """How :func:`int8_linear` runs one shape: ``kernel`` ``"gemv"`` or ``"tiles"``, its tiles
    (``config``; the GEMV kernel uses ``block_n``, ``block_k``, warps and stages) and ``split_k``
    (programs along K; 1: none)."""

    kernel: str
    config: MatmulConfig
    split_k: int


def int8_launch_plan(m: int, n: int, k: int, group_size: int, *, interpreter: bool, shared_memory: int | None = None,
                     sms: int | None = None) -> LaunchPlan:
    """The plan for ``(M, K) x (K, N)`` (module docstring). Split-K: when one program per output
    tile would leave fewer than two programs per multiprocessor (``sms``: the current GPU's, or 132,
    an H100's), K is cut into the power of two that reaches it, keeping at least 8 K tiles per
    program (the partial sums cost ``split_k * M * N * 4`` bytes of writes and reads)."""
    if sms is None:
        sms = gpu_limits()[1] if torch.cuda.is_available() and not interpreter else 132
    if m <= GEMV_ROWS:
        block_k = 1
        while block_k * 2 <= (128 if interpreter else 256) and group_size % (block_k * 2) == 0:
            block_k *= 2
        if block_k < 16:
            raise ValueError(f"group size {group_size} must be a multiple of 16 for this kernel")
        config = MatmulConfig(GEMV_ROWS, 64 if interpreter else 16, block_k, num_warps=4,
                              num_stages=1 if interpreter else 4)
    else:
        config = int8_matmul_config(m, n, k, group_size, interpreter=interpreter, shared_memory=shared_memory)
    programs = triton.cdiv(m, config.block_m if m > GEMV_ROWS else GEMV_ROWS) * triton.cdiv(n, config.block_n)
    k_tiles = k // config.block_k
    split = 1
    while programs * split < 2 * sms and k_tiles // (split * 2) >= 8:
        split *= 2
    return LaunchPlan("gemv" if m <= GEMV_ROWS else "tiles", config, split)


@triton.jit
def store_partial(out_ptr, acc, pid_k, M, N, offs_m, offs_n, m_ok, n_ok, SPLIT_K: tl.constexpr):
    """Write a program's (rows, columns) tile of sums: into the output in its dtype, or, split
    over K, into its K range's float32 slice of the partial sums (``int8_linear`` adds them)."""
    out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def int8_gemv_kernel(
    x_ptr,  # (M, K) activations, contiguous, M <= M_PAD
    w_ptr,  # (N, K) int8 codes, contiguous
    s_ptr,  # (N, G) float32 scales, contiguous
    out_ptr,  # (SPLIT_K, M, N) float32 partial sums, or (M, N) in x's dtype when SPLIT_K == 1
    M, N, K,
    GROUPS,  # G
    GROUP_SIZE,  # K // G
    K_PER_SPLIT,  # a multiple of BLOCK_K
    M_PAD: tl.constexpr,  # rows padded to a power of two (4)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE
    SPLIT_K: tl.constexpr,
):
    # One program: BLOCK_N outputs of every row, over one range of K. Products are broadcast and
    # summed in float32 on the CUDA cores: at 1-4 rows a tensor-core tile would be mostly padding.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=m_ok[:, None],
                    other=0.0).to(tl.float32)  # (M_PAD, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :], mask=n_ok[:, None],
                    other=0)  # (BLOCK_N, BLOCK_K) int8
        scale = tl.load(s_ptr + offs_n * GROUPS + k0 // GROUP_SIZE, mask=n_ok, other=0.0)  # (BLOCK_N,)
        w = w.to(tl.float32) * scale[:, None]  # dequantised in registers
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # (M_PAD, BLOCK_N)
    store_partial(out_ptr, acc, pid_k, M, N, offs_m, offs_n, m_ok, n_ok, SPLIT_K)


@triton.jit
def int8_matmul_splitk_kernel(
    x_ptr,  # (M, K) activations, contiguous
    w_ptr,  # (N, K) int8 codes, contiguous
    s_ptr,  # (N, G) float32 scales, contiguous
    out_ptr,  # (SPLIT_K, M, N) float32 partial sums, or (M, N) in x's dtype when SPLIT_K == 1
    M, N, K,
    GROUPS,
    GROUP_SIZE,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    # int8_matmul_kernel's tiles over one range of K (a third grid axis): its partial sum goes to
    # its own slice of the output, and int8_linear adds the slices.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + (k0 + offs_k)[:, None],
                    mask=n_ok[None, :], other=0)  # (BLOCK_K, BLOCK_N) int8: W^T's tile
        scale = tl.load(s_ptr + offs_n * GROUPS + k0 // GROUP_SIZE, mask=n_ok, other=0.0)
        w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    store_partial(out_ptr, acc, pid_k, M, N, offs_m, offs_n, m_ok, n_ok, SPLIT_K)


def int8_linear(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, *, plan: LaunchPlan | None = None,
                validate: bool = True) -> torch.Tensor:
    """The course's tuned weight-only int8 linear layer (module docstring): the same result as
    :func:`int8_matmul_spec`, (M, N) in x's dtype. ``plan`` defaults to :func:`int8_launch_plan`
    for this device (a benchmark passes others)."""
    if validate:
        m, n, k, group = validate_int8_matmul_args(x, w_q, scales)
    else:
        (m, k), n, group = x.shape, w_q.shape[0], x.shape[1] // scales.shape[1]
    interp = interpreter_mode()
    if plan is None:
        plan = int8_launch_plan(m, n, k, group, interpreter=interp)
    x = x if x.is_contiguous() else x.contiguous()
    scales = scales if scales.dtype == torch.float32 and scales.is_contiguous() else scales.float().contiguous()
    cfg, split = plan.config, plan.split_k
    per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, per_split)  # no empty range
    out = torch.empty((m, n) if split == 1 else (split, m, n), dtype=x.dtype if split == 1 else torch.float32,
                      device=x.device)
    if plan.kernel == "gemv":
        if m > GEMV_ROWS:
            raise ValueError(f"the matrix-vector kernel takes at most {GEMV_ROWS} rows, got {m}")
        int8_gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
            x, w_q, scales, out, m, n, k, scales.shape[1], group, per_split,
            M_PAD=GEMV_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
        int8_matmul_splitk_kernel[grid](
            x, w_q, scales, out, m, n, k, scales.shape[1], group, per_split,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
            IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if split == 1 else out.sum(0).to(x.dtype)


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
