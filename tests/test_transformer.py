"""The runnable Llama-style model: cache correctness, GQA shapes, attention choices, bad inputs."""

import pytest
import torch

from labsupport import costs
from labsupport.attention import flash_attention_reference
from labsupport.models import ModelConfig, get_model
from labsupport.transformer import (
    ROPE_THETA,
    KVCache,
    Transformer,
    apply_rope,
    naive_attention,
    random_prompt,
    rope_cos_sin,
)

TINY = get_model("tiny-2m")
# Untied head and a group size of 4, as in the Llama 3 models.
GQA4 = ModelConfig("test-gqa4", 2, 64, 8, 2, 96, 97)


@pytest.fixture(scope="module")
def tiny():
    return Transformer(TINY, seed=0)


@pytest.fixture(scope="module")
def gqa4():
    return Transformer(GQA4, seed=1)


@pytest.mark.parametrize("cfg", [TINY, GQA4, get_model("tiny-20m")], ids=lambda c: c.name)
def test_param_count_matches_costs(cfg):
    model = Transformer(cfg)
    assert model.param_count() == costs.param_count(cfg)
    assert model.param_bytes() == 4 * costs.param_count(cfg)
    assert Transformer(cfg, dtype=torch.float16).param_bytes() == 2 * costs.param_count(cfg)


def test_weights_are_seeded():
    a, b, c = Transformer(TINY, seed=3), Transformer(TINY, seed=3), Transformer(TINY, seed=4)
    assert torch.equal(a.layers[0].attention.wq.weight, b.layers[0].attention.wq.weight)
    assert not torch.equal(a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight)
    assert torch.isfinite(a.layers[1].feed_forward.w2.weight).all()


@pytest.mark.parametrize("name", ["tiny", "gqa4"])
def test_cached_decode_matches_full_recompute(name, request):
    model = request.getfixturevalue(name)
    prompt = model.random_prompt(batch=3, length=7, seed=5)
    cache = model.new_cache(3, 12)
    tokens = prompt
    logits = model.prefill(prompt, cache)
    torch.testing.assert_close(logits, model.forward_no_cache(prompt), rtol=1e-4, atol=1e-4)
    for _ in range(4):
        nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits = model.decode_step(nxt, cache)
        torch.testing.assert_close(logits, model.forward_no_cache(tokens), rtol=1e-4, atol=1e-4)
    assert cache.length == tokens.shape[1] == 11


def test_generate_same_tokens_with_and_without_cache(gqa4):
    prompt = gqa4.random_prompt(batch=2, length=5, seed=2)
    with_cache = gqa4.generate(prompt, 6)
    without = gqa4.generate(prompt, 6, use_cache=False)
    assert with_cache.shape == (2, 11) and with_cache.dtype == torch.int64
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache[:, :5], prompt)
    assert torch.equal(gqa4.generate(prompt, 0), prompt)


def test_chunked_prefill_equals_one_prefill(gqa4):
    prompt = gqa4.random_prompt(batch=2, length=10, seed=7)
    whole = gqa4.prefill(prompt, gqa4.new_cache(2, 10))
    cache = gqa4.new_cache(2, 10)
    gqa4.prefill(prompt[:, :4], cache)
    chunked = gqa4.prefill(prompt[:, 4:], cache, start=cache.length)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    assert cache.length == 10


def test_gqa_cache_shapes_and_bytes(gqa4):
    cache = gqa4.new_cache(batch=2, max_len=16)
    assert isinstance(cache, KVCache)
    # (n_layers, B, n_kv_heads, max_len, head_dim): the cache stores 2 KV heads, not 8 query heads.
    assert cache.k.shape == cache.v.shape == (2, 2, 2, 16, 8)
    assert cache.length == 0
    assert cache.nbytes() == costs.kv_bytes_per_token(GQA4, 4) * 16 * 2
    gqa4.prefill(gqa4.random_prompt(2, 4), cache)
    assert cache.used_nbytes() == costs.kv_bytes_per_token(GQA4, 4) * 4 * 2
    assert "length=4/16" in repr(cache)


def test_cache_length_bookkeeping_and_overflow(tiny):
    cache = tiny.new_cache(1, 6)
    tiny.prefill(tiny.random_prompt(1, 5), cache)
    assert cache.length == 5
    tiny.decode_step(torch.tensor([[3]]), cache)
    assert cache.length == 6
    with pytest.raises(ValueError, match=r"KV cache overflow.*max_len=6.*6 are used and 1 more.*max_len=7"):
        tiny.decode_step(torch.tensor([[3]]), cache)
    assert cache.length == 6  # a refused step changes nothing
    with pytest.raises(ValueError, match="KV cache overflow"):
        tiny.prefill(tiny.random_prompt(1, 7), tiny.new_cache(1, 6))
    tiny.prefill(tiny.random_prompt(1, 2), cache)  # start=0 refills the cache from the beginning
    assert cache.length == 2
    cache.reset()
    assert cache.length == 0


@pytest.mark.parametrize("name", ["tiny", "gqa4"])
def test_naive_attention_equals_sdpa(name, request):
    model = request.getfixturevalue(name)
    prompt = model.random_prompt(2, 9, seed=11)
    sdpa_logits = model.forward_no_cache(prompt)
    sdpa_gen = model.generate(prompt, 4)
    model.attention = "naive"
    try:
        torch.testing.assert_close(model.forward_no_cache(prompt), sdpa_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(model.generate(prompt, 4), sdpa_gen)
    finally:
        model.attention = "sdpa"


def test_custom_attention_callable_is_used():
    calls = []

    def my_attention(q, k, v, causal):
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        return naive_attention(q, k, v, causal)

    model = Transformer(GQA4, seed=1, attention=my_attention)
    reference = Transformer(GQA4, seed=1)
    prompt = model.random_prompt(1, 5)
    assert torch.equal(model.generate(prompt, 2), reference.generate(prompt, 2))
    # Prefill: 2 layers, q (B, H, P, D) and k expanded to H heads, causal. Then a decode step.
    assert calls[0] == ((1, 8, 5, 8), (1, 8, 5, 8), True)
    assert calls[2] == ((1, 8, 1, 8), (1, 8, 6, 8), False)
    assert len(calls) == 4


def test_course_kernel_plugs_in():
    # The course's Triton kernel (run by the interpreter here) returns (out, lse); the model
    # takes out. Prefill calls it causal with S == T, each decode step with one query.
    model = Transformer(TINY, seed=0, attention=flash_attention_reference)
    reference = Transformer(TINY, seed=0)
    prompt = model.random_prompt(2, 13, seed=3)
    torch.testing.assert_close(
        model.forward_no_cache(prompt), reference.forward_no_cache(prompt), rtol=1e-4, atol=1e-4
    )
    assert torch.equal(model.generate(prompt, 2), reference.generate(prompt, 2))


def _rope_reference(x, positions, theta=ROPE_THETA):
    """RoPE written with complex numbers: pair (x[i], x[i + D/2]) is rotated by pos * theta**(-2i/D)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])  # (D/2,)
    angles = positions.double()[:, None] * freqs[None, :]  # (S, D/2)
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
        torch.ones_like(angles), angles
    )
    return torch.cat([pairs.real, pairs.imag], dim=-1)


def test_rope_rotates_pairs_by_position():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=gen)  # (B, heads, S, D)
    positions = torch.tensor([0, 1, 7, 100, 4096])
    cos, sin = rope_cos_sin(positions, 16, torch.float32)
    out = apply_rope(x, cos, sin)
    # fp32 angles: at position 4096 they carry an error of a few 1e-4 radians, as in every fp32 RoPE.
    torch.testing.assert_close(out.double(), _rope_reference(x, positions), rtol=0, atol=1e-3)
    torch.testing.assert_close(out[:, :, :4].double(), _rope_reference(x, positions)[:, :, :4], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    assert not torch.allclose(out[:, :, 1:], x[:, :, 1:], atol=1e-3)  # every other position is


def test_rope_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 64, generator=gen), torch.randn(1, 1, 1, 64, generator=gen)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([m]), 64, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([n]), 64, torch.float32)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


def test_custom_attention_wrong_shape_is_reported(tiny):
    model = Transformer(TINY, attention=lambda q, k, v, causal: q[..., :1])
    with pytest.raises(ValueError, match="attention function returned"):
        model.forward_no_cache(model.random_prompt(1, 3))


def test_random_prompt():
    a = random_prompt(TINY, 2, 8, seed=1)
    assert a.shape == (2, 8) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < TINY.vocab_size
    assert torch.equal(a, random_prompt(TINY, 2, 8, seed=1))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cfg": 2}, "model must be a ModelConfig"),
        ({"cfg": "tiny-9m"}, "unknown model 'tiny-9m'"),
        ({"attention": "flash"}, "attention must be 'sdpa', 'naive' or a callable"),
        ({"dtype": torch.int32}, "dtype must be a floating torch.dtype"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"device": "tpu:x"}, "device must be"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    args = {"cfg": TINY, **kwargs}
    with pytest.raises(ValueError, match=match):
        Transformer(**args)


def test_bad_call_arguments(tiny):
    cache = tiny.new_cache(2, 8)
    with pytest.raises(ValueError, match="integer token ids"):
        tiny.prefill(torch.zeros(2, 3), cache)
    with pytest.raises(ValueError, match=r"shape \(batch, length\)"):
        tiny.prefill(torch.zeros(6, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 1023\]"):
        tiny.prefill(torch.full((2, 3), 5000), cache)
    with pytest.raises(ValueError, match="batch 1 but the cache was made for batch 2"):
        tiny.prefill(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="cache is empty; call model.prefill"):
        tiny.decode_step(torch.zeros(2, 1, dtype=torch.long), cache)
    tiny.prefill(torch.zeros(2, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"shape \(batch, 1\)"):
        tiny.decode_step(torch.zeros(2, 2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="cache must be a KVCache"):
        tiny.decode_step(torch.zeros(2, 1, dtype=torch.long), None)
    with pytest.raises(ValueError, match="not made by this model"):
        tiny.decode_step(torch.zeros(1, 1, dtype=torch.long), Transformer(GQA4).new_cache(1, 4))
    with pytest.raises(ValueError, match="gap"):
        tiny.prefill(torch.zeros(2, 1, dtype=torch.long), cache, start=5)
    with pytest.raises(ValueError, match="max_len must be 1 or more"):
        tiny.new_cache(1, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny.generate(torch.zeros(1, 2, dtype=torch.long), -1)


def test_half_precision_runs_on_cpu():
    model = Transformer(TINY, dtype=torch.bfloat16)
    prompt = model.random_prompt(1, 6)
    out = model.generate(prompt, 3)
    assert out.shape == (1, 9)
    assert model.new_cache(1, 4).k.dtype == torch.bfloat16


def test_a_model_name_builds_the_same_model():
    """The Transformer takes a shape through labsupport.models.as_model, like every other function."""
    by_name, by_shape = Transformer("tiny-2m"), Transformer(TINY)
    assert by_name.cfg == TINY
    assert all(torch.equal(a, b) for a, b in zip(by_name.state_dict().values(), by_shape.state_dict().values()))


def test_the_old_module_name_still_imports():
    """Notebooks released before the rename say `from labsupport.model import Transformer`."""
    from labsupport import model

    assert model.Transformer is Transformer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_the_cpu_rope_table_rows_are_the_numbers_computed_alone(dtype, scaling):
    """A CPU model looks its rotation up in a table (``_rope_rows``); every row must be bit for bit what
    ``rope_cos_sin`` gives for that position alone, at any offset, after the table grows and after the
    model's dtype changes."""
    import dataclasses

    from labsupport.models import _frozen
    from labsupport.transformer import rope_cos_sin

    cfg = get_model("tiny-2m")
    if scaling is not None:
        cfg = dataclasses.replace(cfg, rope_scaling_items=_frozen(scaling))
    model = Transformer(cfg, dtype=dtype)
    for positions in ([0], [5], [3, 4, 5, 6], list(range(250, 262)), [1000], [7, 2000, 9]):
        pos = torch.tensor(positions)
        cos, sin = model._rope_rows(pos)
        want_cos, want_sin = rope_cos_sin(pos, cfg.head_dim, dtype, cfg.rope_theta, cfg.rope_scaling,
                                          inv_freq=model._inv_freq)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), positions
    assert model._rope_table[0].shape[0] == 2048  # grown to a power of two past the largest position
    model.to(torch.float64 if dtype == torch.float32 else torch.float32)
    pos = torch.tensor([3, 700])
    want = rope_cos_sin(pos, cfg.head_dim, model.dtype, cfg.rope_theta, cfg.rope_scaling, inv_freq=model._inv_freq)
    got = model._rope_rows(pos)
    assert got[0].dtype == model.dtype and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
