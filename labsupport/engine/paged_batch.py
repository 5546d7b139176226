"""The engine's KV batch: one step's flat metadata over the paged cache, consumed by every layer.

The model's forward pass takes a KV batch (:class:`labsupport.transformer.KVBatch`): positions for
RoPE, and an ``attend(layer, q, k, v)`` that stores the layer's keys and values and returns its
attention. :class:`PagedBatch` is the engine's: the model runner builds the step's metadata once
(:class:`StepMetadata`: slot mapping, block tables, sequence lengths, cumulative query lengths),
and each layer's own attention calls :meth:`PagedBatch.attend`, which

1. writes the layer's new keys and values into their slots, one call
   (``index_copy_`` on a CPU, :func:`labsupport.batch_attention.store_kv_triton` on a GPU);
2. runs one attention call over the whole mixed batch of prefill chunks and decodes (on a CPU one
   SDPA call (two when decodes share the step with prompt chunks), over indices and masks built once per step by
   :class:`~labsupport.engine.cpu_attention.CpuAttentionPlan`; on a GPU
   :mod:`labsupport.batch_attention`'s kernel, and for steps of decodes only the split-KV kernel of
   :mod:`labsupport.flash_decoding`).

This is nano-vllm's design (its ``Context`` carries the metadata to its ``Attention`` layer) and
vLLM's (``set_forward_context`` and an attention backend's metadata builder), with the metadata
handed to the forward pass explicitly instead of through a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch_attention import paged_attention_triton, store_kv_triton
from ..flash_decoding import split_kv_decode_attention
from .cpu_attention import CpuAttentionPlan

BACKENDS = ("torch", "triton")


@dataclass
class StepMetadata:
    """A step's flat metadata (shapes in :mod:`labsupport.batch_attention`), on the model's device."""

    input_ids: torch.Tensor  # (N,) int64: the step's tokens, sequence after sequence
    positions: torch.Tensor  # (N,) int64: each token's position in its sequence
    slot_mapping: torch.Tensor  # (N,) int64: block * block_size + offset of each token's key and value
    block_tables: torch.Tensor  # (B, W) int32: each sequence's blocks (W: what the longest needs)
    seq_lens: torch.Tensor  # (B,) int32: tokens each sequence holds once the step's are written
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32: sequence b's tokens are rows cu[b] .. cu[b+1]-1
    logits_indices: torch.Tensor  # (R,) int64: the last row of each sequence that samples this step
    max_q_len: int  # the most tokens one sequence has in the step (host-side: sizes padding)
    decode_only: bool  # every sequence runs exactly one token
    tiles: tuple | None = None  # the Triton prefill kernel's query tiles (batch_attention.query_tiles)


class PagedBatch:
    """The KV batch of one engine step (module docstring). ``backend``: ``"torch"`` (the CPU path:
    :class:`~labsupport.engine.cpu_attention.CpuAttentionPlan`, built at the first layer and reused by
    the others: one ``index_copy_`` per cache and one SDPA call per layer, two for a mixed step; one
    decoding sequence on consecutive blocks stores and reads through views, :meth:`CpuAttentionPlan.attend_one`) or ``"triton"`` (the kernels; a GPU, or the
    interpreter in tests). ``num_splits`` fixes the split-KV kernel's grid (a captured CUDA graph
    needs a fixed one); None lets it choose."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata, backend: str = "torch",
                 num_splits: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.k_cache, self.v_cache = k_cache, v_cache  # (L, num_blocks, block_size, Hkv, D) each
        self.meta, self.backend, self.num_splits = meta, backend, num_splits
        self.positions = meta.positions  # (N,): the model's RoPE reads them
        self.plan: CpuAttentionPlan | None = None  # the torch path's per-step indices and masks (first layer)
        # the plan's batch-1 decode reads the caches through strided views, which needs them contiguous
        self._views = backend == "torch" and k_cache.is_contiguous() and v_cache.is_contiguous()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D), k and v (1, Hkv, N, D): store k and v in their slots, attend over the cache."""
        m = self.meta
        if self.backend == "torch":
            if self.plan is None:  # once per step: every layer reads the same positions
                self.plan = CpuAttentionPlan(m, self.k_cache.shape[2], self.k_cache.dtype)
            if self.plan.one_slot is not None and self._views:  # batch-1 decode on consecutive blocks: views only
                return self.plan.attend_one(layer, q, k, v, self.k_cache, self.v_cache)  # (1, H, 1, D)
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, heads, D) views
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]  # (num_blocks, block_size, Hkv, D)
        if self.backend == "torch":
            out = self.plan.attend(q, k, v, k_cache, v_cache)
        else:
            store_kv_triton(k, v, k_cache, v_cache, m.slot_mapping)
            if m.decode_only:  # one query per sequence: rows of q are the sequences
                out = split_kv_decode_attention(q, k_cache, v_cache, m.block_tables, m.seq_lens,
                                                num_splits=self.num_splits, validate=False)
            else:
                out = paged_attention_triton(q, k_cache, v_cache, m.block_tables, m.seq_lens, m.cu_seqlens_q,
                                             tiles=m.tiles, validate=False)
        return out.transpose(0, 1)[None]  # (1, H, N, D)
