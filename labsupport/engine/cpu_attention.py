"""The engine's attention on a CPU: what a step needs, built once, then one SDPA call per layer.

A step's flat metadata (:class:`~labsupport.engine.paged_batch.StepMetadata`) says where every
token's keys are in the paged cache. The torch reference of the batched attention
(:func:`labsupport.batch_attention.paged_attention_torch`) turns it, in every call, into gather
indices, query rows and a position mask; the engine calls attention once per layer, so a 30-layer
model rebuilt the same indices and masks 30 times a step, and gathered every block of each table
(a profile of SmolLM2-135M at batch 16 found ``aten::index`` at 11% of the step). Here
:class:`CpuAttentionPlan` builds them once per step from the metadata (as vLLM's attention
backends build their metadata once per step), and :meth:`CpuAttentionPlan.attend` is, per layer,

* one ``index_copy_`` per cache for the step's new keys and values (slots of -1 already dropped);
* one ``index_select`` per cache of the blocks the step's sequences hold (whole blocks, contiguous
  rows of ``BS * Hkv * D`` values), cut at ``T``, the longest sequence's length (none for one
  sequence whose blocks follow each other in the pool: a view of the cache);
* one ``scaled_dot_product_attention`` call. A step of decodes only folds each KV head's ``G`` query
  heads into SDPA's query axis (``(B, Hkv, G, D)`` against ``(B, Hkv, T, D)``: the cache is read
  once, unexpanded, as :class:`labsupport.transformer.ContiguousBatch` does for one sequence) with a
  length mask only when the lengths differ; a step with prompt chunks pads each sequence's queries
  to the longest chunk and masks causally by position, its output rows put back in one copy. A step
  that mixes decodes with prompt chunks makes two calls, the decodes' (folded, as above) and the
  chunks' (padded): padded to the longest chunk, every decode would cost that chunk's length in
  arithmetic (a 128-token prompt beside 7 decodes: 8 x 128 query rows for 135 real ones).

A step of one decoding sequence whose blocks follow each other in the pool (a lone request on a fresh
pool: batch-1 decode) takes :meth:`CpuAttentionPlan.attend_one` instead: it writes the token's key and
value into its slot and hands SDPA one strided view per cache of the whole (layers, blocks, ...) tensor,
a handful of operators per layer instead of about thirty.

The result equals :func:`labsupport.batch_attention.paged_attention_spec` (the tests check it).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

__all__ = ["CpuAttentionPlan"]


class CpuAttentionPlan:
    """One step's gather indices, masks and output rows, shared by every layer (module docstring).

    ``meta`` is the step's :class:`~labsupport.engine.paged_batch.StepMetadata` (on the CPU);
    ``block_size`` the cache's; ``dtype`` the cache's (the additive mask's dtype)."""

    def __init__(self, meta, block_size: int, dtype: torch.dtype):
        self.decode_only = bool(meta.decode_only)
        self.one_slot = None  # set below for batch-1 decode on consecutive blocks (attend_one)
        slots = meta.slot_mapping.long()
        keep = slots >= 0  # a padded row (slot -1) writes nothing
        self.store_rows = None if bool(keep.all()) else keep.nonzero().flatten()  # (N',) or None: every row
        self.store_slots = slots if self.store_rows is None else slots[self.store_rows]
        self.parts = None
        if not self.decode_only:
            q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()  # (B,)
            one = q_lens == 1
            if bool(one.any()) and bool((q_lens > 1).any()):
                # decodes beside prompt chunks: padded to the longest chunk (Q rows) a decode would cost
                # Q times its arithmetic, so each kind gets its own SDPA call over its own rows
                seq_of_row = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens)
                self.parts = [(kind[seq_of_row].nonzero().flatten(), CpuAttentionPlan(_subset(meta, kind, q_lens), block_size, dtype))
                              for kind in (one, ~one)]  # (rows, plan) per kind
                return
        lens = meta.seq_lens.long().clamp(min=1)  # (B,): a padded sequence of length 0 reads one key, never used
        b = lens.shape[0]
        t = int(lens.max())  # T: the longest sequence's keys
        dev = lens.device
        pos = torch.arange(t, device=dev)  # (T,)
        # the blocks that hold them: W = ceil(T / BS) per sequence (a table's unused entries, -1, read
        # block 0 and are masked), gathered whole: one row of BS * Hkv * D values per block
        self.w = -(-t // block_size)
        self.kv_index = meta.block_tables[:, :self.w].long().clamp(min=0).flatten()  # (B * W,)
        # one sequence whose blocks follow each other in the pool (a fresh pool hands them out in
        # order): its keys are a view of the cache, nothing gathered
        first = int(self.kv_index[0])
        self.run_start = first if b == 1 and torch.equal(self.kv_index, torch.arange(first, first + self.w, device=dev)) else None
        self.b, self.t = b, t
        # batch-1 decode on consecutive blocks (the common case of one request): attend_one stores and
        # reads through views of the whole cache, a few operators per layer instead of about thirty
        one = self.decode_only and self.run_start is not None and self.store_rows is None and slots.shape[0] == 1
        self.one_slot = int(slots[0]) if one else None
        self._flat = None  # attend_one's (slots, Hkv, D) views of every layer's cache, made at its first call
        masked = pos[None, :] >= lens[:, None]  # (B, T): keys past a sequence's end
        if self.decode_only:
            self.mask = _additive(masked[:, None, None, :], dtype) if bool(masked.any()) else None  # (B, 1, 1, T)
            return
        # prompt chunks: sequence b's queries are its last q_len positions, padded to Q = max_q_len rows
        cu = meta.cu_seqlens_q.long()
        starts, q_lens = cu[:-1], cu[1:] - cu[:-1]  # (B,) each
        q = int(meta.max_q_len)
        i = torch.arange(q, device=dev)  # (Q,)
        valid = i[None, :] < q_lens[:, None]  # (B, Q)
        self.q_rows = torch.where(valid, starts[:, None] + i[None, :], 0).flatten()  # (B * Q,) flat row of each
        # each query's position (a padded query gets the last one, so no row is empty)
        q_pos = torch.where(valid, lens[:, None] - q_lens[:, None] + i[None, :], lens[:, None] - 1)  # (B, Q)
        hidden = (pos[None, None, :] > q_pos[:, :, None]) | masked[:, None, :]  # (B, Q, T)
        self.mask = _additive(hidden[:, None], dtype)  # (B, 1, Q, T)
        self.n, self.q = int(cu[-1]), q
        self.out_rows = torch.where(valid, starts[:, None] + i[None, :], self.n).flatten()  # padded rows: spare row N

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
        """One layer: ``q`` (N, H, D), ``k`` and ``v`` (N, Hkv, D) and the layer's caches
        (num_blocks, BS, Hkv, D); stores ``k`` and ``v``, returns the attention (N, H, D)."""
        n, h, d = q.shape
        hkv = k_cache.shape[2]
        k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)  # (slots, Hkv, D)
        if self.store_rows is not None:
            k, v = k[self.store_rows], v[self.store_rows]
        k_flat.index_copy_(0, self.store_slots, k.to(k_cache.dtype))
        v_flat.index_copy_(0, self.store_slots, v.to(v_cache.dtype))
        if self.parts is None:
            return self._read(q, k_cache, v_cache)
        out = q.new_empty((n, h, d))
        for rows, part in self.parts:  # the decodes, then the prompt chunks
            out.index_copy_(0, rows, part._read(q.index_select(0, rows), k_cache, v_cache))
        return out

    def attend_one(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_all: torch.Tensor,
                   v_all: torch.Tensor) -> torch.Tensor:
        """Batch-1 decode on consecutive blocks (``one_slot`` set): ``q`` (1, H, 1, D), ``k`` and ``v``
        (1, Hkv, 1, D), the whole caches ``k_all``, ``v_all`` (L, num_blocks, BS, Hkv, D). Stores the
        token's key and value in its slot of ``layer`` and attends over the sequence's ``T`` keys, read as
        one strided view per cache; returns (1, H, 1, D). The same numbers as :meth:`attend`."""
        _, h, _, d = q.shape
        hkv = k_all.shape[3]
        slots_per_layer = k_all.shape[1] * k_all.shape[2]
        if self._flat is None:
            self._flat = (k_all.view(-1, hkv, d), v_all.view(-1, hkv, d))  # (L * slots, Hkv, D)
        row = layer * slots_per_layer + self.one_slot
        self._flat[0][row].copy_(k.reshape(hkv, d))
        self._flat[1][row].copy_(v.reshape(hkv, d))
        # sequence b = 0's keys: T rows from block run_start of this layer, as (1, Hkv, T, D)
        size, stride = (1, hkv, self.t, d), (self.t * hkv * d, d, hkv * d, 1)
        offset = layer * k_all.stride(0) + self.run_start * k_all.stride(1)
        keys = torch.as_strided(k_all, size, stride, k_all.storage_offset() + offset)
        values = torch.as_strided(v_all, size, stride, v_all.storage_offset() + offset)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, h // hkv, d), keys, values)  # (1, Hkv, G, D)
        return out.view(1, h, 1, d)

    def _read(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The attention of the plan's query rows ``q`` (N, H, D) over the cache (its keys stored)."""
        n, h, d = q.shape
        hkv = k_cache.shape[2]
        b, t, bs = self.b, self.t, k_cache.shape[1]
        # (B, Hkv, T, D) views of each sequence's blocks laid end to end, cut at T
        if self.run_start is not None:  # consecutive blocks: a view
            keys, values = (c[self.run_start:self.run_start + self.w] for c in (k_cache, v_cache))
        else:
            keys, values = k_cache.index_select(0, self.kv_index), v_cache.index_select(0, self.kv_index)
        keys = keys.view(b, self.w * bs, hkv, d)[:, :t].transpose(1, 2)
        values = values.view(b, self.w * bs, hkv, d)[:, :t].transpose(1, 2)
        if self.decode_only:  # row b of q is sequence b's one query: fold the G query heads of a KV head
            out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), keys, values,
                                                 attn_mask=self.mask)  # (B, Hkv, G, D)
            return out.reshape(n, h, d)
        qq = q.index_select(0, self.q_rows).view(b, self.q, h, d).transpose(1, 2)  # (B, H, Q, D)
        out = F.scaled_dot_product_attention(qq, keys, values, attn_mask=self.mask, enable_gqa=h != hkv)  # (B, H, Q, D)
        flat = q.new_empty((n + 1, h, d))
        flat.index_copy_(0, self.out_rows, out.transpose(1, 2).reshape(b * self.q, h, d))
        return flat[:n]


def _subset(meta, keep: torch.Tensor, q_lens: torch.Tensor) -> SimpleNamespace:
    """The metadata of the sequences ``keep`` (B,) selects, their query rows renumbered from 0."""
    q_lens = q_lens[keep]
    cu = torch.zeros(q_lens.shape[0] + 1, dtype=torch.long, device=q_lens.device)
    cu[1:] = q_lens.cumsum(0)
    return SimpleNamespace(slot_mapping=meta.slot_mapping[:0], block_tables=meta.block_tables[keep],
                           seq_lens=meta.seq_lens[keep], cu_seqlens_q=cu, max_q_len=int(q_lens.max()),
                           decode_only=bool((q_lens == 1).all()))


def _additive(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: not seen) as SDPA's additive float mask: 0 where seen, -inf where not."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
