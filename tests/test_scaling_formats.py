"""FP8 scaling schemes, MX formats and NVFP4 (chapter 09): each quantiser's defining property, and
torch._scaled_mm against the fake-quantised matmul."""

from __future__ import annotations

import pytest
import torch

from labsupport import scaling_formats as sf


def _x(seed=0, shape=(64, 256)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_e2m1_rounding_is_to_nearest_even_and_saturates():
    got = sf.round_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -6.5, 0.1, 2.9]))
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.0, 3.0]
    grid = torch.tensor(sf.E2M1_VALUES)
    assert torch.equal(sf.round_e2m1(grid), grid) and torch.equal(sf.round_e2m1(-grid), -grid)


def test_every_fp8_scheme_keeps_each_element_within_half_an_e4m3_step_of_its_scaled_value():
    x = _x()
    for scheme in ("per_tensor_dynamic", "per_token_channel", "blocks_deepseek"):
        q = sf.fake_quant(x, scheme)
        # E4M3 has 3 mantissa bits: a relative error of at most 2**-4 for normal values
        normal = x.abs() > x.abs().amax() * 2.0**-6 / sf.E4M3_MAX * 448
        assert float(((q - x).abs() / x.abs())[normal].max()) <= 2.0**-4 + 1e-6, scheme
        assert torch.equal(sf.fake_quant(q, scheme), q)  # a quantised tensor is its own quantisation


def test_a_static_scale_clips_what_calibration_did_not_see_and_dynamic_does_not():
    x = _x() * 10
    static = float(x.abs().amax() / sf.E4M3_MAX) / 4  # calibrated on data four times smaller
    clipped = sf.fake_quant(x, "per_tensor_static", static_scale=static)
    assert float(clipped.abs().max()) == pytest.approx(sf.E4M3_MAX * static)
    assert float(sf.fake_quant(x, "per_tensor_dynamic").abs().max()) == pytest.approx(float(x.abs().max()), rel=2**-4)
    with pytest.raises(ValueError, match="calibrated static_scale"):
        sf.fake_quant(x, "per_tensor_static")


def test_mx_scales_are_powers_of_two_shared_by_32_elements_and_nvfp4_blocks_are_16():
    x = _x(1, (8, 128))
    for scheme, block in (("mxfp4", 32), ("nvfp4", 16)):
        q = sf.fake_quant(x, scheme)
        for b in q.reshape(8, -1, block).reshape(-1, block):
            values = b[b != 0].abs()
            ratios = values / values.min()  # every value is a grid point times one shared scale
            assert len(torch.unique(values)) <= len(sf.E2M1_VALUES) - 1, scheme
            assert float(ratios.max()) <= 12 + 1e-5  # 6 / 0.5
    mx = sf.fake_quant(x, "mxfp8").reshape(-1, 32)
    scales = x.reshape(-1, 32).abs().amax(1)
    exponents = torch.floor(torch.log2(scales)) - 8
    assert torch.allclose(mx.abs().amax(1), (x.reshape(-1, 32).abs().amax(1) / 2**exponents).to(
        torch.float8_e4m3fn).float() * 2**exponents)


def test_finer_scales_beat_one_scale_where_outliers_sit_in_a_few_channels():
    x = sf.outlier_activations(tokens=128, features=512, seed=2)
    w = _x(3, (256, 512)) * 0.02
    errors = {s: sf.matmul_error(x, w, s) for s in ("per_tensor_dynamic", "blocks_deepseek", "mxfp4", "nvfp4")}
    assert errors["blocks_deepseek"] < errors["per_tensor_dynamic"] < errors["nvfp4"] < errors["mxfp4"]
    assert sf.bits_per_element("nvfp4") > sf.bits_per_element("mxfp4") == 4.25


def test_scaled_mm_rowwise_is_the_fake_quantised_matmul_rounded_to_bf16():
    x, w = _x(4, (32, 256)), _x(5, (48, 256))
    got = sf.scaled_mm_rowwise(x, w).float()
    ref = sf.fake_quant(x, "per_token_channel") @ sf.fake_quant(w, "per_token_channel", role="weight").T
    assert torch.allclose(got, ref, rtol=2**-8, atol=1e-3)


def test_keys_quantise_better_per_channel_before_rope_and_alike_per_tensor():
    errors = sf.rope_key_quantization_errors()
    assert errors["per_channel_int"]["before"] < 0.85 * errors["per_channel_int"]["after"]
    ratio = errors["per_tensor_fp8"]["before"] / errors["per_tensor_fp8"]["after"]
    assert 0.8 < ratio < 1.25


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="blocks of 1 x 128"):
        sf.fake_quant(_x(0, (4, 100)), "blocks_deepseek")
    with pytest.raises(ValueError, match="unknown scheme"):
        sf.fake_quant(_x(), "fp3")
