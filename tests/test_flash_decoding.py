"""Split-KV paged decode (Flash-Decoding) in the interpreter: the kernel against the spec, with
splits that see different maxima, empty splits and a length-0 row; the planted mistakes of a
split kernel the cases catch; the split count's rule."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport import flash_decoding as FD
from labsupport._answers import unguarded
from labsupport.paged_attention import gather_contiguous, paged_decode_attention, random_paged_cache

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

spec = unguarded(paged_decode_attention)
# lengths 1 (one split used of four), 19, 40 and 53 with 16-token tiles: 1 to 4 tiles, so with four
# splits some are empty and the others hold different keys (different maxima to combine)
LENS, SPLITS, TILE = [1, 19, 40, 53], 4, 16


def case(dtype=torch.float32, heads=(6, 2), block_size=4, seed=0):
    h, h_kv = heads
    k_cache, v_cache, tables, lens = random_paged_cache(LENS, h_kv, 16, block_size, dtype=dtype, seed=seed)
    q = (3 * torch.randn(len(LENS), h, 16, generator=torch.Generator().manual_seed(seed + 1))).to(dtype)  # peaked
    return q, k_cache, v_cache, tables, lens


def assert_matches_spec(fn, dtype=torch.float32, **kw):
    args = case(dtype, **kw)
    want, got = spec(*args), fn(*args)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    err = (got.float() - want.float()).abs().max().item()
    assert got.shape == want.shape and got.dtype == want.dtype and err <= tol, f"max error {err:.2e}"


@pytest.mark.parametrize("dtype,heads,block_size", [(torch.float32, (6, 2), 4), (torch.float16, (4, 4), 6)])
def test_the_kernel_matches_the_spec(dtype, heads, block_size):
    assert_matches_spec(lambda *a: FD.split_kv_decode_attention(*a, num_splits=SPLITS, block_n=TILE), dtype,
                        heads=heads, block_size=block_size)


def test_a_length_0_row_gives_zeros_and_disturbs_nothing():
    q, k, v, tables, lens = case()
    lens0 = lens.clone()
    lens0[0] = 0  # a padded row of a captured batch
    got = FD.split_kv_decode_attention(q, k, v, tables, lens0, num_splits=2, block_n=TILE, validate=False)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got[1:], spec(q, k, v, tables, lens)[1:], atol=1e-5, rtol=1e-5)


# --- planted mistakes of a split kernel, in torch ------------------------------------------------

def _split_mutant(mistake):
    """The split-KV algorithm in torch (splits of whole tiles, as the kernel cuts them), with one mistake."""
    def attention(q, k_cache, v_cache, tables, lens):
        out = torch.empty_like(q)
        b, h, d = q.shape
        group = h // k_cache.shape[2]
        for row, n in enumerate(lens.tolist()):
            k = gather_contiguous(k_cache, tables, n, row).float().repeat_interleave(group, 1)  # (n, H, D)
            v = gather_contiguous(v_cache, tables, n, row).float().repeat_interleave(group, 1)
            tiles = -(-n // TILE)
            per = -(-tiles // SPLITS)
            parts = []
            for s in range(SPLITS):
                lo, hi = s * per * TILE, min((s + 1) * per * TILE, n)
                if lo >= hi:
                    continue
                scores = torch.einsum("hd,nhd->hn", q[row].float(), k[lo:hi]) / math.sqrt(d)  # (H, n_s)
                m = scores.max(-1).values  # (H,)
                p = torch.exp(scores - m[:, None])
                o = torch.einsum("hn,nhd->hd", p, v[lo:hi]) / p.sum(-1, keepdim=True)  # (H, D), normalised
                parts.append((o, m, p.sum(-1)))
            o = torch.stack([x[0] for x in parts])  # (S, H, D)
            m = torch.stack([x[1] for x in parts])  # (S, H)
            l_s = torch.stack([x[2] for x in parts])
            if mistake == "a plain mean of the splits":
                w = torch.ones_like(l_s)
            elif mistake == "weights by the sums, maxima ignored":
                w = l_s
            elif mistake == "the last split only":
                w = torch.zeros_like(l_s)
                w[-1] = 1
            else:
                w = l_s * torch.exp(m - m.max(0).values)
            out[row] = ((w[..., None] * o).sum(0) / w.sum(0)[:, None]).to(q.dtype)
        return out
    return attention


@pytest.mark.parametrize("mistake", ["a plain mean of the splits", "weights by the sums, maxima ignored",
                                     "the last split only"])
def test_the_cases_catch_a_wrong_combine(mistake):
    with pytest.raises(AssertionError, match="max error"):
        assert_matches_spec(_split_mutant(mistake))
    assert_matches_spec(_split_mutant("none"))  # the scaffolding is right without the mistake


def test_the_split_count_fills_the_gpu_and_follows_only_the_batch():
    assert FD.num_kv_splits(batch=16, kv_heads=8, max_seq_len=4096, num_sms=132) == 8  # 128 programs -> 1,024
    assert FD.num_kv_splits(batch=256, kv_heads=8, max_seq_len=4096, num_sms=132) == 1  # already enough
    assert FD.num_kv_splits(batch=1, kv_heads=8, max_seq_len=100, num_sms=132) == 2  # two tiles at most
    assert FD.num_kv_splits(batch=3, kv_heads=2, max_seq_len=64, num_sms=1) == 1
    assert FD.num_kv_splits(batch=1, kv_heads=8, max_seq_len=131072, num_sms=132) == FD.MAX_SPLITS


def test_the_kernel_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(FD, "interpreter_mode", lambda: False)
    with pytest.raises(ValueError, match="interpreter mode"):
        FD.split_kv_decode_attention(*case())
