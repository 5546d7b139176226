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
