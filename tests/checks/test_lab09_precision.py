"""The precision checks accept the course's answers and reject planted mistakes, one test each."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from labsupport import int8_matmul as IM
from labsupport import quantize as Q
from labsupport._answers import unguarded
from labsupport.checks import (
    CheckFailed,
    check_dequantize_groupwise,
    check_int8_matmul,
    check_quantize_groupwise,
)
from labsupport.checks import lab09_precision as lab09

quantize_groupwise = unguarded(Q.quantize_groupwise)
dequantize_groupwise = unguarded(Q.dequantize_groupwise)
int8_matmul_reference = unguarded(IM.int8_matmul_reference)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


# --- quantisation mutants -----------------------------------------------------------------------


def quantize(w, bits=8, group_size=128, *, scale_from="max", rounding="nearest", swap_nibbles=False,
             top=None, scale_dtype=torch.float32):
    """Group-wise symmetric quantisation with one optional planted mistake."""
    n, k = w.shape
    top = (2 ** (bits - 1) - 1) if top is None else top
    g = w.float().reshape(n, k // group_size, group_size)
    stat = g.abs().amax(-1) if scale_from == "max" else g.abs().mean(-1)
    scales = stat / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]
    ratio = g / safe
    rounded = {"nearest": torch.round, "toward_zero": torch.trunc}[rounding](ratio)
    codes = rounded.clamp(-top, top).reshape(n, k).to(torch.int8)
    if bits == 4:
        nib = codes.to(torch.int16) & 0xF
        even, odd = nib[:, 0::2], nib[:, 1::2]
        codes = ((odd | (even << 4)) if swap_nibbles else (even | (odd << 4))).to(torch.uint8)
    return codes, scales.to(scale_dtype)


def quantize_mutant(**mistake):
    return lambda w, bits=8, group_size=128: quantize(w, bits, group_size, **mistake)


def quantize_nan_for_zero_groups(w, bits=8, group_size=128):
    n, k = w.shape
    top = 2 ** (bits - 1) - 1
    g = w.float().reshape(n, k // group_size, group_size)
    scales = g.abs().amax(-1) / top
    codes = torch.round(g / scales[..., None]).clamp(-top, top)  # 0 / 0 = NaN in an all-zero group
    codes = codes.nan_to_num(0).reshape(n, k).to(torch.int8)
    return (Q.pack_int4(codes) if bits == 4 else codes), scales * torch.where(scales > 0, 1.0, float("nan"))


def quantize_unpacked_int4(w, bits=8, group_size=128):
    codes, scales = quantize(w, bits, group_size)
    return (Q.unpack_int4(codes) if bits == 4 else codes), scales  # int4: one code per byte, not packed


def quantize_offset_binary(w, bits=8, group_size=128):
    """int4 stored as code + 8 in each nibble (llama.cpp's Q4_0 convention), not two's complement."""
    codes, scales = quantize(w, bits, group_size)
    if bits == 4:
        u = Q.unpack_int4(codes).to(torch.int16) + 8
        codes = (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)
    return codes, scales


def quantize_groups_in_column_order(w, bits=8, group_size=128):
    """Groups taken from W in column-major order (w.T's memory) instead of along each row."""
    n, k = w.shape
    return quantize(w.T.contiguous().reshape(n, k), bits, group_size)


def quantize_stub(w, bits=8, group_size=128):
    raise NotImplementedError("Exercise: quantise w")


QUANT_MUTANTS = {
    "scale_from_mean": (quantize_mutant(scale_from="mean"), "mean of |w|"),
    "nibbles_swapped": (quantize_mutant(swap_nibbles=True), "nibbles are swapped"),
    "rounding_toward_zero": (quantize_mutant(rounding="toward_zero"), "rounded toward zero"),
    "qmax_is_2_to_bits_minus_1": (lambda w, bits=8, group_size=128: quantize(w, bits, group_size, top=2 ** (bits - 1)),
                                  "does not fit"),
    "scales_in_fp16": (quantize_mutant(scale_dtype=torch.float16), "expected float32"),
    "nan_scale_for_zero_group": (quantize_nan_for_zero_groups, "all-zero group"),
    "int4_not_packed": (quantize_unpacked_int4, "expected uint8"),
    "int4_offset_binary": (quantize_offset_binary, "code + 8"),
    "groups_in_column_order": (quantize_groups_in_column_order, "the scales is wrong"),
    "stub": (quantize_stub, "NotImplementedError"),
}


def test_quantize_reference_passes(capsys):
    check_quantize_groupwise(quantize_groupwise)
    check_quantize_groupwise(quantize)  # the mutant harness, with no mutation, is right
    assert "PASSED check_quantize_groupwise" in capsys.readouterr().out


@pytest.mark.parametrize("name", QUANT_MUTANTS)
def test_quantize_check_rejects(name):
    fn, expected = QUANT_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_quantize_groupwise(fn)
    assert expected in str(info.value), str(info.value)


def test_quantize_check_refuses_the_course_answer():
    from labsupport._answers import course_checks_its_answers

    with course_checks_its_answers(False), pytest.raises(CheckFailed, match="course's own answer"):
        check_quantize_groupwise(Q.quantize_groupwise)


# --- dequantisation mutants ---------------------------------------------------------------------


def dequantize(codes, scales, bits=8, group_size=128, *, swap_nibbles=False, sign_extend=True, wrong_group=False):
    if bits == 4:
        p = codes.to(torch.int16)
        low, high = p & 0xF, (p >> 4) & 0xF
        pair = [high, low] if swap_nibbles else [low, high]
        q = torch.stack(pair, -1).reshape(codes.shape[0], -1)
        if sign_extend:
            q = torch.where(q >= 8, q - 16, q)
    else:
        q = codes
    s = scales.float().repeat(1, group_size) if wrong_group else scales.float().repeat_interleave(group_size, 1)
    return q.float() * s


def dequantize_mutant(**mistake):
    return lambda codes, scales, bits=8, group_size=128: dequantize(codes, scales, bits, group_size, **mistake)


def dequantize_in_float16(codes, scales, bits=8, group_size=128):
    return dequantize(codes, scales, bits, group_size).half()


def dequantize_stub(codes, scales, bits=8, group_size=128):
    raise NotImplementedError("Exercise: dequantise")


DEQUANT_MUTANTS = {
    "nibbles_swapped": (dequantize_mutant(swap_nibbles=True), "nibbles are swapped"),
    "no_sign_extension": (dequantize_mutant(sign_extend=False), "not sign-extended"),
    "wrong_group_index": (dequantize_mutant(wrong_group=True), "k % G"),
    "returns_float16": (dequantize_in_float16, "expected float32 (the lab's convention"),
    "stub": (dequantize_stub, "NotImplementedError"),
}


def test_dequantize_reference_passes(capsys):
    check_dequantize_groupwise(dequantize_groupwise)
    check_dequantize_groupwise(dequantize)
    assert "PASSED check_dequantize_groupwise" in capsys.readouterr().out


@pytest.mark.parametrize("name", DEQUANT_MUTANTS)
def test_dequantize_check_rejects(name):
    fn, expected = DEQUANT_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_dequantize_groupwise(fn)
    assert expected in str(info.value), str(info.value)


# --- int8 matmul mutants (Triton, in the interpreter on a CPU) ------------------------------------


@triton.jit
def mutant_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, GROUPS, GROUP_SIZE, LDX,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                  SCALE_ALONG_K: tl.constexpr, FP16_ACC: tl.constexpr, SCALE_BY_TILE: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    if FP16_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * LDX + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * K + (k0 + offs_k)[:, None], mask=n_ok[None, :], other=0)
        if SCALE_ALONG_K:  # the planted mistake: the scale of input channel k, not output channel n
            kk = k0 + offs_k
            scale = tl.load(s_ptr + kk * GROUPS + k0 // GROUP_SIZE, mask=kk < N, other=0.0)
            w = (w.to(tl.float32) * scale[:, None]).to(x.dtype)
        elif SCALE_BY_TILE:  # the planted mistake: the K tile's number, not its group's
            scale = tl.load(s_ptr + offs_n * GROUPS + tl.minimum(k0 // BLOCK_K, GROUPS - 1), mask=n_ok, other=0.0)
            w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)
        else:
            scale = tl.load(s_ptr + offs_n * GROUPS + k0 // GROUP_SIZE, mask=n_ok, other=0.0)
            w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)
        if IEEE:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        acc = (acc + part).to(acc.dtype)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def matmul(x, w_q, scales, *, scale_along_k=False, fp16_acc=False, one_m_tile=False, scale_by_tile=False,
           x_as_given=False):
    """The kernel's wrapper; ``fp16_acc`` accumulates in x's dtype when that is float16 (the usual
    slip: ``tl.zeros(..., dtype=x.dtype)``); ``one_m_tile`` launches one row of programs;
    ``x_as_given`` reads x with K as its row stride, contiguous or not."""
    m, k = x.shape
    n = w_q.shape[0]
    groups = scales.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = IM.int8_matmul_config(m, n, k, k // groups, interpreter=True)
    block_k = min(cfg.block_k, 64)
    grid = (1 if one_m_tile else triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    mutant_kernel[grid](x if x_as_given else x.contiguous(), w_q.contiguous(), scales.float().contiguous(), out,
                        m, n, k, groups, k // groups, k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                        IEEE=x.dtype == torch.float32, SCALE_ALONG_K=scale_along_k,
                        FP16_ACC=fp16_acc and x.dtype == torch.float16, SCALE_BY_TILE=scale_by_tile)
    return out


def matmul_mutant(**mistake):
    return lambda x, w_q, scales: matmul(x, w_q, scales, **mistake)


def matmul_in_torch(x, w_q, scales):
    n, k = w_q.shape
    group = k // scales.shape[1]
    w = (w_q.float() * scales.float().repeat_interleave(group, 1)).to(x.dtype)  # (N, K): the whole W in 16 bits
    return (x.float() @ w.float().T).to(x.dtype)


def matmul_dequantises_first(x, w_q, scales):
    """Dequantises W in torch, then launches the course's kernel-like mutant on it: moves 2-4x the bytes."""
    n, k = w_q.shape
    w = w_q.float() * scales.float().repeat_interleave(k // scales.shape[1], 1)  # (N, K) float: what is refused
    del w
    return matmul(x, w_q, scales)


@triton.jit
def dense_kernel(x_ptr, w_ptr, out_ptr, M, N, K, LDO, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """A plain 16-bit (or fp32) Triton matmul, out[:, :N] = x @ w.T with out's rows LDO apart."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=(offs_m < M)[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * K + (k0 + offs_k)[:, None], mask=(offs_n < N)[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + offs_m[:, None] * LDO + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def matmul_dequantises_in_chunks(x, w_q, scales):
    """Dequantises a quarter of W's rows at a time in torch (no tensor as large as W), then runs a
    Triton matmul of its own on each chunk, writing straight into y."""
    m, k = x.shape
    n, group = w_q.shape[0], k // scales.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    step = max(1, n // 4)
    for a in range(0, n, step):
        b = min(n, a + step)
        w = (w_q[a:b].float().reshape(b - a, -1, group) * scales[a:b, :, None]).reshape(b - a, k).to(x.dtype)
        dense_kernel[(triton.cdiv(m, 16), triton.cdiv(b - a, 64))](
            x, w, out[:, a:], m, b - a, k, n, BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, IEEE=x.dtype == torch.float32)
    return out


def _y_then_copy(x, y):
    out = torch.empty_like(y)
    copy_kernel[(triton.cdiv(y.numel(), 256),)](y.contiguous(), out, y.numel(), BLOCK=256)
    return out


def matmul_kernel_only_copies(x, w_q, scales):
    """Computes y in torch one output channel at a time (no matmul, no large tensor); a Triton
    kernel only copies it into the returned tensor."""
    m, k = x.shape
    n, group = w_q.shape[0], k // scales.shape[1]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    for j in range(n):
        w = (w_q[j].float().reshape(-1, group) * scales[j, :, None]).reshape(k)
        y[:, j] = (x.float() * w).sum(-1)
    return _y_then_copy(x, y.to(x.dtype))


def matmul_codes_through_numpy(x, w_q, scales):
    """Takes the codes out through NumPy, computes y there, and has a kernel copy it."""
    n, k = w_q.shape
    w = w_q.cpu().numpy().astype("float64").reshape(n, scales.shape[1], -1) * scales.cpu().double().numpy()[..., None]
    y = x.cpu().double().numpy() @ w.reshape(n, k).T
    return _y_then_copy(x, torch.from_numpy(y).to(device=x.device, dtype=x.dtype))


def matmul_stub(x, w_q, scales):
    raise NotImplementedError("Exercise: write the kernel")


MATMUL_MUTANTS = {
    "scale_on_wrong_axis": (matmul_mutant(scale_along_k=True), "applied along K"),
    "fp16_accumulation": (matmul_mutant(fp16_acc=True), "accumulator is float16"),
    "computed_in_torch": (matmul_in_torch, "no Triton kernel was launched"),
    "dequantises_w_in_torch": (matmul_dequantises_first, "as many as W has weights"),
    "dequantises_w_in_chunks": (matmul_dequantises_in_chunks, "a slice at a time"),
    "kernel_only_copies": (matmul_kernel_only_copies, "computing y in torch"),
    "codes_through_numpy": (matmul_codes_through_numpy, "`numpy`"),
    "stub": (matmul_stub, "NotImplementedError"),
}


def test_int8_matmul_reference_passes(capsys):
    check_int8_matmul(int8_matmul_reference)
    check_int8_matmul(matmul)  # the mutant harness, with no mutation, is right
    assert "PASSED check_int8_matmul" in capsys.readouterr().out


@pytest.mark.parametrize("name", MATMUL_MUTANTS)
def test_int8_matmul_check_rejects(name):
    fn, expected = MATMUL_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_int8_matmul(fn)
    assert expected in str(info.value), str(info.value)


AIMED_CASE_MUTANTS = {  # results_b's kernels that passed every decode shape
    "one_row_of_programs": (dict(one_m_tile=True), "M = 80 rows, more than one BLOCK_M tile"),
    "scale_indexed_by_k_tile": (dict(scale_by_tile=True), "not the tile number k0 // BLOCK_K"),
    "x_read_as_contiguous": (dict(x_as_given=True), "row stride (x.stride(0)) is not K"),
}


@pytest.mark.parametrize("name", AIMED_CASE_MUTANTS)
def test_int8_matmul_aimed_cases_reject(name, monkeypatch):
    """Each fails one of the cases aimed at it; the decode shapes are left out here (time)."""
    cases = lab09._matmul_cases
    monkeypatch.setattr(lab09, "_matmul_cases", lambda: [c for c in cases() if "hint" in c])
    flags, expected = AIMED_CASE_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_int8_matmul(matmul_mutant(**flags))
    assert expected in str(info.value), str(info.value)


def test_int8_matmul_check_refuses_the_course_answer():
    from labsupport._answers import course_checks_its_answers

    with course_checks_its_answers(False), pytest.raises(CheckFailed, match="course's own answer"):
        check_int8_matmul(IM.int8_matmul_reference)


@pytest.mark.parametrize("check,fn", [
    (check_quantize_groupwise, lambda w, bits=8, group_size=128: Q.quantize_groupwise(w, bits, group_size)),
    (check_dequantize_groupwise, lambda c, s, bits=8, group_size=128: Q.dequantize_groupwise(c, s, bits, group_size)),
    (check_int8_matmul, lambda x, w_q, scales: IM.int8_matmul_spec(x, w_q, scales)),
    (check_int8_matmul, lambda x, w_q, scales: IM.int8_matmul_reference(x, w_q, scales)),
], ids=["quantize", "dequantize", "matmul_spec", "matmul_kernel"])
def test_calling_the_course_answer_is_rejected(check, fn):
    with pytest.raises(CheckFailed, match="the course's own answer"):
        check(fn)


# --- GGUF block mutants (Q8_0, Q4_1) -----------------------------------------------------------------

from labsupport import gguf_blocks as GB  # noqa: E402
from labsupport.checks import check_dequantize_q4_1, check_dequantize_q8_0  # noqa: E402

dequantize_q8_0 = unguarded(GB.dequantize_q8_0)
dequantize_q4_1 = unguarded(GB.dequantize_q4_1)


def _blocks(raw, size):
    return raw.reshape(raw.shape[0], -1, size)


def _half(two, swap=False):
    return (two.flip(-1) if swap else two).contiguous().view(torch.float16)[..., 0].float()


def q8_0(raw, *, unsigned=False, swap=False, absolute=False, first_scale=False, drop_last=False):
    b = _blocks(raw, 34)
    if drop_last:
        b = b[:, :-1]
    d = _half(b[..., 0:2], swap)
    d = d.abs() if absolute else d
    d = d[:, :1].expand_as(d) if first_scale else d
    q = b[..., 2:].float() if unsigned else b[..., 2:].contiguous().view(torch.int8).float()
    return (d[..., None] * q).reshape(raw.shape[0], -1)


def q4_1(raw, *, order="blocked", add_min=True, centred=False, swap_dm=False, minus_min=False, swap=False):
    b = _blocks(raw, 20)
    d, m = _half(b[..., 0:2], swap), _half(b[..., 2:4], swap)
    m = -m if minus_min else m
    if swap_dm:
        d, m = m, d
    qs = b[..., 4:].to(torch.int16)
    if order == "blocked":
        q = torch.cat([qs & 0xF, qs >> 4], -1)
    elif order == "high_first":
        q = torch.cat([qs >> 4, qs & 0xF], -1)
    else:  # interleaved: the course's own int4 packing
        q = torch.stack([qs & 0xF, qs >> 4], -1).reshape(*qs.shape[:-1], 32)
    q = q.float() - (8 if centred else 0)
    return (d[..., None] * q + (m[..., None] if add_min else 0)).reshape(raw.shape[0], -1)


def gguf_stub(raw):
    raise NotImplementedError("Exercise: read the blocks")


Q8_0_MUTANTS = {
    "codes_unsigned": (lambda raw: q8_0(raw, unsigned=True), "unsigned bytes"),
    "scale_big_endian": (lambda raw: q8_0(raw, swap=True), "big-endian"),
    "scale_sign_lost": (lambda raw: q8_0(raw, absolute=True), "sign is lost"),
    "first_block_scale": (lambda raw: q8_0(raw, first_scale=True), "first block's scale"),
    "last_block_dropped": (lambda raw: q8_0(raw, drop_last=True), "has shape"),
    "float16_result": (lambda raw: q8_0(raw).half(), "expected float32"),
    "stub": (gguf_stub, "NotImplementedError"),
}
Q4_1_MUTANTS = {
    "nibbles_interleaved": (lambda raw: q4_1(raw, order="interleaved"), "interleaved"),
    "min_not_added": (lambda raw: q4_1(raw, add_min=False), "minimum m is not added"),
    "centred_like_q4_0": (lambda raw: q4_1(raw, centred=True), "centred as in Q4_0"),
    "d_and_m_swapped": (lambda raw: q4_1(raw, swap_dm=True), "d and m are swapped"),
    "high_nibbles_first": (lambda raw: q4_1(raw, order="high_first"), "high nibbles are taken first"),
    "min_subtracted": (lambda raw: q4_1(raw, minus_min=True), "m is subtracted"),
    "big_endian": (lambda raw: q4_1(raw, swap=True), "big-endian"),
    "float64_result": (lambda raw: q4_1(raw).double(), "expected float32"),
    "stub": (gguf_stub, "NotImplementedError"),
}


def test_gguf_block_references_pass(capsys):
    check_dequantize_q8_0(dequantize_q8_0)
    check_dequantize_q8_0(q8_0)  # the mutant harness, with no mutation, is right
    check_dequantize_q4_1(dequantize_q4_1)
    check_dequantize_q4_1(q4_1)
    out = capsys.readouterr().out
    assert "PASSED check_dequantize_q8_0" in out and "PASSED check_dequantize_q4_1" in out


@pytest.mark.parametrize("name", Q8_0_MUTANTS)
def test_q8_0_check_rejects(name):
    fn, expected = Q8_0_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_dequantize_q8_0(fn)
    assert expected in str(info.value), str(info.value)


@pytest.mark.parametrize("name", Q4_1_MUTANTS)
def test_q4_1_check_rejects(name):
    fn, expected = Q4_1_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_dequantize_q4_1(fn)
    assert expected in str(info.value), str(info.value)


def test_gguf_checks_read_real_blocks_of_both_types():
    from labsupport.checks.lab09_precision import _real_rows

    real = _real_rows()
    assert set(real) == {"Q8_0", "Q4_1"}, real  # the shipped file is installed (make setup) and holds both
    assert all(raw.dtype == torch.uint8 and raw.shape[1] % (34 if kind == "Q8_0" else 20) == 0
               for kind, rows in real.items() for _, raw in rows)


def test_gguf_checks_refuse_the_course_answers():
    from labsupport._answers import course_checks_its_answers

    with course_checks_its_answers(False), pytest.raises(CheckFailed, match="course's own answer"):
        check_dequantize_q4_1(GB.dequantize_q4_1)
