"""ModelConfig's real-model fields (explicit head width, biases, q/k norms, rotary base and
scaling), the config.json reader, and the course model against Hugging Face transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labsupport import costs
from labsupport.models import (
    HF_CONFIGS,
    ModelConfig,
    from_hf_config,
    get_model,
    hf_config,
    to_hf_config,
)
from labsupport.transformer import Transformer

transformers = pytest.importorskip("transformers")

# The totals the Hugging Face Hub lists beside each checkpoint (counted from its weight files), rounded
# as it rounds them.
PUBLISHED_BILLIONS = {"llama-3.1-8b": 8.03, "mistral-7b-v0.1": 7.24, "qwen2-7b": 7.62, "qwen3-8b": 8.19,
                      "qwen3-0.6b": 0.60}

# Small shapes with each real-model feature, for building the course model and transformers' model.
EXPLICIT = ModelConfig("test-explicit", 2, 48, 4, 2, 80, 101, head_dim=16, qk_norm=True, rope_theta=1e6)
QKV_BIAS = ModelConfig("test-qkv-bias", 2, 64, 4, 1, 96, 103, qkv_bias=True, rope_theta=1e6)
ALL_BIAS = ModelConfig("test-all-bias", 1, 64, 4, 4, 96, 50, tied_embeddings=True, qkv_bias=True, o_bias=True)
TINY_SHAPES = [get_model("tiny-2m"), EXPLICIT, QKV_BIAS, ALL_BIAS]


def hf_model(config: dict, device="meta"):
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))


def test_head_dim_defaults_to_d_model_over_heads_and_can_be_explicit():
    assert get_model("llama-3.1-8b").head_dim == 128
    cfg = get_model("qwen3-0.6b")
    assert cfg.head_dim == 128 and cfg.d_model // cfg.n_heads == 64 and cfg.q_width == 2048
    # an explicit head width lifts the divisibility rule; without one it still applies
    assert ModelConfig("x", 1, 66, 4, 2, 8, 10, head_dim=16).head_dim == 16
    with pytest.raises(ValueError, match="divisible by n_heads.*head_dim"):
        ModelConfig("x", 1, 66, 4, 2, 8, 10)
    with pytest.raises(ValueError, match="head_dim.*even"):
        ModelConfig("x", 1, 64, 4, 2, 8, 10, head_dim=15)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        ModelConfig("x", 1, 64, 4, 2, 8, 10, head_dim=0)
    # a default head width equals the same width given explicitly
    assert ModelConfig("x", 1, 64, 4, 2, 8, 10) == ModelConfig("x", 1, 64, 4, 2, 8, 10, head_dim=16)


def test_config_stays_frozen_and_hashable_with_rope_scaling():
    cfg = get_model("llama-3.1-8b")
    assert cfg.rope_theta == 500_000.0
    scaling = cfg.rope_scaling
    assert scaling == HF_CONFIGS["llama-3.1-8b"]["rope_scaling"]
    scaling["factor"] = 1.0  # a copy: the config does not change
    assert cfg.rope_scaling["factor"] == 8.0
    assert hash(cfg) == hash(dataclasses.replace(cfg))
    assert {cfg: 1}[dataclasses.replace(cfg)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rope_theta = 10.0
    assert get_model("tiny-2m").rope_scaling is None and get_model("tiny-2m").rope_theta == 500_000.0
    with pytest.raises(ValueError, match="rope_scaling must be a dict"):
        ModelConfig("x", 1, 64, 4, 2, 8, 10, rope_scaling=[("factor", 8.0)])
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig("x", 1, 64, 4, 2, 8, 10, rope_theta=0)
    with pytest.raises(ValueError, match="qkv_bias must be True or False"):
        ModelConfig("x", 1, 64, 4, 2, 8, 10, qkv_bias=1)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_stored_configs_read_and_count_as_transformers_does(name):
    cfg = get_model(name)
    assert cfg == dataclasses.replace(from_hf_config(hf_config(name)), name=cfg.name, source=cfg.source)
    assert "Hugging Face" in cfg.source
    expected = sum(p.numel() for p in hf_model(hf_config(name)).parameters())
    assert costs.param_count(cfg) == expected
    assert round(costs.param_count(cfg) / 1e9, 2) == PUBLISHED_BILLIONS[name]


def test_family_spellings():
    assert get_model("qwen2-7b").qkv_bias and not get_model("qwen2-7b").o_bias
    assert get_model("qwen3-8b").qk_norm and not get_model("qwen3-8b").qkv_bias
    assert get_model("qwen3-0.6b").tied_embeddings
    assert get_model("mistral-7b-v0.1").rope_theta == 10_000.0
    llama = hf_config("llama-3.1-8b") | {"attention_bias": True}
    assert from_hf_config(llama).qkv_bias and from_hf_config(llama).o_bias
    qwen2 = hf_config("qwen2-7b") | {"attention_bias": False}  # Qwen2 ignores the field: biases always
    assert from_hf_config(qwen2).qkv_bias
    no_kv = {k: v for k, v in hf_config("mistral-7b-v0.1").items() if k != "num_key_value_heads"}
    assert from_hf_config(no_kv).n_kv_heads == 8  # absent: MistralConfig's default, not the query heads
    assert from_hf_config(no_kv | {"num_key_value_heads": None}).n_kv_heads == 32  # null: multi-head
    no_type = {k: v for k, v in hf_config("qwen3-8b").items() if k != "model_type"}
    assert from_hf_config(no_type).qk_norm  # the architectures entry names the family
    # transformers 5 writes theta and the scaling together in rope_parameters
    v5 = {k: v for k, v in hf_config("llama-3.1-8b").items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **hf_config("llama-3.1-8b")["rope_scaling"]}
    assert from_hf_config(v5).rope_scaling == get_model("llama-3.1-8b").rope_scaling
    plain = {k: v for k, v in hf_config("qwen3-8b").items() if k != "rope_theta"}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    assert from_hf_config(plain).rope_scaling is None and from_hf_config(plain).rope_theta == 1e6


@pytest.mark.parametrize("name, field", [
    ("llama-3.1-8b", "num_key_value_heads"), ("mistral-7b-v0.1", "num_key_value_heads"),
    ("qwen3-8b", "num_key_value_heads"), ("qwen3-0.6b", "head_dim"), ("qwen2-7b", "head_dim"),
    ("mistral-7b-v0.1", "head_dim"),
])
def test_an_absent_field_takes_the_default_transformers_builds(name, field):
    """A config.json without num_key_value_heads or head_dim: the reader must build what transformers
    (and vLLM, which reads the same config classes) builds, whose defaults differ by family
    (Qwen3's head_dim is 128 whatever the width; Mistral's KV heads 8, Qwen's 32)."""
    config = {k: v for k, v in hf_config(name).items() if k != field}
    cfg = from_hf_config(config)
    attention = hf_model(config).model.layers[0].self_attn
    assert attention.k_proj.out_features == cfg.n_kv_heads * cfg.head_dim
    assert attention.q_proj.out_features == cfg.n_heads * cfg.head_dim
    assert costs.param_count(cfg) == sum(p.numel() for p in hf_model(config).parameters())


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
        ({"model_type": None, "architectures": ["GPT2LMHeadModel"]}, "no model_type"),
        ({"hidden_size": None}, "no hidden_size"),
        ({"num_hidden_layers": None}, "no num_hidden_layers"),
        ({"intermediate_size": None}, "no intermediate_size"),
        ({"vocab_size": "128k"}, "vocab_size must be a positive int"),
        ({"head_dim": 0}, "head_dim must be a positive int"),
        ({"rope_theta": None}, "no rope_theta"),
        ({"rope_scaling": "llama3"}, "rope_scaling must be a dict"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_configs_name_the_field(change, match):
    config = {k: v for k, v in (hf_config("llama-3.1-8b") | change).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        from_hf_config(config)


def test_not_a_dict_and_unknown_names():
    with pytest.raises(ValueError, match="dict"):
        from_hf_config('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="no stored config.json"):
        hf_config("gpt-5")


@pytest.mark.parametrize("cfg", TINY_SHAPES, ids=lambda c: c.name)
def test_to_hf_config_round_trips_and_counts_the_same(cfg):
    back = from_hf_config(to_hf_config(cfg))
    assert dataclasses.replace(back, name=cfg.name, source=cfg.source) == cfg
    model = Transformer(cfg)
    assert model.param_count() == costs.param_count(cfg)
    assert sum(p.numel() for p in hf_model(to_hf_config(cfg)).parameters()) == costs.param_count(cfg)


def test_output_bias_alone_has_no_family():
    with pytest.raises(ValueError, match="output bias"):
        to_hf_config(ModelConfig("x", 1, 64, 4, 2, 8, 10, o_bias=True))


def _copy_weights(ours: Transformer, theirs) -> None:
    """Our Meta-style names onto transformers' names."""
    sd = {"model.embed_tokens.weight": ours.tok_embeddings.weight, "model.norm.weight": ours.norm.weight}
    for i, block in enumerate(ours.layers):
        pre = f"model.layers.{i}."
        a, f = block.attention, block.feed_forward
        for ours_name, theirs_name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            for kind in ("weight", "bias"):
                p = getattr(getattr(a, ours_name), kind)
                if p is not None:
                    sd[f"{pre}self_attn.{theirs_name}.{kind}"] = p
        if a.q_norm is not None:
            sd[f"{pre}self_attn.q_norm.weight"], sd[f"{pre}self_attn.k_norm.weight"] = a.q_norm.weight, a.k_norm.weight
        sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"] = f.w1.weight, f.w3.weight
        sd[pre + "mlp.down_proj.weight"] = f.w2.weight
        sd[pre + "input_layernorm.weight"] = block.attention_norm.weight
        sd[pre + "post_attention_layernorm.weight"] = block.ffn_norm.weight
    if ours.output is not None:
        sd["lm_head.weight"] = ours.output.weight
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)


@pytest.mark.parametrize("cfg", TINY_SHAPES, ids=lambda c: c.name)
def test_course_model_computes_what_transformers_computes(cfg):
    """Same weights, same logits: the course model's biases, q/k norms, head width and rotary base
    mean what they mean in Llama, Qwen2 and Qwen3."""
    ours = Transformer(cfg, seed=3)
    with torch.no_grad():  # random norm weights, so a norm applied in the wrong place shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf_cfg = to_hf_config(cfg) | {"rms_norm_eps": 1e-5, "attn_implementation": "eager"}
    theirs = hf_model(hf_cfg, device="cpu").eval()
    _copy_weights(ours, theirs)
    prompt = ours.random_prompt(batch=2, length=9, seed=1)
    with torch.no_grad():
        want = theirs(prompt).logits[:, -1].float()
    got = ours.forward_no_cache(prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
