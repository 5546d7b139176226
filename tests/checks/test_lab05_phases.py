"""The phases lab's checks pass the reference and reject each planted mistake, naming it."""

import pytest

from labsupport.checks import check_decode_bytes, check_prefill_flops
from labsupport.checks.framework import CheckFailed
from labsupport.costs import param_count


def prefill_reference(cfg, prompt_tokens, causal=False):
    n, L, d, p = param_count(cfg), cfg.n_layers, cfg.n_heads * cfg.head_dim, prompt_tokens
    attention = 4 * L * p * p * d
    return 2 * n * p + (attention / 2 if causal else attention)


def decode_reference(cfg, batch, context):
    weights = param_count(cfg) * 2
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
    return weights + batch * context * per_token


def decode_reference_any_dtype(cfg, batch, context, dtype_bytes=2):
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    return param_count(cfg) * dtype_bytes + batch * context * per_token


def test_prefill_reference_passes(capsys):
    check_prefill_flops(prefill_reference)
    assert "PASSED check_prefill_flops" in capsys.readouterr().out


@pytest.mark.parametrize("fn", [decode_reference, decode_reference_any_dtype])
def test_decode_reference_passes(fn, capsys):
    check_decode_bytes(fn)
    assert "PASSED check_decode_bytes" in capsys.readouterr().out


def _n(cfg):
    return param_count(cfg)


PREFILL_MUTANTS = {
    "no_attention": (
        lambda cfg, p, causal=False: 2 * _n(cfg) * p,
        "attention term 4\\*L\\*P\\*\\*2\\*d_q is left out",
    ),
    "no_factor_2_linear": (
        lambda cfg, p, causal=False: (
            _n(cfg) * p + 4 * cfg.n_layers * p * p * cfg.d_model / (2 if causal else 1)
        ),
        "factor 2 is missing from the linear term",
    ),
    "no_causal_halving": (
        lambda cfg, p, causal=False: 2 * _n(cfg) * p + 4 * cfg.n_layers * p * p * cfg.d_model,
        "causal=True did not halve",
    ),
    "always_halved": (
        lambda cfg, p, causal=False: 2 * _n(cfg) * p + 2 * cfg.n_layers * p * p * cfg.d_model,
        "half its size",
    ),
    "head_dim_not_d_model": (
        lambda cfg, p, causal=False: (
            2 * _n(cfg) * p + 4 * cfg.n_layers * p * p * cfg.head_dim / (2 if causal else 1)
        ),
        "width of one head",
    ),
    "one_layer": (
        lambda cfg, p, causal=False: 2 * _n(cfg) * p + 4 * p * p * cfg.d_model / (2 if causal else 1),
        "one layer only",
    ),
    "linear_attention": (
        lambda cfg, p, causal=False: (
            2 * _n(cfg) * p + 4 * cfg.n_layers * p * cfg.d_model / (2 if causal else 1)
        ),
        "linear in P",
    ),
    "no_factor_2_anywhere": (
        lambda cfg, p, causal=False: prefill_reference(cfg, p, causal) / 2,
        "factor 2 is missing everywhere",
    ),
    "n_without_embeddings": (
        lambda cfg, p, causal=False: (
            prefill_reference(cfg, p, causal)
            - 2 * p * cfg.vocab_size * cfg.d_model * (1 if cfg.tied_embeddings else 2)
        ),
        "N leaves the embedding tables out",
    ),
    "n_with_mha_projections": (
        lambda cfg, p, causal=False: (
            prefill_reference(cfg, p, causal)
            + 2 * p * cfg.n_layers * 2 * cfg.d_model * (cfg.n_heads - cfg.n_kv_heads) * cfg.head_dim
        ),
        "n_heads instead of n_kv_heads",
    ),
    "no_causal_argument": (lambda cfg, p: prefill_reference(cfg, p), "TypeError"),
    # the red team's (issue 26): right wherever n_heads * head_dim = d_model, which every Llama has
    "attention_width_d_model": (
        lambda cfg, p, causal=False: 2 * _n(cfg) * p + 4 * cfg.n_layers * p * p * cfg.d_model / (2 if causal else 1),
        r"(?s)model=qwen3-0.6b.*attention uses d_model \(1,024\) instead of the query width n_heads \* head_dim "
        r"\(2,048\)",
    ),
    "head_dim_derived": (
        lambda cfg, p, causal=False: 2 * _n(cfg) * p + 4 * cfg.n_layers * p * p * cfg.n_heads * (
            cfg.d_model // cfg.n_heads) / (2 if causal else 1),
        r"(?s)model=qwen3-0.6b.*derived as d_model // n_heads \(64\)",
    ),
    "causal_halves_everything": (
        lambda cfg, p, causal=False: prefill_reference(cfg, p) / (2 if causal else 1),
        r"(?s)causal=True\].*causal=True halved the whole count, the weights' 2\*N\*P as well",
    ),
    "causal_exact_triangle": (
        lambda cfg, p, causal=False: 2 * _n(cfg) * p + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * (
            p * (p + 1) / 2 if causal else p * p),
        "exact triangle, P\\*\\(P\\+1\\)/2 scores per head",
    ),
    "returns_a_string": (lambda cfg, p, causal=False: "34.2 TFLOP", "expected a number"),
}


@pytest.mark.parametrize("name", PREFILL_MUTANTS)
def test_prefill_mutant_fails(name):
    fn, message = PREFILL_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_prefill_flops(fn)


def _kv(cfg, heads=None, b=2):
    return 2 * cfg.n_layers * (heads or cfg.n_kv_heads) * cfg.head_dim * b


DECODE_MUTANTS = {
    "no_cache": (lambda cfg, batch, ctx: _n(cfg) * 2, "KV cache is left out"),
    "cache_once": (
        lambda cfg, batch, ctx: _n(cfg) * 2 + ctx * _kv(cfg),
        "counted once, not once per sequence",
    ),
    "no_weights": (lambda cfg, batch, ctx: batch * ctx * _kv(cfg), "weights are left out"),
    "weights_per_sequence": (
        lambda cfg, batch, ctx: batch * _n(cfg) * 2 + batch * ctx * _kv(cfg),
        "weights are counted once per sequence",
    ),
    "n_heads_not_n_kv_heads": (
        lambda cfg, batch, ctx: _n(cfg) * 2 + batch * ctx * _kv(cfg, heads=cfg.n_heads),
        "n_heads instead of n_kv_heads",
    ),
    "no_k_and_v": (lambda cfg, batch, ctx: _n(cfg) * 2 + batch * ctx * _kv(cfg) / 2, "keys AND values"),
    "one_layer": (
        lambda cfg, batch, ctx: _n(cfg) * 2 + batch * ctx * _kv(cfg) / cfg.n_layers,
        "one layer only",
    ),
    "elements_not_bytes": (
        lambda cfg, batch, ctx: _n(cfg) + batch * ctx * _kv(cfg) / 2,
        "elements are counted",
    ),
    "fp32": (lambda cfg, batch, ctx: _n(cfg) * 4 + batch * ctx * _kv(cfg, b=4), "4 bytes \\(fp32\\)"),
    "ignores_dtype_bytes": (
        lambda cfg, batch, ctx, dtype_bytes=2: _n(cfg) * 2 + batch * ctx * _kv(cfg),
        "dtype_bytes is ignored",
    ),
    "ignores_element_bytes": (  # the fourth parameter has another name: it is still checked
        lambda cfg, batch, ctx, element_bytes=2: _n(cfg) * 2 + batch * ctx * _kv(cfg),
        "dtype_bytes is ignored",
    ),
    "returns_a_dict": (lambda cfg, batch, ctx: {"weights": _n(cfg) * 2}, "expected a number"),
    # the red team's (issue 26)
    "head_dim_derived": (
        lambda cfg, batch, ctx: _n(cfg) * 2 + batch * ctx * 2 * cfg.n_layers * cfg.n_kv_heads * (
            cfg.d_model // cfg.n_heads) * 2,
        r"(?s)model=qwen3-0.6b.*derived as d_model // n_heads \(64\) instead of cfg.head_dim \(128\)",
    ),
    "context_plus_one": (
        lambda cfg, batch, ctx: _n(cfg) * 2 + batch * (ctx + 1) * _kv(cfg),
        "context \\+ 1 tokens of cache are counted per sequence",
    ),
}


def test_decode_check_accepts_correct_functions_with_other_parameters():
    def split_bytes(cfg, batch, context, weight_bytes=2, kv_dtype_bytes=2):  # labsupport.costs before the rename
        return _n(cfg) * weight_bytes + batch * context * _kv(cfg, b=kv_dtype_bytes)

    def split_dtype_bytes(cfg, batch, context, weight_dtype_bytes=2, kv_dtype_bytes=2):  # like labsupport.costs
        return _n(cfg) * weight_dtype_bytes + batch * context * _kv(cfg, b=kv_dtype_bytes)

    def with_a_flag(cfg, batch, context, verbose=False):  # not a bytes parameter: bf16 only
        return _n(cfg) * 2 + batch * context * _kv(cfg)

    check_decode_bytes(split_bytes)
    check_decode_bytes(split_dtype_bytes)
    check_decode_bytes(with_a_flag)


@pytest.mark.parametrize("name", DECODE_MUTANTS)
def test_decode_mutant_fails(name):
    fn, message = DECODE_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_decode_bytes(fn)


def test_not_implemented_is_reported():
    def stub(cfg, prompt_tokens, causal=False):
        raise NotImplementedError("Exercise: count the FLOPs")

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_prefill_flops(stub)


def test_failure_message_names_the_case():
    with pytest.raises(CheckFailed) as info:
        check_decode_bytes(DECODE_MUTANTS["cache_once"][0])
    message = str(info.value)
    assert "model=llama-3.1-8b, batch=64, context=8192" in message
    assert "kv_bytes_per_token = 2 (K and V)" in message
