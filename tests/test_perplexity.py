"""labsupport.perplexity: windows, perplexity, KL to a reference, loss by position, int8 KV."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from labsupport import perplexity as P
from labsupport.models import get_model
from labsupport.phases import cpu_threads
from labsupport.quantize import quantize_model_weights
from labsupport.transformer import Transformer

CFG = dataclasses.replace(get_model("tiny-2m"), n_layers=2, name="ppl-model")
IDS = [int(i) for i in torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module")
def model():
    with cpu_threads(1):
        yield Transformer(CFG, seed=2)


def test_window_starts():
    assert P.window_starts(10, 4) == [0, 4]
    assert P.window_starts(10, 4, 2) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="does not fit"):
        P.window_starts(3, 4)
    with pytest.raises(ValueError, match="at least 2"):
        P.window_starts(3, 1)


def test_token_nll_is_cross_entropy_of_a_full_forward(model):
    nll = P.token_nll(model, IDS, 16, 8)  # windows at 0, 8, 16, 24
    assert nll.shape == (4, 15) and nll.dtype == torch.float64
    for j in (0, 7, 14):  # prediction j of window 1 (tokens 8 .. 23): the last logits of a prefill of j + 1 tokens
        logits = model.prefill(torch.tensor([IDS[8:9 + j]]), model.new_cache(1, 16))  # (1, V)
        want = F.cross_entropy(logits.float(), torch.tensor([IDS[9 + j]]))
        assert float(nll[1, j]) == pytest.approx(float(want), abs=1e-4)
    assert P.perplexity(nll) == pytest.approx(math.exp(float(nll.mean())))


def test_compare_to_reference(model):
    table = P.compare_to_reference(model, {"itself": model, "int8 KV": lambda: P.with_int8_kv_cache(model),
                                           "int4 weights": lambda: quantize_model_weights(model, 4, 32)}, IDS, 20)
    assert list(table) == ["reference", "itself", "int8 KV", "int4 weights"]
    ref = table["reference"]
    assert ref.positions == 2 * 19 and table["itself"].kl_mean < 1e-6
    assert table["itself"].perplexity == pytest.approx(ref.perplexity) and table["itself"].top1 == 1.0
    assert 0 < table["int8 KV"].kl_mean < table["int4 weights"].kl_mean  # int4 weights move it further
    assert table["int4 weights"].kl_p99 >= table["int4 weights"].kl_mean
    assert P.with_int8_kv_cache(model) is not model and model.attention is not P.int8_kv_attention


def test_loss_by_position_bins_double(model):
    curve = P.loss_by_position(model, IDS, 20)
    assert curve.bins == [(1, 1), (2, 3), (4, 7), (8, 15), (16, 19)]
    assert curve.predictions == [2, 4, 8, 16, 8] and curve.windows == 2
    nll = P.token_nll(model, IDS, 20)
    assert curve.nll[2] == pytest.approx(float(nll[:, 3:7].mean()))


def test_heldout_text_is_shipped():
    ident = P.heldout_identity()
    assert ident["characters"] > 30_000 and len(ident["sha256"]) == 64
