"""The engine's CPU attention (labsupport.engine.cpu_attention): the step's plan, built once, gives
the spec's attention for mixed steps and steps of decodes only (equal and unequal lengths, padded
rows), stores the step's keys and values in their slots, and is reused by every layer of a step."""

from __future__ import annotations

import pytest
import torch

from labsupport import batch_attention as BA
from labsupport.engine.cpu_attention import CpuAttentionPlan
from labsupport.engine.paged_batch import PagedBatch, StepMetadata
from labsupport.paged_attention import random_paged_cache

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def step(seq_lens, q_lens, heads=(6, 2), dim=16, block_size=4, dtype=torch.float32, pad=0, seed=0):
    """A step over a random paged cache: (metadata, q, k, v, caches); ``pad`` padded decode rows
    (slot -1, length 0) after the real ones, as a captured batch size pads them."""
    h, h_kv = heads
    k_cache, v_cache, tables, lens = random_paged_cache(seq_lens, h_kv, dim, block_size, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = sum(q_lens)
    q, k, v = (torch.randn(n + pad, hh, dim, generator=g).to(dtype) for hh in (h, h_kv, h_kv))
    slots = []
    for b, (length, q_len) in enumerate(zip(seq_lens, q_lens)):
        for p in range(length - q_len, length):
            slots.append(int(tables[b, p // block_size]) * block_size + p % block_size)
    slots += [-1] * pad
    lens = torch.tensor([*seq_lens, *[0] * pad], dtype=torch.int32)
    tables = torch.cat([tables, torch.zeros(pad, tables.shape[1], dtype=tables.dtype)])
    cu = torch.tensor([0, *torch.tensor([*q_lens, *[1] * pad]).cumsum(0).tolist()], dtype=torch.int32)
    meta = StepMetadata(input_ids=torch.zeros(n + pad, dtype=torch.long), positions=torch.zeros(n + pad, dtype=torch.long),
                        slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=lens, cu_seqlens_q=cu,
                        logits_indices=torch.arange(n), max_q_len=max(q_lens), decode_only=max(q_lens) == 1)
    return meta, q, k, v, k_cache, v_cache


def expected(meta, q, k, v, k_cache, v_cache):
    """The spec after writing the step's keys and values with the reference store."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    BA.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    real = int((meta.seq_lens > 0).sum())
    rows = int(meta.cu_seqlens_q[real])
    out = BA.paged_attention_spec(q[:rows], k_cache, v_cache, meta.block_tables[:real], meta.seq_lens[:real],
                                  meta.cu_seqlens_q[:real + 1])
    return out, k_cache, v_cache


@pytest.mark.parametrize("seq_lens,q_lens,pad", [
    ([20, 19, 7, 1], [1, 5, 7, 1], 0),  # mixed: a decode, a chunk after cached tokens, whole prompts
    ([13, 6, 9], [1, 1, 1], 0),  # decodes of unequal lengths: a length mask
    ([9, 9], [1, 1], 0),  # decodes of equal lengths: no mask at all
    ([9, 14], [1, 1], 2),  # decodes with padded rows (slot -1, length 0)
    ([12, 30, 5], [4, 3, 1], 0),  # speculative verify rows: several queries per sequence after cached tokens
])
def test_the_plan_matches_the_spec_and_stores_the_steps_keys(seq_lens, q_lens, pad):
    meta, q, k, v, k_cache, v_cache = step(seq_lens, q_lens, pad=pad)
    want, k_want, v_want = expected(meta, q, k, v, k_cache, v_cache)
    plan = CpuAttentionPlan(meta, k_cache.shape[1], k_cache.dtype)
    split = not meta.decode_only and 1 in q_lens and max(q_lens) > 1
    assert (plan.parts is not None) == split  # decodes beside prompt chunks: one SDPA call per kind
    if split:  # the decodes' call folds their heads, not padded to the longest chunk
        assert plan.parts[0][1].decode_only and plan.parts[0][0].tolist() == [r for r, n in zip(
            meta.cu_seqlens_q[:-1].tolist(), q_lens) if n == 1]
    else:
        assert (plan.mask is None) == (len(set(seq_lens)) == 1 and meta.decode_only and not pad)
    got = plan.attend(q, k, v, k_cache, v_cache)
    assert got.shape == q.shape
    torch.testing.assert_close(got[:want.shape[0]], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_bf16_and_grouped_heads_match_the_spec():
    meta, q, k, v, k_cache, v_cache = step([20, 19, 7, 1], [1, 5, 7, 1], heads=(9, 3), dtype=torch.bfloat16)
    want, _, _ = expected(meta, q, k, v, k_cache, v_cache)
    got = CpuAttentionPlan(meta, k_cache.shape[1], k_cache.dtype).attend(q, k, v, k_cache, v_cache)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_a_paged_batch_builds_its_plan_once_for_every_layer(monkeypatch):
    meta, q, k, v, k_cache, v_cache = step([13, 6, 9], [1, 1, 1])
    built = []
    monkeypatch.setattr(CpuAttentionPlan, "__init__", lambda self, *a, __init=CpuAttentionPlan.__init__:
                        (built.append(1), __init(self, *a))[1])
    layers = 3
    kv = PagedBatch(torch.stack([k_cache] * layers), torch.stack([v_cache] * layers), meta, "torch")
    outs = [kv.attend(i, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            for i in range(layers)]
    assert len(built) == 1  # the indices and masks of the step were built once, not once per layer
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("q_len", [1, 4])  # a decode; a prompt chunk after 7 cached tokens
def test_one_sequence_on_consecutive_blocks_reads_a_view_and_matches_the_spec(q_len):
    meta, q, k, v, k_cache, v_cache = step([11], [q_len], block_size=4)
    meta.block_tables[0, :3] = torch.tensor([2, 3, 4], dtype=meta.block_tables.dtype)  # consecutive blocks
    meta.slot_mapping[:] = torch.tensor([(2 + p // 4) * 4 + p % 4 for p in range(11 - q_len, 11)])  # 10: block 4, offset 2
    want, _, _ = expected(meta, q, k, v, k_cache, v_cache)
    plan = CpuAttentionPlan(meta, 4, k_cache.dtype)
    assert plan.run_start == 2
    torch.testing.assert_close(plan.attend(q, k, v, k_cache, v_cache), want, atol=1e-5, rtol=1e-5)
    meta.block_tables[0, :3] = torch.tensor([2, 5, 4], dtype=meta.block_tables.dtype)
    assert CpuAttentionPlan(meta, 4, k_cache.dtype).run_start is None  # not consecutive: gathered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_1_decode_through_the_paged_batch_stores_and_attends_through_views(dtype):
    """One decoding sequence on consecutive blocks (a lone request): PagedBatch.attend takes the plan's
    view-only path (attend_one) for every layer, writes the token's key and value in that layer's slot
    only, and gives the spec's attention (and the general path's numbers)."""
    meta, q, k, v, k_cache, v_cache = step([11], [1], heads=(6, 2), block_size=4, dtype=dtype)
    meta.block_tables[0, :3] = torch.tensor([2, 3, 4], dtype=meta.block_tables.dtype)  # consecutive blocks
    meta.slot_mapping[:] = torch.tensor([4 * 4 + 2])  # position 10: block 4, offset 2
    want, k_want, v_want = expected(meta, q, k, v, k_cache, v_cache)
    layers = 3
    k_all, v_all = torch.stack([k_cache] * layers), torch.stack([v_cache] * layers)  # (L, NB, BS, Hkv, D)
    before = k_all.clone()
    kv = PagedBatch(k_all, v_all, meta, "torch")
    for layer in range(layers):
        out = kv.attend(layer, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        assert kv.plan.one_slot == 18 and out.shape == (1, 6, 1, 16)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[0].transpose(0, 1), want, atol=tol, rtol=tol)
        assert torch.equal(k_all[layer], k_want) and torch.equal(v_all[layer], v_want)
        general = CpuAttentionPlan(meta, 4, dtype)._read(q, k_want, v_want)
        assert torch.equal(out[0].transpose(0, 1), general)  # the same numbers as the gathered path
    changed = (k_all != before).flatten(2).any(-1)  # (L, NB): blocks written
    assert changed.sum() == layers and changed[:, 4].all()  # one slot of block 4 per layer, nothing else


def test_a_non_contiguous_cache_takes_the_gathered_path_with_the_same_numbers():
    """attend_one's strided views assume contiguous caches; caches that are views of a larger tensor
    (keys and values interleaved per layer) fall back to the gathered path, with the spec's result."""
    meta, q, k, v, k_cache, v_cache = step([11], [1], block_size=4)
    meta.block_tables[0, :3] = torch.tensor([2, 3, 4], dtype=meta.block_tables.dtype)
    meta.slot_mapping[:] = torch.tensor([4 * 4 + 2])
    want, k_want, _ = expected(meta, q, k, v, k_cache, v_cache)
    both = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # (L, 2, NB, BS, Hkv, D)
    k_all, v_all = both[:, 0], both[:, 1]  # non-contiguous views
    kv = PagedBatch(k_all, v_all, meta, "torch")
    out = kv.attend(1, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    assert not kv._views and kv.plan.one_slot is not None  # the plan would, the caches do not allow it
    torch.testing.assert_close(out[0].transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_all[1], k_want)
