"""The capacity planner, interactive: a workload and a deployment in; replicas, memory and cost out.

Two versions of one thing, both driven by :func:`labsupport.planning.plan` (chapter 14):

* :func:`show` (JupyterLab, needs a kernel): ipywidgets inputs, the planner's results and a
  matplotlib plot of the decode step against the batch, with the TPOT target across it.
  ``from labsupport.planner_widget import show; show()``.
* :func:`static_html` (the HTML book, no kernel): one self-contained HTML snippet with number
  inputs, selects, the results and an SVG plot. Its script and styles are the package files
  ``planner_static/planner.js`` and ``planner.css``, inlined (after the explainer's number
  formatting, ``explainer_static/number_format.js``; see :mod:`labsupport._static_widget`); the
  JavaScript re-implements
  :func:`labsupport.planning.plan` operation for operation (integer products exact, as Python's
  ints are), and reads its model and GPU tables from a JSON block generated here from
  :mod:`labsupport.models`, :mod:`labsupport.hardware` and :mod:`labsupport.costs`. It loads
  nothing from the network.

:func:`display_values` gives the exact strings both versions show for a setting; the browser test
compares the page with it. Numbers are rounded as JavaScript's ``toFixed`` does (ties away from
zero on the exact binary value; :func:`labsupport.explainer.format_seconds` and its siblings).

Units of the controls: targets and overhead in milliseconds, efficiencies in percent of the
datasheet figure, lengths as mean tokens per request, the price per GPU-hour in the reader's own
currency. Fixed, as :func:`~labsupport.planning.plan`'s defaults: memory sized at the 99th
percentile (for mean lengths that is the mean), 90% of each GPU's memory for weights and cache
(vLLM's ``gpu_memory_utilization``), replicas sized for the 99th percentile of Poisson
concurrency. One known limit: the Poisson percentile sums ``exp`` terms, and a browser's ``exp``
may differ from the C library's in the last bit; the two versions could then disagree on the
headroom when the cumulative probability lands within a few units in the last place of 0.99.
"""

from __future__ import annotations

import html
import io
import math

from . import _static_widget as widget
from . import planning
from .costs import kv_bytes_per_token, param_count
from .explainer import _fixed, _group, format_percent, format_seconds, model_label
from .hardware import GPUS, as_gpu
from .models import get_model

#: The models offered (the course's toy models left out), smallest first.
MODELS = [
    "qwen3-0.6b",
    "mistral-7b-v0.1",
    "qwen2-7b",
    "llama-3.1-8b",
    "qwen3-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
]

#: Precision choices: (bytes per weight, bytes per cached K or V element). int4 counts a bf16 scale
#: per group of 128 weights (chapter 09: 4/8 + 2/128 bytes a weight); it is applied to every
#: weight, as the planner counts weights (``param_count * weight_dtype_bytes``).
PRECISIONS: dict[str, tuple[float, float]] = {
    "bf16": (2, 2),
    "fp8 weights, bf16 cache": (1, 2),
    "fp8 weights and cache": (1, 1),
    "int4 weights (group 128), bf16 cache": (4 / 8 + 2 / 128, 2),
}
#: The precisions whose weights are FP8: on a GPU with FP8 tensor cores (Hopper, Ada) the planner
#: runs their matmuls at the FP8 peak (W8A8, as vLLM's fp8 quantisation does there); elsewhere the
#: weights are dequantised to 16 bits and the bf16 peak applies.
FP8_WEIGHTS = ("fp8 weights, bf16 cache", "fp8 weights and cache")
TENSOR_PARALLEL = [1, 2, 4, 8]

#: Efficiencies measured in chapter 05's H200 run (results/gpu_phases.json, 2026-11-30), as
#: planning.measured_h200_calibration fits them, rounded: decode bandwidth over the datasheet's and
#: the fixed cost per step (one line through the batch-1 CUDA-graph step and the largest batch, in
#: the bytes a step reads), and the median prefill rate over the dense bf16 peak.
#: tests/test_planner_widget.py checks them against the file.
MEASURED_BANDWIDTH_PCT = 83
MEASURED_COMPUTE_PCT = 58
MEASURED_OVERHEAD_MS = 3.34
MEASURED_DEVICE = "NVIDIA H200"  # the run they come from, as its results file names it
MEASURED_DATE = "2026-11-30"

#: The starting setting (keys as the page's ``data-control``). The price is an example figure,
#: not a quote: enter your own.
DEFAULTS = {
    "model": "llama-3.1-70b",
    "gpu": "H200",
    "precision": "bf16",
    "tp": 2,
    "rate": 10,
    "prompt": 1000,
    "output": 250,
    "ttft_ms": 1000,
    "tpot_ms": 50,
    "bandwidth_pct": MEASURED_BANDWIDTH_PCT,
    "compute_pct": MEASURED_COMPUTE_PCT,
    "overhead_ms": MEASURED_OVERHEAD_MS,
    "price": 4,
}
NUMBERS = (
    "rate",
    "prompt",
    "output",
    "ttft_ms",
    "tpot_ms",
    "bandwidth_pct",
    "compute_pct",
    "overhead_ms",
    "price",
)
#: Percentiles the widget holds fixed (planning.plan's defaults).
PERCENTILE = 99.0
BURST_PERCENTILE = 99.0

STEP_COLOUR = "#1c6dd0"
TARGET_COLOUR = "#d9480f"
MEMORY_COLOUR = "#6e7781"


# --- the strings both versions display --------------------------------------------------------


def _plain(x: float) -> str:
    """A number as typed, up to two decimals: 10 -> '10', 0.5 -> '0.5', 2.745 -> '2.75'."""
    text = _fixed(x, 2)
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return _group(text)


def _count(n: int) -> str:
    return _group(str(int(n)))


def format_gib(nbytes: float) -> str:
    """Binary gibibytes, as the planner counts capacity: 1.5e11 -> '139.7 GiB'."""
    gib = nbytes / planning.GIB
    return _group(_fixed(gib, 2 if gib < 10 else 1)) + " GiB"


def format_cost(value: float) -> str:
    """A price per million tokens: 0.0421 -> '0.0421'; 0.62 -> '0.620'; 12.3 -> '12.30'."""
    digits = 4 if value < 0.1 else 3 if value < 1 else 2 if value < 1000 else 0
    return _group(_fixed(value, digits))


def format_tokens_per_s(value: float) -> str:
    return _group(_fixed(value, 1 if value < 10 else 0)) + " tok/s"


def _plural(n: int, word: str) -> str:
    return f"{_count(n)} {word}" if n == 1 else f"{_count(n)} {word}s"


def display_values(p: planning.Plan, settings: dict) -> dict[str, str]:
    """Every string the planner shows for plan ``p`` made from ``settings`` (keys match ``data-out``)."""
    s = {**DEFAULTS, **settings}
    tp, gpu = p.gpus_per_replica, s["gpu"]
    rate = _plain(p.arrival_rate)
    budget_text = f"{_plain(planning.DEFAULT_MEMORY_UTILIZATION * 100)}% of {tp} x {gpu}"
    out = {
        "concurrency": _group(_fixed(p.concurrency, 1)) + " requests",
        "concurrency-note": f"{rate} requests/s x {format_seconds(p.time_in_system_s)} in the system",
        "headroom": (
            f"Headroom for bursts: +{format_percent(p.headroom)}, for the {BURST_PERCENTILE:g}th percentile of "
            "requests in the system under Poisson arrivals."
        ),
        "throughput": format_tokens_per_s(p.output_tokens_per_s) + " out",
        "throughput-note": format_tokens_per_s(p.total_tokens_per_s) + " prompt and output",
        "batch-tpot": (
            f"The TPOT target allows a batch of {_count(p.batch_for_tpot)} at {_count(p.step_context_tokens)} "
            "tokens of context"
            + (
                f", prefill taking {format_percent(p.prefill_share)} of each replica's time."
                if p.feasible
                else "."
            )
            if p.batch_for_tpot
            else f"Even one sequence misses the {format_seconds(p.tpot_target_s)} TPOT target: a decode step "
            "reads every weight."
        ),
        "plot-target": f"TPOT target {format_seconds(p.tpot_target_s)}",
        "plot-memory": f"memory holds {_count(p.batch_in_memory)}",
        "device": (
            f"{model_label(s['model'])}, {s['precision']}, on {tp} x {gpu} per replica: "
            f"{format_gib(p.weight_bytes)} of weights, {_count(p.kv_bytes_per_token)} bytes of KV cache a token."
            + (
                f" Matmuls in FP8, at its {_group(_fixed(p.matmul_peak_flops / 1e12, 0))} TFLOP/s dense FP8 peak."
                if p.matmul_peak_flops != as_gpu(gpu).peak_flops
                else ""
            )
            + (
                f" The all-reduces between the {tp} GPUs are not modelled: each step is a lower bound."
                if tp > 1
                else ""
            )
        ),
    }
    out["memory"] = _memory_text(p, budget_text)
    out.update(_plan_values(p, tp, gpu, rate) if p.feasible else _no_plan_values(p))
    return out


def _memory_text(p: planning.Plan, budget_text: str) -> str:
    """What memory holds: nothing past the weights, too little, or the batch's cache and the room left."""
    free = p.memory_budget_bytes - p.weight_bytes
    if p.batch_in_memory == 0:
        return (
            f"The weights ({format_gib(p.weight_bytes)}) and one sequence of {_count(p.memory_context_tokens)} tokens "
            f"do not fit in {format_gib(p.memory_budget_bytes)} ({budget_text}): more GPUs per replica or "
            "fewer bytes per element."
        )
    if not p.feasible:
        return (
            f"Memory has room for {_plural(p.batch_in_memory, 'sequence')} of {_count(p.memory_context_tokens)} "
            f"tokens: {format_gib(free)} left after the weights in {format_gib(p.memory_budget_bytes)} ({budget_text})."
        )
    return (
        f"KV cache for {_plural(p.batch, 'sequence')} of {_count(p.memory_context_tokens)} tokens: "
        f"{format_gib(p.kv_cache_bytes)} of the {format_gib(free)} left after the weights in "
        f"{format_gib(p.memory_budget_bytes)} ({budget_text}); room for {_count(p.batch_in_memory)}."
    )


def _plan_values(p: planning.Plan, tp: int, gpu: str, rate: str) -> dict[str, str]:
    """The results of a plan that meets the TPOT target, and its verdict."""
    out = {
        "replicas": _count(p.replicas),
        "replicas-note": f"{_plural(p.gpus, 'GPU')}, {tp} per replica",
        "batch": _count(p.batch),
        "batch-note": f"TPOT allows {_count(p.batch_for_tpot)}, memory {_count(p.batch_in_memory)}",
        "utilisation": format_percent(p.utilisation),
        "utilisation-note": "of the batch slots, on average",
        "tpot": format_seconds(p.tpot_s),
        "tpot-note": f"the mean: step {format_seconds(p.step_s)}, prefill turns included",
        "ttft": format_seconds(p.ttft_s),
        "ttft-note": f"{'meets' if p.meets_ttft else 'misses'} the {format_seconds(p.ttft_target_s)} target",
    }
    if p.cost_per_million_tokens is None:
        out["cost"], out["cost-note"] = "no price", "enter a GPU-hour price"
        out["cost-saturation"], out["cost-saturation-note"] = "no price", "enter a GPU-hour price"
    else:
        out["cost"] = format_cost(p.cost_per_million_tokens)
        out["cost-note"] = f"{format_cost(p.cost_per_million_output_tokens)} per million output tokens"
        out["cost-saturation"] = format_cost(p.cost_per_million_tokens_at_saturation)
        out["cost-saturation-note"] = (
            f"{format_cost(p.cost_per_million_output_tokens_at_saturation)} per million output tokens, "
            "every batch slot busy"
        )
    out["plot-batch"] = f"batch {_count(p.batch)}"
    what = f"{_plural(p.replicas, 'replica')} of {tp} x {gpu} ({_plural(p.gpus, 'GPU')}) "
    what += f"{'carries' if p.replicas == 1 else 'carry'} {rate} requests/s"
    out["verdict"] = (
        f"{what} within both targets."
        if p.meets_ttft
        else f"{what} within the TPOT target, but the predicted TTFT misses its target: more GPUs per replica."
    )
    return out


def _no_plan_values(p: planning.Plan) -> dict[str, str]:
    """The results when no replica meets the targets, and why."""
    out = {key: "none" for key in ("replicas", "batch", "utilisation", "tpot", "ttft", "cost", "cost-saturation")}
    out["replicas-note"] = "no replica meets the targets"
    out["batch-note"] = f"TPOT allows {_count(p.batch_for_tpot)}, memory {_count(p.batch_in_memory)}"
    out["utilisation-note"] = "nothing runs"
    out["tpot-note"] = f"target {format_seconds(p.tpot_target_s)}"
    out["ttft-note"] = f"target {format_seconds(p.ttft_target_s)}"
    out["cost-note"] = "no plan, no price"
    out["cost-saturation-note"] = "no plan, no price"
    out["plot-batch"] = "no batch meets both"
    out["verdict"] = "No replica can meet these targets: " + (
        "the weights and one sequence do not fit."
        if p.batch_in_memory == 0
        else "the TPOT target is too tight."
    )
    return out


# --- one setting, computed ---------------------------------------------------------------------


def _settings(settings: dict) -> dict:
    """Check a setting against the controls' choices; return it complete, as the page's JSON."""
    unknown = set(settings) - set(DEFAULTS)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(sorted(unknown))}; the settings are {', '.join(DEFAULTS)}"
        )
    s = {**DEFAULTS, **settings}
    for name, accepted in (
        ("model", MODELS),
        ("gpu", list(GPUS)),
        ("precision", list(PRECISIONS)),
        ("tp", TENSOR_PARALLEL),
    ):
        if s[name] not in accepted:
            raise ValueError(f"{name} must be one of {', '.join(map(str, accepted))}; got {s[name]!r}")
    for name in NUMBERS:
        value = s[name]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    for name in ("bandwidth_pct", "compute_pct"):
        if not 0 < s[name] <= 100:
            raise ValueError(
                f"{name} is a percentage of the datasheet figure, above 0 and at most 100; got {s[name]}"
            )
    return s


def plan_settings(**settings) -> planning.PlanSettings:
    """The planner's settings for one setting of the controls (keys as :data:`DEFAULTS`)."""
    s = _settings(settings)
    weight_dtype_bytes, kv_dtype_bytes = PRECISIONS[s["precision"]]
    gpu = as_gpu(s["gpu"])
    return planning.PlanSettings.create(
        get_model(s["model"]),
        gpu,
        arrival_rate=s["rate"],
        prompt_tokens=s["prompt"],
        output_tokens=s["output"],
        ttft_target_s=s["ttft_ms"] / 1000,
        tpot_target_s=s["tpot_ms"] / 1000,
        bandwidth_efficiency=s["bandwidth_pct"] / 100,
        compute_efficiency=s["compute_pct"] / 100,
        step_overhead_s=s["overhead_ms"] / 1000,
        percentile=PERCENTILE,
        weight_dtype_bytes=weight_dtype_bytes,
        kv_dtype_bytes=kv_dtype_bytes,
        tensor_parallel=s["tp"],
        burst_percentile=BURST_PERCENTILE,
        gpu_hour_price=s["price"] if s["price"] > 0 else None,
        fp8_compute=s["precision"] in FP8_WEIGHTS and gpu.fp8_peak_flops > 0,
    )


def compute(**settings) -> tuple[planning.Plan, dict[str, str]]:
    """The plan and the display strings for one setting of the controls (keys as :data:`DEFAULTS`)."""
    p = planning.plan_from(plan_settings(**settings))
    return p, display_values(p, _settings(settings))


def step_curve(p: planning.Plan, settings: dict) -> list[tuple[int, float]]:
    """``(batch, decode step seconds)`` at powers of two for the plot, at the plan's step context:
    the step the plan prices (:meth:`labsupport.planning.PlanSettings.step_time`)."""
    planned = plan_settings(**settings)
    return [(b, planned.step_time(b, p.step_context_tokens)) for b in plot_batches(p)]


def plot_batches(p: planning.Plan) -> list[int]:
    """The batches the plot shows: powers of two from 1 past both limits (at least 16, at most 2**20)."""
    top = max(16, 2 * p.batch_for_tpot, 2 * p.batch_in_memory)
    k = min(20, math.ceil(math.log2(top)))
    return [2**i for i in range(k + 1)]


def planner_data() -> dict:
    """The tables and choices the static page embeds, all taken from labsupport."""
    models = {}
    for name in MODELS:
        cfg = get_model(name)
        models[name] = {
            "label": model_label(name),
            "params": param_count(cfg),
            "n_layers": cfg.n_layers,
            "q_width": cfg.q_width,
            "kv_values_per_token": kv_bytes_per_token(cfg, 1),
            # the input embedding rows a step never reads (planning's read_exact): untied tables only
            "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model,
            "tied": cfg.tied_embeddings,
        }
    cards = {
        name: {
            "peak_flops": gpu.peak_flops,
            "fp8_peak_flops": gpu.fp8_peak_flops,
            "bandwidth": gpu.hbm_bandwidth,
            "usable_bytes": gpu.usable_bytes,
        }
        for name, gpu in GPUS.items()
    }
    p = BURST_PERCENTILE / 100
    return {
        "models": models,
        "cards": cards,
        "precisions": {k: list(v) for k, v in PRECISIONS.items()},
        "fp8_weights": list(FP8_WEIGHTS),
        "tp": TENSOR_PARALLEL,
        "gb": planning.GB,
        "gib": planning.GIB,
        "seconds_per_hour": planning.SECONDS_PER_HOUR,
        "memory_utilization": planning.DEFAULT_MEMORY_UTILIZATION,
        "max_batch_search": planning.MAX_BATCH_SEARCH,
        "percentile": PERCENTILE,
        "burst_percentile": BURST_PERCENTILE,
        # the normal approximation's quantile for means above 1e5 (planning.poisson_quantile), computed
        # by the planner's own inverse error function: browsers have no erf
        "burst_z": math.sqrt(2) * planning._erfinv(2 * p - 1),
        "colours": {"step": STEP_COLOUR, "target": TARGET_COLOUR, "memory": MEMORY_COLOUR},
    }


# --- the static version (HTML book, no kernel) -------------------------------------------------


def _static(name: str) -> str:
    """A file of ``labsupport/planner_static/`` (package data), as text."""
    return widget.package_text("planner_static", name)


def _json_block(name: str, value) -> str:
    return widget.json_block("pl", name, value)


#: The number inputs: (key, label, min, step). Targets in ms, efficiencies in percent.
_INPUTS = {
    "workload": [
        ("rate", "Arrival rate (requests/s)", "0", "any"),
        ("prompt", "Prompt, mean (tokens)", "1", "1"),
        ("output", "Output, mean (tokens)", "1", "1"),
        ("ttft_ms", "TTFT target (ms)", "0", "any"),
        ("tpot_ms", "TPOT target (ms)", "0", "any"),
    ],
    "measured": [
        ("bandwidth_pct", "Bandwidth efficiency (% of datasheet)", "0", "any"),
        ("compute_pct", "Compute efficiency (% of peak)", "0", "any"),
        ("overhead_ms", "Overhead per decode step (ms)", "0", "any"),
        ("price", "Price of a GPU-hour (your currency)", "0", "any"),
    ],
}


def _number(key: str, title: str, low: str, step: str, value) -> str:
    return (
        f'<label>{html.escape(title)}<input type="number" min="{low}" step="{step}" value="{html.escape(str(value))}" '
        f'data-control="{key}" aria-label="{html.escape(title)}"></label>'
    )


METRICS = [
    ("replicas", "Replicas"),
    ("batch", "Batch per replica"),
    ("concurrency", "Concurrency (Little's law)"),
    ("utilisation", "Utilisation"),
    ("tpot", "Predicted TPOT"),
    ("ttft", "Predicted TTFT"),
    ("throughput", "Throughput"),
    ("cost", "Cost per million tokens"),
    ("cost-saturation", "Cost at saturation"),
]


def static_html(element_id: str | None = None, **settings) -> str:
    """A self-contained HTML+JS planner for a page without a kernel, starting at ``settings``
    (keys and defaults as :data:`DEFAULTS`)."""
    start = _settings(settings)
    element_id = widget.element_id(element_id, "c14p")
    # The starting values are rendered here too, so the page reads right before the script runs.
    _, text = compute(**start)
    selects = (
        widget.select("model", "Model", widget.options(MODELS, start["model"], model_label))
        + widget.select("gpu", "GPU", widget.options(list(GPUS), start["gpu"]))
        + widget.select("precision", "Precision", widget.options(list(PRECISIONS), start["precision"]))
        + widget.select("tp", "Tensor parallel (GPUs per replica)", widget.options(TENSOR_PARALLEL, start["tp"]))
    )
    fields = {
        group: "".join(_number(key, title, low, step, start[key]) for key, title, low, step in inputs)
        for group, inputs in _INPUTS.items()
    }
    verdict_class = "pl-verdict" + (
        "" if text["replicas"] != "none" and "misses" not in text["verdict"] else " pl-bad"
    )
    return (
        f'<div id="{element_id}" class="c14p-planner">'
        f"<style>{_static('planner.css')}</style>"
        f'<fieldset><legend>Workload and targets</legend><div class="pl-controls">{fields["workload"]}</div></fieldset>'
        f'<fieldset><legend>Deployment</legend><div class="pl-controls">{selects}</div></fieldset>'
        f'<fieldset><legend>Measured, and priced</legend><div class="pl-controls">{fields["measured"]}</div></fieldset>'
        '<p class="pl-error" data-error hidden></p>'
        '<div class="pl-results">'
        f'<p class="{verdict_class} pl-text" data-out="verdict">{html.escape(text["verdict"])}</p>'
        '<div class="pl-metrics">'
        + "".join(widget.metric("pl", key, name, text) for key, name in METRICS)
        + "</div>"
        + "".join(
            f'<p class="pl-line pl-text" data-out="{key}">{html.escape(text[key])}</p>'
            for key in ("batch-tpot", "memory", "headroom")
        )
        + '<div class="pl-svg"></div>'
        '<p class="pl-legend">'
        f'<span style="color:{STEP_COLOUR}">&#9473; decode step</span> '
        f'<span class="pl-legend-stretch" style="color:{STEP_COLOUR}">&#9549; with prefill turns</span> '
        f'<span style="color:{TARGET_COLOUR}">&#9473; <span class="pl-text" data-out="plot-target">'
        f"{html.escape(text['plot-target'])}</span></span> "
        f'<span style="color:{MEMORY_COLOUR}">&#8942; <span class="pl-text" data-out="plot-memory">'
        f"{html.escape(text['plot-memory'])}</span></span> "
        f'<span style="color:{STEP_COLOUR}">&#9679; <span class="pl-text" data-out="plot-batch">'
        f"{html.escape(text['plot-batch'])}</span></span></p>"
        f'<p class="pl-device pl-text" data-out="device">{html.escape(text["device"])}</p>'
        "</div>"
        + _json_block("data", planner_data())
        + _json_block("start", start)
        + widget.script("planner_static", "planner.js", "labsupportPlanner", element_id)
        + "</div>"
    )


# --- the live version (JupyterLab, ipywidgets) -------------------------------------------------


def plan_figure(p: planning.Plan, settings: dict, values: dict[str, str] | None = None):
    """A matplotlib Figure: the decode step against the batch, the TPOT target and the memory limit."""
    from matplotlib.figure import Figure  # matplotlib only when plotting
    from matplotlib.ticker import FuncFormatter

    values = values or display_values(p, {**DEFAULTS, **settings})
    curve = step_curve(p, settings)
    fig = Figure(figsize=(7.5, 3.8), dpi=100)
    ax = fig.add_subplot()
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = [b for b, _ in curve]
    ax.plot(xs, [t * 1e3 for _, t in curve], color=STEP_COLOUR, lw=2, label="decode step")
    if p.prefill_share > 0:
        ax.plot(
            xs,
            [t * 1e3 / (1 - p.prefill_share) for _, t in curve],
            color=STEP_COLOUR,
            lw=1.5,
            ls="--",
            label="with prefill turns",
        )
    ax.axhline(p.tpot_target_s * 1e3, color=TARGET_COLOUR, lw=1.5)
    ax.text(xs[0], p.tpot_target_s * 1e3 * 1.08, values["plot-target"], color=TARGET_COLOUR, fontsize=9)
    if p.batch_in_memory >= 1:
        ax.axvline(p.batch_in_memory, color=MEMORY_COLOUR, ls=":", lw=1.5)
        ax.text(
            p.batch_in_memory,
            ax.get_ylim()[1],
            values["plot-memory"] + " ",
            color=MEMORY_COLOUR,
            fontsize=9,
            rotation=90,
            va="top",
            ha="right",
        )
    if p.feasible:
        ax.plot([p.batch], [p.tpot_s * 1e3], "o", color=STEP_COLOUR, ms=9)
        ax.annotate(
            values["plot-batch"],
            (p.batch, p.tpot_s * 1e3),
            textcoords="offset points",
            xytext=(8, -14),
            color=STEP_COLOUR,
            fontsize=9,
        )
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    # label the 2s and 5s between the powers of ten too, so the TPOT target can be read off
    ax.yaxis.set_minor_formatter(
        FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else "")
    )
    ax.set_xlabel("sequences in the batch (one replica)")
    ax.set_ylabel("milliseconds per decode step")
    ax.set_title("The batch a TPOT target allows", fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def results_html(values: dict[str, str], good: bool = True) -> str:
    """The results as a small HTML block for the live widget."""

    def card(key: str, name: str) -> str:
        return (
            '<div style="border:1px solid #d0d7de;border-radius:6px;padding:6px 10px;min-width:150px">'
            f'<div style="font-size:12px;color:#57606a">{name}</div>'
            f'<div style="font-size:20px;font-weight:650" data-out="{key}">{html.escape(values[key])}</div>'
            f'<div style="font-size:12px;color:#57606a">{html.escape(values[key + "-note"])}</div></div>'
        )

    colour = "#1f2328" if good else "#b42318"
    return (
        f'<div style="font-size:15px;font-weight:600;color:{colour};margin:6px 0">{html.escape(values["verdict"])}</div>'
        '<div style="display:flex;gap:8px;flex-wrap:wrap;margin:6px 0">'
        + "".join(card(key, name) for key, name in METRICS)
        + "</div>"
        + "".join(
            f'<div style="font-size:13px">{html.escape(values[key])}</div>'
            for key in ("batch-tpot", "memory", "headroom")
        )
        + f'<div style="font-size:12px;color:#57606a">{html.escape(values["device"])}</div>'
    )


class LivePlanner:
    """The ipywidgets planner. ``.widget`` is what to display; :meth:`update` recomputes.

    Every control calls :meth:`update` when it changes; it can also be called directly.
    """

    def __init__(self, **settings) -> None:
        import ipywidgets as w  # an optional dependency, needed only for the live version

        start = _settings(settings)
        wide = {"description_width": "230px"}
        layout = w.Layout(width="400px")
        self.controls = {
            "model": w.Dropdown(
                options=[(model_label(m), m) for m in MODELS],
                value=start["model"],
                description="Model",
                style=wide,
                layout=layout,
            ),
            "gpu": w.Dropdown(
                options=list(GPUS), value=start["gpu"], description="GPU", style=wide, layout=layout
            ),
            "precision": w.Dropdown(
                options=list(PRECISIONS),
                value=start["precision"],
                description="Precision",
                style=wide,
                layout=layout,
            ),
            "tp": w.Dropdown(
                options=TENSOR_PARALLEL,
                value=start["tp"],
                description="Tensor parallel (GPUs/replica)",
                style=wide,
                layout=layout,
            ),
        }
        for inputs in _INPUTS.values():
            for key, title, _, _ in inputs:
                self.controls[key] = w.BoundedFloatText(
                    value=start[key], min=0, max=1e9, description=title, style=wide, layout=layout
                )
        self.results = w.HTML()
        self.figure = w.Image(format="png")
        for control in self.controls.values():
            control.observe(lambda _change: self.update(), names="value")
        c = self.controls
        self.widget = w.VBox(
            [
                w.HBox(
                    [
                        w.VBox([c[k] for k, *_ in _INPUTS["workload"]]),
                        w.VBox(
                            [
                                c["model"],
                                c["gpu"],
                                c["precision"],
                                c["tp"],
                                *(c[k] for k, *_ in _INPUTS["measured"]),
                            ]
                        ),
                    ]
                ),
                self.results,
                self.figure,
            ]
        )
        self.plan: planning.Plan | None = None
        self.values: dict[str, str] = {}
        self.update()

    def settings(self) -> dict:
        """The controls' current values, as :func:`compute` takes them."""
        out = {key: control.value for key, control in self.controls.items()}
        for key in NUMBERS:  # whole numbers stay ints, so the strings match the page's
            if float(out[key]).is_integer():
                out[key] = int(out[key])
        return out

    def update(self) -> planning.Plan | None:
        """Recompute from the controls, refresh the results and the plot; return the plan (None on bad input)."""
        settings = self.settings()
        try:
            p, values = compute(**settings)
        except ValueError as exc:
            self.plan, self.values = None, {}
            self.results.value = f'<div style="color:#b42318;font-weight:600">{html.escape(str(exc))}</div>'
            return None
        self.plan, self.values = p, values
        self.results.value = results_html(values, good=p.feasible and p.meets_ttft)
        buffer = io.BytesIO()
        plan_figure(p, settings, values).savefig(buffer, format="png")
        self.figure.value = buffer.getvalue()
        return p

    def _ipython_display_(self) -> None:
        from IPython.display import display  # IPython only inside a notebook

        display(self.widget)


def show(**settings) -> None:
    """Display the live planner in JupyterLab (keyword arguments as :data:`DEFAULTS`)."""
    from IPython.display import display  # IPython only inside a notebook

    display(LivePlanner(**settings).widget)
