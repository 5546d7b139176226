"""The interactive planner (chapter 14) without a browser: the strings it shows on known cases, the
tables its page embeds against labsupport's, its arguments, and the ipywidgets version.
The browser side (the page's JavaScript against these strings) is tests/book/test_planner_page.py."""

from __future__ import annotations

import json
import math
import re
from importlib import resources
from pathlib import Path

import pytest

from labsupport import planner_widget as pw
from labsupport import planning
from labsupport.costs import kv_bytes_per_token, param_count
from labsupport.hardware import GPUS, get_gpu
from labsupport.models import get_model

ROOT = Path(__file__).resolve().parents[1]


def direct_plan(**settings) -> planning.Plan:
    """planning.plan called by hand with the widget's units converted, as a reader would."""
    s = {**pw.DEFAULTS, **settings}
    w, kv = pw.PRECISIONS[s["precision"]]
    return planning.plan(
        s["model"],
        s["gpu"],
        arrival_rate=s["rate"],
        prompt_tokens=s["prompt"],
        output_tokens=s["output"],
        ttft_target_s=s["ttft_ms"] / 1000,
        tpot_target_s=s["tpot_ms"] / 1000,
        bandwidth_efficiency=s["bandwidth_pct"] / 100,
        compute_efficiency=s["compute_pct"] / 100,
        step_overhead_s=s["overhead_ms"] / 1000,
        weight_dtype_bytes=w,
        kv_dtype_bytes=kv,
        tensor_parallel=s["tp"],
        gpu_hour_price=s["price"] or None,
    )


# --- display_values on known cases --------------------------------------------------------------


def test_the_starting_point_shows_the_planners_numbers():
    p, v = pw.compute()
    assert p == direct_plan()
    assert p.feasible and p.meets_ttft and p.gpus_per_replica == 2
    assert v["replicas"] == str(p.replicas) and v["batch"] == str(p.batch)
    assert v["replicas-note"] == f"{p.gpus} GPUs, 2 per replica"
    assert v["batch-note"] == f"TPOT allows {p.batch_for_tpot}, memory {p.batch_in_memory}"
    assert v["concurrency"] == f"{p.concurrency:.1f} requests"
    assert v["concurrency-note"] == f"10 requests/s x {p.time_in_system_s:.2f} s in the system"
    assert v["utilisation"] == f"{p.utilisation * 100:.0f}%"
    assert v["tpot"] == f"{p.tpot_s * 1e3:.1f} ms" and v["ttft"] == f"{p.ttft_s * 1e3:.1f} ms"
    assert v["ttft-note"] == "meets the 1.00 s target"
    assert v["cost"] == f"{p.cost_per_million_tokens:.3f}"  # between 0.1 and 1: three decimals
    assert v["throughput"] == "2,500 tok/s out" and v["throughput-note"] == "12,500 tok/s prompt and output"
    # the KV cache line, in GiB as the planner counts capacity
    kv = p.batch * 1250 * kv_bytes_per_token(get_model("llama-3.1-70b"))
    assert p.kv_cache_bytes == kv
    assert f"{kv / 2**30:.1f} GiB of the" in v["memory"] and f"room for {p.batch_in_memory}." in v["memory"]
    assert (
        v["verdict"]
        == f"{p.replicas} replicas of 2 x H200 ({p.gpus} GPUs) carry 10 requests/s within both targets."
    )
    assert v["device"].startswith("Llama 3.1 70B, bf16, on 2 x H200 per replica: ")


def test_weights_that_do_not_fit_give_no_plan_and_say_why():
    p, v = pw.compute(tp=1)  # 131 GiB of bf16 weights against 90% of one H200's 140 GiB
    assert not p.feasible and p.batch_in_memory == 0 and p.batch_for_tpot >= 1
    assert v["replicas"] == v["batch"] == v["cost"] == v["tpot"] == "none"
    assert v["memory"].startswith(
        "The weights (131.4 GiB) and one sequence of 1,250 tokens do not fit in 126.4 GiB"
    )
    assert v["verdict"] == "No replica can meet these targets: the weights and one sequence do not fit."


def test_a_tpot_target_no_batch_meets():
    p, v = pw.compute(tpot_ms=5)
    assert not p.feasible and p.batch_for_tpot == 0 and p.batch_in_memory >= 1
    assert (
        v["batch-tpot"]
        == "Even one sequence misses the 5.0 ms TPOT target: a decode step reads every weight."
    )
    assert v["memory"].startswith(f"Memory has room for {p.batch_in_memory} sequences of 1,250 tokens")
    assert v["verdict"].endswith("the TPOT target is too tight.")


def test_tensor_parallel_multiplies_the_gpus_and_the_memory():
    p2, _ = pw.compute(tp=2)
    p8, v8 = pw.compute(tp=8)
    assert p8.gpus == 8 * p8.replicas and p8.memory_budget_bytes == pytest.approx(4 * p2.memory_budget_bytes)
    assert p8.batch_in_memory > p2.batch_in_memory and p8 == direct_plan(tp=8)
    assert v8["replicas-note"] == f"{p8.gpus} GPUs, 8 per replica"


def test_a_missed_ttft_target_is_named():
    p, v = pw.compute(ttft_ms=50)
    assert p.feasible and not p.meets_ttft
    assert v["ttft-note"] == "misses the 50.0 ms target"
    assert "but the predicted TTFT misses its target" in v["verdict"]


def test_one_replica_and_no_price():
    p, v = pw.compute(model="llama-3.1-8b", tp=1, rate=0.2, price=0)
    assert p.replicas == 1 and p.cost_per_million_tokens is None
    assert "1 replica of 1 x H200 (1 GPU) carries 0.2 requests/s" in v["verdict"]
    assert v["cost"] == "no price"


def test_precisions_change_the_bytes():
    for name, (w, kv) in pw.PRECISIONS.items():
        p, v = pw.compute(precision=name, tp=1)
        assert p.weight_bytes == param_count(get_model("llama-3.1-70b")) * w
        assert p.kv_bytes_per_token == kv_bytes_per_token(get_model("llama-3.1-70b"), kv)
        assert f", {name}, on 1 x H200" in v["device"]
    assert pw.PRECISIONS["int4 weights (group 128), bf16 cache"][0] == 0.515625  # 4/8 + 2/128


def test_formatting_rounds_like_javascript():
    # toFixed rounds an exact binary tie away from zero; Python's format() rounds it to even
    assert pw._plain(0.125) == "0.13" and f"{0.125:.2f}" == "0.12"
    assert pw._plain(10) == "10" and pw._plain(2.50) == "2.5" and pw._plain(12345.678) == "12,345.68"
    assert pw.format_gib(2**30 * 139.75) == "139.8 GiB" and pw.format_gib(2**30 * 1.125) == "1.13 GiB"
    assert pw.format_cost(0.04216) == "0.0422" and pw.format_cost(0.5) == "0.500"
    assert pw.format_cost(12.345) == "12.35" and pw.format_cost(12345.6) == "12,346"
    assert pw.format_tokens_per_s(2500) == "2,500 tok/s" and pw.format_tokens_per_s(2.25) == "2.3 tok/s"


# --- the page's tables and script ---------------------------------------------------------------


def _block(snippet: str, name: str):
    return json.loads(
        re.search(rf'<script type="application/json" data-pl="{name}">(.*?)</script>', snippet).group(1)
    )


def test_embedded_tables_come_from_labsupport():
    snippet = pw.static_html(element_id="c14p-test")
    data = _block(snippet, "data")
    assert data == json.loads(json.dumps(pw.planner_data()))
    assert _block(snippet, "start") == pw.DEFAULTS
    assert set(data["models"]) == set(pw.MODELS) and set(data["cards"]) == set(GPUS)
    for name in pw.MODELS:
        cfg, m = get_model(name), data["models"][name]
        assert (
            m["params"] == param_count(cfg) and m["n_layers"] == cfg.n_layers and m["q_width"] == cfg.q_width
        )
        assert m["kv_values_per_token"] * 2 == kv_bytes_per_token(cfg, 2)
    for name, gpu in GPUS.items():
        card = data["cards"][name]
        assert (card["peak_flops"], card["bandwidth"], card["usable_bytes"]) == (
            gpu.peak_flops,
            gpu.hbm_bandwidth,
            gpu.usable_bytes,
        )
    assert data["memory_utilization"] == planning.DEFAULT_MEMORY_UTILIZATION
    assert data["max_batch_search"] == planning.MAX_BATCH_SEARCH and data["gib"] == 2**30
    assert {k: tuple(v) for k, v in data["precisions"].items()} == pw.PRECISIONS
    assert set(data["fp8_weights"]) <= set(pw.PRECISIONS)
    for name, gpu in GPUS.items():
        assert data["cards"][name]["fp8_peak_flops"] == gpu.fp8_peak_flops
    for name in pw.MODELS:
        cfg, m = get_model(name), data["models"][name]
        assert (m["vocab_size"], m["d_model"], m["tied"]) == (cfg.vocab_size, cfg.d_model, cfg.tied_embeddings)


def test_the_cost_at_saturation_is_shown():
    p, v = pw.compute()
    assert v["cost-saturation"] == pw.format_cost(p.cost_per_million_tokens * p.utilisation)
    assert v["cost-saturation-note"].startswith(pw.format_cost(p.cost_per_million_output_tokens_at_saturation))
    assert v["tpot-note"].startswith("the mean: ")
    assert "all-reduces between the 2 GPUs are not modelled" in v["device"]
    assert pw.compute(price=0)[1]["cost-saturation"] == "no price"
    assert pw.compute(tp=1)[1]["cost-saturation"] == "none"


def test_fp8_weights_run_fp8_matmuls_where_the_gpu_has_them():
    hopper, _ = pw.compute(precision="fp8 weights, bf16 cache", tp=1)
    ampere, _ = pw.compute(precision="fp8 weights, bf16 cache", tp=1, gpu="A100 80GB")
    assert hopper.matmul_peak_flops == get_gpu("H200").fp8_peak_flops
    assert ampere.matmul_peak_flops == get_gpu("A100 80GB").peak_flops  # no FP8 tensor cores: dequantised
    assert "Matmuls in FP8, at its 1,979 TFLOP/s" in pw.compute(precision="fp8 weights, bf16 cache", tp=1)[1]["device"]


def test_the_burst_quantile_constant_reproduces_the_planners():
    """Above a mean of 1e5 the planner uses a normal approximation; the page carries its z."""
    z = pw.planner_data()["burst_z"]
    for mean in (100_001.5, 3.2e6, 7.77e7):
        assert max(0, math.ceil(mean + z * math.sqrt(mean) - 0.5)) == planning.poisson_quantile(mean, 99)


def test_the_default_efficiencies_are_chapter_05s_measurements():
    results = planning.load_gpu_results()
    calibration = planning.measured_h200_calibration(results)
    if calibration is None:
        pytest.skip("no measured run in results/gpu_phases.json")
    assert calibration.device == pw.MEASURED_DEVICE and calibration.date.startswith(pw.MEASURED_DATE)
    assert round(calibration.bandwidth_efficiency * 100) == pw.MEASURED_BANDWIDTH_PCT
    assert round(calibration.step_overhead_s * 1e3, 2) == pw.MEASURED_OVERHEAD_MS
    assert round(calibration.compute_efficiency * 100) == pw.MEASURED_COMPUTE_PCT


def test_static_snippet_is_self_contained_and_inlines_the_package_files():
    snippet = pw.static_html(element_id="c14p-test")
    assert "http" not in snippet and "<script src" not in snippet and "<link" not in snippet
    assert snippet.count("<script>") == 1 and 'id="c14p-test"' in snippet
    static = resources.files("labsupport").joinpath("planner_static")
    js, css = (static.joinpath(name).read_text() for name in ("planner.js", "planner.css"))
    assert "function labsupportPlanner(root)" in js and ".c14p-planner" in css
    assert js in snippet and css in snippet
    # the starting numbers are in the HTML itself, before any script runs
    _, v = pw.compute()
    for key in ("replicas", "batch", "concurrency", "cost", "memory"):
        assert f'data-out="{key}">{v[key]}<' in snippet
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "planner_static/*.js" in pyproject and "planner_static/*.css" in pyproject


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"model": "tiny-2m"}, "model"),
        ({"gpu": "B200"}, "gpu"),
        ({"tp": 3}, "tp"),
        ({"precision": "fp4"}, "precision"),
        ({"rate": -1}, "rate"),
        ({"bandwidth_pct": 120}, "bandwidth_pct"),
        ({"compute_pct": 0}, "compute_pct"),
        ({"prompt": "long"}, "prompt"),
        ({"speed": 3}, "speed"),
        ({"element_id": "a b<"}, "element_id"),
    ],
)
def test_static_snippet_checks_its_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        pw.static_html(**kwargs)


def test_zero_rate_is_refused_by_the_planner():
    with pytest.raises(ValueError, match="arrival_rate"):
        pw.compute(rate=0)


def test_the_plots_curve_is_the_planners_decode_step():
    p, _ = pw.compute()
    curve = pw.step_curve(p, {})
    batches = [b for b, _ in curve]
    assert batches == [2**i for i in range(len(batches))] and batches[-1] >= 2 * p.batch_in_memory
    h200 = get_gpu("H200")
    b, t = curve[5]
    assert t == planning.decode_step_time(
        "llama-3.1-70b",
        b,
        p.step_context_tokens,
        bandwidth_gb_s=h200.hbm_bandwidth / 1e9,
        peak_tflops=h200.peak_flops / 1e12,
        bandwidth_efficiency=0.83,
        compute_efficiency=0.58,
        step_overhead_s=0.00334,
        tensor_parallel=2,
        read_exact=True,  # the bytes a step reads, as the plan prices them
    )
    assert all(a[1] < c[1] for a, c in zip(curve, curve[1:]))  # a larger batch takes longer


# --- the live ipywidgets version ----------------------------------------------------------------


def test_live_planner_builds_and_updates():
    app = pw.LivePlanner()
    assert app.values == pw.compute()[1]
    assert app.values["verdict"] in app.results.value and app.values["cost"] in app.results.value
    assert app.figure.value[:8] == b"\x89PNG\r\n\x1a\n"
    first_png = app.figure.value

    app.controls["tp"].value = 8  # a control change updates by itself
    assert app.plan == direct_plan(tp=8) and app.values == pw.compute(tp=8)[1]
    assert app.figure.value != first_png

    app.controls["tpot_ms"].value = 5  # no batch meets it: the widget says so
    assert not app.plan.feasible and "too tight" in app.results.value

    app.controls["rate"].value = 0  # bad input: a message, not a traceback
    assert app.update() is None and "arrival_rate" in app.results.value
    app.controls["rate"].value = 2.5
    app.controls["tpot_ms"].value = 50
    assert app.update() == direct_plan(tp=8, rate=2.5)


def test_show_displays_the_widget(capsys):
    pw.show(model="llama-3.1-8b", tp=1)
    assert "VBox" in capsys.readouterr().out
