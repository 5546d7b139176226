"""Min-p, vLLM's penalties and a regex-constrained sampler (chapter 13), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport.constrained_decoding import (
    apply_penalties,
    constrained_sample,
    min_p_filter,
    regex_token_mask,
)


def test_min_p_keeps_what_is_within_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    kept = torch.isfinite(min_p_filter(logits, 0.15))
    assert kept.tolist() == [True, True, True, False, False]  # 0.1 >= 0.15 * 0.5 = 0.075; 0.06 is not
    assert torch.isfinite(min_p_filter(logits, 0.0)).all() and torch.isfinite(min_p_filter(logits, 1.0)).sum() == 1
    with pytest.raises(ValueError, match="min_p"):
        min_p_filter(logits, 1.5)


def test_penalties_as_vllm_applies_them():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits, prompt_ids=[1], output_ids=[0, 0, 2], repetition_penalty=2.0, frequency_penalty=0.1,
                          presence_penalty=0.5)
    # token 0: seen, positive -> 2 / 2, then - 0.1 * 2 - 0.5; token 1: in the prompt only -> -2 * 2, no other penalty;
    # token 2: 1 / 2 - 0.1 - 0.5; token 3: untouched
    assert out.tolist() == pytest.approx([1.0 - 0.2 - 0.5, -4.0, 0.5 - 0.1 - 0.5, 0.5])
    assert torch.equal(apply_penalties(logits, [], []), logits)


TOKENS = ['{"', 'answer', '": ', 'true', 'false', '}', ' ', 'x', '"', '{', None, '1', '12']
PATTERN = r'\{"answer": (true|false)\}'


def test_the_mask_allows_exactly_the_tokens_that_keep_a_match_possible():
    allowed = [TOKENS[i] for i in torch.nonzero(regex_token_mask(PATTERN, "", TOKENS)).flatten().tolist()]
    assert allowed == ['{"', '{']
    allowed = [TOKENS[i] for i in torch.nonzero(regex_token_mask(PATTERN, '{"answer": ', TOKENS)).flatten().tolist()]
    assert allowed == ['true', 'false']


def test_random_logits_still_give_a_match():
    gen = torch.Generator().manual_seed(0)
    out = constrained_sample(lambda ids: torch.randn(len(TOKENS), generator=gen), TOKENS, PATTERN, max_tokens=20, seed=1)
    assert out["complete"] and out["text"] in ('{"answer": true}', '{"answer": false}')
    assert 0.5 < out["masked_share"] < 1 and not math.isnan(out["masked_share"])
