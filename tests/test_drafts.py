"""labsupport.drafts: prompt lookup's rule, greedy verification equal to plain greedy, the figures."""

import dataclasses

import pytest
import torch

from labsupport import drafts
from labsupport.checkpoints import greedy
from labsupport.models import get_model
from labsupport.phases import cpu_threads
from labsupport.speculative import expected_tokens_per_step
from labsupport.transformer import Transformer

CFG = dataclasses.replace(get_model("tiny-2m"), n_layers=4, tied_embeddings=False, name="drafts-target")


@pytest.fixture(scope="module")
def target():
    with cpu_threads(1):
        yield Transformer(CFG, seed=3)


def test_ngram_proposal_takes_the_longest_match_earliest():
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    assert drafts.ngram_proposal(context, 2) == [8, 1]  # "5 6 7" (n = 3) matched at 0, not "6 7" at 5
    assert drafts.ngram_proposal(context, 10) == [8, 1, 6, 7, 9, 5, 6, 7]  # fewer than k follow it
    assert drafts.ngram_proposal([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert drafts.ngram_proposal([4, 2, 9, 3, 2], 2, max_n=1) == [9, 3]  # n = 1: the earliest 2
    with pytest.raises(ValueError, match="min_n"):
        drafts.ngram_proposal(context, 2, min_n=3, max_n=2)


@pytest.mark.parametrize("propose", ["lookup", "wrong", "none"])
def test_greedy_speculative_equals_greedy(target, propose):
    prompt = [3, 17, 42, 3, 17, 42, 3, 17]
    plain = greedy(target, prompt, 12)
    proposers = {"lookup": lambda seq, k: drafts.ngram_proposal(seq, k),
                 "wrong": lambda seq, k: [(seq[-1] + 1) % CFG.vocab_size] * k,
                 "none": lambda seq, k: []}
    run = drafts.greedy_speculative(target, prompt, 12, 3, proposers[propose])
    assert run["tokens"] == plain
    assert sum(run["emitted"]) >= 12 and run["steps"] == len(run["emitted"])
    if propose == "none":
        assert run["steps"] == 12 and run["proposed"] == 0
    if propose == "wrong":  # unless the target itself would emit it, each pass tests one and rejects it
        assert run["accepted"] <= sum(a == b for a, b in zip(plain[1:], plain))


def test_greedy_speculative_stops_at_a_stop_id(target):
    prompt = [3, 17, 42, 3]
    plain = greedy(target, prompt, 12)
    stop = plain[4]
    run = drafts.greedy_speculative(target, prompt, 12, 4, lambda seq, k: plain[len(seq) - 4:][:k], [stop])
    assert run["tokens"] == plain[:plain.index(stop) + 1]
    assert run["accepted"] > 0  # the perfect proposer was accepted


def test_acceptance_figures_and_truncation():
    run = {"tokens": [1, 2, 3, 4, 5, 6], "steps": 3, "proposed": 5, "accepted": 3, "emitted": [3, 1, 2],
           "offered": [2, 2, 0]}
    fig = drafts.acceptance(run, 2)
    assert fig["acceptance"] == pytest.approx(3 / 5) and fig["tokens_per_pass"] == pytest.approx(2.0)
    assert fig["tokens_per_pass_offered_k"] == pytest.approx(2.0) and fig["passes_offered_none"] == 1
    assert fig["formula_tokens_per_pass"] == pytest.approx(expected_tokens_per_step(0.6, 2))
    both = drafts.acceptance([run, run], 2)
    assert both["steps"] == 6 and both["acceptance"] == pytest.approx(0.6)
    # speculative_generate's result cut at the stop id 4 (emitted in the second step)
    cut = drafts.truncate_at_stop({"tokens": [1, 2, 3, 4, 5, 6], "emitted": [3, 2, 1]}, 2, [4])
    assert cut["tokens"] == [1, 2, 3, 4] and cut["steps"] == 2 and cut["accepted"] == 3 and cut["proposed"] == 4


def test_layer_draft_with_every_layer_accepts_everything(target):
    prompt = [5, 9, 11]
    run = drafts.layer_draft_speculative(target, prompt, 9, 2, CFG.n_layers)
    assert run["tokens"] == greedy(target, prompt, 9)
    assert run["accepted"] == run["proposed"] > 0
    torch.testing.assert_close(drafts.acceptance(run, 2)["acceptance"], 1.0)
