"""The course's sampler (chapter 13): the distribution it draws from, its edges and its settings."""

from __future__ import annotations

import pytest
import torch

from labsupport._answers import unguarded
from labsupport.engine.sampler import BatchedSampler, batched_sampling_probs, greedy_ids, row_settings
from labsupport.sampling import SamplingParams, min_p_filter, request_generator, sample, sampling_probs

probs_of = unguarded(sampling_probs)
draw = unguarded(sample)
batched = unguarded(batched_sampling_probs)
Z = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))


def test_top_p_keeps_the_crossing_token():
    kept = probs_of(Z, 1.0, 0, 0.6)[0]
    assert torch.allclose(kept, torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65)
    assert int((probs_of(Z, 1.0, 0, 0.65 + 1e-6)[0] > 0).sum()) == 3
    assert int((probs_of(Z, 1.0, 0, 1e-9)[0] > 0).sum()) == 1  # the most likely token always stays


def test_temperature_top_k_and_the_edges():
    assert torch.allclose(probs_of(Z, 1.0)[0], torch.softmax(Z[0], -1))
    assert torch.allclose(probs_of(Z, 0.5)[0], torch.softmax(Z[0] / 0.5, -1))
    assert int((probs_of(Z, 1.0, 2)[0] > 0).sum()) == 2
    assert torch.equal(probs_of(Z, 1.0, 100), probs_of(Z, 1.0))  # top-k beyond the vocabulary keeps all
    assert torch.equal(probs_of(Z, 0.0)[0], torch.tensor([1.0, 0, 0, 0, 0, 0]))
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert int(draw(Z, 0.0, generator=gen)[0]) == 0 and torch.equal(gen.get_state(), state)  # greedy draws nothing


def test_seeded_generators_repeat():
    a = draw(Z.expand(50, -1), 1.0, generator=request_generator(7))
    b = draw(Z.expand(50, -1), 1.0, generator=request_generator(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed=1.5), "seed"),
])
def test_sampling_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logits_must_be_a_batch():
    with pytest.raises(ValueError, match="batch, vocab"):
        probs_of(Z[0])


# top_p values the API accepts, (0, 1], that float32 rounds to 0 (1e-300) or to its smallest numbers
TINY_TOP_P = (1e-300, 1e-46, 1e-45, 1e-40)


@pytest.mark.parametrize("top_p", TINY_TOP_P)
def test_a_tiny_top_p_keeps_the_most_likely_token_in_every_sampler(top_p):
    """vLLM's rule: the most likely token is never cut. Without it a top_p that rounds to 0 in float32
    cut every token and the renormalisation divided 0 by 0 (NaN, and the draw raised)."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)) * 4
    logits[3, :5] = logits[3].max() + 1  # a tie at the top: the lowest id wins (the stable sort)
    best = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
    for kw in (dict(), dict(top_k=3), dict(min_p=1.0), dict(top_k=1, min_p=0.5)):
        probs = probs_of(logits, 0.8, top_p=top_p, **kw)
        assert not probs.isnan().any() and torch.equal(probs, best)
        assert torch.equal(draw(logits, 0.8, top_p=top_p, generator=request_generator(1), **kw), logits.argmax(-1))
        params = [SamplingParams(temperature=0.8, top_p=top_p, **kw)] * 6
        assert torch.equal(batched(logits, *row_settings(params, 40, "cpu")), best)
        assert BatchedSampler()(logits, params, [request_generator(i) for i in range(6)]) == logits.argmax(-1).tolist()


def test_min_p_keeps_the_most_likely_token_whatever_the_logits():
    logits = torch.tensor([[80.0, -80.0, 79.9, 0.0], [1e-30, 0.0, -1e30, 1e30]])
    for min_p in (1.0, 0.999999, 1e-300):
        kept = min_p_filter(logits, min_p)
        assert torch.equal(kept.argmax(-1), logits.argmax(-1)) and bool(torch.isfinite(kept.max(-1).values).all())


def test_greedy_ids_take_torch_argmax_rule_on_ties_nan_and_infinities():
    """The all-greedy path's argmax (numpy on the CPU) gives torch's index: the first maximum, a NaN
    counting as the largest, a row of -inf its first index; float32, float64, a strided view and a
    negated view (whose numpy() needs resolving first) alike."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf],
                         [0.0, inf, inf, 1.0], [-1.0, -2.0, -0.5, -0.5]])
    for logits in (rows, rows.double(), rows.t().contiguous().t(), torch._neg_view(rows), torch.randn(7, 49152)):
        assert greedy_ids(logits) == logits.argmax(-1).tolist()
    assert greedy_ids(rows) == [1, 1, 0, 1, 2]
    assert greedy_ids(rows.bfloat16()) == [1, 1, 0, 1, 2]  # not float32: torch's own argmax
