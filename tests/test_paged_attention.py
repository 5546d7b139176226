"""Paged decode attention: the torch spec, the course's Triton kernel, the inputs it refuses, and
the byte formulas."""

from __future__ import annotations

import pytest
import torch

from labsupport import paged_attention as P
from labsupport._answers import unguarded
from labsupport.interpreter_bytes import count_bytes

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

spec = unguarded(P.paged_decode_attention)
kernel = unguarded(P.paged_decode_attention_triton)


def contiguous_inputs(q, k_cache, v_cache, tables, lens):
    s = int(lens.max())
    k = torch.zeros(q.shape[0], s, *k_cache.shape[2:], dtype=k_cache.dtype)
    v = torch.zeros_like(k)
    for row, n in enumerate(lens.tolist()):
        k[row, :n] = P.gather_contiguous(k_cache, tables, n, row)
        v[row, :n] = P.gather_contiguous(v_cache, tables, n, row)
    return q, k, v, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens,h,h_kv,bs", [([1], 2, 1, 4), ([7, 16, 33], 6, 2, 8), ([5, 2], 4, 4, 2)])
def test_spec_and_kernel_match_contiguous_attention(dtype, lens, h, h_kv, bs):
    k_cache, v_cache, tables, seq_lens = P.random_paged_cache(lens, h_kv, 32, bs, dtype=dtype, seed=len(lens))
    q = torch.randn(len(lens), h, 32).to(dtype)
    want = P.contiguous_decode_attention(*contiguous_inputs(q, k_cache, v_cache, tables, seq_lens))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for got in (spec(q, k_cache, v_cache, tables, seq_lens), kernel(q, k_cache, v_cache, tables, seq_lens)):
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_kernel_runs_bf16_in_the_interpreter_by_upcasting():
    k_cache, v_cache, tables, lens = P.random_paged_cache([9], 1, 16, 4, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 16).to(torch.bfloat16)
    got = kernel(q, k_cache, v_cache, tables, lens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), spec(q, k_cache, v_cache, tables, lens).float(), atol=2e-2, rtol=2e-2)


def test_random_cache_shuffles_blocks_and_pads_tables():
    k_cache, _, tables, lens = P.random_paged_cache([5, 1], 1, 16, 4, spare_blocks=3, seed=1)
    assert k_cache.shape == (6, 4, 1, 16) and tables.dtype == torch.int32 and lens.tolist() == [5, 1]
    assert tables[1, 1].item() == -1  # padding past the blocks a sequence uses
    used = tables[0].tolist() + tables[1, :1].tolist()
    assert len(set(used)) == 3 and all(0 <= b < 6 for b in used)


def good_inputs():
    k_cache, v_cache, tables, lens = P.random_paged_cache([5, 3], 2, 16, 4)
    return torch.randn(2, 4, 16), k_cache, v_cache, tables, lens


@pytest.mark.parametrize("fn", [spec, kernel])
@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(0, torch.randn(2, 16)), r"q must be \(B, H, D\)"),
    (lambda a: a.__setitem__(1, a[1][0]), r"k_cache must be \(num_blocks, block_size, Hkv, D\)"),
    (lambda a: a.__setitem__(2, a[2][:, :2]), "v_cache must have k_cache's shape"),
    (lambda a: a.__setitem__(0, torch.randn(2, 3, 16)), "multiple of the 2 KV heads"),
    (lambda a: a.__setitem__(3, a[3][:1]), r"block_tables must be \(B, max_blocks\) with B=2"),
    (lambda a: a.__setitem__(4, torch.tensor([5, 9], dtype=torch.int32)), "longer than its table"),
    (lambda a: a[3].__setitem__((1, 0), 99), r"block_tables\[1, 0\] = 99 is out of range"),
    (lambda a: a[3].__setitem__((0, 1), -1), r"block_tables\[0, 1\] = -1 is out of range"),
    (lambda a: a.__setitem__(4, torch.tensor([5, 0], dtype=torch.int32)), r"seq_lens\[1\] = 0"),
    (lambda a: a.__setitem__(3, a[3].float()), "block_tables must hold integers"),
    (lambda a: a.__setitem__(0, a[0].half()), "share one float dtype"),
])
def test_bad_inputs_are_value_errors_saying_which(fn, change, message):
    args = list(good_inputs())
    change(args)
    with pytest.raises(ValueError, match=message):
        fn(*args)


def test_padding_past_a_sequences_blocks_is_ignored():
    q, k_cache, v_cache, tables, lens = good_inputs()
    tables[1, 1] = 12345  # sequence 1 holds 3 tokens: one block; column 1 is padding
    spec(q, k_cache, v_cache, tables, lens)


def test_byte_formulas():
    lens, h, h_kv, d, bs = [1, 17, 32], 8, 2, 64, 16
    contiguous = P.contiguous_decode_bytes(lens, h, h_kv, d, dtype_bytes=2)
    assert contiguous == 2 * 3 * 8 * 64 * 2 + 2 * 50 * 2 * 64 * 2
    paged = P.paged_decode_bytes(lens, h, h_kv, d, bs, dtype_bytes=2)
    assert paged - contiguous == (1 + 2 + 2) * h_kv * 4 + 3 * h_kv * 4  # table entries and lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_counted_bytes_equal_the_formula(dtype):
    """In the interpreter the course's kernel moves exactly what paged_decode_bytes says: masked
    tail slots and padded query rows are not read, the table once per block and KV head."""
    lens, h, h_kv, d, bs = [1, 17, 40], 6, 2, 32, 16
    k_cache, v_cache, tables, seq_lens = P.random_paged_cache(lens, h_kv, d, bs, dtype=dtype)
    q = torch.randn(len(lens), h, d).to(dtype)
    with count_bytes() as counted:
        kernel(q, k_cache, v_cache, tables, seq_lens)
    assert counted.total == P.paged_decode_bytes(lens, h, h_kv, d, bs, dtype_bytes=q.element_size())
    assert counted.by_argument["bt_ptr"].loaded == sum(-(-n // bs) for n in lens) * h_kv * 4


@pytest.mark.parametrize("bs,d", [(3, 32), (12, 24), (16, 80)])
def test_the_kernel_takes_block_sizes_and_head_dims_that_are_not_powers_of_two(bs, d):
    """Tiles are padded to a power of two and masked: the padding slots of a block (which belong
    to the next block in memory) and the padding lanes of a head must never count."""
    lens, h, h_kv = [1, 7, 25], 6, 2
    k_cache, v_cache, tables, seq_lens = P.random_paged_cache(lens, h_kv, d, bs, seed=bs)
    q = torch.randn(len(lens), h, d)
    want = P.contiguous_decode_attention(*contiguous_inputs(q, k_cache, v_cache, tables, seq_lens))
    with count_bytes() as counted:
        got = kernel(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counted.total == P.paged_decode_bytes(lens, h, h_kv, d, bs, dtype_bytes=4)
