"""A learner cannot pass a check by handing in, wrapping or calling the course's own answer."""

from __future__ import annotations

import pytest
import torch

from labsupport import attention as A
from labsupport import costs, kvcache
from labsupport._answers import unguarded
from labsupport.checks import (
    CheckFailed,
    check_arithmetic_intensity,
    check_decode_bytes,
    check_kv_bytes_per_token,
    check_max_concurrency,
    check_naive_attention,
    check_online_softmax,
    check_prefill_flops,
)
from labsupport.checks.lab04_roofline import reference_intensity

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

HANDED_IN = {
    "naive attention: the spec": (check_naive_attention, lambda q, k, v, causal=False: A.attention_spec(q, k, v, causal)[0]),
    "naive attention: the reference": (check_naive_attention, A.naive_attention_reference),
    "online softmax: the reference": (check_online_softmax, A.online_softmax_reference),
    "online softmax: the flash reference": (check_online_softmax,
                                            lambda q, k, v, causal=False, block_n=64: A.flash_attention_reference(q, k, v, causal)),
    "kv bytes": (check_kv_bytes_per_token, costs.kv_bytes_per_token),
    "concurrency": (check_max_concurrency, kvcache.max_concurrency),
    "intensity": (check_arithmetic_intensity, reference_intensity),
    "intensity, the helper it uses": (check_arithmetic_intensity, __import__("labsupport.roofline").roofline.matmul_intensity),
    "prefill flops": (check_prefill_flops, lambda cfg, p, causal=False: costs.prefill_flops(cfg, p, causal)),
    "decode bytes": (check_decode_bytes, costs.decode_step_bytes),
}


@pytest.mark.parametrize("name", HANDED_IN)
def test_the_course_answer_is_rejected(name):
    check, fn = HANDED_IN[name]
    with pytest.raises(CheckFailed, match="the course's own answer"):
        check(fn)


def test_answers_work_normally_outside_a_check():
    q = k = v = torch.randn(1, 1, 4, 16)
    assert A.naive_attention_reference(q, k, v).shape == (1, 1, 4, 16)
    assert costs.kv_bytes_per_token.__wrapped__ is unguarded(costs.kv_bytes_per_token)


def test_using_another_exercise_answer_is_allowed():
    """max_concurrency may use the course's kv_bytes_per_token: only its own answer is banned."""
    def mine(cfg, gpu_memory_bytes, context_tokens, weight_bytes=2, kv_dtype_bytes=2, reserve_bytes=0):
        free = gpu_memory_bytes - costs.param_count(cfg) * weight_bytes - reserve_bytes
        per_seq = costs.kv_bytes_per_token(cfg, kv_dtype_bytes) * context_tokens
        return max(0, int(free // per_seq))

    check_max_concurrency(mine)


def test_private_sdpa_variants_are_forbidden_too():
    def sneaky(q, k, v, causal=False):
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=causal)[0]

    with pytest.raises(CheckFailed, match="scaled_dot_product_attention"):
        check_naive_attention(sneaky)
