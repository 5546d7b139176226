"""Group-wise quantisation, int4 packing, the error of each granularity, and the quantised course model."""

from __future__ import annotations

import pytest
import torch

from labsupport import quantize as Q
from labsupport.costs import decode_step_bytes
from labsupport.transformer import Transformer


def test_int4_packing_order_and_sign():
    codes = torch.tensor([[1, -1, -8, 7]], dtype=torch.int8)
    packed = Q.pack_int4(codes)
    assert packed.tolist() == [[0xF1, 0x78]]  # element 0 in the low nibble, element 1 in the high one
    assert torch.equal(Q.unpack_int4(packed), codes)
    with pytest.raises(ValueError, match="-8..7"):
        Q.pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 128, 256])
def test_round_trip_within_half_a_step(bits, group):
    w = torch.randn(16, 256)
    w[0, :group] = 0  # an all-zero group
    codes, scales = Q.quantize_groupwise(w, bits, group)
    assert scales.shape == (16, 256 // group) and scales.dtype == torch.float32
    back = Q.dequantize_groupwise(codes, scales, bits, group)
    assert bool(((back - w).abs() <= Q.half_step_bound(scales, group) * (1 + 1e-6)).all())
    assert bool((back[0, :group] == 0).all()) and bool(torch.isfinite(scales).all())
    q = Q.unpack_int4(codes) if bits == 4 else codes
    assert int(q.abs().max()) == Q.qmax(bits)  # each group's largest magnitude lands on qmax


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="multiple of group_size"):
        Q.quantize_groupwise(torch.randn(4, 100), 8, 64)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        Q.quantize_groupwise(torch.randn(4, 64), 3, 64)


def test_finer_groups_err_less_on_outliers():
    w = Q.outlier_weight(64, 512)
    for bits in (8, 4):
        e = Q.granularity_errors(w, bits, 128)
        assert e["per group of 128, symmetric"] < e["per channel, symmetric"] < e["per tensor, symmetric"]
        assert e["per channel, asymmetric"] <= e["per channel, symmetric"] * 1.05


def test_bytes_per_weight_counts_the_scales():
    assert Q.weight_dtype_bytes_with_scales(8, 128, 2) == 1 + 2 / 128
    assert Q.weight_dtype_bytes_with_scales(4, 128, 2) == 0.5 + 2 / 128
    cfg = "llama-3.1-8b"
    bf16 = decode_step_bytes(cfg, 1, 1024).weights
    int8 = decode_step_bytes(cfg, 1, 1024, weight_dtype_bytes=Q.weight_dtype_bytes_with_scales(8, 128)).weights
    assert 1.9 < bf16 / int8 < 2.0


def test_quantised_model_leaves_the_original_alone():
    model = Transformer("tiny-2m")
    before = model.layers[0].attention.wq.weight.clone()
    q8 = Q.quantize_model_weights(model, 8, 64)
    assert torch.equal(model.layers[0].attention.wq.weight, before)
    assert not torch.equal(q8.layers[0].attention.wq.weight, before)
    assert torch.equal(q8.tok_embeddings.weight, model.tok_embeddings.weight)  # embeddings untouched
    prompts = model.random_prompt(8, 6)
    same = Q.output_agreement(model, model, prompts)
    assert same.top1 == 1.0 and same.kl_mean == 0.0
    a8 = Q.output_agreement(model, q8, prompts)
    a4 = Q.output_agreement(model, Q.quantize_model_weights(model, 4, 64), prompts)
    assert 0 < a8.kl_mean < a4.kl_mean and a8.positions == 8


def test_weight_only_bytes_leave_embeddings_and_head_in_16_bits():
    from labsupport.costs import param_count
    from labsupport.models import get_model

    m8 = get_model("llama-3.1-8b")
    total, proj = param_count(m8), Q.projection_params(m8)
    # Llama 3.1 8B: 32 layers of (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) weights
    assert proj == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    per_param = Q.weight_only_bytes_per_param(m8, 8, 128)
    assert per_param * total == pytest.approx(proj * (1 + 2 / 128) + (total - proj) * 2)
    assert 1 + 2 / 128 < per_param < 2  # the 16-bit embedding table and head cost more than the scales


def test_asymmetric_zero_point_is_a_storable_code():
    # an all-positive group: without widening the range to 0, the zero point would be negative
    w = torch.tensor([[1.0, 1.5, 2.0, 3.0]])
    out = Q.fake_quantize(w, 4, 4, symmetric=False)
    step = 3.0 / 15
    assert (out - w).abs().max() <= step / 2 + 1e-6
    assert Q.fake_quantize(torch.tensor([[-1.0, 0.0, 0.3, 2.0]]), 4, 4, symmetric=False)[0, 1] == 0.0
