"""Attention, three ways: the plain-torch spec, a blockwise online softmax, and a Triton kernel.

Everything here works on tensors of shape ``(B, H, S, D)``: batch, heads, sequence, head dim.
Row ``i`` of the output is a weighted average of the value rows, with weights
``softmax(q_i . k_j / sqrt(D))`` over the keys ``j`` (only ``j <= i`` when ``causal``).

* :func:`attention_spec` is the definition: fp32 arithmetic on the full ``S x S`` score matrix.
  It also returns the log-sum-exp of every row, ``lse_i = log(sum_j exp(s_ij))`` in fp32.
* :func:`online_softmax_reference` computes the same thing one block of keys at a time, with a
  running maximum and running sum (Milakov & Gimelshein 2018), never holding ``S x S`` numbers.
* :func:`flash_attention_reference` is the course's FlashAttention forward kernel in Triton
  (Dao et al. 2022; the loop order of FlashAttention-2, Dao 2023): one program per block of
  queries, looping over blocks of keys, with fully masked causal tiles skipped.

The module also holds the arithmetic the chapter quotes (score-matrix sizes, HBM traffic and
arithmetic intensity of the naive and tiled forms, the fraction of causal tiles skipped) and
:func:`peak_tensor_memory`, which measures on any device how many bytes of tensors a call
keeps alive at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import weakref
from dataclasses import dataclass

import torch

from ._answers import answer
from ._validate import positive_int, positive_number
from .interpreter_bytes import count_bytes

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): log(x) == log2(x) * LN2
HEAD_DIMS = (16, 32, 64, 128, 256)  # head dims the Triton kernel accepts (powers of two, >= 16)


# --- arguments ---------------------------------------------------------------------------------


def check_qkv(q, k, v, causal=False) -> tuple[int, int, int, int, int]:
    """Validate attention inputs and return ``(B, H, S_q, S_k, D)``.

    ``q`` is ``(B, H, S_q, D)``; ``k`` and ``v`` are ``(B, H, S_k, D)`` with the same dtype and
    device. ``S_q`` may differ from ``S_k`` (one query against a long cache, as in decode) only
    when ``causal`` is False.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, S, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, S, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor (float16, bfloat16 or float32), got {t.dtype}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, s_q, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise ValueError(
            f"k must have the batch, heads and head dim of q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    s_k = k.shape[2]
    if min(b, h, s_q, s_k, d) < 1:
        raise ValueError(f"every dimension must be at least 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and s_q != s_k:
        raise ValueError(
            f"causal attention needs as many queries as keys, got S_q={s_q} and S_k={s_k}; "
            f"for one query against a cache use causal=False (it may see every cached key)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    return b, h, s_q, s_k, d


def causal_mask(s_q: int, s_k: int, device=None) -> torch.Tensor:
    """Boolean ``(S_q, S_k)`` mask, True where query ``i`` may see key ``j`` (``j <= i``)."""
    rows = torch.arange(s_q, device=device)[:, None]
    cols = torch.arange(s_k, device=device)[None, :]
    return cols <= rows


# --- the definition ----------------------------------------------------------------------------


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit inputs, fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@answer
def attention_spec(q, k, v, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by its definition, in fp32 (fp64 for fp64 inputs). Returns ``(out, lse)``.

    ``out`` has the shape and dtype of ``q``; ``lse`` is fp32 (fp64 for fp64 inputs) of shape
    ``(B, H, S_q)``, the natural log of each row's softmax denominator
    ``sum_j exp(q_i . k_j / sqrt(D))``.
    Materialises the whole ``(B, H, S_q, S_k)`` score matrix: fine for checking, the very thing
    FlashAttention avoids.
    """
    _, _, s_q, s_k, d = check_qkv(q, k, v, causal)
    qf, kf, vf = (t.to(_math_dtype(q.dtype)) for t in (q, k, v))
    scores = (qf @ kf.transpose(-2, -1)) / math.sqrt(d)  # (B, H, S_q, S_k)
    if causal:
        scores = scores.masked_fill(~causal_mask(s_q, s_k, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, S_q)
    weights = torch.exp(scores - lse[..., None])  # rows sum to 1
    out = weights @ vf  # (B, H, S_q, D)
    return out.to(q.dtype), lse


@answer
def naive_attention_reference(q, k, v, causal: bool = False) -> torch.Tensor:
    """The textbook form in the inputs' dtype, as model code writes it ("eager" attention).

    Scores and probabilities are full ``S x S`` tensors; the softmax runs in fp32 and is cast
    back, as Hugging Face's eager attention does. Used as the naive baseline in benchmarks.
    """
    _, _, s_q, s_k, d = check_qkv(q, k, v, causal)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (B, H, S_q, S_k)
    if causal:
        scores = scores.masked_fill(~causal_mask(s_q, s_k, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


# --- the online softmax, blockwise in plain torch ---------------------------------------------


@answer
def online_softmax_reference(q, k, v, causal: bool = False, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over blocks of ``block_n`` keys with a running max and sum. Returns ``(out, lse)``.

    Holds at most a ``(B, H, S_q, block_n)`` block of scores at a time. The arithmetic is fp32
    (fp64 for fp64 inputs); ``out`` is returned in the inputs' dtype and ``lse`` in the arithmetic
    dtype, as :func:`attention_spec`.
    """
    b, h, s_q, s_k, d = check_qkv(q, k, v, causal)
    block_n = positive_int("block_n", block_n)
    acc_dtype = _math_dtype(q.dtype)
    qf = q.to(acc_dtype) / math.sqrt(d)  # fold the scale into q once
    m = torch.full((b, h, s_q), float("-inf"), dtype=acc_dtype, device=q.device)  # running max of each row
    denom = torch.zeros((b, h, s_q), dtype=acc_dtype, device=q.device)  # running sum of exp(score - m)
    acc = torch.zeros((b, h, s_q, d), dtype=acc_dtype, device=q.device)  # running sum of exp(score - m) * v
    rows = torch.arange(s_q, device=q.device)[:, None]
    for start in range(0, s_k, block_n):
        if causal and start > s_q - 1:
            break  # every later key is in the future of every query
        kb = k[:, :, start : start + block_n].to(acc_dtype)  # (B, H, n, D)
        vb = v[:, :, start : start + block_n].to(acc_dtype)
        s = qf @ kb.transpose(-2, -1)  # (B, H, S_q, n)
        if causal:
            cols = torch.arange(start, start + kb.shape[2], device=q.device)[None, :]
            s = s.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))  # never -inf: key 0 is visible to every row
        alpha = torch.exp(m - m_new)  # how much the old max overstated: rescale factor
        p = torch.exp(s - m_new[..., None])  # (B, H, S_q, n)
        denom = denom * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + p @ vb
        m = m_new
    out = acc / denom[..., None]
    lse = m + torch.log(denom)
    return out.to(q.dtype), lse


# --- the Triton kernel -------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is part of the course's install
    triton = None


if triton is not None:

    @triton.jit
    def _flash_attention_key_blocks(
        acc,  # (BLOCK_M, HEAD_DIM) fp32: running sum of p * v for this program's rows
        m_i,  # (BLOCK_M,) fp32: running max, in log2 units
        l_i,  # (BLOCK_M,) fp32: running sum of exp2(s - m_i)
        q,  # (BLOCK_M, HEAD_DIM) this program's queries, already loaded
        k_base,  # pointer to key 0 of this (batch, head)
        v_base,  # pointer to value 0 of this (batch, head)
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        offs_m,  # (BLOCK_M,) query positions of this program
        start_n,  # first key of the first block to visit (a multiple of BLOCK_N)
        stop_n,  # visit key blocks starting below this
        seq_k,  # number of keys
        qk_scale,  # 1/sqrt(D) * log2(e): scores come out in log2 units, ready for exp2
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,  # these blocks need the tail and/or causal mask
        CAUSAL: tl.constexpr,
    ):
        offs_d = tl.arange(0, HEAD_DIM)
        for block_start in range(start_n, stop_n, BLOCK_N):
            offs_n = block_start + tl.arange(0, BLOCK_N)
            # K is loaded transposed, (HEAD_DIM, BLOCK_N), so that q @ kt is a plain tl.dot.
            kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
            v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
            if MASKED:
                kt = tl.load(kt_ptrs, mask=offs_n[None, :] < seq_k, other=0.0)
                v = tl.load(v_ptrs, mask=offs_n[:, None] < seq_k, other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                v = tl.load(v_ptrs)
            # fp32 inputs: "ieee" keeps full fp32 products on GPUs (the default would be tf32).
            s = tl.dot(q, kt, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N)
            if MASKED:
                keep = offs_n[None, :] < seq_k  # keys past the end do not exist
                if CAUSAL:
                    keep = keep & (offs_n[None, :] <= offs_m[:, None])  # nor do future keys
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)  # rescale what was accumulated under the old max
            p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N), each in [0, 1]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")  # accumulate in place
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def flash_attention_forward_kernel(
        q_ptr,  # (B, H, S_q, D) queries
        k_ptr,  # (B, H, S_k, D) keys
        v_ptr,  # (B, H, S_k, D) values
        out_ptr,  # (B, H, S_q, D) output, same dtype as q
        lse_ptr,  # (B, H, S_q) fp32 log-sum-exp, contiguous
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_ob, stride_oh, stride_os, stride_od,
        n_heads,  # H
        seq_q,  # S_q
        seq_k,  # S_k
        qk_scale,  # 1/sqrt(D) * log2(e)
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,  # queries per program
        BLOCK_N: tl.constexpr,  # keys per inner-loop step
        CAUSAL: tl.constexpr,
    ):
        # Grid: (query blocks, B * H). Causal programs with the highest query block do the most
        # work; numbering them first lets the GPU start the long ones early.
        pid_m = tl.program_id(0)
        if CAUSAL:
            pid_m = tl.num_programs(0) - 1 - pid_m
        pid_bh = tl.program_id(1)
        off_b = (pid_bh // n_heads).to(tl.int64)
        off_h = (pid_bh % n_heads).to(tl.int64)
        q_base = q_ptr + off_b * stride_qb + off_h * stride_qh
        k_base = k_ptr + off_b * stride_kb + off_h * stride_kh
        v_base = v_ptr + off_b * stride_vb + off_h * stride_vh
        o_base = out_ptr + off_b * stride_ob + off_h * stride_oh

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_q  # the last query block may be partial
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None], other=0.0)

        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

        # Key blocks come in two kinds. Below `full_stop` every key is visible to every row:
        # no mask at all. From there to `stop` a block straddles the diagonal (causal) or the
        # end of the keys, and gets masked. Blocks past `stop` are entirely in the future of
        # every row of this program: causal attention never visits them.
        if CAUSAL:
            stop = tl.minimum((pid_m + 1) * BLOCK_M, seq_k)
            full_stop = tl.minimum(pid_m * BLOCK_M, seq_k) // BLOCK_N * BLOCK_N
        else:
            stop = seq_k
            full_stop = seq_k // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _flash_attention_key_blocks(
            acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
            offs_m, 0, full_stop, seq_k, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL,
        )
        acc, m_i, l_i = _flash_attention_key_blocks(
            acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
            offs_m, full_stop, stop, seq_k, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL,
        )

        out = acc / l_i[:, None]
        tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back from log2 to natural log
        tl.store(lse_ptr + pid_bh.to(tl.int64) * seq_q + offs_m, lse, mask=row_ok)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of :func:`flash_attention_reference`."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Launch configurations, largest shared memory first. On a GPU :func:`kernel_config` takes the first one whose
# shared memory (:func:`shared_memory_bound`) fits the device; if a launch still runs out of
# resources, :func:`flash_attention_reference` steps down this list and says so.
GPU_CONFIGS = (
    KernelConfig(128, 64, 8, 3),
    KernelConfig(128, 64, 8, 2),
    KernelConfig(64, 64, 4, 2),
    KernelConfig(128, 32, 8, 2),
    KernelConfig(64, 32, 4, 2),
    KernelConfig(32, 32, 4, 1),
    KernelConfig(16, 16, 4, 1),
)


def shared_memory_bound(config: KernelConfig, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of shared memory :func:`flash_attention_reference`'s kernel needs at most with ``config``.

    The Q tile, ``num_stages`` K and V tiles (at least two), and the fp32 score tile (the compiler stages it
    through shared memory on some architectures: on a T4, 128 x 32 tiles at head dim 128 in fp16
    need 81,920 bytes, 16,384 more than the three tiles alone). It is an upper bound, not the
    exact figure: ``tests/test_kernel_configs.py`` compiles the kernel for sm_75, sm_80, sm_89
    and sm_90 (no GPU needed) and checks that every configuration :func:`kernel_config` picks for
    the GPUs in :mod:`labsupport.hardware` compiles within that GPU's limit.
    """
    c = config
    buffers = max(c.num_stages, 2)  # even unpipelined, the compiler keeps two K/V buffers on some targets
    tiles = (c.block_m * head_dim + 2 * buffers * c.block_n * head_dim) * dtype_bytes
    return tiles + 4 * c.block_m * c.block_n


def _device_limits() -> tuple[int, tuple[int, int]]:
    """(shared memory one program may use, compute capability) of the current GPU."""
    return _limits_of(torch.cuda.current_device())


@functools.cache
def _limits_of(index: int) -> tuple[int, tuple[int, int]]:
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin), capability
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]), capability
    except Exception:
        return 64 * 1024, capability  # the smallest limit of any GPU the course names (a T4)


@functools.cache
def _gpu_config(head_dim: int, dtype_bytes: int, shared_memory: int) -> KernelConfig:
    for config in GPU_CONFIGS:
        if shared_memory_bound(config, head_dim, dtype_bytes) <= shared_memory:
            break
    # else: nothing fits by the bound; the smallest tiles are tried, and a launch failure says so
    if head_dim < 128 and config.num_warps > 4:
        config = dataclasses.replace(config, num_warps=4)  # small heads: 4 warps cover a 128-row tile
    return config


def kernel_config(
    seq_q: int, seq_k: int, head_dim: int, dtype: torch.dtype, *, interpreter: bool,
    shared_memory: int | None = None,
) -> KernelConfig:
    """Tile sizes for :func:`flash_attention_reference`, without autotuning.

    In the interpreter a step costs about the same whatever the tile size, so the tiles are as
    large as keeps several key blocks in the test sizes: 128 queries by 64 keys below 1024
    positions, 256 by 128 from there. The query tile is twice the key tile there as on a GPU, so a
    kernel that confuses ``BLOCK_M`` with ``BLOCK_N`` (a causal loop that stops at
    ``(pid_m + 1) * BLOCK_N``) is wrong in the interpreter too, not only on a GPU. On a GPU: the first of :data:`GPU_CONFIGS` (128 queries x 64 keys per step, 8 warps, 3
    pipeline stages, then smaller) whose :func:`shared_memory_bound` fits the device's shared
    memory per program, or ``shared_memory`` bytes when given (to plan for another GPU; see
    :attr:`labsupport.hardware.GPU.shared_memory_per_block`). The choice is cached.
    """
    if interpreter:
        block_n = 128 if max(seq_q, seq_k) >= 1024 else 64
        return KernelConfig(2 * block_n, block_n, 4, 1)
    if shared_memory is None:
        shared_memory = _device_limits()[0]
    return _gpu_config(int(head_dim), dtype.itemsize, int(shared_memory))


def compiled_shared_memory(config: KernelConfig, head_dim: int, dtype: torch.dtype,
                           capability: tuple[int, int], causal: bool = True) -> int:
    """Bytes of shared memory the reference kernel needs once Triton compiles it for a GPU of
    ``capability`` with ``config`` (see :func:`compile_for`)."""
    return int(compile_for(config, head_dim, dtype, capability, causal).metadata.shared)


def compile_for(config: KernelConfig, head_dim: int, dtype: torch.dtype, capability: tuple[int, int],
                causal: bool = True):
    """The reference kernel compiled by Triton for a GPU of compute ``capability`` (its
    ``metadata.shared`` bytes, its ``asm["ptx"]``). No GPU is needed (Triton compiles for any
    target), but the kernel must not be in interpreter mode: run with ``TRITON_INTERPRET=0``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = flash_attention_forward_kernel
    if not hasattr(fn, "cache_key"):
        raise RuntimeError("the kernel was defined in interpreter mode; set TRITON_INTERPRET=0 before "
                           "importing labsupport to compile it for a GPU")
    pointer = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    constants = {"HEAD_DIM": head_dim, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "CAUSAL": causal}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name == "lse_ptr":
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = pointer
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )


def smaller_configs(config: KernelConfig) -> list[KernelConfig]:
    """The configurations of :data:`GPU_CONFIGS` after ``config``: what to try when it fails to launch
    (with no more warps than ``config`` has, as :func:`kernel_config` gives small heads 4)."""
    def key(c: KernelConfig):
        return c.block_m, c.block_n, c.num_stages

    keys = [key(c) for c in GPU_CONFIGS]
    start = keys.index(key(config)) + 1 if key(config) in keys else 0
    return [dataclasses.replace(c, num_warps=min(c.num_warps, config.num_warps)) for c in GPU_CONFIGS[start:]]


@answer
def flash_attention_reference(
    q, k, v, causal: bool = False, block_m: int | None = None, block_n: int | None = None,
    *, config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward in Triton. Returns ``(out, lse)`` like :func:`attention_spec`.

    ``q`` is ``(B, H, S_q, D)``, ``k`` and ``v`` ``(B, H, S_k, D)``; float16 or float32 (and
    bfloat16 on a GPU), any strides, head dim one of 16, 32, 64, 128, 256. ``block_m`` and
    ``block_n`` override the tile sizes :func:`kernel_config` chooses (powers of two; at least
    16 on a GPU); ``config`` replaces its whole choice, warps and pipeline stages included (the
    benchmark's ``--configs`` sweep uses it). ``lse`` is fp32, ``(B, H, S_q)``, natural log.
    """
    if triton is None:  # pragma: no cover
        raise RuntimeError("flash_attention_reference needs triton; install the course's requirements")
    from .device import interpreter_mode

    b, h, s_q, s_k, d = check_qkv(q, k, v, causal)
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {', '.join(map(str, HEAD_DIMS))}, got {d}")
    interp = interpreter_mode()
    if q.device.type == "cpu" and not interp:
        raise ValueError("q, k and v are on the CPU but Triton is not in interpreter mode: move them to the GPU")
    if q.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {q.dtype}")
    out_dtype = q.dtype
    if interp and q.dtype == torch.bfloat16:
        # bf16 arithmetic is broken in the Triton interpreter (tl.dot multiplies bit patterns);
        # run the fp32 kernel on the upcast inputs there and round the result back.
        q, k, v = q.float(), k.float(), v.float()
    automatic = config is None and block_m is None and block_n is None
    if config is None:
        config = kernel_config(s_q, s_k, d, q.dtype, interpreter=interp)
        config = _stepped_down.get((q.device.index, q.dtype, d), config)
    elif not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig, got {type(config).__name__}")
    bm = config.block_m if block_m is None else positive_int("block_m", block_m)
    bn = config.block_n if block_n is None else positive_int("block_n", block_n)
    for name, value in (("block_m", bm), ("block_n", bn)):
        if value & (value - 1) or (not interp and value < 16):
            raise ValueError(f"{name} must be a power of two{'' if interp else ' and at least 16'}, got {value}")

    # The kernel adds int64 offsets for the (batch, head) and int32 ones within a head, which is
    # fast and enough for any contiguous tensor below 16M positions. A strided view whose offsets
    # within one head pass 2**31 elements (a (B, S, H, D) layout with S * H * D that large) is
    # copied to a contiguous layout first rather than overflow.
    q, k, v = (t if _head_offsets_fit_int32(t.shape, t.stride()) else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s_q), dtype=torch.float32, device=q.device)
    while True:
        try:
            flash_attention_forward_kernel[(triton.cdiv(s_q, bm), b * h)](
                q, k, v, out, lse,
                *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                h, s_q, s_k, LOG2E / math.sqrt(d),
                HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                num_warps=config.num_warps, num_stages=config.num_stages,
            )
            return out.to(out_dtype), lse
        except Exception as exc:
            smaller = smaller_configs(config) if automatic and is_out_of_resources(exc) else []
            if not smaller:
                raise
            # The compiled kernel needs more shared memory (or registers) than this GPU gives one
            # program: step down once, say so, and remember the choice for this device and shape.
            warnings.warn(
                f"flash_attention_reference: the launch configuration {config_name(config)} does not fit "
                f"this GPU ({str(exc).strip().splitlines()[0][:160]}); using {config_name(smaller[0])} "
                f"from now on for {q.dtype} at head dim {d}",
                RuntimeWarning, stacklevel=2,
            )
            config = _stepped_down[(q.device.index, q.dtype, d)] = smaller[0]
            bm, bn = config.block_m, config.block_n


# Configurations flash_attention_reference stepped down to after a failed launch, by
# (device index, dtype, head dim).
_stepped_down: dict[tuple, KernelConfig] = {}


def is_out_of_resources(exc: BaseException) -> bool:
    """True for Triton's error when a compiled kernel needs more shared memory or registers than
    the GPU has (``triton.runtime.errors.OutOfResources``)."""
    return type(exc).__name__ == "OutOfResources"


def config_name(c: KernelConfig) -> str:
    """``"128x64 tiles, 8 warps, 3 stages"``: how messages and tables name a configuration."""
    return f"{c.block_m}x{c.block_n} tiles, {c.num_warps} warps, {c.num_stages} stages"


def _head_offsets_fit_int32(shape, stride) -> bool:
    """True when every offset within one (batch, head) of a ``(B, H, S, D)`` tensor, plus a block
    of padding past the end (masked loads still form the address), stays below 2**31 elements."""
    _, _, s, d = shape
    _, _, stride_s, stride_d = stride
    padded = s + 256  # the largest tile the kernel uses
    return (padded - 1) * abs(stride_s) + (d - 1) * abs(stride_d) < 2**31


def combine_partials(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention computed over disjoint chunks of the keys into attention over all of them.

    ``outs[c]`` and ``lses[c]`` are what chunk ``c`` of the keys gives on its own. Each chunk's
    output is weighted by its share of the total softmax mass, ``exp(lse_c - lse)``; this is how
    split-key (decode) kernels use the log-sum-exp a forward pass returns.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError("outs and lses must be non-empty lists of the same length")
    lse_all = torch.stack([x.float() for x in lses])  # (C, B, H, S_q)
    total = torch.logsumexp(lse_all, dim=0)  # (B, H, S_q)
    weights = torch.exp(lse_all - total)  # (C, B, H, S_q), sums to 1 over chunks
    out = sum(w[..., None] * o.float() for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), total


# --- arithmetic the chapter quotes --------------------------------------------------------------


def score_matrix_elements(seq_len: int, seq_k: int | None = None) -> int:
    """Numbers in one head's score matrix: ``S_q * S_k`` (``S**2`` for self-attention)."""
    s_q = positive_int("seq_len", seq_len)
    s_k = s_q if seq_k is None else positive_int("seq_k", seq_k)
    return s_q * s_k


def naive_attention_hbm_bytes(seq_len: int, head_dim: int, dtype_bytes: float = 2) -> float:
    """Bytes one head of naive attention moves to and from HBM, forward pass.

    Three passes, each a separate kernel: ``S = Q K^T`` reads Q and K and writes S; the softmax
    reads S and writes P; ``O = P V`` reads P and V and writes O. That is ``4*S*D + 4*S**2``
    elements: the ``S**2`` terms dominate once the sequence is longer than the head dim.
    """
    s = positive_int("seq_len", seq_len)
    d = positive_int("head_dim", head_dim)
    b = positive_number("dtype_bytes", dtype_bytes)
    return float((4 * s * d + 4 * s * s) * b)


def flash_attention_hbm_bytes(seq_len: int, head_dim: int, block_m: int = 128, dtype_bytes: float = 2,
                              *, kv_reuse: bool = False, group_size: int = 1) -> float:
    """Bytes one query head of tiled attention moves to and from HBM, forward pass.

    Each of the ``ceil(S / block_m)`` query blocks reads its Q tile once and every K and V tile
    once, and writes its O tile and ``block_m`` fp32 log-sum-exps. Nothing of size ``S**2`` is
    ever written. With ``kv_reuse=False`` every K and V re-read counts (no cache at all: the upper
    bound). With ``kv_reuse=True`` K and V are fetched from HBM once per head, as when the
    programs working on one head find each other's tiles in the GPU's L2 cache (the lower bound).

    Under grouped-query attention ``group_size`` query heads share one K and V head. A kernel
    that serves the whole group from each K and V tile it loads (one program per group, or
    programs that meet in L2) reads K and V once per group, so each query head is charged
    ``1/group_size`` of those reads; ``group_size=1`` charges every query head in full, which
    overstates the K and V traffic of a GQA model up to ``group_size`` times.
    """
    s = positive_int("seq_len", seq_len)
    d = positive_int("head_dim", head_dim)
    bm = positive_int("block_m", block_m)
    b = positive_number("dtype_bytes", dtype_bytes)
    g = positive_int("group_size", group_size)
    kv_reads = 1 if kv_reuse else math.ceil(s / bm)
    return float((2 * s * d + kv_reads * 2 * s * d / g) * b + 4 * s)


def flash_attention_counted_bytes(seq_len: int, head_dim: int, block_m: int = 128, block_n: int = 64,
                                  dtype: torch.dtype = torch.float16, causal: bool = False) -> int:
    """Bytes the course's FlashAttention kernel (:func:`flash_attention_reference`) loads and stores
    for one head, counted in Triton's interpreter (:func:`labsupport.interpreter_bytes.count_bytes`).

    Random inputs of shape (1, 1, S, D) in ``dtype`` (2 bytes per element for float16, as bf16
    on a GPU). Non-causal, it equals :func:`flash_attention_hbm_bytes` with ``kv_reuse=False``:
    the interpreter has no cache, so every re-read of K and V is counted. Raises
    :class:`labsupport.interpreter_bytes.BytesNotCountable` outside the interpreter (on a GPU the
    bytes come from the formula). Chapter 07 plots it beside the formulas.
    """
    s = positive_int("seq_len", seq_len)
    d = positive_int("head_dim", head_dim)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, s, d, generator=gen).to(dtype) for _ in range(3))
    with count_bytes() as counted:
        flash_attention_reference(q, k, v, causal, block_m=block_m, block_n=block_n)
    return counted.total


def attention_intensity(seq_len: int, head_dim: int, *, tiled: bool, block_m: int = 128,
                        dtype_bytes: float = 2, kv_reuse: bool = False, group_size: int = 1) -> float:
    """FLOPs per HBM byte of one query head's forward pass (``4*S**2*D`` FLOPs, non-causal).

    ``group_size`` (tiled only): query heads sharing each K and V head, see
    :func:`flash_attention_hbm_bytes`.
    """
    flops = 4 * positive_int("seq_len", seq_len) ** 2 * positive_int("head_dim", head_dim)
    moved = (flash_attention_hbm_bytes(seq_len, head_dim, block_m, dtype_bytes, kv_reuse=kv_reuse,
                                       group_size=group_size) if tiled
             else naive_attention_hbm_bytes(seq_len, head_dim, dtype_bytes))
    return flops / moved


def tile_schedule(seq_len: int, block_m: int, block_n: int, causal: bool = True) -> "torch.Tensor":
    """Which (query block, key block) tiles a causal kernel visits: an int tensor of shape
    ``(ceil(S/block_m), ceil(S/block_n))`` with 0 = skipped, 1 = computed without a mask,
    2 = computed with a mask (it straddles the diagonal or the end of the sequence).

    Matches the loop bounds of :func:`flash_attention_reference`.
    """
    s = positive_int("seq_len", seq_len)
    bm = positive_int("block_m", block_m)
    bn = positive_int("block_n", block_n)
    n_m, n_n = math.ceil(s / bm), math.ceil(s / bn)
    grid = torch.zeros((n_m, n_n), dtype=torch.int64)
    for i in range(n_m):
        if causal:
            stop = min((i + 1) * bm, s)
            full_stop = min(i * bm, s) // bn * bn
        else:
            stop, full_stop = s, s // bn * bn
        for j in range(n_n):
            start = j * bn
            if start < full_stop:
                grid[i, j] = 1
            elif start < stop:
                grid[i, j] = 2
    return grid


def causal_tiles_skipped(seq_len: int, block_m: int, block_n: int) -> float:
    """Fraction of the ``S x S`` tiles a causal kernel never visits (tends to 1/2 as S grows)."""
    grid = tile_schedule(seq_len, block_m, block_n, causal=True)
    return float((grid == 0).sum()) / grid.numel()


# --- measuring memory on any device --------------------------------------------------------------


@dataclass(frozen=True)
class MemoryReport:
    """What :func:`peak_tensor_memory` saw during one call."""

    peak_bytes: int  # most bytes of tensor storage created during the call and alive at once
    largest_bytes: int  # the largest floating-point tensor storage created during the call
    largest_numel: int  # its number of elements (masks and indices are not counted here)
    largest_shape: tuple  # and its shape


class _StorageTracker:
    """Counts the storages of tensors created by torch operations while active.

    Works through ``TorchDispatchMode``: every ATen operation (including those inside
    ``torch.softmax`` and friends) reports its outputs; each new storage is counted until the
    last tensor that uses it is garbage-collected.
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.live: dict[int, list[int]] = {}  # data_ptr -> [nbytes, tensors referencing it]
        self.pre_existing: set[int] = set()
        self.current = self.peak = self.largest = self.largest_numel = 0
        self.largest_shape: tuple = ()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                for t in _tensors(result):
                    tracker._saw(t)
                return result

        self.mode = Mode()

    def _saw(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except Exception:
            return
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self.pre_existing:
            return
        if key not in self.live:
            self.live[key] = [nbytes, 0]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            if nbytes > self.largest and t.is_floating_point():
                self.largest, self.largest_numel, self.largest_shape = nbytes, t.numel(), tuple(t.shape)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)


def peak_tensor_memory(fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)`` and return ``(result, MemoryReport)``.

    Counts only tensors created during the call (inputs are not counted), on any device, by
    watching every torch operation. Memory that a Triton kernel or a C extension allocates
    outside torch is invisible to it; the tensors a wrapper allocates with torch are counted.
    On a GPU, ``torch.cuda.max_memory_allocated`` measures the same thing for all allocations.
    """
    import gc

    tracker = _StorageTracker()
    for value in list(args) + list(kwargs.values()):
        for t in _tensors(value):
            tracker.pre_existing.add(t.untyped_storage().data_ptr())
    gc.collect()
    with tracker.mode:
        result = fn(*args, **kwargs)
    report = MemoryReport(tracker.peak, tracker.largest, tracker.largest_numel, tracker.largest_shape)
    return result, report
