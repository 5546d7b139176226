"""Paged attention for one engine step: a flat batch of prefill chunks and decode tokens (chapter 13).

An engine step lays every scheduled token end to end, whatever sequence it belongs to and
whether it is a prompt chunk or a decode (chapter 13's engine, :mod:`labsupport.engine`). The
step's **flat metadata**, built once per step, tells attention where everything is:

=================  ===================  ====================================================
``q``              (N, H, D)            the step's N query tokens, sequence after sequence
``k_cache``        (num_blocks, BS,     one layer's paged cache (``v_cache`` the same)
                   Hkv, D)
``slot_mapping``   (N,) int64           where token ``n``'s key and value go:
                                        ``block * BS + offset``; -1 writes nothing (padding)
``block_tables``   (B, max_blocks)      each sequence's physical blocks, int32
``seq_lens``       (B,) int32           tokens in each sequence's cache once this step's are in
``cu_seqlens_q``   (B + 1,) int32       sequence ``b``'s query rows are ``cu[b] .. cu[b+1]-1``
=================  ===================  ====================================================

Sequence ``b``'s ``q_len = cu[b+1] - cu[b]`` queries are its *last* positions,
``seq_lens[b] - q_len .. seq_lens[b] - 1``, and attend causally to every key up to their own
position: a decode is ``q_len = 1``, a prefill chunk after cached tokens a larger ``q_len``. The
step first writes its keys and values into their slots (:func:`store_kv`), then one attention call
per layer covers the whole batch. Scores are ``q . k / sqrt(D)``; query head ``h`` reads KV head
``h // (H // Hkv)``; softmax in float32.

Three implementations of that call, one contract:

* :func:`paged_attention_spec`: a loop over sequences, plain torch (what the others are checked
  against);
* :func:`paged_attention_torch`: the whole batch in one ``scaled_dot_product_attention`` call over
  keys gathered through the block tables and padded to the longest sequence (the engine's path on a
  CPU);
* :func:`paged_attention_triton`: the Triton kernel, one program per (query tile, KV head): a tile
  is up to ``BLOCK_M`` rows made of ``BLOCK_Q`` query tokens times the ``G`` query heads of the KV
  head, so each key tile read serves the whole group, and it walks the sequence's pages in tiles of
  ``BLOCK_N`` tokens only up to its last query's position. The engine's path on a GPU for steps
  with prefill chunks; decode-only steps use :mod:`labsupport.flash_decoding`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .device import interpreter_mode
from .flash_decoding import load_kv_tile, online_softmax_step
from .paged_attention import gather_contiguous

__all__ = ["check_batch_inputs", "store_kv", "store_kv_triton", "paged_attention_spec", "paged_attention_torch",
           "paged_attention_triton", "query_tiles", "BLOCK_M", "BLOCK_N"]

BLOCK_M = 16  # query rows per program: BLOCK_Q tokens x G heads (tl.dot's smallest tile on a GPU is 16)
BLOCK_N = 64  # key/value tokens per tile


def check_batch_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> tuple[int, int, int, int, int]:
    """Validate the flat-batch arguments (module docstring); return ``(N, B, H, Hkv, D)``.
    Raises ValueError saying which argument is wrong. Reads the lengths back to the host."""
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                 cu_seqlens_q=cu_seqlens_q)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be (N, H, D): the step's query tokens; got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (num_blocks, block_size, Hkv, D), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    n, h, d = q.shape
    num_blocks, block_size, h_kv, d_k = k_cache.shape
    if d_k != d or h % h_kv:
        raise ValueError(f"q (N, H, D) = {tuple(q.shape)} does not fit the cache's (Hkv, D) = ({h_kv}, {d_k}): "
                         f"D must agree and H be a multiple of Hkv")
    if not (q.is_floating_point() and q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q and the caches must share one float dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    b = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != b or cu_seqlens_q.shape != (b + 1,):
        raise ValueError(f"seq_lens must be (B,), block_tables (B, max_blocks) and cu_seqlens_q (B + 1,); got "
                         f"{tuple(seq_lens.shape)}, {tuple(block_tables.shape)}, {tuple(cu_seqlens_q.shape)}")
    for name in ("block_tables", "seq_lens", "cu_seqlens_q"):
        if named[name].dtype.is_floating_point or named[name].dtype == torch.bool:
            raise ValueError(f"{name} must hold integers (torch.int32), got {named[name].dtype}")
    if len({t.device for t in named.values()}) > 1:
        raise ValueError("all arguments must be on one device")
    cu, lens, tables = cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables.tolist()
    if cu[0] != 0 or cu[-1] != n:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at N = {n}, got {cu[0]} and {cu[-1]}")
    for i in range(b):
        q_len = cu[i + 1] - cu[i]
        if q_len < 1 or q_len > lens[i]:
            raise ValueError(f"sequence {i} has {q_len} query tokens and seq_lens[{i}] = {lens[i]}: every sequence "
                             f"needs 1 to seq_len queries (its last positions)")
        used = -(-lens[i] // block_size)
        if used > block_tables.shape[1]:
            raise ValueError(f"seq_lens[{i}] = {lens[i]} needs {used} blocks but block_tables has "
                             f"{block_tables.shape[1]} columns")
        for j, blk in enumerate(tables[i][:used]):
            if not 0 <= blk < num_blocks:
                raise ValueError(f"block_tables[{i}, {j}] = {blk} is out of range (the cache has {num_blocks} blocks)")
    return n, b, h, h_kv, d


# --- writing the step's keys and values ---------------------------------------------------------


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write ``k`` and ``v`` (N, Hkv, D) into the slots ``slot_mapping`` (N,) names, in torch: one
    ``index_copy_`` per tensor; a slot of -1 writes nothing. The Triton twin is :func:`store_kv_triton`."""
    hkv, d = k_cache.shape[2:]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # padded rows (of a batch padded to a captured size) write nothing
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


@triton.jit
def store_kv_kernel(
    k_ptr,  # (N, Hkv, D), any token and head strides
    v_ptr,
    k_cache_ptr,  # (num_blocks * BS, Hkv * D) contiguous: slot s starts at s * Hkv * D
    v_cache_ptr,
    slot_ptr,  # (N,) int64; -1: nothing to write (a padded row)
    N,
    stride_kn, stride_kh,
    stride_vn, stride_vh,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW_PAD: tl.constexpr,  # KV_HEADS * HEAD_DIM rounded up to a power of two
    BLOCK_T: tl.constexpr,  # tokens per program
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, ROW_PAD)  # element (head, dim) of a token's keys, flattened
    head, dim = offs_e // HEAD_DIM, offs_e % HEAD_DIM
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < N, other=-1)  # (BLOCK_T,)
    ok = (slot >= 0)[:, None] & (offs_e < KV_HEADS * HEAD_DIM)[None, :]
    k = tl.load(k_ptr + offs_t[:, None] * stride_kn + head[None, :] * stride_kh + dim[None, :], mask=ok)
    v = tl.load(v_ptr + offs_t[:, None] * stride_vn + head[None, :] * stride_vh + dim[None, :], mask=ok)
    dst = slot.to(tl.int64)[:, None] * (KV_HEADS * HEAD_DIM) + offs_e[None, :]
    tl.store(k_cache_ptr + dst, k, mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping, block_t: int = 16) -> None:
    """:func:`store_kv` as one Triton kernel for keys and values together (slots of -1 are
    skipped, so a CUDA graph's padded rows write nothing). ``k_cache`` must be contiguous."""
    n, hkv, d = k.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("store_kv_triton needs contiguous caches and keys/values with unit stride in D")
    if n == 0:
        return
    store_kv_kernel[(triton.cdiv(n, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=hkv, HEAD_DIM=d, ROW_PAD=triton.next_power_of_2(hkv * d), BLOCK_T=block_t,
    )


# --- attention over the paged cache -----------------------------------------------------------


def paged_attention_spec(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> torch.Tensor:
    """The contract in plain torch, one sequence at a time (module docstring); ``(N, H, D)`` in q's
    dtype."""
    n, b, h, h_kv, d = check_batch_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    group = h // h_kv
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        rows = slice(cu[i], cu[i + 1])
        q_len = cu[i + 1] - cu[i]
        k = gather_contiguous(k_cache, block_tables, length, i).float().repeat_interleave(group, dim=1)  # (T, H, D)
        v = gather_contiguous(v_cache, block_tables, length, i).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,thd->hqt", q[rows].float(), k) / math.sqrt(d)  # (H, q_len, T)
        q_pos = torch.arange(length - q_len, length)[:, None]  # (q_len, 1)
        scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
        out[rows] = torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len: int) -> torch.Tensor:
    """The whole batch in one ``scaled_dot_product_attention`` call; ``(N, H, D)``. No argument
    checks and no host sync: ``max_q_len`` (the longest ``q_len``, known on the host) sizes the
    padding. Keys are gathered through the tables for ``block_tables.shape[1]`` blocks per sequence
    (pass tables as wide as the longest sequence needs), the queries padded to ``max_q_len`` rows."""
    n, h, d = q.shape
    b, max_blocks = block_tables.shape
    num_blocks, bs, h_kv, _ = k_cache.shape
    dev = q.device
    # keys and values of every sequence, (B, Hkv, T, D) with T = max_blocks * BS; unused table
    # entries (-1 or stale) are clamped to a valid block and masked out below
    blocks = block_tables.long().clamp(0, num_blocks - 1)  # (B, max_blocks)
    k = k_cache[blocks].reshape(b, max_blocks * bs, h_kv, d).transpose(1, 2)
    v = v_cache[blocks].reshape(b, max_blocks * bs, h_kv, d).transpose(1, 2)
    # the queries, (B, H, Q, D) with Q = max_q_len: row i of sequence b is flat row cu[b] + i
    starts, q_lens = cu_seqlens_q[:-1].long(), (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # (B,) each
    i = torch.arange(max_q_len, device=dev)  # (Q,)
    valid = i[None, :] < q_lens[:, None]  # (B, Q)
    rows = torch.where(valid, starts[:, None] + i[None, :], 0)  # (B, Q) flat row of each padded query
    qq = q[rows].transpose(1, 2)  # (B, H, Q, D)
    # each query's position; a padded row gets one past the end, so it sees every key (no empty
    # row), and a sequence of length 0 (a padded one) sees key 0: its rows are never used
    lens = seq_lens.long()[:, None]  # (B, 1)
    q_pos = torch.where(valid, lens - q_lens[:, None] + i[None, :], lens)  # (B, Q)
    k_pos = torch.arange(max_blocks * bs, device=dev)  # (T,)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens.clamp(min=1)[:, :, None])
    out = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask[:, None], enable_gqa=h != h_kv)  # (B, H, Q, D)
    # back to flat rows; padded rows land in a spare row N that is dropped
    flat = torch.empty((n + 1, h, d), dtype=out.dtype, device=dev)
    flat.index_copy_(0, torch.where(valid, rows, n).flatten(), out.transpose(1, 2).reshape(b * max_q_len, h, d))
    return flat[:n]


def query_tiles(q_lens, group: int, block_m: int = BLOCK_M) -> tuple[list[int], list[int], int]:
    """The programs of :func:`paged_attention_triton` along the queries: for each tile the
    sequence it belongs to and its first query row within that sequence, and ``BLOCK_Q``, the
    query tokens per tile (``block_m // group``, at least 1). Built on the host from the query
    lengths the scheduler chose (the engine does it once per step)."""
    block_q = max(1, block_m // group)
    seqs, firsts = [], []
    for i, q_len in enumerate(q_lens):
        for first in range(0, q_len, block_q):
            seqs.append(i)
            firsts.append(first)
    return seqs, firsts, block_q


@triton.jit
def paged_attention_kernel(
    q_ptr,  # (N, H, D)
    k_ptr,  # (num_blocks, BS, Hkv, D)
    v_ptr,
    out_ptr,  # (N, H, D)
    bt_ptr,  # (B, max_blocks) int32
    len_ptr,  # (B,) int32
    cu_ptr,  # (B + 1,) int32
    tile_seq_ptr,  # (num_tiles,) int32: the sequence of each query tile
    tile_first_ptr,  # (num_tiles,) int32: its first query row within the sequence
    stride_qn, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_on, stride_oh,
    stride_btb,
    sm_scale,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per tile: BLOCK_Q * GROUP <= BLOCK_M rows
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    BLOCK_N: tl.constexpr,  # key tokens per tile
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    row0 = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - row0
    seq_len = tl.load(len_ptr + seq)
    context = seq_len - q_len  # tokens cached before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = first + offs_m // GROUP  # (BLOCK_M,) the row's query token within the sequence
    head = kvh * GROUP + offs_m % GROUP  # (BLOCK_M,) and its query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (row0 + tok)[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, D_PAD)
    q_pos = context + tok  # (BLOCK_M,) a row past q_len sits past the end: it sees every key, is never stored

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    end = tl.minimum(seq_len, context + first + BLOCK_Q)  # keys past the tile's last query are never needed
    for start in range(0, end, BLOCK_N):
        pos = start + offs_n  # (BLOCK_N,)
        ok = pos < end
        k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr + seq * stride_btb, pos, ok, kvh, offs_d, d_ok,
                            stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh, BLOCK_SIZE)
        visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])  # causal: a query sees keys up to itself
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, sm_scale, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (row0 + tok)[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, tiles=None,
                           block_n: int = BLOCK_N, validate: bool = True) -> torch.Tensor:
    """The Triton kernel (module docstring): same arguments and result as
    :func:`paged_attention_spec`. ``tiles`` is ``(tile_seq, tile_first, BLOCK_Q)`` from
    :func:`query_tiles`, with the first two as int32 tensors on q's device (the engine builds them
    with the step's metadata); without it they are built here from ``cu_seqlens_q`` (a host sync).
    ``validate=False`` skips the argument checks."""
    if validate:
        _, _, h, h_kv, d = check_batch_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    else:
        (_, h, d), h_kv = q.shape, k_cache.shape[2]
    interp = interpreter_mode()
    if q.device.type == "cpu" and not interp:
        raise ValueError("the tensors are on the CPU but Triton is not in interpreter mode: move them to the GPU")
    group = h // h_kv
    if tiles is None:
        cu = cu_seqlens_q.tolist()
        seqs, firsts, block_q = query_tiles([cu[i + 1] - cu[i] for i in range(len(cu) - 1)], group)
        tiles = (torch.tensor(seqs, dtype=torch.int32, device=q.device),
                 torch.tensor(firsts, dtype=torch.int32, device=q.device), block_q)
    tile_seq, tile_first, block_q = tiles
    out_dtype = q.dtype
    if interp and q.dtype == torch.bfloat16:  # bf16 arithmetic is broken in the interpreter
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    paged_attention_kernel[(tile_seq.shape[0], h_kv)](
        q, k_cache, v_cache, out, tables, seq_lens, cu_seqlens_q, tile_seq, tile_first,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        tables.stride(0),
        1.0 / math.sqrt(d),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=max(BLOCK_M, triton.next_power_of_2(group)), HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)
