"""Decode attention over a paged KV cache: the reference in torch, and the course's Triton kernel.

Chapter 10 explains it. One new token per sequence attends to every token its cache holds, and
the cache is paged (:mod:`labsupport.paged_cache`): the keys of sequence ``b`` at position ``p``
are ``k_cache[block_tables[b, p // block_size], p % block_size]``.

Shapes (the names used in comments)::

    q             (B, H, D)          one query per sequence and query head
    k_cache       (N, BS, Hkv, D)    N physical blocks of BS token slots (v_cache the same)
    block_tables  (B, max_blocks)    int32: physical block of each logical block; entries past
                                     ceil(seq_lens[b] / BS) are ignored (padding)
    seq_lens      (B,)               int32: tokens in each sequence's cache, the new one included
    out           (B, H, D)          q's dtype

Grouped-query attention: query head ``h`` reads KV head ``h // (H // Hkv)``. Scores are
``q . k / sqrt(D)``; the softmax is in float32.
"""

from __future__ import annotations

import math

import torch

from ._answers import answer
from ._validate import positive_int

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is part of the course's install
    triton = None

__all__ = [
    "check_paged_inputs",
    "paged_decode_attention",
    "paged_decode_attention_triton",
    "contiguous_decode_attention",
    "gather_contiguous",
    "random_paged_cache",
    "paged_decode_bytes",
    "contiguous_decode_bytes",
]


def check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> tuple[int, int, int, int, int, int]:
    """Validate the paged-attention arguments; return ``(B, H, Hkv, D, num_blocks, block_size)``.

    Raises ValueError saying which argument is wrong: a shape, a dtype, a device, a length longer
    than its table, or a block id out of range (only the entries a sequence uses are read).
    """
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D): one query per sequence and head; got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be (num_blocks, block_size, Hkv, D), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    b, h, d = q.shape
    num_blocks, block_size, h_kv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(f"head dim differs: q has D={d}, k_cache has D={d_k}")
    if min(b, h, d, num_blocks, block_size, h_kv) == 0:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if h % h_kv:
        raise ValueError(f"the {h} query heads of q must be a multiple of the {h_kv} KV heads of k_cache")
    if not (q.is_floating_point() and q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one float dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be (B, max_blocks) with B={b}, got shape {tuple(block_tables.shape)}")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must be (B,) with B={b}, got shape {tuple(seq_lens.shape)}")
    for name in ("block_tables", "seq_lens"):
        t = tensors[name]
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers (torch.int32), got {t.dtype}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"all arguments must be on one device, got {', '.join(sorted(map(str, devices)))}")
    lens = seq_lens.tolist()
    tables = block_tables.tolist()
    max_blocks = block_tables.shape[1]
    for i, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"seq_lens[{i}] = {n}: every sequence holds at least its new token (1 or more)")
        used = -(-n // block_size)
        if used > max_blocks:
            raise ValueError(f"seq_lens[{i}] = {n} needs {used} blocks of {block_size} tokens, but block_tables "
                             f"has only {max_blocks} columns: the length is longer than its table")
        for j, blk in enumerate(tables[i][:used]):
            if not 0 <= blk < num_blocks:
                raise ValueError(f"block_tables[{i}, {j}] = {blk} is out of range: the cache has {num_blocks} "
                                 f"blocks (ids 0 to {num_blocks - 1})")
    return b, h, h_kv, d, num_blocks, block_size


def gather_contiguous(k_cache, block_tables, seq_len: int, row: int) -> torch.Tensor:
    """Sequence ``row``'s first ``seq_len`` keys (or values) from the paged cache, ``(seq_len, Hkv, D)``."""
    block_size = k_cache.shape[1]
    used = -(-seq_len // block_size)
    blocks = block_tables[row, :used].long()
    return k_cache[blocks].reshape(used * block_size, *k_cache.shape[2:])[:seq_len]


@answer
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens) -> torch.Tensor:
    """Decode attention over a paged cache, in plain torch (the spec the lab's kernel is checked
    against); shapes in the module docstring. Returns ``(B, H, D)`` in q's dtype."""
    b, h, h_kv, d, _, _ = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    group = h // h_kv
    out = torch.empty_like(q)
    for row, n in enumerate(seq_lens.tolist()):
        k = gather_contiguous(k_cache, block_tables, n, row).float()  # (n, Hkv, D)
        v = gather_contiguous(v_cache, block_tables, n, row).float()
        k = k.repeat_interleave(group, dim=1)  # (n, H, D): query head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) / math.sqrt(d)  # (H, n)
        out[row] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def contiguous_decode_attention(q, k, v, seq_lens) -> torch.Tensor:
    """Decode attention over a contiguous cache ``k, v`` of shape ``(B, S_max, Hkv, D)`` (positions
    past ``seq_lens[b]`` ignored), in torch: the baseline paging is compared with."""
    b, h, d = q.shape
    h_kv = k.shape[2]
    pos = torch.arange(k.shape[1], device=q.device)
    qg = q.float().view(b, h_kv, h // h_kv, d)  # (B, Hkv, G, D)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k.float()) / math.sqrt(d)  # (B, Hkv, G, S)
    scores = scores.masked_fill(pos[None, None, None, :] >= seq_lens.to(q.device)[:, None, None, None].long(),
                                float("-inf"))
    out = torch.einsum("bkgs,bskd->bkgd", torch.softmax(scores, dim=-1), v.float())
    return out.reshape(b, h, d).to(q.dtype)


def random_paged_cache(seq_lens, n_kv_heads: int, head_dim: int, block_size: int, *, spare_blocks: int = 3,
                       dtype=torch.float32, device="cpu", seed: int = 0, pad: int = -1):
    """A paged cache filled with random keys and values, and block tables in random physical order.

    Returns ``(k_cache, v_cache, block_tables, seq_lens)``. Every slot is random, the unused tail
    of each last block included (a kernel that forgets the tail mask reads those values), and
    ``spare_blocks`` random blocks belong to no sequence. Table entries past a sequence's blocks
    hold ``pad``.
    """
    lens = [positive_int("seq_lens", n) for n in seq_lens]
    block_size = positive_int("block_size", block_size)
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # physical blocks, shuffled
    tables = torch.full((len(lens), max(used)), pad, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(used):
        tables[row, :count] = torch.tensor(order[taken:taken + count], dtype=torch.int32)
        taken += count
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    return k_cache, v_cache, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def paged_decode_bytes(seq_lens, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
                       dtype_bytes: float = 2, table_dtype_bytes: int = 4) -> int:
    """Bytes a paged decode-attention kernel must move, counted the way the course's kernel
    works (one program per (sequence, KV head)): each program reads its group's queries once,
    the keys and values of its sequence's tokens for its KV head (masked tail slots are not
    read), one table entry per block it visits, and its sequence's length; it writes its
    group's outputs. Contiguous attention moves the same minus the table reads."""
    lens = [positive_int("seq_lens", n) for n in seq_lens]
    q_and_out = 2 * len(lens) * n_heads * head_dim * dtype_bytes
    kv = 2 * sum(lens) * n_kv_heads * head_dim * dtype_bytes
    tables = sum(-(-n // block_size) for n in lens) * n_kv_heads * table_dtype_bytes
    lengths = len(lens) * n_kv_heads * 4
    return int(q_and_out + kv + tables + lengths)


def contiguous_decode_bytes(seq_lens, n_heads: int, n_kv_heads: int, head_dim: int, dtype_bytes: float = 2) -> int:
    """Bytes decode attention over a contiguous cache must move: queries, outputs, and the keys
    and values of the tokens each sequence holds (not of its whole reservation)."""
    lens = [positive_int("seq_lens", n) for n in seq_lens]
    return int(2 * len(lens) * n_heads * head_dim * dtype_bytes + 2 * sum(lens) * n_kv_heads * head_dim * dtype_bytes)


# --- the Triton kernel -------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def paged_decode_attention_kernel(
        q_ptr,  # (B, H, D)
        k_ptr,  # (N, BS, Hkv, D)
        v_ptr,  # (N, BS, Hkv, D)
        bt_ptr,  # (B, max_blocks) int32
        len_ptr,  # (B,) int32
        out_ptr,  # (B, H, D)
        stride_qb, stride_qh,
        stride_kn, stride_kt, stride_kh,
        stride_vn, stride_vt, stride_vh,
        stride_btb,
        stride_ob, stride_oh,
        sm_scale,
        GROUP: tl.constexpr,  # H // Hkv query heads share one KV head
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange needs one)
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        BLOCK_PAD: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
    ):
        # One program per (sequence, KV head): it loads each key and value block once for all
        # GROUP query heads that read it.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_t = tl.arange(0, BLOCK_PAD)
        heads = kvh * GROUP + offs_g  # (GROUP_PAD,) query heads of this group
        head_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (GROUP_PAD, D_PAD)
        seq_len = tl.load(len_ptr + b)

        m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, D_PAD), dtype=tl.float32)
        for logical in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            physical = tl.load(bt_ptr + b * stride_btb + logical).to(tl.int64)  # the block table lookup
            pos = logical * BLOCK_SIZE + offs_t  # (BLOCK_PAD,) token positions in this block
            valid = (offs_t < BLOCK_SIZE) & (pos < seq_len)  # the last block may be partly filled
            kv_ok = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + physical * stride_kn + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=kv_ok, other=0.0).to(tl.float32)  # (BLOCK_PAD, D_PAD)
            v = tl.load(v_ptr + physical * stride_vn + offs_t[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale  # (GROUP_PAD, BLOCK_PAD)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # (GROUP_PAD, BLOCK_PAD)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (GROUP_PAD, D)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])


@answer
def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, *, validate: bool = True) -> torch.Tensor:
    """The course's paged decode-attention kernel: same arguments and result as
    :func:`paged_decode_attention`. Any ``block_size`` and ``D``: tiles are padded to powers of two
    and masked, so the padding is never loaded or stored. ``validate=False`` skips the argument
    checks, which read the lengths and tables back to the host (a benchmark checks once, then
    times the kernel alone)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("paged_decode_attention_triton needs triton; install the course's requirements")
    from .device import interpreter_mode

    if validate:
        b, h, h_kv, d, _, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    else:
        (b, h, d), (_, block_size, h_kv, _) = q.shape, k_cache.shape
    interp = interpreter_mode()
    if q.device.type == "cpu" and not interp:
        raise ValueError("the tensors are on the CPU but Triton is not in interpreter mode: move them to the GPU")
    out_dtype = q.dtype
    if interp and q.dtype == torch.bfloat16:  # bf16 arithmetic is broken in the interpreter
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = h // h_kv
    paged_decode_attention_kernel[(b, h_kv)](
        q, k_cache, v_cache, tables, lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0),
        out.stride(0), out.stride(1),
        1.0 / math.sqrt(d),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=block_size, BLOCK_PAD=triton.next_power_of_2(block_size),
    )
    return out.to(out_dtype)
