"""Split-KV paged decode attention (Flash-Decoding): the course's reference decode kernel.

Chapter 10 explains it. Decode gives each sequence one query token per head, so a kernel with one
program per (sequence, KV head), like lab 10's, has ``B * Hkv`` programs: at batch 16 with 8 KV
heads that is 128 programs for a GPU with 132 multiprocessors, each walking thousands of keys one
tile after another. Flash-Decoding (Dao, Haziza, Massa and Sizov, 2023) splits every sequence's
keys and values into ``num_splits`` ranges, one program each, and combines the partial results:

1. :func:`split_kv_decode_kernel`, grid ``(B, Hkv, num_splits)``: the program for split ``s``
   reads its range of sequence ``b``'s cache through the block table, in tiles of ``BLOCK_N``
   tokens (several pages per tile: the tile's table entries are one vector load), and runs the
   online softmax over it. The ``G = H // Hkv`` query heads that share the KV head are the rows
   of one ``tl.dot``, so each key tile is read once for the whole group. It writes, per query
   head, the partial output ``o_s`` (normalised by its own sum), its running maximum ``m_s`` and
   its sum ``l_s``.
2. :func:`combine_splits_kernel`, grid ``(B, H)``: ``out = sum_s w_s o_s / sum_s w_s`` with
   ``w_s = l_s exp(m_s - max_s m_s)``, the log-sum-exp combination of the partial softmaxes.

Shapes are those of :mod:`labsupport.paged_attention` (``q`` (B, H, D), the cache
(num_blocks, block_size, Hkv, D), ``block_tables`` (B, max_blocks), ``seq_lens`` (B,)); its
:func:`~labsupport.paged_attention.paged_decode_attention` is the spec. Every sequence is split
into ``num_splits`` equal runs of whole tiles, so the grid depends only on the batch (a CUDA
graph can hold it) while each sequence's splits follow its own length; a split with no tile left
writes ``l = 0`` and weighs nothing. A sequence of length 0 (a padded row of a captured graph)
gets a zero output.

Timing it against SDPA on a contiguous cache is :mod:`labsupport.bench_cache_ops`'s job.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device import interpreter_mode
from .paged_attention import check_paged_inputs

__all__ = ["split_kv_decode_attention", "num_kv_splits", "split_kv_decode_kernel", "combine_splits_kernel",
           "load_kv_tile", "online_softmax_step", "BLOCK_N"]

BLOCK_N = 64  # tokens per key/value tile (several 16-token pages)


@triton.jit
def load_kv_tile(k_ptr, v_ptr, table_ptr, pos, ok, kvh, offs_d, d_ok,
                 stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh, BLOCK_SIZE: tl.constexpr):
    """The keys and values of token positions ``pos`` (a tile, masked by ``ok``) of one sequence
    (``table_ptr``: its row of the block table) for KV head ``kvh``: (BLOCK_N, D_PAD) each. The
    tile's table entries are one vector load (neighbouring tokens share a page)."""
    page = tl.load(table_ptr + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    kv_ok = ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kn + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=kv_ok, other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_vn + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=kv_ok, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, sm_scale, IEEE: tl.constexpr):
    """One tile of the online softmax (chapter 07): scores ``q k^T`` where ``visible`` (else
    -inf), the running maximum ``m_i`` and sum ``l_i`` rescaled, ``acc`` updated with the tile's
    values. Returns ``(m_i, l_i, acc)``."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # float32 accumulation
    s = tl.where(visible, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def split_kv_decode_kernel(
    q_ptr,  # (B, H, D)
    k_ptr,  # (num_blocks, BS, Hkv, D)
    v_ptr,  # (num_blocks, BS, Hkv, D)
    bt_ptr,  # (B, max_blocks) int32
    len_ptr,  # (B,) int32
    mid_o_ptr,  # (B, H, NUM_SPLITS, HEAD_DIM) float32: each split's normalised output
    mid_m_ptr,  # (B, H, NUM_SPLITS) float32: each split's running maximum of the scores
    mid_l_ptr,  # (B, H, NUM_SPLITS) float32: each split's sum of exp(score - maximum)
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_btb,
    sm_scale,
    H: tl.constexpr,  # query heads
    GROUP: tl.constexpr,  # H // Hkv query heads share a KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's smallest tile on a GPU)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    BLOCK_N: tl.constexpr,  # tokens per tile: BLOCK_N / BLOCK_SIZE pages per iteration
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: full-precision products, not tf32
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g  # (GROUP_PAD,) the query heads of this group: the dot's rows
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (GROUP_PAD, D_PAD)
    seq_len = tl.load(len_ptr + b)

    # this split's run of tiles: the sequence's tiles cut into NUM_SPLITS equal runs
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, num_tiles)

    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D_PAD), dtype=tl.float32)
    for tile in range(first, last):
        pos = tile * BLOCK_N + offs_n  # (BLOCK_N,) token positions of this tile
        ok = pos < seq_len
        k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr + b * stride_btb, pos, ok, kvh, offs_d, d_ok,
                            stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh, BLOCK_SIZE)
        m_i, l_i, acc = online_softmax_step(q, k, v, ok[None, :], m_i, l_i, acc, sm_scale, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split leaves 0 (and l = 0)
    row = (b * H + heads) * NUM_SPLITS + split  # (GROUP_PAD,) index into (B, H, NUM_SPLITS)
    tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(mid_m_ptr + row, m_i, mask=g_ok)
    tl.store(mid_l_ptr + row, l_i, mask=g_ok)


@triton.jit
def combine_splits_kernel(
    mid_o_ptr,  # (B, H, NUM_SPLITS, HEAD_DIM) float32
    mid_m_ptr,  # (B, H, NUM_SPLITS) float32
    mid_l_ptr,  # (B, H, NUM_SPLITS) float32
    out_ptr,  # (B, H, D)
    stride_ob, stride_oh,
    H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    row = (b * H + h) * NUM_SPLITS + offs_s  # (SPLITS_PAD,)
    m = tl.load(mid_m_ptr + row, mask=s_ok, other=float("-inf"))
    l_s = tl.load(mid_l_ptr + row, mask=s_ok, other=0.0)
    o = tl.load(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                other=0.0)  # (SPLITS_PAD, D_PAD)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # every split empty: a length-0 row
    w = l_s * tl.exp(m - m_max)  # (SPLITS_PAD,): each split's share of the softmax's denominator
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)  # (D_PAD,)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


MAX_SPLITS = 16  # vLLM's Triton backend fixes 16 decode segments (for small batches): more is mostly empty programs


def num_kv_splits(batch: int, kv_heads: int, max_seq_len: int, num_sms: int, block_n: int = BLOCK_N) -> int:
    """How many splits per sequence: enough programs to give every multiprocessor about four
    (``4 * num_sms`` over the ``batch * kv_heads`` programs of one split), a power of two, at most
    :data:`MAX_SPLITS` and at most the longest sequence's tile count rounded up to a power of two
    (so up to half the splits of the longest sequence can be empty). Depends on the batch and
    the longest length the step may hold, not on the lengths themselves, so a CUDA graph captured
    for a batch size keeps its grid."""
    tiles = max(1, -(-max_seq_len // block_n))
    want = max(1, -(-4 * num_sms // max(1, batch * kv_heads)))
    return min(triton.next_power_of_2(want), triton.next_power_of_2(tiles), MAX_SPLITS)


def split_kv_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, num_splits: int | None = None,
                              block_n: int = BLOCK_N, validate: bool = True) -> torch.Tensor:
    """Split-KV decode attention over a paged cache (module docstring): the same arguments and
    result as :func:`labsupport.paged_attention.paged_decode_attention`, ``(B, H, D)`` in q's
    dtype. ``num_splits`` defaults to :func:`num_kv_splits` for this device. ``validate=False``
    skips the argument checks (they read the lengths back to the host, a device sync): the
    engine's step and the benchmark's timed calls validate once, outside."""
    if validate:
        b, h, h_kv, d, _, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    else:
        (b, h, d), (_, block_size, h_kv, _) = q.shape, k_cache.shape
    interp = interpreter_mode()
    if q.device.type == "cpu" and not interp:
        raise ValueError("the tensors are on the CPU but Triton is not in interpreter mode: move them to the GPU")
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = num_kv_splits(b, h_kv, block_tables.shape[1] * block_size, sms, block_n)
    out_dtype = q.dtype
    if interp and q.dtype == torch.bfloat16:  # bf16 arithmetic is broken in the interpreter
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    group = h // h_kv
    mid_o = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    mid_m = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    d_pad = triton.next_power_of_2(d)
    split_kv_decode_kernel[(b, h_kv, num_splits)](
        q, k_cache, v_cache, tables, lens, mid_o, mid_m, mid_l,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0),
        1.0 / math.sqrt(d),
        H=h, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
    )
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    combine_splits_kernel[(b, h)](
        mid_o, mid_m, mid_l, out, out.stride(0), out.stride(1),
        H=h, HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)
