"""The two-phase explainer: prompt, output and batch in; TTFT, ITL, request latency, throughput out.

Two versions of one thing, both driven by :mod:`labsupport.serving`:

* :func:`show` (JupyterLab, needs a kernel): ipywidgets sliders and dropdowns, the four metrics,
  and a matplotlib roofline with prefill and decode placed on it. ``from labsupport.explainer
  import show; show()``.
* :func:`static_html` (the HTML book, no kernel): one self-contained HTML snippet with range
  sliders, selects, the metrics and an SVG roofline. Its JavaScript re-implements
  :func:`labsupport.serving.phases` operation for operation, and its model and GPU tables are
  JSON generated here from :mod:`labsupport.models`, :mod:`labsupport.hardware` and
  :mod:`labsupport.costs`. It loads nothing from the network.

:func:`display_values` gives the exact strings both versions show for a setting; the browser
test compares the page with it. Numbers are rounded half away from zero on their exact binary
value, which is what JavaScript's ``toFixed`` does, so the two agree to the last digit.
"""

from __future__ import annotations

import html
import io
import json
import math
import uuid
from decimal import ROUND_HALF_UP, Decimal

from . import costs, serving
from .hardware import GPUS
from .models import get_model

# The values each slider steps through (powers of two; "1K" is 1,024 tokens).
PROMPTS = [2**k for k in range(6, 18)]  # 64 ... 128K tokens
OUTPUTS = [2**k for k in range(0, 14)]  # 1 ... 8K tokens
BATCHES = [2**k for k in range(0, 11)]  # 1 ... 1,024 requests
CARD_COUNTS = [1, 2, 4, 8]
MODELS = list(serving.NOMINAL_PARAMS)  # the models with a published size

PREFILL_COLOUR = "#d9480f"
DECODE_COLOUR = "#1c6dd0"


# --- the strings both versions display --------------------------------------------------------


def _fixed(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals, ties away from zero on the exact value (JavaScript's toFixed)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _group(text: str) -> str:
    """Thousands separators on the integer part: '12345.6' -> '12,345.6'."""
    whole, dot, frac = text.partition(".")
    sign = "-" if whole.startswith("-") else ""
    whole = whole.lstrip("-")
    groups = []
    while len(whole) > 3:
        groups.insert(0, whole[-3:])
        whole = whole[:-3]
    groups.insert(0, whole)
    return sign + ",".join(groups) + dot + frac


def format_seconds(seconds: float) -> str:
    """0.1149 -> '114.9 ms'; 3.109 -> '3.11 s'; long times in minutes or hours."""
    ms = seconds * 1000
    if ms < 1:
        return _fixed(ms, 2) + " ms"
    if seconds < 1:
        return _fixed(ms, 1) + " ms"
    if seconds < 100:
        return _fixed(seconds, 2) + " s"
    if seconds < 3600:
        return _fixed(seconds / 60, 1) + " min"
    return _group(_fixed(seconds / 3600, 1)) + " h"


def format_rate(tokens_per_second: float) -> str:
    """42.75 -> '43 tok/s'."""
    digits = 1 if tokens_per_second < 10 else 0
    return _group(_fixed(tokens_per_second, digits)) + " tok/s"


def format_intensity(flop_per_byte: float) -> str:
    """1021.6 -> '1022 FLOP/B'; 0.997 -> '1.0 FLOP/B'; 303560 -> '303,560 FLOP/B'."""
    text = _fixed(flop_per_byte, 1 if flop_per_byte < 10 else 0)
    return (_group(text) if flop_per_byte >= 10000 else text) + " FLOP/B"


def format_percent(fraction: float) -> str:
    """1.0 -> '100%'; 0.0048 -> '0.5%'."""
    p = fraction * 100
    return _fixed(p, 1 if p < 10 else 0) + "%"


def format_gb(nbytes: float) -> str:
    """Decimal gigabytes: 3.77e8 -> '0.38 GB'; 1.4e11 -> '140 GB'."""
    gb = nbytes / 1e9
    digits = 2 if gb < 10 else 1 if gb < 100 else 0
    return _group(_fixed(gb, digits)) + " GB"


def _three_figures(value: float) -> str:
    digits = 2 if value < 10 else 1 if value < 100 else 0
    text = _fixed(value, digits)
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def format_rate_si(value: float, unit: str) -> str:
    """1.248e15, 'FLOP/s' -> '1.25 PFLOP/s'; 6e12, 'B/s' -> '6 TB/s'."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G")):
        if value >= factor:
            return f"{_three_figures(value / factor)} {prefix}{unit}"
    return f"{_three_figures(value)} {unit}"


def token_label(tokens: int) -> str:
    """1024 -> '1K'; 512 -> '512'."""
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def model_label(name: str) -> str:
    """'llama-3.1-70b' -> 'Llama 3.1 70B'."""
    family, *rest = name.split("-")
    return " ".join([family.capitalize(), *(part.upper() if part[-1:] in "bm" else part for part in rest)])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def display_values(report: serving.PhaseReport) -> dict[str, str]:
    """Every string the explainer shows for ``report`` (keys match the page's ``data-out``)."""
    pre, dec = report.prefill, report.decode
    prompt = token_label(report.prompt_tokens)
    prefill_what = f"{prompt} tokens" if report.batch == 1 else f"{report.batch} x {prompt} tokens"
    wb = report.conventions.weight_bytes
    dtype = "bf16" if wb == 2 else f"{_three_figures(wb)}-byte weights"
    if report.weight_bytes > report.memory_bytes:
        memory = (
            f"The weights alone ({format_gb(report.weight_bytes)}) exceed the {format_gb(report.memory_bytes)} "
            f"of memory: this setting cannot run."
        )
    else:
        verdict = "fits" if report.fits else "does not fit"
        memory = (
            f"KV cache at the last token: {format_gb(report.kv_cache_bytes)} for "
            f"{_plural(report.batch, 'request')}, against {format_gb(report.free_bytes)} left after "
            f"{format_gb(report.weight_bytes)} of weights: {verdict}."
        )
    return {
        "ttft": format_seconds(report.ttft),
        "ttft-note": f"prefill, {pre.bound}-bound",
        "itl": format_seconds(report.itl),
        "itl-note": f"one decode step, {dec.bound}-bound",
        "latency": format_seconds(report.request_latency),
        "latency-note": f"{_plural(report.output_tokens, 'token')} end to end",
        "throughput": format_rate(report.throughput),
        "throughput-note": f"across {_plural(report.batch, 'request')}",
        "steps": f"prefill = {_fixed(report.prefill_in_decode_steps, 1)} decode steps",
        "prefill-label": f"prefill, {prefill_what}",
        "prefill-point": f"{format_intensity(pre.intensity)}, {format_percent(pre.fraction_of_peak)} of peak",
        "decode-label": f"decode, batch {report.batch}",
        "decode-point": f"{format_intensity(dec.intensity)}, {format_percent(dec.fraction_of_peak)} of peak",
        "ridge": f"ridge {format_intensity(report.ridge_point)}",
        "device": (
            f"{model_label(report.model)} in {dtype} on {report.gpu}: "
            f"{format_rate_si(report.peak_flops, 'FLOP/s')} dense peak against "
            f"{format_rate_si(report.hbm_bandwidth, 'B/s')}."
        ),
        "memory": memory,
    }


# --- one setting, computed ---------------------------------------------------------------------


def compute(
    model: str = serving.SOURCE_MODEL,
    card: str = serving.SOURCE_CARD,
    count: int = serving.SOURCE_CARD_COUNT,
    prompt_tokens: int = serving.SOURCE_PROMPT,
    output_tokens: int = serving.SOURCE_OUTPUT,
    batch: int = serving.SOURCE_BATCH,
    bandwidth: str = "source",
    conventions: serving.Conventions | None = None,
) -> tuple[serving.PhaseReport, dict[str, str]]:
    """The report and the display strings for one setting of the controls."""
    gpu = serving.serving_gpu(card, count, bandwidth)
    report = serving.phases(model, gpu, prompt_tokens, output_tokens, batch, conventions)
    return report, display_values(report)


def explainer_data() -> dict:
    """The tables and choices the static page embeds, all taken from labsupport."""
    models = {}
    for name in MODELS:
        cfg = get_model(name)
        models[name] = {
            "label": model_label(name),
            "nominal_params": serving.model_params(cfg, "nominal"),
            "counted_params": serving.model_params(cfg, "counted"),
            "n_layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "kv_values_per_token": costs.kv_bytes_per_token(cfg, 1),
        }
    cards = {
        name: {
            "peak_flops": gpu.peak_flops,
            "bandwidth": gpu.hbm_bandwidth,
            "source_bandwidth": serving.SOURCE_BANDWIDTH.get(name),
            "memory_bytes": gpu.memory_bytes,
            "source": gpu.source,
        }
        for name, gpu in GPUS.items()
    }
    defaults = serving.SOURCE
    return {
        "models": models,
        "cards": cards,
        "counts": CARD_COUNTS,
        "prompts": PROMPTS,
        "outputs": OUTPUTS,
        "batches": BATCHES,
        "choices": {**serving.Conventions.choices(), "bandwidth": list(serving.BANDWIDTH_CHOICES)},
        "weight_bytes": defaults.weight_bytes,
        "kv_bytes": defaults.kv_bytes,
        "colours": {"prefill": PREFILL_COLOUR, "decode": DECODE_COLOUR},
    }


def _settings(model, card, count, prompt_tokens, output_tokens, batch, bandwidth, conventions) -> dict:
    """Check a starting setting against the controls' choices; return it as the page's JSON."""
    conv = conventions if conventions is not None else serving.SOURCE
    if not isinstance(conv, serving.Conventions):
        raise ValueError(f"conventions must be a labsupport.serving.Conventions, got {type(conv).__name__}")
    if (conv.weight_bytes, conv.kv_bytes) != (serving.SOURCE.weight_bytes, serving.SOURCE.kv_bytes):
        raise ValueError(
            "the explainer shows bf16 weights and cache: conventions.weight_bytes and kv_bytes must be 2"
        )
    for name, value, accepted in (
        ("model", model, MODELS),
        ("card", card, list(GPUS)),
        ("count", count, CARD_COUNTS),
        ("prompt_tokens", prompt_tokens, PROMPTS),
        ("output_tokens", output_tokens, OUTPUTS),
        ("batch", batch, BATCHES),
        ("bandwidth", bandwidth, list(serving.BANDWIDTH_CHOICES)),
    ):
        if value not in accepted:
            raise ValueError(f"{name} must be one of {', '.join(map(str, accepted))}; got {value!r}")
    return {
        "model": model,
        "card": card,
        "count": count,
        "prompt": prompt_tokens,
        "output": output_tokens,
        "batch": batch,
        "bandwidth": bandwidth,
        **{name: getattr(conv, name) for name in serving.Conventions.choices()},
    }


# --- the roofline's frame, shared by both drawings ----------------------------------------------


def roofline_frame(report: serving.PhaseReport) -> tuple[float, float, float, float]:
    """Log-axis limits ``(x_min, x_max, y_min, y_max)`` that hold the roof and both points."""
    pts = (report.prefill, report.decode)
    lo = min(min(p.intensity for p in pts), report.ridge_point)
    hi = max(max(p.intensity for p in pts), report.ridge_point)
    x_min = 10 ** math.floor(math.log10(lo / 2))
    x_max = 10 ** math.ceil(math.log10(hi * 2))
    y_low = min(min(p.attained_flops for p in pts), report.hbm_bandwidth * x_min)
    y_min = 10 ** math.floor(math.log10(y_low))
    y_max = 10 ** math.ceil(math.log10(report.peak_flops * 2))
    return x_min, x_max, y_min, y_max


def roofline_figure(report: serving.PhaseReport, values: dict[str, str] | None = None):
    """A matplotlib Figure: the device's roof and the two phases placed on it (no pyplot state)."""
    from matplotlib.figure import Figure

    values = values or display_values(report)
    x_min, x_max, y_min, y_max = roofline_frame(report)
    fig = Figure(figsize=(7.5, 4.2), dpi=100)
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_min, x_max)
    ax.set_ylim(y_min, y_max)
    ridge = report.ridge_point
    ax.plot(
        [x_min, ridge, x_max],
        [report.hbm_bandwidth * x_min, report.peak_flops, report.peak_flops],
        color="#333",
        lw=2,
    )
    ax.axvline(ridge, color="#888", ls="--", lw=1)
    ax.text(ridge * 1.1, y_min * 2, values["ridge"], color="#555", fontsize=9)
    ax.text(
        x_min * 1.5,
        report.peak_flops * 1.25,
        f"{format_rate_si(report.peak_flops, 'FLOP/s')} peak",
        fontsize=9,
        color="#333",
    )
    middle = math.sqrt(x_min * x_max)
    for phase, colour in ((report.prefill, PREFILL_COLOUR), (report.decode, DECODE_COLOUR)):
        align = "right" if phase.intensity > middle else "left"
        ax.plot([phase.intensity], [phase.attained_flops], "o", ms=10, color=colour, zorder=3)
        offset = 0.8 if align == "right" else 1.25
        ax.text(
            phase.intensity * offset,
            phase.attained_flops / 1.6,
            f"{values[phase.name + '-label']}\n{values[phase.name + '-point']}",
            ha=align,
            va="top",
            fontsize=9,
            color=colour,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
        )
    ax.set_xlabel("arithmetic intensity (FLOP per byte read from memory)")
    ax.set_ylabel("attained FLOP/s")
    ax.set_title("Prefill and decode on the roofline", fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


# --- the static version (HTML book, no kernel) -------------------------------------------------

_CSS = """
#ID { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; border: 1px solid #d0d7de;
  border-radius: 8px; padding: 1rem 1.2rem; margin: 1rem 0; color: #1f2328; background: #fff; }
#ID .xp-controls { display: grid; grid-template-columns: repeat(auto-fit, minmax(15rem, 1fr)); gap: .6rem 1.4rem; }
#ID label { display: flex; flex-direction: column; font-size: .85rem; gap: .2rem; }
#ID label span.xp-head { display: flex; justify-content: space-between; }
#ID output { font-weight: 600; }
#ID input[type=range] { width: 100%; }
#ID select { font-size: .9rem; padding: .15rem; }
#ID details { margin-top: .6rem; font-size: .85rem; }
#ID details .xp-controls { margin-top: .5rem; }
#ID .xp-bar { display: flex; height: 1.1rem; margin: 1rem 0 .2rem; border-radius: 3px; overflow: hidden; }
#ID .xp-bar div { min-width: 2px; }
#ID .xp-bar-legend { font-size: .8rem; color: #57606a; }
#ID .xp-metrics { display: grid; grid-template-columns: repeat(4, minmax(0, 1fr)); gap: .6rem; margin: .8rem 0; }
@media (max-width: 640px) { #ID .xp-metrics { grid-template-columns: repeat(2, minmax(0, 1fr)); } }
#ID .xp-metric { border: 1px solid #d0d7de; border-radius: 6px; padding: .5rem .7rem; }
#ID .xp-metric .xp-name { font-size: .8rem; color: #57606a; }
#ID .xp-metric .xp-value { font-size: 1.25rem; white-space: nowrap; font-weight: 650; font-variant-numeric: tabular-nums; }
#ID .xp-metric .xp-note { font-size: .8rem; color: #57606a; }
#ID .xp-memory { font-size: .9rem; }
#ID .xp-memory.xp-bad { color: #b42318; font-weight: 600; }
#ID .xp-device { font-size: .8rem; color: #57606a; }
#ID svg { width: 100%; height: auto; max-width: 720px; display: block; }
"""

_JS = r"""
(function () {
  "use strict";
  const root = document.getElementById("__ID__");
  const DATA = __DATA__;
  const START = __START__;
  const $ = (sel) => root.querySelector(sel);

  // Number formatting: toFixed rounds ties away from zero on the exact value, as the Python side.
  const fixed = (x, d) => x.toFixed(d);
  function group(text) {
    let [whole, frac] = text.split(".");
    const sign = whole.startsWith("-") ? "-" : "";
    whole = whole.replace("-", "").replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return sign + whole + (frac === undefined ? "" : "." + frac);
  }
  function seconds(s) {
    const ms = s * 1000;
    if (ms < 1) return fixed(ms, 2) + " ms";
    if (s < 1) return fixed(ms, 1) + " ms";
    if (s < 100) return fixed(s, 2) + " s";
    if (s < 3600) return fixed(s / 60, 1) + " min";
    return group(fixed(s / 3600, 1)) + " h";
  }
  const rate = (r) => group(fixed(r, r < 10 ? 1 : 0)) + " tok/s";
  const intensity = (x) => { const t = fixed(x, x < 10 ? 1 : 0); return (x >= 10000 ? group(t) : t) + " FLOP/B"; };
  const percent = (f) => { const p = f * 100; return fixed(p, p < 10 ? 1 : 0) + "%"; };
  function gb(b) { const g = b / 1e9; return group(fixed(g, g < 10 ? 2 : g < 100 ? 1 : 0)) + " GB"; }
  function three(v) {
    let t = fixed(v, v < 10 ? 2 : v < 100 ? 1 : 0);
    if (t.includes(".")) t = t.replace(/0+$/, "").replace(/\.$/, "");
    return t;
  }
  function si(v, unit) {
    for (const [f, p] of [[1e15, "P"], [1e12, "T"], [1e9, "G"]]) if (v >= f) return three(v / f) + " " + p + unit;
    return three(v) + " " + unit;
  }
  const tokens = (n) => (n >= 1024 && n % 1024 === 0 ? n / 1024 + "K" : String(n));
  const plural = (n, w) => n + " " + w + (n === 1 ? "" : "s");

  // The phase model: labsupport.serving.phases, operation for operation.
  function phase(name, flops, bytes, peak, bw) {
    const compute = flops / peak, memory = bytes / bw;
    const time = Math.max(compute, memory);
    const attained = flops / time;
    return { name, flops, bytes, time, intensity: flops / bytes, attained, fraction: attained / peak,
             bound: compute >= memory ? "compute" : "memory" };
  }
  function model(s) {
    const m = DATA.models[s.model], c = DATA.cards[s.card];
    const n = s.params === "nominal" ? m.nominal_params : m.counted_params;
    const perCard = s.bandwidth === "source" && c.source_bandwidth !== null ? c.source_bandwidth : c.bandwidth;
    const peak = c.peak_flops * s.count, bw = perCard * s.count, mem = c.memory_bytes * s.count;
    const kv = m.kv_values_per_token * DATA.kv_bytes;
    const p = s.prompt, o = s.output, b = s.batch;
    const tokensIn = b * p;
    let pf = 2 * n * tokensIn;
    if (s.attention !== "none") {
      const attn = 4 * m.n_layers * p * p * m.d_model;
      pf += b * (s.attention === "causal" ? attn / 2 : attn);
    }
    const pre = phase("prefill", pf, n * DATA.weight_bytes + tokensIn * kv, peak, bw);
    const ctx = s.decode_context === "start" ? p : s.decode_context === "end" ? p + o - 1 : p + (o - 1) / 2;
    let df = 2 * n * b;
    if (s.attention !== "none") df += b * 4 * m.n_layers * ctx * m.d_model;
    const dec = phase("decode", df, n * DATA.weight_bytes + b * ctx * kv, peak, bw);
    const ttft = pre.time, itl = dec.time;
    const steps = s.decode_steps === "output" ? o : o - 1;
    const latency = ttft + steps * itl;
    const throughput = s.throughput === "decode" ? b / itl : b * o / latency;
    const weights = n * DATA.weight_bytes, cache = b * (p + o) * kv;
    return { s, pre, dec, ttft, itl, latency, throughput, peak, bw, mem, weights, cache,
             ridge: peak / bw, free: mem - weights, fits: weights + cache <= mem };
  }
  function texts(r) {
    const s = r.s, m = DATA.models[s.model];
    const what = s.batch === 1 ? tokens(s.prompt) + " tokens" : s.batch + " x " + tokens(s.prompt) + " tokens";
    let memory;
    if (r.weights > r.mem) {
      memory = "The weights alone (" + gb(r.weights) + ") exceed the " + gb(r.mem) + " of memory: this setting cannot run.";
    } else {
      memory = "KV cache at the last token: " + gb(r.cache) + " for " + plural(s.batch, "request") + ", against " +
        gb(r.free) + " left after " + gb(r.weights) + " of weights: " + (r.fits ? "fits" : "does not fit") + ".";
    }
    const dtype = DATA.weight_bytes === 2 ? "bf16" : three(DATA.weight_bytes) + "-byte weights";
    return {
      "ttft": seconds(r.ttft), "ttft-note": "prefill, " + r.pre.bound + "-bound",
      "itl": seconds(r.itl), "itl-note": "one decode step, " + r.dec.bound + "-bound",
      "latency": seconds(r.latency), "latency-note": plural(s.output, "token") + " end to end",
      "throughput": rate(r.throughput), "throughput-note": "across " + plural(s.batch, "request"),
      "steps": "prefill = " + fixed(r.ttft / r.itl, 1) + " decode steps",
      "prefill-label": "prefill, " + what,
      "prefill-point": intensity(r.pre.intensity) + ", " + percent(r.pre.fraction) + " of peak",
      "decode-label": "decode, batch " + s.batch,
      "decode-point": intensity(r.dec.intensity) + ", " + percent(r.dec.fraction) + " of peak",
      "ridge": "ridge " + intensity(r.ridge),
      "device": m.label + " in " + dtype + " on " + s.count + "x " + s.card + ": " + si(r.peak, "FLOP/s") +
        " dense peak against " + si(r.bw, "B/s") + ".",
      "memory": memory,
    };
  }

  // The roofline, drawn as SVG on log axes (the frame as labsupport.explainer.roofline_frame).
  const HALO = 'stroke="#fff" stroke-width="4" stroke-linejoin="round" paint-order="stroke"';
  const esc = (t) => String(t).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  function axisLabel(v, unit) {
    const e = Math.round(Math.log10(v));
    const names = { 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E" };
    if (unit === "") {
      if (e < 0) return String(v);
      const base = 3 * Math.floor(e / 3);
      return Math.pow(10, e - base) + names[base];
    }
    const base = 3 * Math.floor(e / 3);
    return Math.pow(10, e - base) + " " + (names[base] || "") + unit;
  }
  function roofline(r, t) {
    const pts = [r.pre, r.dec];
    const lo = Math.min(Math.min(...pts.map((p) => p.intensity)), r.ridge);
    const hi = Math.max(Math.max(...pts.map((p) => p.intensity)), r.ridge);
    const xLo = Math.floor(Math.log10(lo / 2)), xHi = Math.ceil(Math.log10(hi * 2));
    const xMin = Math.pow(10, xLo), xMax = Math.pow(10, xHi);
    const yLow = Math.min(Math.min(...pts.map((p) => p.attained)), r.bw * xMin);
    const yLo = Math.floor(Math.log10(yLow)), yHi = Math.ceil(Math.log10(r.peak * 2));
    const yMin = Math.pow(10, yLo), yMax = Math.pow(10, yHi);
    const W = 720, H = 400, L = 72, R = 20, T = 30, B = 50;
    const X = (v) => L + (Math.log10(v) - xLo) / (xHi - xLo) * (W - L - R);
    const Y = (v) => H - B - (Math.log10(v) - yLo) / (yHi - yLo) * (H - T - B);
    const f = (v) => v.toFixed(1);
    let svg = '<svg viewBox="0 0 ' + W + " " + H + '" role="img" aria-label="roofline with prefill and decode">';
    svg += '<text x="' + L + '" y="18" font-size="14" font-weight="600">Prefill and decode on the roofline</text>';
    for (let e = xLo; e <= xHi; e++) {
      const v = Math.pow(10, e);
      svg += '<line x1="' + f(X(v)) + '" x2="' + f(X(v)) + '" y1="' + T + '" y2="' + (H - B) + '" stroke="#eaeef2"/>';
      svg += '<text x="' + f(X(v)) + '" y="' + (H - B + 16) + '" font-size="11" text-anchor="middle" fill="#57606a">' +
        axisLabel(v, "") + "</text>";
    }
    for (let e = yLo; e <= yHi; e++) {
      const v = Math.pow(10, e);
      svg += '<line x1="' + L + '" x2="' + (W - R) + '" y1="' + f(Y(v)) + '" y2="' + f(Y(v)) + '" stroke="#eaeef2"/>';
      svg += '<text x="' + (L - 6) + '" y="' + f(Y(v) + 4) + '" font-size="11" text-anchor="end" fill="#57606a">' +
        axisLabel(v, "F") + "</text>";
    }
    svg += '<text x="' + ((L + W - R) / 2) + '" y="' + (H - 12) + '" font-size="12" text-anchor="middle">' +
      "arithmetic intensity (FLOP per byte read from memory)</text>";
    svg += '<text transform="translate(16,' + ((T + H - B) / 2) + ') rotate(-90)" font-size="12" text-anchor="middle">' +
      "attained FLOP/s</text>";
    svg += '<polyline fill="none" stroke="#24292f" stroke-width="2.5" points="' + f(X(xMin)) + "," + f(Y(r.bw * xMin)) +
      " " + f(X(r.ridge)) + "," + f(Y(r.peak)) + " " + f(X(xMax)) + "," + f(Y(r.peak)) + '"/>';
    svg += '<line x1="' + f(X(r.ridge)) + '" x2="' + f(X(r.ridge)) + '" y1="' + f(Y(r.peak)) + '" y2="' + (H - B) +
      '" stroke="#8c959f" stroke-dasharray="4 4"/>';
    svg += '<text data-out="ridge" x="' + f(X(r.ridge) + 5) + '" y="' + (H - B - 8) + '" font-size="11" fill="#57606a" ' + HALO + ">" +
      esc(t["ridge"]) + "</text>";
    svg += '<text x="' + f(X(r.ridge) - 8) + '" y="' + f(Y(r.peak) - 8) + '" font-size="11" text-anchor="end" fill="#57606a">memory-bound</text>';
    svg += '<text x="' + f(X(r.ridge) + 8) + '" y="' + f(Y(r.peak) - 8) + '" font-size="11" fill="#57606a">compute-bound, ' +
      esc(si(r.peak, "FLOP/s")) + " peak</text>";
    for (const [p, colour] of [[r.pre, DATA.colours.prefill], [r.dec, DATA.colours.decode]]) {
      const cx = X(p.intensity), cy = Y(p.attained);
      const anchor = cx > (L + W - R) / 2 ? "end" : "start";
      const dx = anchor === "end" ? -12 : 12;
      svg += '<circle cx="' + f(cx) + '" cy="' + f(cy) + '" r="7" fill="' + colour + '"/>';
      svg += '<text x="' + f(cx + dx) + '" y="' + f(cy + 20) + '" font-size="12" text-anchor="' + anchor + '" fill="' + colour + '" ' + HALO + ">";
      svg += '<tspan data-out="' + p.name + '-label" font-weight="600">' + esc(t[p.name + "-label"]) + "</tspan>";
      svg += '<tspan data-out="' + p.name + '-point" x="' + f(cx + dx) + '" dy="15">' + esc(t[p.name + "-point"]) + "</tspan></text>";
    }
    return svg + "</svg>";
  }

  // Controls.
  const state = Object.assign({}, START);
  const ranges = { prompt: DATA.prompts, output: DATA.outputs, batch: DATA.batches };
  const rangeText = { prompt: (v) => tokens(v) + " tokens", output: (v) => tokens(v) + " tokens",
                      batch: (v) => plural(v, "request") };
  function render() {
    const r = model(state), t = texts(r);
    for (const key of Object.keys(rangeText)) root.querySelector('output[data-for="' + key + '"]').textContent = rangeText[key](state[key]);
    $(".xp-svg").innerHTML = roofline(r, t);
    for (const el of root.querySelectorAll(".xp-text[data-out]")) el.textContent = t[el.dataset.out];
    $(".xp-memory").classList.toggle("xp-bad", !(r.weights <= r.mem && r.fits));
    const share = r.ttft / r.latency;
    $(".xp-bar-prefill").style.width = (100 * share).toFixed(2) + "%";
    $(".xp-bar-decode").style.width = (100 * (1 - share)).toFixed(2) + "%";
  }
  for (const el of root.querySelectorAll("[data-control]")) {
    const key = el.dataset.control;
    if (key in ranges) {
      el.max = String(ranges[key].length - 1);
      el.value = String(ranges[key].indexOf(state[key]));
      el.addEventListener("input", () => { state[key] = ranges[key][Number(el.value)]; render(); });
    } else {
      el.value = String(state[key]);
      el.addEventListener("change", () => { state[key] = key === "count" ? Number(el.value) : el.value; render(); });
    }
  }
  render();
  root.dataset.ready = "1";
})();
"""


def _options(values, selected, label=str) -> str:
    return "".join(
        f'<option value="{html.escape(str(v))}"{" selected" if v == selected else ""}>{html.escape(label(v))}</option>'
        for v in values
    )


def _range(key: str, title: str) -> str:
    return (
        f'<label><span class="xp-head">{title} <output data-for="{key}"></output></span>'
        f'<input type="range" min="0" max="0" step="1" value="0" data-control="{key}" aria-label="{title}"></label>'
    )


def _select(key: str, title: str, options: str) -> str:
    return f'<label>{title}<select data-control="{key}" aria-label="{title}">{options}</select></label>'


_CONVENTION_TITLES = {
    "params": (
        "Parameters",
        {"nominal": "nominal (the size in the name)", "counted": "counted (every weight)"},
    ),
    "bandwidth": ("Bandwidth", {"source": "as the source rounds it", "datasheet": "datasheet"}),
    "decode_context": (
        "Decode step costed at",
        {
            "midpoint": "the context's midpoint",
            "start": "the first step's context",
            "end": "the last step's context",
        },
    ),
    "decode_steps": (
        "Request latency counts",
        {"output": "TTFT + output x ITL", "output-1": "TTFT + (output - 1) x ITL"},
    ),
    "throughput": ("Throughput", {"decode": "batch / ITL", "request": "batch x output / request latency"}),
    "attention": (
        "Attention FLOPs",
        {"none": "left out", "causal": "counted, causal", "full": "counted, no mask"},
    ),
}


def static_html(
    model: str = serving.SOURCE_MODEL,
    card: str = serving.SOURCE_CARD,
    count: int = serving.SOURCE_CARD_COUNT,
    prompt_tokens: int = serving.SOURCE_PROMPT,
    output_tokens: int = serving.SOURCE_OUTPUT,
    batch: int = serving.SOURCE_BATCH,
    bandwidth: str = "source",
    conventions: serving.Conventions | None = None,
    element_id: str | None = None,
) -> str:
    """A self-contained HTML+JS explainer for a page without a kernel, starting at this setting.

    Slider values must be among :data:`PROMPTS`, :data:`OUTPUTS` and :data:`BATCHES`; ``card`` a
    name in :data:`labsupport.hardware.GPUS`; ``count`` in :data:`CARD_COUNTS`.
    """
    start = _settings(model, card, count, prompt_tokens, output_tokens, batch, bandwidth, conventions)
    data = explainer_data()
    element_id = element_id or f"c05x-{uuid.uuid4().hex[:8]}"
    if not element_id.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"element_id must be letters, digits, '-' or '_', got {element_id!r}")
    # Starting values are rendered server-side too, so the page reads right before the script runs.
    _, text = compute(model, card, count, prompt_tokens, output_tokens, batch, bandwidth, conventions)

    def metric(key: str, name: str) -> str:
        return (
            f'<div class="xp-metric"><div class="xp-name">{name}</div>'
            f'<div class="xp-value xp-text" data-out="{key}">{html.escape(text[key])}</div>'
            f'<div class="xp-note xp-text" data-out="{key}-note">{html.escape(text[key + "-note"])}</div></div>'
        )

    models = _options(MODELS, model, model_label)
    cards = _options(list(GPUS), card)
    counts = _options(CARD_COUNTS, count, lambda n: f"{n} card" + ("" if n == 1 else "s"))
    conventions_html = "".join(
        _select(key, title, _options(data["choices"][key], start[key], lambda v, labels=labels: labels[v]))
        for key, (title, labels) in _CONVENTION_TITLES.items()
    )
    js = (
        _JS.replace("__ID__", element_id)
        .replace("__DATA__", json.dumps(data).replace("</", "<\\/"))
        .replace("__START__", json.dumps(start).replace("</", "<\\/"))
    )
    return (
        f'<div id="{element_id}" class="c05x-explainer">'
        f"<style>{_CSS.replace('#ID', '#' + element_id)}</style>"
        '<div class="xp-controls">'
        + _range("prompt", "Prompt")
        + _range("output", "Output")
        + _range("batch", "Requests in the batch")
        + _select("model", "Model", models)
        + _select("card", "GPU", cards)
        + _select("count", "Cards", counts)
        + "</div>"
        f"<details><summary>Conventions (the defaults reproduce the source)</summary>"
        f'<div class="xp-controls">{conventions_html}</div></details>'
        f'<div class="xp-bar"><div class="xp-bar-prefill" style="background:{PREFILL_COLOUR}"></div>'
        f'<div class="xp-bar-decode" style="background:{DECODE_COLOUR}"></div></div>'
        '<div class="xp-bar-legend">one request, start to finish: '
        f'<span style="color:{PREFILL_COLOUR}">prefill</span> then '
        f'<span style="color:{DECODE_COLOUR}">decode</span>; '
        f'<span class="xp-text" data-out="steps">{html.escape(text["steps"])}</span></div>'
        '<div class="xp-metrics">'
        + metric("ttft", "Time to first token")
        + metric("itl", "Inter-token latency")
        + metric("latency", "Request latency")
        + metric("throughput", "Throughput")
        + "</div>"
        f'<p class="xp-memory xp-text" data-out="memory">{html.escape(text["memory"])}</p>'
        '<div class="xp-svg"></div>'
        f'<p class="xp-device xp-text" data-out="device">{html.escape(text["device"])}</p>'
        f"<script>{js}</script></div>"
    )


# --- the live version (JupyterLab, ipywidgets) -------------------------------------------------


def metrics_html(values: dict[str, str], fits: bool = True) -> str:
    """The four metrics as a small HTML block for the live widget."""

    def card(key: str, name: str) -> str:
        return (
            '<div style="border:1px solid #d0d7de;border-radius:6px;padding:6px 10px;min-width:150px">'
            f'<div style="font-size:12px;color:#57606a">{name}</div>'
            f'<div style="font-size:22px;font-weight:650" data-out="{key}">{html.escape(values[key])}</div>'
            f'<div style="font-size:12px;color:#57606a">{html.escape(values[key + "-note"])}</div></div>'
        )

    colour = "#1f2328" if fits else "#b42318"
    return (
        '<div style="display:flex;gap:8px;flex-wrap:wrap;margin:6px 0">'
        + card("ttft", "Time to first token")
        + card("itl", "Inter-token latency")
        + card("latency", "Request latency")
        + card("throughput", "Throughput")
        + "</div>"
        f'<div style="font-size:13px;color:#57606a">{html.escape(values["steps"])}</div>'
        f'<div style="font-size:13px;color:{colour}">{html.escape(values["memory"])}</div>'
        f'<div style="font-size:12px;color:#57606a">{html.escape(values["device"])}</div>'
    )


class LiveExplainer:
    """The ipywidgets explainer. ``.widget`` is what to display; :meth:`update` recomputes.

    Every control calls :meth:`update` when it changes; it can also be called directly.
    """

    def __init__(
        self,
        model: str = serving.SOURCE_MODEL,
        card: str = serving.SOURCE_CARD,
        count: int = serving.SOURCE_CARD_COUNT,
        prompt_tokens: int = serving.SOURCE_PROMPT,
        output_tokens: int = serving.SOURCE_OUTPUT,
        batch: int = serving.SOURCE_BATCH,
        bandwidth: str = "source",
        conventions: serving.Conventions | None = None,
    ) -> None:
        import ipywidgets as w

        start = _settings(model, card, count, prompt_tokens, output_tokens, batch, bandwidth, conventions)
        wide = {"description_width": "150px"}
        layout = w.Layout(width="420px")

        def slider(title, values, value, text):
            return w.SelectionSlider(
                options=[(text(v), v) for v in values],
                value=value,
                description=title,
                continuous_update=True,
                style=wide,
                layout=layout,
            )

        self.prompt = slider("Prompt (tokens)", PROMPTS, prompt_tokens, token_label)
        self.output = slider("Output (tokens)", OUTPUTS, output_tokens, token_label)
        self.batch = slider("Requests in batch", BATCHES, batch, str)
        self.model = w.Dropdown(
            options=[(model_label(m), m) for m in MODELS],
            value=model,
            description="Model",
            style=wide,
            layout=layout,
        )
        self.card = w.Dropdown(options=list(GPUS), value=card, description="GPU", style=wide, layout=layout)
        self.count = w.Dropdown(
            options=CARD_COUNTS, value=count, description="Cards", style=wide, layout=layout
        )
        self.conventions = {
            key: w.Dropdown(
                options=[
                    (labels[v], v)
                    for v in (
                        serving.BANDWIDTH_CHOICES
                        if key == "bandwidth"
                        else serving.Conventions.choices()[key]
                    )
                ],
                value=start[key],
                description=title,
                style=wide,
                layout=layout,
            )
            for key, (title, labels) in _CONVENTION_TITLES.items()
        }
        self.metrics = w.HTML()
        self.figure = w.Image(format="png")
        controls = [
            self.prompt,
            self.output,
            self.batch,
            self.model,
            self.card,
            self.count,
            *self.conventions.values(),
        ]
        for control in controls:
            control.observe(lambda _change: self.update(), names="value")
        conventions_box = w.Accordion(children=[w.VBox(list(self.conventions.values()))])
        conventions_box.set_title(0, "Conventions (the defaults reproduce the source)")
        conventions_box.selected_index = None
        self.widget = w.VBox(
            [
                w.HBox(
                    [
                        w.VBox([self.prompt, self.output, self.batch]),
                        w.VBox([self.model, self.card, self.count]),
                    ]
                ),
                conventions_box,
                self.metrics,
                self.figure,
            ]
        )
        self.report: serving.PhaseReport | None = None
        self.values: dict[str, str] = {}
        self.update()

    def update(self) -> serving.PhaseReport:
        """Recompute from the controls, refresh the metrics and the roofline, return the report."""
        conv = serving.Conventions(**{k: c.value for k, c in self.conventions.items() if k != "bandwidth"})
        report, values = compute(
            self.model.value,
            self.card.value,
            self.count.value,
            self.prompt.value,
            self.output.value,
            self.batch.value,
            self.conventions["bandwidth"].value,
            conv,
        )
        self.report, self.values = report, values
        self.metrics.value = metrics_html(
            values, fits=report.weight_bytes <= report.memory_bytes and report.fits
        )
        fig = roofline_figure(report, values)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        self.figure.value = buffer.getvalue()
        return report

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def show(**settings) -> None:
    """Display the live explainer in JupyterLab (keyword arguments as :class:`LiveExplainer`)."""
    from IPython.display import display

    display(LiveExplainer(**settings).widget)
