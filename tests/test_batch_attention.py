"""Paged attention for a flat, mixed batch (chapter 13's engine step): the spec against plain causal
attention, the torch and Triton implementations against the spec, the planted mistakes the cases
catch, and the slot-write kernel."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport import batch_attention as BA
from labsupport.paged_attention import gather_contiguous, random_paged_cache
from labsupport.transformer import sdpa_attention

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# one mixed step: a decode after 19 cached tokens, a 5-token chunk after 14, a whole 7-token prompt,
# a 1-token prompt; blocks of 4 (every last block partly filled), tables shuffled
SEQ_LENS, Q_LENS = [20, 19, 7, 1], [1, 5, 7, 1]


def mixed_case(dtype=torch.float32, heads=(6, 2), dim=16, block_size=4, seed=0):
    h, h_kv = heads
    k_cache, v_cache, tables, lens = random_paged_cache(SEQ_LENS, h_kv, dim, block_size, dtype=dtype, seed=seed)
    cu = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(Q_LENS), h, dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, k_cache, v_cache, tables, lens, cu


def causal_reference(q, k_cache, v_cache, tables, lens, cu):
    """Each sequence on its own through the model's SDPA with the end-aligned causal mask."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        k = gather_contiguous(k_cache, tables, n, i).repeat_interleave(group, 1).transpose(0, 1)[None]  # (1, H, T, D)
        v = gather_contiguous(v_cache, tables, n, i).repeat_interleave(group, 1).transpose(0, 1)[None]
        qq = q[rows].transpose(0, 1)[None]  # (1, H, q_len, D)
        out[rows] = sdpa_attention(qq.float(), k.float(), v.float(), qq.shape[2] > 1)[0].transpose(0, 1).to(q.dtype)
    return out


def assert_matches_spec(fn, dtype=torch.float32, **case):
    args = mixed_case(dtype, **case)
    want = BA.paged_attention_spec(*args)
    got = fn(*args)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    err = (got.float() - want.float()).abs().max().item()
    assert got.shape == want.shape and got.dtype == want.dtype and err <= tol, f"max error {err:.2e}"


def test_the_spec_is_causal_attention_of_each_sequence():
    args = mixed_case()
    torch.testing.assert_close(BA.paged_attention_spec(*args), causal_reference(*args), atol=1e-5, rtol=1e-5)


def test_torch_batch_matches_the_spec():
    assert_matches_spec(lambda *a: BA.paged_attention_torch(*a, max_q_len=max(Q_LENS)))
    assert_matches_spec(lambda *a: BA.paged_attention_torch(*a, max_q_len=max(Q_LENS)), heads=(4, 4))


@pytest.mark.parametrize("dtype,heads,block_size", [(torch.float32, (6, 2), 4), (torch.float16, (6, 2), 6)])
def test_triton_kernel_matches_the_spec(dtype, heads, block_size):
    assert_matches_spec(lambda *a: BA.paged_attention_triton(*a, block_n=16), dtype, heads=heads,
                        block_size=block_size)


# --- planted mistakes: what the mixed case tells apart -----------------------------------------

def _mutant(mistake):
    def attention(q, k_cache, v_cache, tables, lens, cu):
        out = torch.empty_like(q)
        h, h_kv = q.shape[1], k_cache.shape[2]
        for i, n in enumerate(lens.tolist()):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            q_len = rows.stop - rows.start
            if mistake == "ignores the table":
                blocks = torch.arange(-(-n // k_cache.shape[1]))
                k = k_cache[blocks].flatten(0, 1)[:n]
                v = v_cache[blocks].flatten(0, 1)[:n]
            else:
                k, v = gather_contiguous(k_cache, tables, n, i), gather_contiguous(v_cache, tables, n, i)
            if mistake == "only the step's own keys":
                k, v = k[n - q_len:], v[n - q_len:]
            heads = torch.arange(h) % h_kv if mistake == "query head h reads KV head h % Hkv" else \
                torch.arange(h) // (h // h_kv)
            k, v = k[:, heads].float(), v[:, heads].float()  # (T, H, D)
            s = torch.einsum("qhd,thd->hqt", q[rows].float(), k) / math.sqrt(q.shape[-1])
            t = torch.arange(k.shape[0])[None, :]
            q_pos = torch.arange(q_len)[:, None] + (k.shape[0] - q_len)
            if mistake == "mask aligned to the start":
                q_pos = torch.arange(q_len)[:, None]
            if mistake != "no causal mask":
                s = s.masked_fill(t > q_pos, float("-inf"))
            out[rows] = torch.einsum("hqt,thd->qhd", torch.softmax(s, -1), v).to(q.dtype)
        return out
    return attention


@pytest.mark.parametrize("mistake", ["no causal mask", "mask aligned to the start", "only the step's own keys",
                                     "query head h reads KV head h % Hkv", "ignores the table"])
def test_the_case_catches_planted_mistakes(mistake):
    with pytest.raises(AssertionError, match="max error"):
        assert_matches_spec(_mutant(mistake))
    assert_matches_spec(_mutant("none"))  # the mutants' scaffolding is right without its mistake


def test_query_tiles_cover_every_row_once():
    seqs, firsts, block_q = BA.query_tiles([1, 9, 16, 3], group=2)  # 16 rows: 8 tokens x 2 heads
    assert block_q == 8
    assert list(zip(seqs, firsts)) == [(0, 0), (1, 0), (1, 8), (2, 0), (2, 8), (3, 0)]
    assert BA.query_tiles([5], group=32)[2] == 1  # a group wider than the tile: one token per tile


def test_bad_inputs_say_which():
    q, k, v, t, lens, cu = mixed_case()
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and end at N"):
        BA.paged_attention_spec(q, k, v, t, lens, cu - 1)
    with pytest.raises(ValueError, match="query tokens and seq_lens"):
        BA.paged_attention_spec(q, k, v, t, torch.tensor([20, 19, 7, 0], dtype=torch.int32), cu)
    with pytest.raises(ValueError, match="H be a multiple of Hkv"):
        BA.paged_attention_spec(q[:, :5], k, v, t, lens, cu)


# --- writing the step's keys and values ----------------------------------------------------------

def test_store_kv_writes_each_token_to_its_slot_and_skips_padding():
    k_cache = torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([6, -1, 0, 11, 5])  # block 1 slot 2, padding, block 0 slot 0, ...
    for store in (BA.store_kv, BA.store_kv_triton):
        kc, vc = torch.zeros_like(k_cache), torch.zeros_like(k_cache)
        store(k, v, kc, vc, slots)
        for n, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(kc[slot // 4, slot % 4], k[n]) and torch.equal(vc[slot // 4, slot % 4], v[n])
        assert int((kc != 0).any(-1).any(-1).sum()) == 4, store.__name__  # nothing else written
    strided = torch.randn(2, 5, 8).transpose(0, 1)  # (N, Hkv, D) with the engine's head-major strides
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    BA.store_kv_triton(strided[:3], strided[:3], kc, vc, torch.tensor([1, 2, 3]))
    assert torch.equal(kc[0, 1:4], strided[:3])
