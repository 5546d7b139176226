"""The attention checks accept the reference implementations and reject planted mistakes.

Each mutant below is a small, realistic wrong implementation; every one must make its check
raise CheckFailed, and where the check can name the mistake, the message must say so.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from labsupport.attention import (
    attention_spec,
    flash_attention_reference,
    naive_attention_reference,
    online_softmax_reference,
)
from labsupport.checks import CheckFailed, check_flash_attention, check_naive_attention, check_online_softmax

# triton 3.6's interpreter trips a numpy deprecation on every loop; it is harmless and not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# --- naive attention mutants (plain torch) ------------------------------------------------------


def naive(q, k, v, causal=False, *, scale="sqrt", axis=-1, shift=0, transposed=False, ignore_causal=False,
          subtract_max=True, normalise=True, dtype=None):
    """Naive attention in the inputs' dtype, with one optional planted mistake."""
    d, s = q.shape[-1], q.shape[-2]
    factor = {"sqrt": 1 / math.sqrt(d), "none": 1.0, "d": 1 / d}[scale]
    scores = (q.float() @ k.float().transpose(-2, -1)) * factor  # (B, H, S, S)
    if causal and not ignore_causal:
        rows, cols = torch.arange(s)[:, None], torch.arange(s)[None, :]
        visible = cols >= rows - shift if transposed else cols <= rows + shift
        scores = scores.masked_fill(~visible, float("-inf"))
    if axis != -1:  # torch.softmax over another dimension (it subtracts that dimension's max)
        return (torch.softmax(scores, dim=axis) @ v.float()).to(dtype or q.dtype)
    if subtract_max:
        scores = scores - scores.amax(dim=-1, keepdim=True)
    e = torch.exp(scores)
    p = e / e.sum(dim=-1, keepdim=True) if normalise else e
    return (p @ v.float()).to(dtype or q.dtype)


def naive_calls_sdpa(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def naive_scales_q_in_place(q, k, v, causal=False):
    q.mul_(1 / math.sqrt(q.shape[-1]))
    return naive(q * math.sqrt(q.shape[-1]), k, v, causal)


def naive_returns_pair(q, k, v, causal=False):
    return attention_spec(q, k, v, causal)


NAIVE_MUTANTS = {
    "no_scale": (lambda q, k, v, causal=False: naive(q, k, v, causal, scale="none"), "1/sqrt(D)"),
    "scale_by_d": (lambda q, k, v, causal=False: naive(q, k, v, causal, scale="d"), "divided by D instead"),
    "softmax_wrong_axis": (lambda q, k, v, causal=False: naive(q, k, v, causal, axis=-2), "dim=-2"),
    "causal_hides_diagonal": (lambda q, k, v, causal=False: naive(q, k, v, causal, shift=-1), "hides the diagonal"),
    "causal_sees_one_future_key": (lambda q, k, v, causal=False: naive(q, k, v, causal, shift=1),
                                   "one key in its future"),
    "causal_mask_transposed": (lambda q, k, v, causal=False: naive(q, k, v, causal, transposed=True), "transposed"),
    "causal_ignored": (lambda q, k, v, causal=False: naive(q, k, v, causal, ignore_causal=True), "no causal mask"),
    "no_max_subtraction": (lambda q, k, v, causal=False: naive(q, k, v, causal, subtract_max=False),
                           "subtract the (running) maximum"),
    "unnormalised": (lambda q, k, v, causal=False: naive(q, k, v, causal, normalise=False), "unnormalised"),
    "calls_sdpa": (naive_calls_sdpa, "scaled_dot_product_attention"),
    "returns_fp32": (lambda q, k, v, causal=False: naive(q, k, v, causal, dtype=torch.float32), "dtype"),
    "changes_inputs": (naive_scales_q_in_place, "changed q, k or v"),
    "returns_out_and_lse": (naive_returns_pair, "expected a torch.Tensor"),
}


def test_naive_reference_passes(capsys):
    check_naive_attention(naive_attention_reference)
    check_naive_attention(naive)  # the mutant harness itself, with no mutation, is correct
    assert "PASSED check_naive_attention" in capsys.readouterr().out


@pytest.mark.parametrize("name", NAIVE_MUTANTS)
def test_naive_check_rejects(name):
    fn, expected = NAIVE_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_naive_attention(fn)
    assert expected in str(info.value), str(info.value)


def test_naive_check_reports_unfinished_exercise():
    def naive_attention(q, k, v, causal=False):
        raise NotImplementedError("Exercise: write naive attention")

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_naive_attention(naive_attention)


# --- online softmax mutants (plain torch, blockwise) ------------------------------------------


def online(q, k, v, causal=False, block_n=16, *, rescale_acc=True, rescale_sum=True, drop_tail=False,
           subtract_max=True, normalise=True, lse_mode="natural", shift=0, whole_matrix=False, scaled=True,
           out_dtype=None):
    """Blockwise attention with a running max and sum, with one optional planted mistake."""
    b, h, s, d = q.shape
    if whole_matrix:
        block_n = s  # one block: the S x S score matrix, what the exercise must avoid
    qf = q.float() / (math.sqrt(d) if scaled else 1.0)
    m = torch.full((b, h, s), float("-inf"))
    denom = torch.zeros((b, h, s))
    acc = torch.zeros((b, h, s, d))
    rows = torch.arange(s)[:, None]
    stop = s // block_n * block_n if drop_tail else s
    for start in range(0, stop, block_n):
        kb, vb = k[:, :, start:start + block_n].float(), v[:, :, start:start + block_n].float()
        scores = qf @ kb.transpose(-2, -1)  # (B, H, S, n)
        if causal:
            cols = torch.arange(start, start + kb.shape[2])[None, :]
            scores = scores.masked_fill(cols > rows + shift, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1)) if subtract_max else torch.zeros_like(m)
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        denom = (denom * alpha if rescale_sum else denom) + p.sum(dim=-1)
        acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ vb
        m = m_new
    out = acc / denom[..., None] if normalise else acc
    lse = {"natural": m + torch.log(denom), "no_max": torch.log(denom), "base2": (m + torch.log(denom)) / math.log(2)}
    return out.to(out_dtype or q.dtype), lse[lse_mode]


def online_mutant(**mistake):
    return lambda q, k, v, causal=False, block_n=16: online(q, k, v, causal, block_n, **mistake)


ONLINE_MUTANTS = {
    "no_accumulator_rescale": (online_mutant(rescale_acc=False), "rescaled by exp(m_old - m_new)"),
    "no_rescale_at_all": (online_mutant(rescale_acc=False, rescale_sum=False), "rescaled by exp(m_old - m_new)"),
    "last_partial_block_dropped": (online_mutant(drop_tail=True), "partial"),
    "no_max_subtraction": (online_mutant(subtract_max=False), "subtract the (running) maximum"),
    "unnormalised": (online_mutant(normalise=False), "unnormalised"),
    "no_scale": (online_mutant(scaled=False), "1/sqrt(D)"),
    "causal_hides_diagonal": (online_mutant(shift=-1), "hides the diagonal"),
    "causal_sees_one_future_key": (online_mutant(shift=1), "one key in its future"),
    "returns_fp32_output": (online_mutant(out_dtype=torch.float32), "dtype"),
    "lse_without_max": (online_mutant(lse_mode="no_max"), "leaves out the running maximum"),
    "lse_in_base_2": (online_mutant(lse_mode="base2"), "base 2"),
    "whole_score_matrix": (online_mutant(whole_matrix=True), "S x S"),
    "returns_out_only": (lambda q, k, v, causal=False, block_n=16: online(q, k, v, causal, block_n)[0],
                         "expected a pair (out, lse)"),
    "calls_sdpa": (lambda q, k, v, causal=False, block_n=16: (
        F.scaled_dot_product_attention(q, k, v, is_causal=causal), attention_spec(q, k, v, causal)[1]),
        "scaled_dot_product_attention"),
}


def test_online_reference_passes(capsys):
    check_online_softmax(online_softmax_reference)
    check_online_softmax(online)  # the mutant harness with no mutation
    assert "PASSED check_online_softmax" in capsys.readouterr().out


@pytest.mark.parametrize("name", ONLINE_MUTANTS)
def test_online_check_rejects(name):
    fn, expected = ONLINE_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_online_softmax(fn)
    assert expected in str(info.value), str(info.value)


# --- FlashAttention mutants: real Triton kernels ----------------------------------------------


@triton.jit
def _mutant_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seq_len, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   RESCALE: tl.constexpr, TAIL_MASK: tl.constexpr, LSE_NATURAL: tl.constexpr):
    """A single-loop FlashAttention forward on contiguous inputs; the flags plant mistakes."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    base = pid_bh.to(tl.int64) * seq_len * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < seq_len, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    stop = seq_len
    if CAUSAL:
        stop = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    for start_n in range(0, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(k_ptr + base + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=offs_n[None, :] < seq_len,
                     other=0.0)  # (HEAD_DIM, BLOCK_N)
        v = tl.load(v_ptr + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_n[:, None] < seq_len,
                    other=0.0)
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale
        if TAIL_MASK:
            s = tl.where(offs_n[None, :] < seq_len, s, float("-inf"))
        if CAUSAL:
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if RESCALE:
            acc = acc * alpha[:, None]
        acc = acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=offs_m[:, None] < seq_len)
    lse = m_i + tl.log(l_i)
    if not LSE_NATURAL:
        lse = lse * 1.4426950408889634
    tl.store(lse_ptr + pid_bh.to(tl.int64) * seq_len + offs_m, lse, mask=offs_m < seq_len)


def triton_flash(rescale=True, tail_mask=True, lse_natural=True, contiguous=True):
    def flash_attention(q, k, v, causal=False):
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, h, s, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, h, s), dtype=torch.float32)
        grid = (triton.cdiv(s, 64), b * h)
        _mutant_kernel[grid](q, k, v, out, lse, s, 1 / math.sqrt(d), HEAD_DIM=d, BLOCK_M=64, BLOCK_N=64,
                             CAUSAL=causal, RESCALE=rescale, TAIL_MASK=tail_mask, LSE_NATURAL=lse_natural)
        return out, lse

    return flash_attention


def torch_flash(**mistake):
    """FlashAttention's interface on top of the blockwise torch code (64-key blocks)."""
    return lambda q, k, v, causal=False: online(q, k, v, causal, 64, **mistake)


FLASH_MUTANTS = {
    # real Triton kernels
    "triton_no_rescale": (lambda: triton_flash(rescale=False), "rescaled by exp(m_old - m_new)"),
    "triton_no_tail_mask": (lambda: triton_flash(tail_mask=False), "partial"),
    "triton_lse_base_2": (lambda: triton_flash(lse_natural=False), "base 2"),
    "triton_assumes_contiguous": (lambda: triton_flash(contiguous=False), "not contiguous"),
    # the same interface in torch, for mistakes that do not need a kernel to show
    "no_scale": (lambda: lambda q, k, v, causal=False: (naive(q, k, v, causal, scale="none"),
                                                        attention_spec(q, k, v, causal)[1]), "1/sqrt(D)"),
    "softmax_wrong_axis": (lambda: lambda q, k, v, causal=False: (naive(q, k, v, causal, axis=-2),
                                                                  attention_spec(q, k, v, causal)[1]), "dim=-2"),
    "causal_off_by_one": (lambda: torch_flash(shift=1), "one key in its future"),
    "no_max_subtraction": (lambda: torch_flash(subtract_max=False), "subtract the (running) maximum"),
    "unnormalised": (lambda: torch_flash(normalise=False), "unnormalised"),
    "lse_without_max": (lambda: torch_flash(lse_mode="no_max"), "leaves out the running maximum"),
    "calls_sdpa": (lambda: lambda q, k, v, causal=False: (F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                          attention_spec(q, k, v, causal)[1]),
                   "scaled_dot_product_attention"),
    "returns_fp32_output": (lambda: lambda q, k, v, causal=False: (attention_spec(q.float(), k.float(), v.float(),
                                                                                  causal)), "dtype"),
    "returns_out_only": (lambda: lambda q, k, v, causal=False: attention_spec(q, k, v, causal)[0], "pair"),
}


def test_flash_reference_passes(capsys):
    check_flash_attention(flash_attention_reference)
    assert "PASSED check_flash_attention" in capsys.readouterr().out


def test_flash_mutant_kernel_without_mutation_passes(capsys):
    check_flash_attention(triton_flash())
    assert "PASSED check_flash_attention" in capsys.readouterr().out


@pytest.mark.parametrize("name", FLASH_MUTANTS)
def test_flash_check_rejects(name):
    make, expected = FLASH_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_flash_attention(make())
    assert expected in str(info.value), str(info.value)


def test_flash_check_explains_a_missing_driver_style_error():
    def flash_attention(q, k, v, causal=False):
        raise RuntimeError("boom from the learner's wrapper")

    with pytest.raises(CheckFailed, match="boom from the learner's wrapper"):
        check_flash_attention(flash_attention)


def test_flash_check_rejects_a_non_function():
    with pytest.raises(CheckFailed, match="takes your function itself"):
        check_flash_attention(flash_attention_reference(*[torch.randn(1, 1, 4, 16)] * 3))
