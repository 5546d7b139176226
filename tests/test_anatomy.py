"""Chapter 02's counting: parameters by component three ways, mixture-of-experts totals, the FLOPs
and bytes of a step by part, and the profile of a step of the course model."""

from __future__ import annotations

import pytest
import torch

from labsupport import anatomy, costs
from labsupport._answers import unguarded
from labsupport.families import component_of
from labsupport.models import HF_CONFIGS, ModelConfig, get_model, hf_config, to_hf_config
from labsupport.transformer import Transformer

by_component = unguarded(anatomy.param_count_by_component)
transformers = pytest.importorskip("transformers")

SHAPES = [get_model("tiny-2m"), get_model("small-63m"),
          ModelConfig("t-qkv", 2, 96, 6, 2, 160, 300, head_dim=32, qkv_bias=True),
          ModelConfig("t-qwen3", 2, 64, 4, 2, 96, 300, tied_embeddings=True, head_dim=32, qk_norm=True)]

# Mixtral 8x7B: the shape of its config.json (mistralai/Mixtral-8x7B-v0.1 on the Hugging Face Hub),
# 8 experts, 2 per token. Mistral AI's announcement ("Mixtral of experts", 11 December 2023) gives
# 46.7B total and 12.9B per token.
MIXTRAL = {"model_type": "mixtral", "hidden_act": "silu", "num_hidden_layers": 32, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
           "tie_word_embeddings": False}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_three_ways_agree_on_real_models(name):
    cfg = get_model(name)
    ours = by_component(cfg)
    assert ours == anatomy.model_param_counts(cfg) == anatomy.hf_param_counts(hf_config(name))
    assert sum(ours.values()) == costs.param_count(cfg)


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.name)
def test_three_ways_agree_on_small_shapes(cfg):
    ours = by_component(cfg)
    assert ours == anatomy.model_param_counts(cfg) == anatomy.hf_param_counts(to_hf_config(cfg))
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == sum(ours.values())


def test_components_carry_each_real_model_detail():
    tied, untied = by_component("qwen3-0.6b"), by_component("qwen3-8b")
    assert tied["output"] == 0 and untied["output"] == untied["embedding"]
    q06 = get_model("qwen3-0.6b")
    assert tied["attention"] == q06.n_layers * 2 * q06.d_model * (q06.n_heads + q06.n_kv_heads) * q06.head_dim
    qwen2 = get_model("qwen2-7b")
    bias = qwen2.n_layers * (qwen2.n_heads + 2 * qwen2.n_kv_heads) * qwen2.head_dim
    assert by_component(qwen2)["attention"] - bias == qwen2.n_layers * 2 * qwen2.d_model * (
        qwen2.n_heads + qwen2.n_kv_heads) * qwen2.head_dim


def test_mixture_of_experts_totals_match_transformers_and_the_announcement():
    dense = ModelConfig("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, rope_theta=1e6)
    counts = anatomy.moe_param_counts(dense, 8, 2)
    assert counts["total"] == sum(p.numel() for p in anatomy.hf_model(MIXTRAL).parameters())
    assert round(counts["total"] / 1e9, 1) == 46.7 and round(counts["active"] / 1e9, 1) == 12.9
    assert anatomy.moe_param_counts(dense, 8, 8)["active"] == counts["total"]
    with pytest.raises(ValueError, match="cannot exceed"):
        anatomy.moe_param_counts(dense, 2, 3)


def test_experts_read_per_decode_step():
    assert anatomy.moe_experts_read(8, 2, 1) == pytest.approx(2)
    assert anatomy.moe_experts_read(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert 7.9 < anatomy.moe_experts_read(8, 2, 16) < 8
    assert anatomy.moe_experts_read(8, 8, 1) == 8
    with pytest.raises(ValueError, match="cannot exceed"):
        anatomy.moe_experts_read(2, 3, 1)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b", "qwen2-7b"])
def test_step_costs_add_up_to_the_costs_module(name):
    cfg = get_model(name)
    p = 512
    prefill = anatomy.step_costs(cfg, 1, p)
    matmul = sum(v["flops"] for k, v in prefill.items() if k not in ("attention (rotate, cache, scores)", "output layer"))
    # every matmul weight once per prompt token, except the output layer (last position only)
    layer_weights = costs.param_count(cfg) - by_component(cfg)["embedding"] - by_component(cfg)["output"] \
        - by_component(cfg)["norms"]
    biases = layer_weights - cfg.n_layers * (2 * cfg.d_model * (cfg.q_width + cfg.kv_width) + 3 * cfg.d_model * cfg.d_ff)
    assert matmul == 2 * p * (layer_weights - biases)
    # causal attention: P(P+1)/2 query-key pairs per head and layer
    assert prefill["attention (rotate, cache, scores)"]["flops"] == 4 * cfg.n_layers * cfg.q_width * p * (p + 1) / 2
    decode = anatomy.step_costs(cfg, 4, 1, context=1000)
    assert decode["attention (rotate, cache, scores)"]["bytes"] == 4 * 1001 * costs.kv_bytes_per_token(cfg)
    assert decode["attention (rotate, cache, scores)"]["flops"] == 4 * 4 * cfg.n_layers * cfg.q_width * 1001
    weights_read = sum(v["bytes"] for k, v in decode.items() if k not in ("embedding", "attention (rotate, cache, scores)"))
    table = cfg.vocab_size * cfg.d_model * 2
    # a decode step reads every weight but the embedding table (one row per sequence), unless tied
    untied_extra = 0 if cfg.tied_embeddings else table
    assert weights_read == costs.param_count(cfg) * 2 - untied_extra
    with pytest.raises(ValueError, match="new_tokens"):
        anatomy.step_costs(cfg, 1, 0)


@pytest.fixture(scope="module")
def tiny():
    return Transformer(get_model("tiny-2m"), seed=0)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_profile_step_splits_the_step(tiny, phase):
    result = anatomy.profile_step(tiny, phase, 32, repeats=2)
    seconds = result["seconds"]
    assert list(seconds) == list(anatomy.STEP_PARTS) and result["device"] == "CPU"
    assert all(v >= 0 for v in seconds.values())
    assert sum(seconds.values()) == pytest.approx(result["step_s"], rel=1e-6)
    for part in ("q/k/v projections", "feed_forward", "output layer", "attention (rotate, cache, scores)"):
        assert seconds[part] > 0, part
    names = {e.key for e in result["profiler"].key_averages()}
    assert "aten::linear" in names or "aten::mm" in names or "aten::addmm" in names
    # the hooks are gone afterwards: a plain step records nothing
    assert not tiny.tok_embeddings._forward_pre_hooks


def test_profile_and_timing_reject_bad_input(tiny):
    with pytest.raises(ValueError, match="phase"):
        anatomy.profile_step(tiny, "train", 8)
    with pytest.raises(ValueError, match="Transformer"):
        anatomy.profile_step(torch.nn.Linear(2, 2), "decode", 8)
    with pytest.raises(ValueError, match="tokens"):
        anatomy.time_step(tiny, "decode", 0)
    assert anatomy.time_step(tiny, "decode", 8, repeats=2) > 0


def test_a_parameter_outside_the_components_is_an_error():
    with pytest.raises(ValueError, match="in no row of labsupport.families.WEIGHTS"):
        component_of("model.rotary_emb.inv_freq")
