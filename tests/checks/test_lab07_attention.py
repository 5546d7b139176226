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

from labsupport import attention as A
from labsupport._answers import unguarded
from labsupport.checks import CheckFailed, check_flash_attention, check_naive_attention, check_online_softmax

# The course's answers refuse to run inside a check that bans them (a learner may not hand them in);
# these tests check the answers themselves and build mutants from them, so they use them unguarded.
attention_spec = unguarded(A.attention_spec)
flash_attention_reference = unguarded(A.flash_attention_reference)
naive_attention_reference = unguarded(A.naive_attention_reference)
online_softmax_reference = unguarded(A.online_softmax_reference)

# triton 3.6's interpreter trips a numpy deprecation on every loop; it is harmless and not ours.
# Mutants without the max subtraction overflow on purpose: numpy's overflow warnings are expected.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

# --- naive attention mutants (plain torch) ------------------------------------------------------


def naive(q, k, v, causal=False, *, scale="sqrt", axis=-1, shift=0, transposed=False, ignore_causal=False,
          subtract_max=True, normalise=True, dtype=None, fill=float("-inf")):
    """Naive attention in the inputs' dtype, with one optional planted mistake."""
    d, s = q.shape[-1], q.shape[-2]
    factor = {"sqrt": 1 / math.sqrt(d), "none": 1.0, "d": 1 / d}[scale]
    scores = (q.float() @ k.float().transpose(-2, -1)) * factor  # (B, H, S, S)
    if causal and not ignore_causal:
        rows, cols = torch.arange(s)[:, None], torch.arange(s)[None, :]
        visible = cols >= rows - shift if transposed else cols <= rows + shift
        scores = scores.masked_fill(~visible, fill)
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
    # the red team's (issue 26)
    "mask_minus_1e4": (lambda q, k, v, causal=False: naive(q, k, v, causal, fill=-1e4),
                       "masked scores are set to -1e4"),
    "scores_in_input_dtype": (lambda q, k, v, causal=False: naive_scores_in_input_dtype(q, k, v, causal),
                              "computed in float16, the inputs' dtype"),
}


def naive_scores_in_input_dtype(q, k, v, causal=False):
    """The red team's naive_wrong_input_dtype: q @ k^T, the softmax and @ v all in the inputs' dtype."""
    s, d = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def naive_prescaled_q(q, k, v, causal=False):
    """Honest: q scaled by 1/sqrt(D) and rounded to the inputs' dtype first (as older Triton tutorials
    do), then the scores and the softmax in float32."""
    s, d = q.shape[-2], q.shape[-1]
    scores = (q * (1 / math.sqrt(d))).to(q.dtype).float() @ k.float().transpose(-2, -1)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


def test_naive_reference_passes(capsys):
    check_naive_attention(lambda q, k, v, causal=False: attention_spec(q, k, v, causal)[0])
    check_naive_attention(naive)  # the mutant harness itself, with no mutation, is correct
    check_naive_attention(naive_prescaled_q)  # float16 q / sqrt(D) is not float16 scores: it must pass
    assert capsys.readouterr().out.count("PASSED check_naive_attention") == 3


def test_the_eager_baseline_rounds_its_scores_to_float16():
    """The benchmarks' eager attention, as model code writes it, takes q @ k^T in the inputs' dtype: with
    float16 logits in the hundreds that is visibly wrong, and the check says so (issue 26)."""
    with pytest.raises(CheckFailed, match="computed in float16, the inputs' dtype"):
        check_naive_attention(naive_attention_reference)


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
           out_dtype=None, m_start=float("-inf"), local_mask=False, max_of_raw=False):
    """Blockwise attention with a running max and sum, with one optional planted mistake."""
    b, h, s, d = q.shape
    if whole_matrix:
        block_n = s  # one block: the S x S score matrix, what the exercise must avoid
    qf = q.float() / (math.sqrt(d) if scaled else 1.0)
    m = torch.full((b, h, s), m_start)
    denom = torch.zeros((b, h, s))
    acc = torch.zeros((b, h, s, d))
    rows = torch.arange(s)[:, None]
    stop = s // block_n * block_n if drop_tail else s
    for start in range(0, stop, block_n):
        kb, vb = k[:, :, start:start + block_n].float(), v[:, :, start:start + block_n].float()
        scores = qf @ kb.transpose(-2, -1)  # (B, H, S, n)
        if causal:
            cols = torch.arange(0 if local_mask else start, (0 if local_mask else start) + kb.shape[2])[None, :]
            scores = scores.masked_fill(cols > rows + shift, float("-inf"))
        block_max = (scores * math.sqrt(d) if max_of_raw else scores).amax(dim=-1)  # raw q.k: the wrong maximum
        m_new = torch.maximum(m, block_max) if subtract_max else torch.zeros_like(m)
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
    "softmax_wrong_axis": (lambda q, k, v, causal=False, block_n=16: (naive(q, k, v, causal, axis=-2),
                                                                      attention_spec(q, k, v, causal)[1]), "dim=-2"),
    "returns_out_only": (lambda q, k, v, causal=False, block_n=16: online(q, k, v, causal, block_n)[0],
                         "expected a pair (out, lse)"),
    "calls_sdpa": (lambda q, k, v, causal=False, block_n=16: (
        F.scaled_dot_product_attention(q, k, v, is_causal=causal), attention_spec(q, k, v, causal)[1]),
        "scaled_dot_product_attention"),
    # the red team's (issue 26)
    "max_starts_at_zero": (online_mutant(m_start=0.0), "running maximum starts at 0 instead of -inf"),
    "block_local_mask": (online_mutant(local_mask=True), "index within its block (0 .. block_n - 1)"),
    "max_of_unscaled_scores": (online_mutant(max_of_raw=True), "the maximum of the very scores you exponentiate"),
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
                   RESCALE: tl.constexpr, TAIL_MASK: tl.constexpr, LSE_NATURAL: tl.constexpr,
                   AXIS: tl.constexpr, CAUSAL_SHIFT: tl.constexpr, SUBTRACT_MAX: tl.constexpr,
                   NORMALISE: tl.constexpr, LSE_WITH_MAX: tl.constexpr, M_FROM_ZERO: tl.constexpr,
                   STOP_BY_BLOCK_N: tl.constexpr, SKIP_FUTURE: tl.constexpr, ROW_MASK: tl.constexpr):
    """A single-loop FlashAttention forward on contiguous inputs; the flags plant mistakes.

    AXIS=0 reduces the score tile over its query rows instead of its keys (tiles are square);
    CAUSAL_SHIFT moves the diagonal; SUBTRACT_MAX=False exponentiates raw scores; NORMALISE=False
    skips acc / l; LSE_WITH_MAX=False returns log(l) alone; M_FROM_ZERO starts the running max at 0;
    STOP_BY_BLOCK_N ends the causal loop at (pid_m + 1) * BLOCK_N; SKIP_FUTURE=False never stops it early;
    ROW_MASK=False loads q and stores out without the row mask.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    base = pid_bh.to(tl.int64) * seq_len * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if ROW_MASK:
        q = tl.load(q_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < seq_len,
                    other=0.0)
    else:
        q = tl.load(q_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    if M_FROM_ZERO:
        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    stop = seq_len
    if CAUSAL and SKIP_FUTURE:
        if STOP_BY_BLOCK_N:
            stop = tl.minimum((pid_m + 1) * BLOCK_N, seq_len)
        else:
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
            s = tl.where(offs_n[None, :] <= offs_m[:, None] + CAUSAL_SHIFT, s, float("-inf"))
        if SUBTRACT_MAX:
            m_new = tl.maximum(m_i, tl.max(s, AXIS))
        else:
            m_new = tl.zeros((BLOCK_M,), dtype=tl.float32)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, AXIS)
        if RESCALE:
            acc = acc * alpha[:, None]
        acc = acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    if NORMALISE:
        out = acc / l_i[:, None]
    else:
        out = acc
    if ROW_MASK:
        tl.store(out_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=offs_m[:, None] < seq_len)
    else:
        tl.store(out_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty))
    lse = tl.log(l_i)
    if LSE_WITH_MAX:
        lse += m_i
    if not LSE_NATURAL:
        lse = lse * 1.4426950408889634
    tl.store(lse_ptr + pid_bh.to(tl.int64) * seq_len + offs_m, lse, mask=offs_m < seq_len)


def triton_flash(rescale=True, tail_mask=True, lse_natural=True, contiguous=True, scaled=True, axis=1,
                 causal_shift=0, subtract_max=True, normalise=True, lse_with_max=True, m_from_zero=False,
                 stop_by_block_n=False, skip_future=True, row_mask=True, grid_heads_only=False, tiles=None):
    """The mutant kernel's wrapper; ``tiles`` (block_m, block_n) default to kernel_config's, as a learner's do."""
    def flash_attention(q, k, v, causal=False):
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, h, s, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, h, s), dtype=torch.float32)
        config = A.kernel_config(s, s, d, q.dtype, interpreter=True)
        block_m, block_n = tiles or (config.block_m, config.block_n)
        grid = (triton.cdiv(s, block_m), h if grid_heads_only else b * h)
        _mutant_kernel[grid](q, k, v, out, lse, s, 1 / math.sqrt(d) if scaled else 1.0, HEAD_DIM=d, BLOCK_M=block_m,
                             BLOCK_N=block_n, CAUSAL=causal, RESCALE=rescale, TAIL_MASK=tail_mask,
                             LSE_NATURAL=lse_natural, AXIS=axis, CAUSAL_SHIFT=causal_shift,
                             SUBTRACT_MAX=subtract_max, NORMALISE=normalise, LSE_WITH_MAX=lse_with_max,
                             M_FROM_ZERO=m_from_zero, STOP_BY_BLOCK_N=stop_by_block_n, SKIP_FUTURE=skip_future,
                             ROW_MASK=row_mask)
        return out, lse

    return flash_attention


FLASH_MUTANTS = {
    # real Triton kernels, each with one planted mistake
    "triton_no_rescale": (lambda: triton_flash(rescale=False), "rescaled by exp(m_old - m_new)"),
    "triton_no_tail_mask": (lambda: triton_flash(tail_mask=False), "partial"),
    "triton_lse_base_2": (lambda: triton_flash(lse_natural=False), "base 2"),
    "triton_assumes_contiguous": (lambda: triton_flash(contiguous=False), "not contiguous"),
    "triton_no_scale": (lambda: triton_flash(scaled=False), "1/sqrt(D)"),
    # max and sum over the tile's query rows (axis 0): not a row-wise softmax of the whole matrix,
    # so no named mistake matches; the check must still fail it
    "triton_reduces_over_queries": (lambda: triton_flash(axis=0, tiles=(64, 64)), "the output is wrong"),
    "triton_causal_hides_diagonal": (lambda: triton_flash(causal_shift=-1), "hides the diagonal"),
    "triton_causal_one_future_key": (lambda: triton_flash(causal_shift=1), "one key in its future"),
    "triton_no_max_subtraction": (lambda: triton_flash(subtract_max=False), "subtract the (running) maximum"),
    "triton_unnormalised": (lambda: triton_flash(normalise=False), "unnormalised"),
    "triton_lse_without_max": (lambda: triton_flash(lse_with_max=False), "leaves out the running maximum"),
    # the red team's (issue 26)
    "triton_max_starts_at_zero": (lambda: triton_flash(m_from_zero=True), "running maximum starts at 0 instead of -inf"),
    "triton_causal_stop_by_block_n": (lambda: triton_flash(stop_by_block_n=True),
                                      "the loop over key blocks must run up to (pid_m + 1) * BLOCK_M"),
    "triton_never_skips_future_blocks": (lambda: triton_flash(skip_future=False),
                                         "as many as for the same shape with causal=False"),
    "triton_store_unmasked": (lambda: triton_flash(row_mask=False), "your kernel wrote outside"),
    "triton_grid_heads_only": (lambda: triton_flash(grid_heads_only=True),
                               "every head of batch item 0 is right and every head of batch item 1 is wrong"),
    # the same interface in torch, for mistakes that do not need a kernel to show
    "torch_not_triton": (lambda: lambda q, k, v, causal=False: online_softmax_reference(q, k, v, causal),
                         "no Triton kernel was launched"),
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


@triton.jit
def _idle_kernel(x_ptr):
    tl.load(x_ptr)  # reads one element, writes nothing


def _torch_attention(q, k, v, causal):
    """Attention computed with torch matmul and softmax (what the flash exercise replaces)."""
    s = q.shape[2]
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype), torch.logsumexp(scores, dim=-1)


def torch_attention_beside_an_idle_kernel(q, k, v, causal=False):
    out, lse = _torch_attention(q, k, v, causal)
    _idle_kernel[(1,)](q)
    return out, lse


def torch_attention_into_launched_tensors(q, k, v, causal=False):
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32)
    got_out, got_lse = _torch_attention(q, k, v, causal)
    out.copy_(got_out)
    lse.copy_(got_lse)
    _idle_kernel[(1,)](out)
    _idle_kernel[(1,)](lse)
    return out, lse


def test_flash_check_rejects_torch_attention_beside_an_idle_kernel():
    with pytest.raises(CheckFailed, match="returned a tensor that no Triton kernel you launched wrote to: out, lse"):
        check_flash_attention(torch_attention_beside_an_idle_kernel)


def test_flash_check_rejects_torch_attention_copied_into_launched_tensors():
    with pytest.raises(CheckFailed, match="(?s)the result is right, but your function called `matmul`.*"
                                          "`softmax`.*the Triton kernel computes the answer"):
        check_flash_attention(torch_attention_into_launched_tensors)


def test_naive_and_online_checks_still_allow_torch_matmul(capsys):
    """Only the Triton exercise forbids computing in torch; the torch exercises are made of it."""
    check_naive_attention(lambda q, k, v, causal=False: _torch_attention(q, k, v, causal)[0])
    assert "PASSED check_naive_attention" in capsys.readouterr().out


def test_flash_check_explains_a_missing_driver_style_error():
    def flash_attention(q, k, v, causal=False):
        raise RuntimeError("boom from the learner's wrapper")

    with pytest.raises(CheckFailed, match="boom from the learner's wrapper"):
        check_flash_attention(flash_attention)


def test_flash_check_rejects_a_non_function():
    with pytest.raises(CheckFailed, match="takes your function itself"):
        check_flash_attention(flash_attention_reference(*[torch.randn(1, 1, 4, 16)] * 3))


# --- any correct implementation passes ----------------------------------------------------------


@triton.jit
def _other_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
                  stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                  stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                  n_heads, seq_len, qk_scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Another correct kernel: strided inputs, exp2, key blocks visited LAST to first, its own tiles."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=offs_m[:, None] < seq_len, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    n_blocks = (hi + BLOCK_N - 1) // BLOCK_N
    for i in range(0, n_blocks):
        offs_n = (n_blocks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                    mask=offs_n[:, None] < seq_len, other=0.0)
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                    mask=offs_n[:, None] < seq_len, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2  # log2 units
        keep = offs_n[None, :] < seq_len
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key of a late block
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < seq_len)
    tl.store(lse_ptr + pid_bh * seq_len + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=offs_m < seq_len)


def other_flash(q, k, v, causal=False):
    b, h, s, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), dtype=torch.float32)
    _other_kernel[(triton.cdiv(s, 128), b * h)](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        h, s, 1.4426950408889634 / math.sqrt(d), HEAD_DIM=d, BLOCK_M=128, BLOCK_N=64, CAUSAL=causal)
    return out, lse


def online_by_query_blocks(q, k, v, causal=False, block_n=16):
    """Another correct online softmax: blocks of 96 queries outside, keys inside, in float64."""
    b, h, s, d = q.shape
    outs, lses = [], []
    for q0 in range(0, s, 96):
        qb = q[:, :, q0:q0 + 96].double() / math.sqrt(d)  # (B, H, n_q, D)
        n_q = qb.shape[2]
        m = torch.full((b, h, n_q), float("-inf"), dtype=torch.float64)
        denom = torch.zeros((b, h, n_q), dtype=torch.float64)
        acc = torch.zeros((b, h, n_q, d), dtype=torch.float64)
        rows = torch.arange(q0, q0 + n_q)[:, None]
        for k0 in range(0, s, block_n):
            if causal and k0 > q0 + n_q - 1:
                break
            kb, vb = k[:, :, k0:k0 + block_n].double(), v[:, :, k0:k0 + block_n].double()
            scores = qb @ kb.transpose(-2, -1)
            if causal:
                scores = scores.masked_fill(torch.arange(k0, k0 + kb.shape[2])[None, :] > rows, float("-inf"))
            m_new = torch.maximum(m, scores.amax(dim=-1))
            p = torch.exp(scores - m_new[..., None])
            alpha = torch.exp(m - m_new)
            denom, acc, m = denom * alpha + p.sum(-1), acc * alpha[..., None] + p @ vb, m_new
        outs.append(acc / denom[..., None])
        lses.append(m + torch.log(denom))
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2).to(q.dtype)  # lse in the inputs' dtype


def naive_in_input_dtype(q, k, v, causal=False):
    """What many people write: everything in the inputs' dtype, torch.softmax, an additive mask."""
    s = q.shape[-2]
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if causal:
        scores = scores + torch.full((s, s), float("-inf"), dtype=q.dtype).triu(1)
    return torch.softmax(scores, dim=-1) @ v


def test_other_correct_implementations_pass(capsys):
    check_flash_attention(other_flash)  # strided, exp2, reverse key order, 128 x 64 tiles
    check_online_softmax(online_by_query_blocks)
    assert capsys.readouterr().out.count("PASSED") == 2


def test_attention_in_the_input_dtype_fails_on_float16_logits_in_the_hundreds():
    """What many people write, everything in the inputs' dtype, passes every ordinary case but rounds
    scores of 200 to multiples of 0.125 in float16 (red team, issue 26)."""
    with pytest.raises(CheckFailed) as info:
        check_naive_attention(naive_in_input_dtype)
    assert "large_logits=in the hundreds, in float16" in str(info.value)
    assert "computed in float16" in str(info.value)


def test_bfloat16_cases_accept_naive_attention_computed_in_bfloat16(monkeypatch, capsys):
    """The GPU adds bf16 cases; their tolerances must admit attention rounded to bf16 throughout."""
    import labsupport.checks.lab07_attention as CA

    monkeypatch.setattr(CA, "_dtypes", lambda: [torch.bfloat16])  # as on a GPU, without one
    check_naive_attention(naive_in_input_dtype)
    check_naive_attention(naive_attention_reference)
    check_online_softmax(online_softmax_reference)
    assert capsys.readouterr().out.count("PASSED") == 3
    with pytest.raises(CheckFailed, match="1/sqrt"):
        check_naive_attention(NAIVE_MUTANTS["no_scale"][0])


def _tf32(x):
    """Round float32 to tf32 (10 mantissa bits, round to nearest), as tensor cores read it."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def tf32_flash(q, k, v, causal=False):
    """A correct kernel's arithmetic, except that both matmuls take tf32 inputs (the GPU default)."""
    if q.dtype != torch.float32:
        return online(q, k, v, causal, 64)
    s = q.shape[2]
    scores = _tf32(q) @ _tf32(k).transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None])
    return _tf32(p) @ _tf32(v), lse


def test_flash_check_names_tf32_on_a_gpu(monkeypatch):
    import labsupport.checks.lab07_attention as CA

    monkeypatch.setattr(CA, "_gpu_compiles", lambda: True)  # diagnose as on a GPU (no bf16 cases here)
    monkeypatch.setattr(CA, "_dtypes", lambda: [torch.float32, torch.float16])
    with pytest.raises(CheckFailed, match='input_precision="ieee"') as info:
        check_flash_attention(tf32_flash)
    assert "S=1," in str(info.value)  # caught on the first case, where no logic mistake shows
    with pytest.raises(CheckFailed) as info:  # a logic mistake is not blamed on tf32
        check_flash_attention(triton_flash(rescale=False))
    assert "tf32" not in str(info.value) and "rescaled" in str(info.value)


def test_interpreter_does_not_mention_tf32():
    with pytest.raises(CheckFailed) as info:
        check_flash_attention(tf32_flash)
    assert "tf32" not in str(info.value)


def test_low_precision_lse_is_named():
    def flash_attention(q, k, v, causal=False):
        out, lse = attention_spec(q, k, v, causal)
        return out, lse.half()

    with pytest.raises(CheckFailed, match="float16, less precise than the inputs"):
        check_flash_attention(flash_attention)
