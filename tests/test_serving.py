"""The phase model (labsupport.serving): the source explainer's figures, the conventions behind
them, properties a roofline model must have, and argument checking."""

from __future__ import annotations

import dataclasses
import math

import pytest

from labsupport import costs, serving
from labsupport.hardware import get_gpu
from labsupport.models import get_model
from labsupport.serving import Conventions

M70 = get_model("llama-3.1-70b")


@pytest.fixture(scope="module")
def start():
    return serving.phases()


@pytest.fixture(scope="module")
def source():
    """The source explainer's own conventions: one merged point per phase, attention FLOPs left out."""
    return serving.phases(conventions=serving.SOURCE)


# --- the starting setting: Llama 3 70B bf16, 4x A100 40GB, 1K prompt, 128 out, batch 1 ----------


def test_defaults_are_the_source_setting_with_the_course_conventions(start):
    assert start.model == "llama-3.1-70b"
    assert start.gpu == "4x A100 40GB"
    assert (start.prompt_tokens, start.output_tokens, start.batch) == (1024, 128, 1)
    assert start.conventions == Conventions() == serving.DEFAULT
    assert (start.conventions.roofline, start.conventions.attention) == ("per-kernel", "causal")
    assert (serving.SOURCE.roofline, serving.SOURCE.attention) == ("merged", "none")


def test_every_gpu_figure_comes_from_the_hardware_table(start):
    a100 = get_gpu("A100 40GB")
    assert start.hbm_bandwidth == 4 * a100.hbm_bandwidth and start.peak_flops == 4 * a100.peak_flops
    assert start.memory_bytes == 4 * a100.memory_bytes == 160 * 2**30
    assert not hasattr(serving, "SOURCE_BANDWIDTH")


def test_per_kernel_times_are_summed(start):
    for phase in (start.prefill, start.decode):
        assert [k.name for k in phase.kernels] == ["weight matmuls", "attention"]
        assert phase.time == sum(max(k.flops / k.peak_flops, k.bytes / k.hbm_bandwidth) for k in phase.kernels)
        # never faster than one merged point, which lets one kernel's slack hide the other's time
        assert phase.time >= max(phase.compute_time, phase.memory_time) * (1 - 1e-12)
    pre, dec = start.prefill, start.decode
    # prefill: the matmuls are compute-bound at 1K tokens; causal attention is too. Its intensity is
    # 2P^2d FLOPs over the cached K and V (4Pd/g bytes) plus Q read and O written (4Pd bytes):
    # P*g/(2(g+1)), far below the P*g/2 that K and V alone would give
    assert pre.matmuls.bound == "compute" and pre.attention.bound == "compute"
    g = M70.group_size
    assert pre.attention.intensity == pytest.approx(1024 * g / (2 * (g + 1)))
    assert f"{start.ttft * 1e3:.1f}" == "116.0"  # 114.9 ms of matmuls + 1.1 ms of attention
    # decode: both memory-bound; attention's intensity is the GQA group size (bf16 cache)
    assert dec.matmuls.bound == "memory" and dec.attention.bound == "memory"
    assert dec.attention.intensity == pytest.approx(M70.group_size, rel=0.01)  # plus Q and O: just under
    assert f"{start.itl * 1e3:.1f}" == "22.6"


def test_source_conventions_reproduce_its_prefill(source):
    # the source's 114.9 ms: 2 * 70e9 * 1024 FLOPs at 4 x 312 TFLOP/s (its 23.4 ms ITL used a
    # bandwidth rounded down to 6 TB/s; with the datasheet's it is 22.6 ms)
    assert f"{source.ttft * 1e3:.1f}" == "114.9"
    assert source.prefill.bound == "compute" and source.decode.bound == "memory"
    assert f"{source.itl * 1e3:.1f}" == "22.6"
    assert source.prefill.time == max(source.prefill.compute_time, source.prefill.memory_time)


def test_request_latency_and_throughput(start):
    assert start.request_latency == pytest.approx(start.ttft + 128 * start.itl)
    assert f"{start.request_latency:.2f}" == "3.00"
    assert f"{start.throughput:.0f}" == "44"
    assert f"{start.prefill_in_decode_steps:.1f}" == "5.1"


def test_roofline_placement(start):
    assert f"{start.ridge_point:.0f}" == "201"
    assert f"{start.peak_flops / 1e15:.2f}" == "1.25"
    assert f"{start.prefill.matmuls.intensity:.0f}" == "1022"
    assert f"{100 * start.prefill.matmuls.fraction_of_peak:.0f}" == "100"
    assert f"{start.decode.matmuls.intensity:.1f}" == "1.0"
    assert f"{100 * start.decode.matmuls.fraction_of_peak:.1f}" == "0.5"


def test_decode_matmuls_reach_the_ridge_near_the_ridge_point_whatever_the_context():
    b = serving.decode_ridge_batch(M70)
    ridge = serving.serving_gpu().ridge_point
    assert ridge < b < 1.01 * ridge  # bf16 weights: B = R*W/(2N - R*k), a hair above R
    assert serving.decode_ridge_batch(M70, prompt_tokens=32768) == b
    assert serving.decode_step(M70, batch=128).matmuls.bound == "memory"
    assert serving.decode_step(M70, batch=256).matmuls.bound == "compute"
    # attention stays memory-bound at any batch: its intensity is the group size
    for batch in (1, 256, 1024):
        step = serving.decode_step(M70, batch=batch)
        # its queries and output add 1/g of the cache read per token of context at this context
        assert step.attention.bound == "memory" and step.attention.intensity == pytest.approx(8, rel=0.01)
    assert serving.decode_step(M70, batch=256).bound == "mixed"


def test_the_merged_point_reaches_the_ridge_much_later_or_never():
    merged = serving.decode_ridge_batch(M70, conventions=serving.SOURCE)
    assert 400 < merged < 420  # the source's "512 requests" is the first slider stop past it
    assert serving.decode_ridge_batch(M70, prompt_tokens=4096, conventions=serving.SOURCE) == math.inf
    # yet per kernel, at that 4K prompt and batch 256, the matmuls are compute-bound
    assert serving.decode_step(M70, prompt_tokens=4096, batch=256).matmuls.bound == "compute"


def test_short_prompts_leave_prefill_matmuls_on_the_memory_slope():
    assert f"{serving.prefill_ridge_tokens(M70):.0f}" == "201"
    assert serving.prefill(M70, prompt_tokens=128).matmuls.bound == "memory"
    assert serving.prefill(M70, prompt_tokens=256).matmuls.bound == "compute"
    # below the ridge, prefilling a batch of short prompts together costs less per token
    one = serving.prefill(M70, prompt_tokens=64, batch=1).time
    four = serving.prefill(M70, prompt_tokens=64, batch=4).time
    assert four < 4 * one * 0.5


def test_kv_cache_and_fit(start):
    assert start.weight_bytes == 140e9
    assert start.kv_cache_bytes == 1 * (1024 + 128) * 327_680
    assert start.free_bytes == pytest.approx(160 * 2**30 - 140e9)
    assert start.fits
    assert serving.phases(batch=64).fits  # 64 x 1,152 tokens x 320 KiB = 24.2 GB < 31.8 GB
    assert not serving.phases(batch=128).fits
    big = serving.phases("llama-3.1-405b", serving.serving_gpu("A100 40GB", 1))
    assert big.free_bytes < 0 and not big.fits


# --- the conventions behind those figures, and what the alternatives give ----------------------


def test_source_uses_the_nominal_parameter_count():
    assert serving.model_params(M70) == 70e9
    assert serving.model_params(M70, "counted") == costs.param_count(M70)
    counted = serving.phases(conventions=Conventions(params="counted", roofline="merged", attention="none"))
    assert f"{counted.ttft * 1e3:.1f}" == "115.8"  # not the source's 114.9


def test_source_prompt_is_1024_tokens(source):
    ttft = serving.time_to_first_token(M70, prompt_tokens=1000, conventions=serving.SOURCE)
    assert f"{ttft * 1e3:.1f}" == "112.2"  # not 114.9


def test_decode_is_costed_at_the_midpoint_of_the_context():
    assert serving.decode_context(1024, 128) == 1087.5  # mean of 1024 ... 1151
    kv = costs.kv_bytes_per_token(M70)
    for where, context in (("midpoint", 1087.5), ("start", 1024), ("end", 1151)):
        step = serving.decode_step(M70, conventions=Conventions(decode_context=where))
        qo = 2 * M70.n_layers * M70.d_model * 2  # the new token's queries read and output written
        assert step.attention.bytes == context * kv + qo
        assert step.bytes == 140e9 + kv + context * kv + qo  # weights, the new token's cache, the cache


def test_request_latency_counts_output_steps(start):
    strict = serving.phases(conventions=Conventions(decode_steps="output-1"))
    assert strict.request_latency == pytest.approx(start.ttft + 127 * start.itl)
    assert serving.decode_steps(1, Conventions(decode_steps="output-1")) == 0


def test_throughput_is_decode_rate_across_the_batch():
    r = serving.phases(batch=8)
    assert r.throughput == pytest.approx(8 / r.itl)
    per_request = serving.phases(conventions=Conventions(throughput="request"))
    assert per_request.throughput == pytest.approx(128 / per_request.request_latency)
    assert f"{per_request.throughput:.0f}" == "43"


def test_attention_flops_option():
    plain = serving.prefill(M70, prompt_tokens=4096, batch=2, conventions=Conventions(attention="none"))
    full = serving.prefill(M70, prompt_tokens=4096, batch=2, conventions=Conventions(attention="full"))
    causal = serving.prefill(M70, prompt_tokens=4096, batch=2, conventions=Conventions(attention="causal"))
    attention = 2 * costs.prefill_attention_flops(M70, 4096)
    assert full.flops == pytest.approx(plain.flops + attention)
    assert causal.flops == pytest.approx(plain.flops + attention / 2)
    assert full.bytes == plain.bytes
    assert full.attention.flops == pytest.approx(attention) and plain.attention.flops == 0
    step = serving.decode_step(M70, batch=4, conventions=Conventions(attention="full"))
    assert step.flops == pytest.approx(4 * 2 * 70e9 + 4 * 4 * 80 * 1087.5 * 8192)
    assert step.attention.flops == serving.decode_step(M70, batch=4).attention.flops  # one query: no mask


# --- properties ----------------------------------------------------------------------------------

BATCHES = [1, 2, 4, 8, 16, 64, 256, 1024]
PROMPTS = [64, 256, 1024, 4096, 32768]


@pytest.mark.parametrize("conv", [serving.DEFAULT, serving.SOURCE], ids=["per-kernel", "merged"])
def test_monotone_in_batch(conv):
    reports = [serving.phases(batch=b, conventions=conv) for b in BATCHES]
    for a, b in zip(reports, reports[1:]):
        assert b.ttft >= a.ttft
        assert b.itl >= a.itl
        assert b.request_latency >= a.request_latency
        # past the ridge, per kernel, every kernel's time grows with the batch: throughput levels off
        assert b.throughput >= a.throughput * (1 - 1e-12)
        assert b.decode.intensity > a.decode.intensity
        assert b.decode.fraction_of_peak >= a.decode.fraction_of_peak * (1 - 1e-12)
        assert b.kv_cache_bytes == pytest.approx(a.kv_cache_bytes * b.batch / a.batch)


@pytest.mark.parametrize("conv", [serving.DEFAULT, serving.SOURCE], ids=["per-kernel", "merged"])
def test_monotone_in_prompt_and_output(conv):
    reports = [serving.phases(prompt_tokens=p, conventions=conv) for p in PROMPTS]
    for a, b in zip(reports, reports[1:]):
        assert b.ttft > a.ttft
        assert b.itl > a.itl
        assert b.prefill.intensity > a.prefill.intensity
        if conv.attention == "none":  # attention FLOPs left out: more cache to read per FLOP
            assert b.decode.intensity < a.decode.intensity
        else:  # counted: attention (intensity 8) outweighs more of the step
            assert b.decode.intensity > a.decode.intensity
    outputs = [serving.phases(output_tokens=o, conventions=conv) for o in (1, 16, 128, 1024)]
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
            for conv in (serving.DEFAULT, serving.SOURCE):
                r = serving.phases(prompt_tokens=p, batch=b, conventions=conv)
                points = [r.prefill, r.decode] if conv.roofline == "merged" else []
                points += [k for ph in (r.prefill, r.decode) for k in ph.kernels if k.flops > 0]
                for point in points:
                    roof = min(r.peak_flops, point.intensity * r.hbm_bandwidth)
                    assert point.attained_flops == pytest.approx(roof)
                    assert 0 < point.fraction_of_peak <= 1 + 1e-12
                    assert point.time == max(point.flops / r.peak_flops, point.bytes / r.hbm_bandwidth)
                for phase in (r.prefill, r.decode):  # summed kernels sit on or below the roof
                    assert phase.fraction_of_peak <= 1 + 1e-12


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
        ("roofline", "one point"),
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


def test_one_setting_is_checked_once_and_read_by_every_function():
    s = serving.Setting("llama-3.1-8b", "H100 SXM", 2048, 256, 16, Conventions(throughput="request"))
    assert s.model == get_model("llama-3.1-8b") and s.gpu == get_gpu("H100 SXM")  # names became rows
    assert serving.Setting() == serving.Setting(M70, serving.serving_gpu(), 1024, 128, 1, serving.DEFAULT)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batch = 2
    args = ("llama-3.1-8b", "H100 SXM", 2048, 256, 16, Conventions(throughput="request"))
    assert serving.phases(*args) == s.report()
    assert (serving.request_latency(*args), serving.throughput(*args)) == (s.request_latency, s.throughput)
    assert s.throughput == 16 * 256 / s.request_latency  # "request": the latency phases() reports
    with pytest.raises(ValueError, match="batch"):
        serving.Setting(batch=0)


def test_kernels_and_phases_share_one_roofline():
    r = serving.phases(batch=256)
    for point in (r.decode.matmuls, r.decode.attention, r.decode):
        assert isinstance(point, serving.RooflineCost)
        assert point.intensity == point.flops / point.bytes
        assert point.fraction_of_peak == point.flops / point.time / point.peak_flops
    merged = serving.phases(batch=256, conventions=serving.SOURCE).decode
    assert merged.time == max(merged.compute_time, merged.memory_time)
    dec = r.decode  # per kernel: the sum of the kernels' times, above the one merged point's
    assert dec.time == dec.matmuls.time + dec.attention.time > max(dec.compute_time, dec.memory_time)
