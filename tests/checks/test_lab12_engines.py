"""Lab 12's KV-capacity check passes the course's answer and rejects each planted mistake with a
message that names it; the answer follows its stated convention."""

from __future__ import annotations

import math

import pytest

from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_kv_capacity
from labsupport.costs import kv_bytes_per_token, param_count
from labsupport.kv_capacity import GIB, kv_capacity
from labsupport.models import get_model

capacity_ref = unguarded(kv_capacity)
M8 = get_model("llama-3.1-8b")


def fails(fn, *needles, reason="failed"):
    with pytest.raises(CheckFailed) as info:
        check_kv_capacity(fn)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert info.value.reason == reason
    return message


def _planted(*, heads=False, unit=GIB, floor_blocks=True, util_on_free=False, derived_head_dim=False):
    """kv_capacity written out, with one step optionally done wrong."""

    def capacity(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16,
                 kv_dtype_bytes=2, weight_dtype_bytes=2, reserve_gib=0.0):
        total, reserve = gpu_memory_gib * unit, reserve_gib * unit
        weights = param_count(cfg) * weight_dtype_bytes
        if util_on_free:
            kv = (total - weights - reserve) * gpu_memory_utilization
        else:
            kv = gpu_memory_utilization * total - weights - reserve
        head_dim = cfg.d_model // cfg.n_heads if derived_head_dim else cfg.head_dim
        per_token = 2 * cfg.n_layers * (cfg.n_heads if heads else cfg.n_kv_heads) * head_dim * kv_dtype_bytes
        if floor_blocks:
            blocks = max(0, math.floor(kv / (per_token * block_size)))
            tokens = blocks * block_size
        else:
            tokens = max(0, math.floor(kv / per_token))
            blocks = tokens / block_size
        per_request = -(-max_model_len // block_size)
        return {"num_blocks": blocks, "tokens": tokens, "max_requests": math.floor(blocks / per_request)}

    return capacity


def test_a_correct_function_passes():
    check_kv_capacity(_planted())


def test_the_answer_follows_its_convention():
    got = capacity_ref(M8, 80, 8192)
    kv = 0.9 * 80 * GIB - param_count(M8) * 2
    blocks = math.floor(kv / (16 * kv_bytes_per_token(M8)))
    assert got == {"num_blocks": blocks, "tokens": 16 * blocks, "max_requests": blocks // 512}
    assert capacity_ref(M8, 16, 4096) == {"num_blocks": 0, "tokens": 0, "max_requests": 0}  # weights do not fit
    assert capacity_ref(M8, 80, 8192, kv_dtype_bytes=1)["num_blocks"] in (2 * blocks, 2 * blocks + 1)
    for bad, match in ((dict(gpu_memory_utilization=1.5), "fraction"), (dict(block_size=0), "block_size"),
                       (dict(reserve_gib=-1), "reserve_gib")):
        with pytest.raises(ValueError, match=match):
            capacity_ref(M8, 80, 8192, **bad)


def test_kv_sized_from_query_heads():
    fails(_planted(heads=True), "query heads")


def test_head_width_derived_from_d_model():
    """d_model // n_heads instead of cfg.head_dim: the same for Llama, half of it for Qwen3-0.6B."""
    fails(_planted(derived_head_dim=True), "qwen3-0.6b", "d_model // n_heads = 64", "cfg.head_dim = 128")


def test_gigabytes_instead_of_gib():
    fails(_planted(unit=1e9), "10**9")


def test_blocks_not_rounded_down():
    fails(_planted(floor_blocks=False), "whole tokens, not rounded down to whole blocks")


def test_utilisation_applied_to_free_memory():
    fails(_planted(util_on_free=True), "applied to the memory left after the weights")


def test_request_blocks_not_rounded_up():
    def wrong(cfg, gpu_memory_gib, max_model_len, **kw):
        out = capacity_ref(cfg, gpu_memory_gib, max_model_len, **kw)
        return out | {"max_requests": out["tokens"] // max_model_len}

    fails(wrong, "max_requests", "not rounded up")


def test_wrong_shape_of_result():
    fails(lambda *a, **k: (1, 2, 3), "expected a dict with exactly the keys")


def test_the_stub():
    def stub(cfg, gpu_memory_gib, max_model_len, **kw):
        raise NotImplementedError("exercise 2")

    fails(stub, "NotImplementedError", reason="not done")


def test_the_answer_itself_is_refused():
    fails(kv_capacity, "course's own answer")


def test_blocks_rounded_to_nearest():
    """round() instead of floor: a cache cannot hold a block it has no bytes for."""
    def wrong(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16, kv_dtype_bytes=2,
              weight_dtype_bytes=2, reserve_gib=0.0):
        kv = gpu_memory_utilization * gpu_memory_gib * GIB - param_count(cfg) * weight_dtype_bytes - reserve_gib * GIB
        blocks = max(0, round(kv / (block_size * kv_bytes_per_token(cfg, kv_dtype_bytes))))
        return {"num_blocks": blocks, "tokens": blocks * block_size,
                "max_requests": blocks // -(-max_model_len // block_size)}

    fails(wrong, "num_blocks")


def test_cache_sized_with_the_weights_dtype():
    """The cache's bytes per value taken from weight_dtype_bytes (an fp8 cache under bf16 weights)."""
    def wrong(cfg, gpu_memory_gib, max_model_len, *, kv_dtype_bytes=2, weight_dtype_bytes=2, **kw):
        return capacity_ref(cfg, gpu_memory_gib, max_model_len, kv_dtype_bytes=weight_dtype_bytes,
                            weight_dtype_bytes=weight_dtype_bytes, **kw)

    fails(wrong, "num_blocks")


def test_reserve_ignored():
    def wrong(cfg, gpu_memory_gib, max_model_len, *, reserve_gib=0.0, **kw):
        return capacity_ref(cfg, gpu_memory_gib, max_model_len, **kw)

    fails(wrong, "num_blocks")


def test_the_unguarded_answer_is_refused_too():
    def sneaky(cfg, gpu_memory_gib, max_model_len, **kw):
        return unguarded(kv_capacity)(cfg, gpu_memory_gib, max_model_len, **kw)

    with course_checks_its_answers(False):  # as a learner's notebook runs it
        fails(sneaky, "course's own answer")
