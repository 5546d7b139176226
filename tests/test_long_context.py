"""YaRN and LongRoPE (chapter 08) against transformers' own frequency functions."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from labsupport import long_context as lc
from labsupport.position import default_inv_freq


def _hf(rope, head_dim=128, theta=1e6, max_positions=131072, **extra):
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=max_positions, rope_theta=theta,
                                      rope_scaling=rope, **extra)
    return config


@pytest.mark.parametrize("factor, original, theta, head_dim", [(4.0, 32768, 1e6, 128), (8.0, 4096, 1e4, 64),
                                                              (2.0, 65536, 5e5, 128), (40.0, 4096, 1e4, 64)])
def test_yarn_matches_transformers(factor, original, theta, head_dim):
    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](_hf(rope, head_dim, theta, int(original * factor)), "cpu")
    assert torch.equal(lc.yarn_inv_freq(head_dim, theta, factor, original), inv_freq)
    assert lc.yarn_attention_factor(factor) == pytest.approx(attention, rel=1e-12)


def test_yarn_keeps_the_fast_pairs_interpolates_the_slow_ones_and_ramps_between():
    D, theta, s, L = 128, 1e6, 4.0, 32768
    plain = default_inv_freq(D, theta)
    yarn = lc.yarn_inv_freq(D, theta, s, L)
    low, high = lc.yarn_correction_range(D, theta, L)
    turns = L * plain / (2 * math.pi)  # turns of each pair within the original context
    assert torch.equal(yarn[:low], plain[:low]) and bool((turns[:low] > 32).all())
    assert torch.allclose(yarn[high:], plain[high:] / s) and bool((turns[high + 1:] < 1).all())
    ratio = (plain / yarn)[low:high]
    assert bool((ratio[1:] >= ratio[:-1]).all()) and 1 <= float(ratio.min()) and float(ratio.max()) <= s


def test_longrope_matches_transformers_and_engines_choose_the_list_differently():
    D, theta, L = 96, 1e4, 4096
    short = [1.0 + 0.01 * i for i in range(D // 2)]
    long = [1.0 + 0.5 * i for i in range(D // 2)]
    rope = {"rope_type": "longrope", "short_factor": short, "long_factor": long, "original_max_position_embeddings": L}
    config = _hf(rope, D, theta, 131072)
    for seq_len in (100, L, L + 1, 100_000):
        hf, attention = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        assert torch.allclose(lc.longrope_inv_freq(D, theta, short, long, original_max=L, seq_len=seq_len), hf,
                              rtol=1e-6, atol=0)
        assert lc.longrope_attention_factor(131072 / L, L) == pytest.approx(attention)
    # vLLM decides once, from max_model_len: a short request on a long-context engine gets the long list
    engine = lc.longrope_inv_freq(D, theta, short, long, original_max=L, max_model_len=131072)
    hf_short, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=100)
    assert not torch.allclose(engine, hf_short)
    with pytest.raises(ValueError, match="not both"):
        lc.longrope_inv_freq(D, theta, short, long, original_max=L)
    with pytest.raises(ValueError, match="one factor per pair"):
        lc.longrope_inv_freq(D, theta, short[:-1], long, original_max=L, seq_len=10)


def test_static_yarn_changes_short_scores_and_a_smaller_factor_changes_them_less():
    D, theta, L = 128, 1e6, 32768
    changes = [lc.short_context_change(D, theta, lc.yarn_inv_freq(D, theta, s, L), lc.yarn_attention_factor(s))
               for s in (2.0, 4.0)]
    plain = lc.short_context_change(D, theta, default_inv_freq(D, theta), 1.0)
    assert plain == 0.0 and 0 < changes[0] < changes[1]
    # most of it is the attention factor, which scales every score by its square
    no_factor = lc.short_context_change(D, theta, lc.yarn_inv_freq(D, theta, 4.0, L), 1.0)
    assert no_factor < 0.05 * changes[1]
    assert changes[1] == pytest.approx(lc.yarn_attention_factor(4.0) ** 2 - 1, rel=0.05)
