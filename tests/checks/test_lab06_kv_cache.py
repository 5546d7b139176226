"""The KV cache checks pass the references and reject each planted mistake; the reference
calculators in labsupport.kvcache give the book's figures and refuse bad input."""

from __future__ import annotations

import math

import pytest

from labsupport._answers import unguarded
from labsupport.checks import CheckFailed, check_kv_bytes_per_token, check_max_concurrency
from labsupport.costs import kv_bytes_per_token, param_count
from labsupport.hardware import get_gpu
from labsupport.kvcache import (
    kv_bytes_per_sequence,
    max_concurrency,
    paged_waste,
    reservation_waste,
    weight_bytes_total,
    with_kv_heads,
)
from labsupport.models import get_model

kv_bytes_per_token = unguarded(kv_bytes_per_token)  # the answers themselves, outside the guard
max_concurrency = unguarded(max_concurrency)

M8, M70 = get_model("llama-3.1-8b"), get_model("llama-3.1-70b")
H100 = get_gpu("H100 SXM")

# --- the reference calculators ------------------------------------------------------------------


def test_seed_figures():
    assert kv_bytes_per_token(M8) == 128 * 2**10
    assert kv_bytes_per_sequence(M8, 2000) / 2**30 == pytest.approx(0.244, abs=1e-3)
    assert kv_bytes_per_token(M70) == 320 * 2**10
    assert kv_bytes_per_sequence(M70, 8192) / 2**30 == pytest.approx(2.5)


def test_max_concurrency_definition():
    free = H100.memory_bytes - param_count(M8) * 2
    assert max_concurrency(M8, H100.memory_bytes, 8192) == math.floor(free / (kv_bytes_per_token(M8) * 8192))
    assert max_concurrency(M70, H100.memory_bytes, 8192) == 0  # 141 GB of weights do not fit in 80 GB
    assert max_concurrency(M70, H100.times(4).memory_bytes, 8192) > 0
    more_reserve = max_concurrency(M8, H100.memory_bytes, 8192, reserve_bytes=10e9)
    assert more_reserve < max_concurrency(M8, H100.memory_bytes, 8192)
    assert max_concurrency(M8, H100.memory_bytes, 8192, kv_dtype_bytes=1) >= 2 * max_concurrency(
        M8, H100.memory_bytes, 8192
    )
    # exact fit: room for exactly three sequences, and one byte less leaves two
    per_seq = kv_bytes_per_token(M8) * 1000
    exact = weight_bytes_total(M8) + 3 * per_seq
    assert max_concurrency(M8, exact, 1000) == 3
    assert max_concurrency(M8, exact - 1, 1000) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gpu_memory_bytes=0), "gpu_memory_bytes"),
        (dict(gpu_memory_bytes="80GB"), "gpu_memory_bytes"),
        (dict(context_tokens=0), "context_tokens"),
        (dict(context_tokens=1.5), "context_tokens"),
        (dict(weight_dtype_bytes=0), "weight_dtype_bytes"),
        (dict(weight_bytes=0), "weight_dtype_bytes"),  # the name before the bytes naming rule
        (dict(kv_dtype_bytes=-1), "dtype_bytes"),
        (dict(reserve_bytes=-1), "reserve_bytes"),
        (dict(cfg=8), "ModelConfig"),
    ],
)
def test_max_concurrency_rejects_bad_input(kwargs, match):
    args = dict(cfg=M8, gpu_memory_bytes=80e9, context_tokens=8192) | kwargs
    with pytest.raises(ValueError, match=match):
        max_concurrency(**args)


def test_with_kv_heads():
    mha = with_kv_heads(M70, M70.n_heads)
    assert kv_bytes_per_token(mha) == 8 * kv_bytes_per_token(M70)
    assert "MHA" in mha.name and mha.n_heads == M70.n_heads
    with pytest.raises(ValueError, match="must divide n_heads"):
        with_kv_heads(M70, 7)


def test_reservation_and_paged_waste():
    assert reservation_waste([1000, 3000], 4000) == pytest.approx(0.5)
    assert reservation_waste([4000], 4000) == 0
    assert paged_waste([16, 32], 16) == 0
    assert paged_waste([17], 16) == pytest.approx(1 - 17 / 32)
    with pytest.raises(ValueError, match="does not fit"):
        reservation_waste([5000], 4000)
    with pytest.raises(ValueError, match="at least one"):
        reservation_waste([], 4000)
    with pytest.raises(ValueError, match="block_tokens"):
        paged_waste([10], 0)


# --- check_kv_bytes_per_token ---------------------------------------------------------------------


def ref_kv(cfg, dtype_bytes=2):
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes


def test_kv_reference_passes(capsys):
    check_kv_bytes_per_token(ref_kv)
    check_kv_bytes_per_token(kv_bytes_per_token)
    assert "PASSED check_kv_bytes_per_token" in capsys.readouterr().out


KV_MUTATIONS = {
    "n_heads instead of n_kv_heads": (
        lambda cfg, dtype_bytes=2: 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * dtype_bytes,
        "n_heads is used instead of n_kv_heads",
    ),
    "forgot K and V factor 2": (
        lambda cfg, dtype_bytes=2: cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes,
        "factor 2 for keys and values",
    ),
    "forgot layers": (
        lambda cfg, dtype_bytes=2: 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes,
        "number of layers is missing",
    ),
    "ignored dtype_bytes": (
        lambda cfg, dtype_bytes=2: 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2,
        "fixed 2 bytes",
    ),
    "wrong default dtype": (
        lambda cfg, dtype_bytes=4: 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes,
        "use 2",
    ),
    "d_model instead of head_dim": (
        lambda cfg, dtype_bytes=2: 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_model * dtype_bytes,
        "d_model is used instead of head_dim",
    ),
    "bits": (
        lambda cfg, dtype_bytes=2: 16 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes,
        "bits",
    ),
    "returns a string": (lambda cfg, dtype_bytes=2: "128 KiB", "expected a number"),
}


@pytest.mark.parametrize("name", list(KV_MUTATIONS))
def test_kv_mutation_is_rejected(name):
    fn, message = KV_MUTATIONS[name]
    with pytest.raises(CheckFailed, match=message):
        check_kv_bytes_per_token(fn)


def test_kv_stub_says_not_implemented():
    def stub(cfg, dtype_bytes=2):
        raise NotImplementedError("Exercise")

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_kv_bytes_per_token(stub)


# --- check_max_concurrency --------------------------------------------------------------------------


def ref_concurrency(cfg, gpu_memory_bytes, context_tokens, weight_bytes=2, kv_dtype_bytes=2, reserve_bytes=0):
    free = gpu_memory_bytes - param_count(cfg) * weight_bytes - reserve_bytes
    per_sequence = ref_kv(cfg, kv_dtype_bytes) * context_tokens
    return max(0, int(free // per_sequence))


def test_concurrency_reference_passes(capsys):
    check_max_concurrency(ref_concurrency)
    check_max_concurrency(max_concurrency)
    assert "PASSED check_max_concurrency" in capsys.readouterr().out


def test_concurrency_accepts_both_spellings_of_the_weight_bytes(capsys):
    """A notebook released before the bytes naming rule says weight_bytes=; a new one weight_dtype_bytes=.
    The check passes its arguments under whichever name the learner's function has."""

    def new_spelling(cfg, gpu_memory_bytes, context_tokens, weight_dtype_bytes=2, kv_dtype_bytes=2,
                     reserve_bytes=0):
        return ref_concurrency(cfg, gpu_memory_bytes, context_tokens, weight_dtype_bytes, kv_dtype_bytes,
                               reserve_bytes)

    check_max_concurrency(new_spelling)
    assert "PASSED check_max_concurrency" in capsys.readouterr().out

    def new_spelling_ignores_weights_size(cfg, gpu_memory_bytes, context_tokens, weight_dtype_bytes=2,
                                          kv_dtype_bytes=2, reserve_bytes=0):
        return ref_concurrency(cfg, gpu_memory_bytes, context_tokens, 2, kv_dtype_bytes, reserve_bytes)

    with pytest.raises(CheckFailed, match="weight_dtype_bytes=1"):  # the case names the learner's spelling
        check_max_concurrency(new_spelling_ignores_weights_size)


def _mutant(change):
    """A concurrency calculator with one planted mistake; ``change`` edits its intermediate values."""

    def fn(cfg, gpu_memory_bytes, context_tokens, weight_bytes=2, kv_dtype_bytes=2, reserve_bytes=0):
        v = dict(
            memory=gpu_memory_bytes,
            weights=param_count(cfg) * weight_bytes,
            reserve=reserve_bytes,
            per_seq=ref_kv(cfg, kv_dtype_bytes) * context_tokens,
            cfg=cfg,
            context=context_tokens,
            wb=weight_bytes,
            kb=kv_dtype_bytes,
        )
        v = change(v)
        if "result" in v:
            return v["result"]
        return max(0, math.floor((v["memory"] - v["weights"] - v["reserve"]) / v["per_seq"]))

    return fn


CONCURRENCY_MUTATIONS = {
    "forgot the weights": (_mutant(lambda v: v | {"weights": 0}), "weights are not subtracted"),
    "forgot the reserve": (_mutant(lambda v: v | {"reserve": 0}), "reserve_bytes is not subtracted"),
    "n_heads instead of n_kv_heads": (
        _mutant(lambda v: v | {"per_seq": v["per_seq"] * v["cfg"].group_size}),
        "n_heads is used instead of n_kv_heads",
    ),
    "negative when nothing fits": (
        _mutant(
            lambda v: v | {"result": math.floor((v["memory"] - v["weights"] - v["reserve"]) / v["per_seq"])}
        ),
        "not clamped at 0",
    ),
    "no rounding": (
        _mutant(
            lambda v: v | {"result": max(0.0, (v["memory"] - v["weights"] - v["reserve"]) / v["per_seq"])}
        ),
        "not rounded down",
    ),
    "rounds up": (
        _mutant(
            lambda v: (
                v | {"result": max(0, math.ceil((v["memory"] - v["weights"] - v["reserve"]) / v["per_seq"]))}
            )
        ),
        "rounded up",
    ),
    "swapped byte sizes": (
        _mutant(
            lambda v: (
                v
                | {
                    "weights": param_count(v["cfg"]) * v["kb"],
                    "per_seq": ref_kv(v["cfg"], v["wb"]) * v["context"],
                }
            )
        ),
        "swapped",
    ),
    "ignored context": (
        _mutant(lambda v: v | {"per_seq": ref_kv(v["cfg"], v["kb"])}),
        "context_tokens is ignored",
    ),
    "wrong default weight_bytes": (
        lambda cfg, m, c, weight_bytes=1, kv_dtype_bytes=2, reserve_bytes=0: ref_concurrency(
            cfg, m, c, weight_bytes, kv_dtype_bytes, reserve_bytes
        ),
        "Defaults: weight_bytes=2",
    ),
}


@pytest.mark.parametrize("name", list(CONCURRENCY_MUTATIONS))
def test_concurrency_mutation_is_rejected(name):
    fn, message = CONCURRENCY_MUTATIONS[name]
    with pytest.raises(CheckFailed, match=message):
        check_max_concurrency(fn)


def test_concurrency_stub_says_not_implemented():
    def stub(cfg, gpu_memory_bytes, context_tokens, weight_bytes=2, kv_dtype_bytes=2, reserve_bytes=0):
        raise NotImplementedError("Exercise")

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_max_concurrency(stub)


# --- the red team's (issue 26): an explicit head width, a fractional dtype_bytes ---------------------------


def _kv_derived_head_dim(cfg, dtype_bytes=2):
    return 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * dtype_bytes


def test_kv_bytes_with_a_derived_head_width_fails_on_qwen3():
    with pytest.raises(CheckFailed, match=r"(?s)model=qwen3-0.6b.*derived as d_model // n_heads \(64\) instead "
                                          r"of cfg.head_dim \(128\)"):
        check_kv_bytes_per_token(_kv_derived_head_dim)


def test_kv_bytes_with_a_whole_number_of_bytes_fails_on_a_4_bit_cache():
    def int_bytes(cfg, dtype_bytes=2):
        return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * int(dtype_bytes)

    with pytest.raises(CheckFailed, match=r"(?s)dtype_bytes=0.5.*rounded to a whole number \(int\(0.5\) = 0\)"):
        check_kv_bytes_per_token(int_bytes)


def test_max_concurrency_with_a_derived_head_width_fails_on_qwen3():
    def derived(cfg, gpu_memory_bytes, context_tokens, weight_dtype_bytes=2, kv_dtype_bytes=2, reserve_bytes=0):
        free = gpu_memory_bytes - param_count(cfg) * weight_dtype_bytes - reserve_bytes
        return max(0, int(free // (_kv_derived_head_dim(cfg, kv_dtype_bytes) * context_tokens)))

    with pytest.raises(CheckFailed, match=r"(?s)model=qwen3-0.6b.*the number of sequences is 52, expected 26.*"
                                          r"derived as d_model // n_heads"):
        check_max_concurrency(derived)
