"""labsupport.position: frequencies against transformers, the two layouts, context-extension rules."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from labsupport import position as P
from labsupport._answers import unguarded

apply_rope_reference = unguarded(P.apply_rope_reference)

LLAMA3_CONFIGS = [
    (128, 500_000.0, P.LLAMA31_ROPE_SCALING),  # Llama 3.1 8B/70B/405B
    (64, 500_000.0, {**P.LLAMA31_ROPE_SCALING, "factor": 32.0}),  # Llama 3.2 1B
    (96, 10_000.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                    "original_max_position_embeddings": 4096}),
    (16, 10_000.0, {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                    "original_max_position_embeddings": 512}),
]


def hf_inv_freq(head_dim, theta, scaling):
    n_heads = 4
    cfg = LlamaConfig(hidden_size=head_dim * n_heads, num_attention_heads=n_heads, head_dim=head_dim,
                      rope_theta=theta, rope_scaling=dict(scaling) if scaling else None,
                      max_position_embeddings=131072)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")[0]


@pytest.mark.parametrize("head_dim, theta, scaling", LLAMA3_CONFIGS)
def test_llama3_frequencies_equal_transformers_bit_for_bit(head_dim, theta, scaling):
    got = P.rope_inv_freq(head_dim, theta, scaling)
    assert got.shape == (head_dim // 2,) and got.dtype == torch.float32
    assert torch.equal(got, hf_inv_freq(head_dim, theta, scaling))


def test_llama31_scaling_keeps_fast_pairs_and_slows_slow_ones_by_the_factor():
    plain = P.rope_inv_freq(128, 500_000.0)
    scaled = P.rope_inv_freq(128, 500_000.0, P.LLAMA31_ROPE_SCALING)
    wavelength = 2 * math.pi / plain
    fast, slow = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()  # all three bands exist at D = 128
    assert torch.equal(scaled[fast], plain[fast])
    torch.testing.assert_close(scaled[slow], plain[slow] / 8)
    middle = ~fast & ~slow
    assert bool(((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all())


def test_default_and_linear_types():
    plain = P.rope_inv_freq(64, 10_000.0)
    assert torch.equal(P.rope_inv_freq(64, 10_000.0, {"rope_type": "default"}), plain)
    assert torch.equal(P.rope_inv_freq(64, 10_000.0, {"type": "linear", "factor": 4.0}), plain / 4)
    assert torch.equal(P.rope_inv_freq(64, 10_000.0, {"rope_type": "linear", "factor": 4.0}),
                       hf_inv_freq(64, 10_000.0, {"rope_type": "linear", "factor": 4.0}))
    torch.testing.assert_close(plain[0], torch.tensor(1.0))
    torch.testing.assert_close(plain[-1], torch.tensor(10_000.0 ** (-62 / 64)))


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "'yarn' is not supported here"),
    ({"factor": 4.0}, "names no rope_type"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs 'low_freq_factor'"),
    ({**P.LLAMA31_ROPE_SCALING, "factor": -1}, r"rope_scaling\['factor'\] must be a positive number"),
    ({**P.LLAMA31_ROPE_SCALING, "low_freq_factor": 4.0}, "high_freq_factor > low_freq_factor"),
    ("llama3", "must be a rope_scaling dict"),
])
def test_bad_scaling_is_a_clear_value_error(scaling, message):
    with pytest.raises(ValueError, match=message):
        P.rope_inv_freq(128, 500_000.0, scaling)


@pytest.mark.parametrize("head_dim, theta", [(7, 10_000.0), (0, 10_000.0), (64, 0), (64, -1.0)])
def test_bad_shapes_are_clear_value_errors(head_dim, theta):
    with pytest.raises(ValueError, match="head_dim|theta"):
        P.rope_inv_freq(head_dim, theta)


def test_wavelengths_and_ntk_theta():
    w = P.rope_wavelengths(128, 10_000.0).tolist()
    assert w[0] == pytest.approx(2 * math.pi)
    assert w[-1] == pytest.approx(2 * math.pi * 10_000 ** (126 / 128))
    ntk = P.ntk_aware_theta(10_000.0, 4.0, 128)
    # NTK-aware scaling stretches the slowest pair by exactly the factor
    stretched = P.rope_wavelengths(128, ntk).tolist()
    assert stretched[-1] == pytest.approx(4 * w[-1], rel=1e-6)
    assert stretched[0] == pytest.approx(w[0])


def test_rope_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 10, 64, generator=gen), torch.randn(2, 2, 10, 64, generator=gen)
    positions = torch.arange(100, 110)
    cos, sin = P.rope_cos_sin(positions, P.rope_inv_freq(64, 500_000.0))
    hf_q, hf_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    torch.testing.assert_close(apply_rope_reference(q, positions, 500_000.0, "halves"), hf_q)
    torch.testing.assert_close(apply_rope_reference(k, positions, 500_000.0, "halves"), hf_k)


def test_the_layouts_differ_by_the_permutation():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 5, 16, generator=gen)  # interleaved features
    positions = torch.tensor([0, 3, 7, 100, 5000])
    order = P.halves_order(16)
    assert order.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    interleaved = apply_rope_reference(x, positions, 10_000.0, "interleaved")
    halves = apply_rope_reference(x[..., order], positions, 10_000.0, "halves")
    torch.testing.assert_close(interleaved[..., order], halves)
    assert not torch.allclose(apply_rope_reference(x, positions, 10_000.0, "halves"), interleaved)


def test_weight_permutation_matches_the_feature_order_and_inverts():
    n_heads, head_dim, d_model = 3, 8, 5
    w = torch.randn(n_heads * head_dim, d_model)
    converted = P.interleaved_to_halves(w, n_heads)
    order = P.halves_order(head_dim)
    for h in range(n_heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        assert torch.equal(converted[rows], w[rows][order])
    assert torch.equal(P.halves_to_interleaved(converted, n_heads), w)
    with pytest.raises(ValueError, match="not a multiple of 2 \\* n_heads"):
        P.interleaved_to_halves(torch.randn(10, 4), 3)


def test_scores_depend_on_distance_only():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 64, generator=gen, dtype=torch.float64), torch.randn(1, 1, 1, 64, generator=gen,
                                                                                     dtype=torch.float64)

    def score(m, n):
        return float((apply_rope_reference(q, torch.tensor([m]), 10_000.0) *
                      apply_rope_reference(k, torch.tensor([n]), 10_000.0)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-5)
    assert score(10, 3) != pytest.approx(score(11, 3), abs=1e-3)


def test_score_drift_float32_small_bfloat16_larger():
    f32 = dict(P.score_drift(dtype=torch.float32, starts=(0, 1000, 100_000)))
    bf16 = dict(P.score_drift(dtype=torch.bfloat16, starts=(0, 1000, 100_000)))
    assert f32[0] == 0 and bf16[0] == 0
    assert f32[1000] < 1e-4 < bf16[1000] < 0.05
    assert f32[100_000] > f32[1000]  # the float32 angle's rounding grows with the position


def test_rope_kernel_bytes():
    assert P.rope_kernel_bytes(2, 8, 2, 100, 64, 2) == 2 * 2 * 10 * 100 * 64 * 2 + 2 * 100 * 8
    assert P.rope_kernel_bytes(1, 1, 1, 1, 2, 4, programs=3) == 2 * 2 * 2 * 4 + 8 + 3 * 1 * 4
    with pytest.raises(ValueError, match="programs"):
        P.rope_kernel_bytes(1, 1, 1, 1, 2, 4, programs=-1)


# --- the course model uses the config's theta and scaling ---------------------------------------------


def test_course_rope_equals_llama_rotary_embedding_past_the_original_context():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from labsupport.models import get_model, to_hf_config
    from labsupport.transformer import rope_cos_sin

    cfg = get_model("llama-3.1-8b")
    assert cfg.rope_scaling == P.LLAMA31_ROPE_SCALING
    hf = LlamaRotaryEmbedding(LlamaConfig(**to_hf_config(cfg)))
    positions = torch.tensor([0, 1, 8191, 8192, 9000, 32_768, 131_071])
    x = torch.zeros(1, len(positions), cfg.head_dim)
    hf_cos, hf_sin = hf(x, positions[None])
    cos, sin = rope_cos_sin(positions, cfg.head_dim, torch.float32, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    # without the scaling, positions past the original context get other angles
    plain_cos, _ = rope_cos_sin(positions, cfg.head_dim, torch.float32, cfg.rope_theta)
    assert not torch.allclose(plain_cos[3:], hf_cos[0, 3:], atol=1e-3)


def test_course_model_with_llama3_scaling_matches_transformers():
    """A small model with Llama 3.1's rule, scaled down so that it bites within a short prompt
    (original context 64 positions): same logits as transformers, and not those of plain RoPE."""
    import transformers

    from labsupport.models import ModelConfig, to_hf_config
    from labsupport.transformer import Transformer

    scaling = {**P.LLAMA31_ROPE_SCALING, "original_max_position_embeddings": 64}
    shape = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=101, rope_theta=10_000.0)
    cfg = ModelConfig("test-llama3-scaling", rope_scaling=scaling, **shape)
    ours = Transformer(cfg, seed=5)
    with torch.no_grad():  # sharp attention, so that the angles show in the logits
        for block in ours.layers:
            block.attention.wq.weight.normal_(0, 0.5)
            block.attention.wk.weight.normal_(0, 0.5)
    hf_cfg = to_hf_config(cfg) | {"rms_norm_eps": 1e-5, "attn_implementation": "eager", "max_position_embeddings": 512}
    assert hf_cfg["rope_scaling"]["rope_type"] == "llama3"
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_cfg)).eval()
    sd = {"model.embed_tokens.weight": ours.tok_embeddings.weight, "model.norm.weight": ours.norm.weight}
    for i, block in enumerate(ours.layers):
        pre, a, f = f"model.layers.{i}.", block.attention, block.feed_forward
        for mine, hf_name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            sd[f"{pre}self_attn.{hf_name}.weight"] = getattr(a, mine).weight
        sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"] = f.w1.weight, f.w3.weight
        sd[pre + "mlp.down_proj.weight"] = f.w2.weight
        sd[pre + "input_layernorm.weight"] = block.attention_norm.weight
        sd[pre + "post_attention_layernorm.weight"] = block.ffn_norm.weight
    if ours.output is not None:
        sd["lm_head.weight"] = ours.output.weight
    theirs.load_state_dict(sd, strict=False)
    prompt = ours.random_prompt(batch=2, length=300, seed=1)  # distances up to 299, past the 64 "trained"
    with torch.no_grad():
        want = theirs(prompt).logits[:, -1].float()
    got = ours.forward_no_cache(prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = Transformer(ModelConfig("plain", **shape), seed=5)
    plain.load_state_dict(ours.state_dict())
    assert not torch.allclose(plain.forward_no_cache(prompt), want, atol=1e-3, rtol=1e-3)
