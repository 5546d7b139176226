"""Speculative decoding (chapter 13): the formula, the draft, and greedy speculation giving
exactly the target's greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labsupport.models import get_model
from labsupport.phases import cpu_threads
from labsupport.speculative import (
    acceptance_probability,
    all_position_logits,
    autoregressive_generate,
    expected_speedup,
    expected_tokens_per_step,
    make_draft,
    measured_alpha,
    speculative_generate,
)
from labsupport.transformer import Transformer

CFG = dataclasses.replace(get_model("tiny-2m"), n_layers=4, tied_embeddings=False, name="spec-target")


@pytest.fixture(scope="module")
def target():
    with cpu_threads(1):
        yield Transformer(CFG, seed=5)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))
    assert expected_speedup(0.8, 4, 0.0) == expected_tokens_per_step(0.8, 4)
    assert expected_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(1.5, 2)


def test_acceptance_probability_is_one_minus_total_variation():
    p, q = torch.tensor([0.6, 0.4, 0.0]), torch.tensor([0.2, 0.4, 0.4])
    assert float(acceptance_probability(p, q)) == pytest.approx(1 - 0.5 * float((p - q).abs().sum()))


def test_all_position_logits_match_prefill(target):
    prompt = target.random_prompt(1, 9, seed=2)
    cache = target.new_cache(1, 9)
    every = all_position_logits(target, prompt, cache, 0)
    assert every.shape == (1, 9, CFG.vocab_size) and cache.length == 9
    last = target.prefill(prompt, target.new_cache(1, 9))
    assert torch.allclose(every[:, -1], last, atol=1e-5)


def test_draft_equal_to_target_accepts_everything(target):
    draft = make_draft(target, CFG.n_layers, noise=0.0)
    prompt = target.random_prompt(1, 6, seed=1)[0].tolist()
    r = speculative_generate(target, draft, prompt, 12, k=3, temperature=1.0, seed=0)
    assert measured_alpha(r) == 1.0 and r["steps"] == 3  # 4 tokens per step


@pytest.mark.parametrize("layers, noise", [(1, 0.0), (2, 1.0)])
def test_greedy_speculation_gives_the_targets_greedy_tokens(target, layers, noise):
    with cpu_threads(1):
        draft = make_draft(target, layers, noise=noise, seed=3)
        prompt = target.random_prompt(1, 7, seed=4)[0].tolist()
        plain = autoregressive_generate(target, prompt, 16, temperature=0)
        spec = speculative_generate(target, draft, prompt, 16, k=3, temperature=0)
    assert spec["tokens"] == plain["tokens"]
    assert spec["tokens"] == target.generate(torch.tensor([prompt]), 16)[0, 7:].tolist()
    assert spec["steps"] <= 16 and sum(spec["emitted"]) >= 16


def test_make_draft_refuses_bad_arguments(target):
    with pytest.raises(ValueError, match="n_layers"):
        make_draft(target, 9)
    with pytest.raises(ValueError, match="noise"):
        make_draft(target, 1, noise=-1.0)
