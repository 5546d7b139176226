"""The course's sampler (chapter 13): the distribution it draws from, its edges and its settings."""

from __future__ import annotations

import pytest
import torch

from labsupport._answers import unguarded
from labsupport.sampling import SamplingParams, request_generator, sample, sampling_probs

probs_of = unguarded(sampling_probs)
draw = unguarded(sample)
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
