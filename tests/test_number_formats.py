"""Number formats read from torch (tf32 and int4 computed from their definitions) and FP8 casts."""

from __future__ import annotations

import pytest
import torch

from labsupport import number_formats as NF


def test_the_table_reads_torch():
    by_name = {f.name: f for f in NF.number_formats()}
    assert list(by_name) == ["fp32", "tf32", "bf16", "fp16", "fp8 E4M3", "fp8 E5M2", "int8", "int4"]
    assert by_name["bf16"].eps == torch.finfo(torch.bfloat16).eps and by_name["bf16"].mantissa_bits == 7
    assert by_name["fp16"].max == torch.finfo(torch.float16).max and by_name["fp16"].exponent_bits == 5
    assert by_name["fp8 E4M3"].max == torch.finfo(torch.float8_e4m3fn).max
    assert (by_name["fp8 E4M3"].exponent_bits, by_name["fp8 E4M3"].mantissa_bits) == (4, 3)
    assert (by_name["fp8 E5M2"].exponent_bits, by_name["fp8 E5M2"].mantissa_bits) == (5, 2)
    assert by_name["int8"].min == torch.iinfo(torch.int8).min
    assert "computed" in by_name["tf32"].source and "computed" in by_name["int4"].source


def test_tf32_and_int4_from_their_definitions():
    assert NF.TF32.bits == 19 and NF.TF32.eps == 2.0**-10 == torch.finfo(torch.float16).eps
    assert NF.TF32.smallest_normal == torch.finfo(torch.float32).smallest_normal
    assert NF.TF32.max < torch.finfo(torch.float32).max < NF.TF32.max * 1.001  # fp32's range, shorter mantissa
    assert (NF.INT4.min, NF.INT4.max) == (-8, 7)


def test_rounding_error_is_half_the_spacing():
    x = torch.linspace(1, 2, 10001)[:-1]
    for dtype in (torch.bfloat16, torch.float16):
        err = NF.relative_rounding_error(x, dtype)
        assert err <= torch.finfo(dtype).eps / 2 * 1.0001
        assert err > torch.finfo(dtype).eps / 2 * 0.9


def test_fp8_scaling_avoids_saturation_and_underflow():
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(4096, generator=gen) * 1000
    unscaled, scaled = NF.to_fp8(big, scaled=False), NF.to_fp8(big, scaled=True)
    assert unscaled.saturated > 0 and scaled.saturated == 0
    assert scaled.max_abs_error < unscaled.max_abs_error
    assert float(unscaled.values.abs().max()) == torch.finfo(torch.float8_e4m3fn).max
    tiny = torch.randn(4096, generator=gen) * 1e-4
    assert NF.to_fp8(tiny, scaled=False).flushed > 0 and NF.to_fp8(tiny, scaled=True).flushed == 0
    # E4M3 keeps 3 mantissa bits: relative error at most 1/16 in the normal range
    assert NF.to_fp8(torch.randn(4096, generator=gen), scaled=True).mean_relative_error < 1 / 16


def test_fp8_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        NF.to_fp8(torch.ones(3), torch.float16)
    with pytest.raises(ValueError, match="unknown format"):
        NF.get_format("fp12")


def test_infinities_and_exact_largest_values():
    by_name = {f.name: f for f in NF.number_formats()}
    assert not by_name["fp8 E4M3"].has_inf and by_name["fp8 E5M2"].has_inf  # "fn": finite, NaN only
    assert by_name["bf16"].has_inf and not by_name["int4"].has_inf
    table = NF.format_table_markdown()
    for exact in ("| 448 |", "| 57,344 |", "| 65,504 |", "| 7 (min -8) |"):
        assert exact in table
