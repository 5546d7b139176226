"""The position checks accept the course's answers and reject planted mistakes, one test each."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from labsupport import position as P
from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_apply_rope, check_fused_rope, check_llama3_inv_freq
from labsupport.device import interpreter_mode

apply_rope_reference = unguarded(P.apply_rope_reference)
llama3_inv_freq = unguarded(P.llama3_inv_freq)
rotate = unguarded(P.rotate)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


# --- exercise 1: apply_rope -------------------------------------------------------------------------


def rope(x, positions, theta, layout, *, exponent=2, shift=0, swap=False, sign=1.0, angles_dtype=torch.float32):
    """RoPE written out, with one optional planted mistake."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d // 2, dtype=angles_dtype) * exponent / d)
    angles = (positions.to(angles_dtype) + shift)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), sign * angles.sin().float()
    if swap:
        layout = {"halves": "interleaved", "interleaved": "halves"}[layout]
    xf = x.float()
    if layout == "halves":
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)
    a, b = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)


def test_apply_rope_accepts_the_reference_and_a_float64_version(capsys):
    check_apply_rope(apply_rope_reference)
    check_apply_rope(lambda x, p, t, layout: rope(x, p, t, layout, angles_dtype=torch.float64))
    assert "PASSED check_apply_rope" in capsys.readouterr().out


def test_apply_rope_rejects_the_stub():
    def stub(x, positions, theta, layout):
        raise NotImplementedError("write apply_rope")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_apply_rope(stub)


def test_apply_rope_rejects_the_wrong_layout():
    with pytest.raises(CheckFailed, match="the pairs are taken in the interleaved layout instead of the halves"):
        check_apply_rope(lambda x, p, t, layout: rope(x, p, t, layout, swap=True))


def test_apply_rope_rejects_theta_on_the_wrong_dimension():
    with pytest.raises(CheckFailed, match=r"the exponent is i / D instead of 2i / D"):
        check_apply_rope(lambda x, p, t, layout: rope(x, p, t, layout, exponent=1))


def test_apply_rope_rejects_positions_off_by_one():
    with pytest.raises(CheckFailed, match=r"positions are shifted by one \(position \+ 1\)"):
        check_apply_rope(lambda x, p, t, layout: rope(x, p, t, layout, shift=1))


def test_apply_rope_rejects_the_index_instead_of_the_positions():
    with pytest.raises(CheckFailed, match="rotated x is wrong"):
        check_apply_rope(lambda x, p, t, layout: rope(x, torch.arange(x.shape[-2]), t, layout))


def test_apply_rope_rejects_a_reversed_rotation():
    with pytest.raises(CheckFailed, match="turns the wrong way"):
        check_apply_rope(lambda x, p, t, layout: rope(x, p, t, layout, sign=-1.0))


def _model_rope(x, positions, theta, layout):
    from labsupport.transformer import apply_rope as model_rope

    inv_freq = 1.0 / theta ** (torch.arange(0, x.shape[-1], 2).float() / x.shape[-1])
    angles = positions.float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return model_rope(x.float(), cos, sin).to(x.dtype)


@pytest.mark.parametrize("bypass", [
    lambda x, p, t, layout: P.apply_rope_reference(x, p, t, layout),
    lambda x, p, t, layout: P.rope_with_inv_freq(x, p, 1.0 / t ** (torch.arange(0, x.shape[-1], 2) / x.shape[-1]),
                                                 layout),
    lambda x, p, t, layout: rope(x, p, t, layout) if layout == "interleaved" else _model_rope(x, p, t, layout),
    lambda x, p, t, layout: P.rotate(x, *P.rope_cos_sin(p, P.rope_inv_freq(x.shape[-1], t)), layout),
], ids=["the reference", "rope_with_inv_freq", "the course model's apply_rope", "rope_inv_freq and rotate"])
def test_apply_rope_rejects_the_course_rope_inside_a_learner_function(bypass):
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_apply_rope(bypass)


# --- exercise 3: llama3_inv_freq --------------------------------------------------------------------


def llama3(head_dim, theta, scaling, *, mistake=None):
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    wavelength = (1.0 if mistake == "no 2 pi" else 2 * math.pi) / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = inv_freq * ((1 - smooth) / factor + smooth)
    if mistake == "no blend":
        blended = inv_freq
    if mistake == "theta dim":  # the exponent uses i / D, theta on the wrong dimension
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim // 2).float() / head_dim)
        wavelength = 2 * math.pi / inv_freq
        blended = inv_freq * ((1 - smooth) / factor + smooth)
    slow, fast = wavelength > original / low, wavelength < original / high
    if mistake == "inverted":
        slow, fast = fast, slow
    out = torch.where(slow, inv_freq / factor, blended)
    return torch.where(fast, inv_freq, out)


def test_llama3_accepts_the_reference_and_matches_transformers(capsys):
    check_llama3_inv_freq(llama3_inv_freq)
    check_llama3_inv_freq(llama3)
    assert capsys.readouterr().out.count("PASSED check_llama3_inv_freq") == 2


def test_llama3_rejects_float64_frequencies():
    """The red team's inv_wrong_float64_out (issue 26): computed in double and never cast back."""
    check_llama3_inv_freq(lambda d, t, s: llama3_inv_freq(d, t, s).double().float())  # cast back: passes
    with pytest.raises(CheckFailed, match="dtype torch.float64, expected float32: the fused kernel"):
        check_llama3_inv_freq(lambda d, t, s: llama3_inv_freq(d, t, s).double())


def test_llama3_rejects_the_stub():
    def stub(head_dim, theta, scaling):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_llama3_inv_freq(stub)


def test_llama3_rejects_position_interpolation():
    with pytest.raises(CheckFailed, match="every frequency is divided by factor"):
        check_llama3_inv_freq(lambda d, t, s: 1.0 / t ** (torch.arange(0, d, 2).float() / d) / s["factor"])


def test_llama3_rejects_no_blend():
    with pytest.raises(CheckFailed, match="middle band is not blended"):
        check_llama3_inv_freq(lambda d, t, s: llama3(d, t, s, mistake="no blend"))


def test_llama3_rejects_the_factor_on_fast_pairs():
    with pytest.raises(CheckFailed, match="applied to the fast"):
        check_llama3_inv_freq(lambda d, t, s: llama3(d, t, s, mistake="inverted"))


def test_llama3_rejects_a_missing_two_pi():
    with pytest.raises(CheckFailed, match="without the 2 pi"):
        check_llama3_inv_freq(lambda d, t, s: llama3(d, t, s, mistake="no 2 pi"))


def test_llama3_rejects_theta_on_the_wrong_dimension():
    with pytest.raises(CheckFailed, match="inverse frequencies is wrong"):
        check_llama3_inv_freq(lambda d, t, s: llama3(d, t, s, mistake="theta dim"))


def test_llama3_rejects_the_course_function_inside_a_learner_function():
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_llama3_inv_freq(lambda d, t, s: P.rope_inv_freq(d, t, s))


# --- exercise 4: the fused kernel -------------------------------------------------------------------

BLOCK = 16


@triton.jit
def rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, inv_freq_ptr, seq_len, n_heads, n_kv_heads,
                HALF: tl.constexpr, BLOCK_S: tl.constexpr, ROTATE_K: tl.constexpr, INTERLEAVED: tl.constexpr,
                SHIFT: tl.constexpr, USE_INDEX: tl.constexpr, MASK_LEN: tl.constexpr, K_HEADS_FROM_Q: tl.constexpr,
                POS_FP16: tl.constexpr, SHARED_POS: tl.constexpr, K_ALL_HEADS: tl.constexpr = False,
                STORE_UNMASKED: tl.constexpr = False):
    """The reference design with switches that plant one mistake each (all default to correct)."""
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = offs_s < seq_len - MASK_LEN  # MASK_LEN = 1: the mask drops the last position
    offs_f = tl.arange(0, HALF)
    if USE_INDEX:
        pos = offs_s.to(tl.float32)
    else:
        # positions are (B * S,), one per token; SHARED_POS reads sequence 0's for every sequence
        pos_base = 0 if SHARED_POS else b.to(tl.int64) * seq_len
        pos = tl.load(pos_ptr + pos_base + offs_s, mask=row_ok, other=0)
        if POS_FP16:  # the positions pass through the inputs' 16-bit type: 9001 becomes 9000
            pos = pos.to(tl.float16)
        pos = pos.to(tl.float32) + SHIFT
    angle = pos[:, None] * tl.load(inv_freq_ptr + offs_f)[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    if INTERLEAVED:
        first = offs_s[:, None] * (2 * HALF) + 2 * offs_f[None, :]
        step = 1
    else:
        first = offs_s[:, None] * (2 * HALF) + offs_f[None, :]
        step = HALF
    mask = row_ok[:, None]
    store_mask = offs_s[:, None] < (1 << 30) if STORE_UNMASKED else mask  # STORE_UNMASKED: every lane stores
    for h in range(n_heads):
        base = (b.to(tl.int64) * n_heads + h) * seq_len * (2 * HALF)
        a = tl.load(q_ptr + base + first, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(q_ptr + base + first + step, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_out_ptr + base + first, (a * cos - c * sin).to(q_out_ptr.dtype.element_ty), mask=store_mask)
        tl.store(q_out_ptr + base + first + step, (a * sin + c * cos).to(q_out_ptr.dtype.element_ty),
                 mask=store_mask)
    k_heads = n_kv_heads
    if K_HEADS_FROM_Q:  # the key loop stops at the group count H // Hkv... of the wrong tensor
        k_heads = tl.minimum(n_kv_heads, n_heads // n_kv_heads)
    if K_ALL_HEADS:  # the key loop runs over q's H heads: past the end of k when Hkv < H
        k_heads = n_heads
    for h in range(k_heads):
        base = (b.to(tl.int64) * n_kv_heads + h) * seq_len * (2 * HALF)
        a = tl.load(k_ptr + base + first, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(k_ptr + base + first + step, mask=mask, other=0.0).to(tl.float32)
        if ROTATE_K:
            a, c = a * cos - c * sin, a * sin + c * cos
        tl.store(k_out_ptr + base + first, a.to(k_out_ptr.dtype.element_ty), mask=mask)
        tl.store(k_out_ptr + base + first + step, c.to(k_out_ptr.dtype.element_ty), mask=mask)


def fused(q, k, positions, inv_freq, *, rotate_k=True, interleaved=False, shift=0, use_index=False,
          mask_len=0, k_heads_from_q=False, floor_grid=False, two_launches=False, pos_fp16=False,
          shared_positions=False, k_all_heads=False, store_unmasked=False, one_sequence=False):
    b, h, s, d = q.shape
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.zeros_like(q), torch.zeros_like(k)
    blocks = s // BLOCK if floor_grid else triton.cdiv(s, BLOCK)
    switches = dict(HALF=d // 2, BLOCK_S=BLOCK, ROTATE_K=rotate_k, INTERLEAVED=interleaved, SHIFT=shift,
                    USE_INDEX=use_index, MASK_LEN=mask_len, K_HEADS_FROM_Q=k_heads_from_q,
                    POS_FP16=pos_fp16, SHARED_POS=shared_positions, K_ALL_HEADS=k_all_heads,
                    STORE_UNMASKED=store_unmasked)
    if blocks == 0:
        return q_out, k_out
    if two_launches:
        rope_kernel[(blocks, b)](q, q, q_out, q_out, positions, inv_freq, s, h, 0, **switches)
        rope_kernel[(blocks, b)](k, k, k_out, k_out, positions, inv_freq, s, k.shape[1], 0, **switches)
    else:
        rope_kernel[(blocks, 1 if one_sequence else b)](q, k, q_out, k_out, positions, inv_freq, s, h, k.shape[1],
                                                        **switches)
    return q_out, k_out


def test_fused_accepts_a_correct_kernel(capsys):
    check_fused_rope(fused)
    assert "PASSED check_fused_rope" in capsys.readouterr().out


def test_fused_rejects_the_stub():
    def stub(q, k, positions, inv_freq):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_fused_rope(stub)


def test_fused_rejects_only_q_rotated():
    with pytest.raises(CheckFailed, match="k came back unrotated"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, rotate_k=False))


def test_fused_rejects_the_wrong_layout():
    with pytest.raises(CheckFailed, match="taken interleaved instead of in halves"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, interleaved=True))


def test_fused_rejects_positions_off_by_one():
    with pytest.raises(CheckFailed, match=r"shifted by one \(position \+ 1\)"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, shift=1))


def test_fused_rejects_the_index_instead_of_the_positions():
    with pytest.raises(CheckFailed, match="index within the sequence is used instead of the positions"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, use_index=True))


def test_fused_rejects_positions_shared_by_the_batch():
    # the kernel reads positions[s] for every sequence: right for sequence 0, wrong for the others
    with pytest.raises(CheckFailed, match=r"(?s)positions shared by the batch.*right for sequence 0 and wrong"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, shared_positions=True))


def test_fused_rejects_a_mask_that_drops_the_last_position():
    with pytest.raises(CheckFailed, match="wrong at every position from index 0 on .*grid or the mask drops the last"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, mask_len=1))


def test_fused_rejects_a_grid_without_the_partial_block():
    with pytest.raises(CheckFailed, match=r"wrong at every position from index \d+ on .*partial last block"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, floor_grid=True))


def test_fused_rejects_a_wrong_head_count_for_k():
    with pytest.raises(CheckFailed, match=r"k is wrong only for heads"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, k_heads_from_q=True))


def test_fused_wrong_everywhere_does_not_blame_the_grid():
    """Red team (issue 26): every position wrong but written is not a grid or mask that drops positions."""
    with pytest.raises(CheckFailed) as info:
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, interleaved=True))
    assert "drops the last positions" not in str(info.value)
    assert "the kernel did write there" in str(info.value)


def test_fused_names_a_grid_without_the_batch_axis():
    """Red team (issue 26): sequences never written are the grid's batch axis, not the positions."""
    with pytest.raises(CheckFailed, match=r"never written for sequences \[1\]: the grid must cover every sequence"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, one_sequence=True))


def test_fused_names_a_key_loop_past_the_end_of_k():
    """The red team's fused_wrong_k_loop_n_heads (issue 26): it crashed Python; now it is named."""
    with pytest.raises(CheckFailed, match=r"(?s)your kernel wrote outside the .* tensor your function allocated.*"
                                          r"k has Hkv"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, k_all_heads=True))


def test_fused_names_an_unmasked_store():
    """The red team's fused_wrong_store_unmasked (issue 26): it crashed Python; now it is named."""
    with pytest.raises(CheckFailed, match=r"(?s)your kernel wrote outside .*offs_s < S"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, store_unmasked=True))


def test_fused_rejects_positions_rounded_to_float16():
    # float16 holds every integer only up to 2,048; past 8,192 its spacing is 8
    with pytest.raises(CheckFailed, match=r"positions=past 8192 \(sequence 0: \[9001\]"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, pos_fp16=True))


@pytest.mark.skipif(not interpreter_mode(), reason="launches are counted exactly in the interpreter")
def test_fused_rejects_two_launches():
    with pytest.raises(CheckFailed, match="launched 2 Triton kernels"):
        check_fused_rope(lambda q, k, p, f: fused(q, k, p, f, two_launches=True))


def test_fused_rejects_rotation_in_torch():
    def in_torch(q, k, positions, inv_freq):
        out = fused(q, k, positions, inv_freq)  # the kernel runs, but the answer comes from torch
        cos, sin = P.rope_cos_sin(positions, inv_freq)
        out[0].copy_(rotate(q, cos, sin))  # into the tensor the kernel wrote
        return out

    with pytest.raises(CheckFailed, match="called .* in torch"):
        check_fused_rope(in_torch)


def test_fused_rejects_a_result_no_kernel_wrote():
    def copies(q, k, positions, inv_freq):
        fused(q, k, positions, inv_freq)
        cos, sin = P.rope_cos_sin(positions, inv_freq)
        return rotate(q, cos, sin).clone(), rotate(k, cos, sin).clone()

    with pytest.raises(CheckFailed, match="no Triton kernel you launched wrote to: q_rot, k_rot"):
        check_fused_rope(copies)


def test_fused_rejects_the_course_rope_inside_a_learner_function():
    def bypass(q, k, positions, inv_freq):
        out = fused(q, k, positions, inv_freq)
        out[0].copy_(P.rope_with_inv_freq(q, positions, inv_freq))
        return out

    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_fused_rope(bypass)
