"""The phase model (labsupport.serving): the source explainer's figures, the conventions behind
them, properties a roofline model must have, and argument checking."""

from __future__ import annotations

import math

import pytest

from labsupport import costs, serving
from labsupport.hardware import get_gpu
from labsupport.models import get_model
from labsupport.serving import Conventions

M70 = get_model("llama-3.1-70b")


@pytest.fixture(scope="module")
def source():
    return serving.phases()


# --- the source's figures: Llama 3 70B bf16, 4x A100 40GB, 1K prompt, 128 out, batch 1 ---------


def test_defaults_are_the_source_setting(source):
    assert source.model == "llama-3.1-70b"
    assert source.gpu == "4x A100 40GB"
    assert (source.prompt_tokens, source.output_tokens, source.batch) == (1024, 128, 1)
    assert source.conventions == Conventions()


def test_time_to_first_token(source):
    assert f"{source.ttft * 1e3:.1f}" == "114.9"
    assert source.prefill.bound == "compute"


def test_inter_token_latency(source):
    assert f"{source.itl * 1e3:.1f}" == "23.4"
    assert source.decode.bound == "memory"


def test_request_latency(source):
    assert f"{source.request_latency:.2f}" == "3.11"


def test_throughput(source):
    assert f"{source.throughput:.0f}" == "43"


def test_prefill_worth_decode_steps(source):
    assert f"{source.prefill_in_decode_steps:.1f}" == "4.9"


def test_roofline_placement(source):
    assert f"{source.ridge_point:.0f}" == "208"
    assert f"{source.peak_flops / 1e15:.2f}" == "1.25"
    assert source.hbm_bandwidth == pytest.approx(6e12)
    assert f"{source.prefill.intensity:.0f}" == "1022"
    assert f"{100 * source.prefill.fraction_of_peak:.0f}" == "100"
    assert f"{source.decode.intensity:.1f}" == "1.0"
    assert f"{100 * source.decode.fraction_of_peak:.1f}" == "0.5"


def test_decode_needs_hundreds_of_requests_to_reach_the_ridge():
    # "decode does not cross the ridge until 512 requests" (the batch slider steps in powers of two)
    b = serving.decode_ridge_batch(M70)
    assert 256 < b <= 512
    assert serving.decode_step(M70, batch=256).bound == "memory"
    assert serving.decode_step(M70, batch=512).bound == "compute"
    # "holding 512 of them takes 182 GB of cache" (at the midpoint context the steps are costed at)
    mid = 512 * serving.decode_context(1024, 128) * costs.kv_bytes_per_token(M70)
    assert f"{mid / 1e9:.0f}" == "182"
    # "give each request 4K instead and it never crosses at all"
    assert serving.decode_ridge_batch(M70, prompt_tokens=4096) == math.inf
    assert serving.decode_step(M70, prompt_tokens=4096, batch=2**20).bound == "memory"


def test_short_prompts_leave_prefill_on_the_memory_slope():
    # "below roughly two hundred tokens ... even prefill falls onto the memory slope"
    assert f"{serving.prefill_ridge_tokens(M70):.0f}" == "208"
    assert serving.prefill(M70, prompt_tokens=128).bound == "memory"
    assert serving.prefill(M70, prompt_tokens=256).bound == "compute"


def test_kv_cache_and_fit(source):
    assert source.weight_bytes == 140e9
    assert source.kv_cache_bytes == 1 * (1024 + 128) * 327_680
    assert source.free_bytes == pytest.approx(20e9)
    assert source.fits
    assert not serving.phases(batch=64).fits  # 64 x 1,152 tokens x 320 KiB = 24 GB > 20 GB
    big = serving.phases("llama-3.1-405b", serving.serving_gpu("A100 40GB", 1))
    assert big.free_bytes < 0 and not big.fits


# --- the conventions behind those figures, and what the alternatives give ----------------------


def test_source_uses_the_nominal_parameter_count():
    assert serving.model_params(M70) == 70e9
    assert serving.model_params(M70, "counted") == costs.param_count(M70)
    counted = serving.phases(conventions=Conventions(params="counted"))
    assert f"{counted.ttft * 1e3:.1f}" == "115.8"  # not the source's 114.9


def test_source_prompt_is_1024_tokens():
    assert f"{serving.time_to_first_token(M70, prompt_tokens=1000) * 1e3:.1f}" == "112.2"  # not 114.9


def test_source_bandwidth_is_6_tb_per_s_for_four_cards():
    assert serving.serving_gpu().hbm_bandwidth == pytest.approx(6e12)
    assert serving.serving_gpu().peak_flops == pytest.approx(4 * 312e12)
    sheet = serving.serving_gpu(bandwidth="datasheet")
    assert sheet.hbm_bandwidth == pytest.approx(4 * get_gpu("A100 40GB").hbm_bandwidth)
    assert f"{serving.inter_token_latency(M70, sheet) * 1e3:.1f}" == "22.6"  # not 23.4
    # a card the source does not quote is the datasheet's either way
    assert serving.serving_gpu("H100 SXM", 2) == serving.serving_gpu("H100 SXM", 2, "datasheet")
    assert serving.serving_gpu("H100 SXM", 2) == get_gpu("H100 SXM").times(2)


def test_decode_is_costed_at_the_midpoint_of_the_context():
    assert serving.decode_context(1024, 128) == 1087.5  # mean of 1024 ... 1151
    kv = costs.kv_bytes_per_token(M70)
    for where, context in (("midpoint", 1087.5), ("start", 1024), ("end", 1151)):
        step = serving.decode_step(M70, conventions=Conventions(decode_context=where))
        assert step.bytes == 140e9 + context * kv
    # the cache adds enough at the midpoint to make 23.4 rather than weights-only 23.3
    assert f"{140e9 / 6e12 * 1e3:.1f}" == "23.3"


def test_request_latency_counts_output_steps():
    r = serving.phases()
    assert r.request_latency == pytest.approx(r.ttft + 128 * r.itl)
    strict = serving.phases(conventions=Conventions(decode_steps="output-1"))
    assert strict.request_latency == pytest.approx(r.ttft + 127 * r.itl)
    assert f"{strict.request_latency:.2f}" == "3.09"
    assert serving.decode_steps(1, Conventions(decode_steps="output-1")) == 0


def test_throughput_is_decode_rate_across_the_batch():
    r = serving.phases(batch=8)
    assert r.throughput == pytest.approx(8 / r.itl)
    per_request = serving.phases(conventions=Conventions(throughput="request"))
    assert per_request.throughput == pytest.approx(128 / per_request.request_latency)
    assert f"{per_request.throughput:.0f}" == "41"


def test_attention_flops_option():
    plain = serving.prefill(M70, prompt_tokens=4096, batch=2)
    full = serving.prefill(M70, prompt_tokens=4096, batch=2, conventions=Conventions(attention="full"))
    causal = serving.prefill(M70, prompt_tokens=4096, batch=2, conventions=Conventions(attention="causal"))
    attention = 2 * costs.prefill_attention_flops(M70, 4096)
    assert full.flops == pytest.approx(plain.flops + attention)
    assert causal.flops == pytest.approx(plain.flops + attention / 2)
    assert full.bytes == plain.bytes
    step = serving.decode_step(M70, batch=4, conventions=Conventions(attention="full"))
    assert step.flops == pytest.approx(4 * 2 * 70e9 + 4 * 4 * 80 * 1087.5 * 8192)


# --- properties ----------------------------------------------------------------------------------

BATCHES = [1, 2, 4, 8, 16, 64, 256, 1024]
PROMPTS = [64, 256, 1024, 4096, 32768]


def test_monotone_in_batch():
    reports = [serving.phases(batch=b) for b in BATCHES]
    for a, b in zip(reports, reports[1:]):
        assert b.ttft >= a.ttft
        assert b.itl >= a.itl
        assert b.request_latency >= a.request_latency
        assert b.throughput > a.throughput
        assert b.decode.intensity > a.decode.intensity
        assert b.decode.fraction_of_peak >= a.decode.fraction_of_peak
        assert b.kv_cache_bytes == pytest.approx(a.kv_cache_bytes * b.batch / a.batch)


def test_monotone_in_prompt_and_output():
    reports = [serving.phases(prompt_tokens=p) for p in PROMPTS]
    for a, b in zip(reports, reports[1:]):
        assert b.ttft > a.ttft
        assert b.itl > a.itl
        assert b.prefill.intensity > a.prefill.intensity
        assert b.decode.intensity < a.decode.intensity  # more cache to read per FLOP
    outputs = [serving.phases(output_tokens=o) for o in (1, 16, 128, 1024)]
    for a, b in zip(outputs, outputs[1:]):
        assert b.ttft == a.ttft
        assert b.itl > a.itl
        assert b.request_latency > a.request_latency


def test_more_cards_never_slower():
    times = [serving.phases(gpu=serving.serving_gpu(count=n)) for n in (1, 2, 4, 8)]
    for a, b in zip(times, times[1:]):
        assert b.ttft < a.ttft and b.itl < a.itl
        assert b.ridge_point == pytest.approx(a.ridge_point)


def test_roofline_is_a_ceiling():
    for b in BATCHES:
        for p in PROMPTS:
            r = serving.phases(prompt_tokens=p, batch=b)
            for phase in (r.prefill, r.decode):
                roof = min(r.peak_flops, phase.intensity * r.hbm_bandwidth)
                assert phase.attained_flops == pytest.approx(roof)
                assert 0 < phase.fraction_of_peak <= 1 + 1e-12
                assert phase.time == max(phase.flops / r.peak_flops, phase.bytes / r.hbm_bandwidth)


def test_functions_agree_with_phases():
    args = (M70, serving.serving_gpu("H100 SXM", 2), 2048, 256, 16)
    r = serving.phases(*args)
    assert serving.time_to_first_token(M70, args[1], 2048, 16) == r.ttft
    assert serving.inter_token_latency(*args) == r.itl
    assert serving.request_latency(*args) == r.request_latency
    assert serving.throughput(*args) == r.throughput
    assert serving.kv_cache_bytes(M70, 2048, 256, 16) == r.kv_cache_bytes


def test_accepts_several_cards_and_names():
    r = serving.phases("llama-3.1-8b", get_gpu("H200").times(2), 2048, 64, 4)
    assert r.gpu == "2x H200" and r.peak_flops == pytest.approx(2 * 989.4e12)
    assert serving.phases("llama-3.1-8b", "H200").gpu == "H200"
    tiny = serving.phases("tiny-2m", "T4", 64, 8, 1, Conventions(params="counted"))
    assert tiny.ttft > 0


# --- argument checking ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"prompt_tokens": 0}, "prompt_tokens"),
        ({"prompt_tokens": 1.5}, "prompt_tokens"),
        ({"output_tokens": -1}, "output_tokens"),
        ({"output_tokens": True}, "output_tokens"),
        ({"batch": 0}, "batch"),
        ({"batch": "8"}, "batch"),
        ({"model": 70}, "model"),
        ({"model": "llama-9"}, "unknown model"),
        ({"gpu": 4}, "gpu"),
        ({"gpu": "B300"}, "unknown GPU"),
        ({"conventions": "source"}, "conventions"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        serving.phases(**kwargs)


@pytest.mark.parametrize(
    "field, value",
    [
        ("params", "exact"),
        ("decode_context", "middle"),
        ("decode_steps", "output+1"),
        ("throughput", "peak"),
        ("attention", True),
        ("weight_dtype_bytes", 0),
        ("kv_dtype_bytes", -2),
    ],
)
def test_bad_conventions_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        Conventions(**{field: value})


def test_bad_gpu_setup_is_named():
    with pytest.raises(ValueError, match="count"):
        serving.serving_gpu(count=0)
    with pytest.raises(ValueError, match="bandwidth"):
        serving.serving_gpu(bandwidth="rounded")
    with pytest.raises(ValueError, match="unknown GPU"):
        serving.serving_gpu("A100 96GB")


def test_nominal_size_needs_a_published_one():
    with pytest.raises(ValueError, match="params='counted'"):
        serving.model_params(get_model("tiny-2m"))
    with pytest.raises(ValueError, match="params"):
        serving.model_params(M70, "rounded")


def test_conventions_still_read_under_their_old_names():
    conv = Conventions(weight_dtype_bytes=1, kv_dtype_bytes=4)
    assert (conv.weight_bytes, conv.kv_bytes) == (1, 4)
    assert Conventions(weight_bytes=1, kv_bytes=4) == conv != Conventions()
