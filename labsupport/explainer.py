"""The two-phase explainer: prompt, output and batch in; TTFT, ITL, request latency, throughput out.

Two versions of one thing, both driven by :mod:`labsupport.serving`:

* :func:`show` (JupyterLab, needs a kernel): ipywidgets sliders and dropdowns, the four metrics,
  and a matplotlib roofline with prefill and decode placed on it. ``from labsupport.explainer
  import show; show()``.
* :func:`static_html` (the HTML book, no kernel): one self-contained HTML snippet with range
  sliders, selects, the metrics and an SVG roofline. Its script and styles are the package files
  ``explainer_static/explainer.js`` and ``explainer.css``, inlined (after the number formatting the
  planner shares, ``number_format.js``; see :mod:`labsupport._static_widget`); the JavaScript
  re-implements :func:`labsupport.serving.phases` operation for operation, and reads its model
  and GPU tables from a JSON block generated here from :mod:`labsupport.models`,
  :mod:`labsupport.hardware` and :mod:`labsupport.costs`. It loads nothing from the network.

:func:`display_values` gives the exact strings both versions show for a setting; the browser
test compares the page with it. Numbers are rounded half away from zero on their exact binary
value, which is what JavaScript's ``toFixed`` does, so the two agree to the last digit.
"""

from __future__ import annotations

import html
import io
import math
from decimal import ROUND_HALF_UP, Decimal

from . import _static_widget as widget
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


def _bound_note(phase: serving.Phase, what: str) -> str:
    if phase.bound != "mixed":
        return f"{what}, {phase.bound}-bound"
    return f"{what}: matmuls {phase.matmuls.bound}-bound, attention {phase.attention.bound}-bound"


def _split(phase: serving.Phase, what: str) -> str:
    m, a = phase.matmuls, phase.attention
    return (
        f"{what} = weight matmuls {format_seconds(m.time)} ({m.bound}-bound) + "
        f"attention {format_seconds(a.time)} ({a.bound}-bound)"
    )


def roofline_points(report: serving.PhaseReport) -> list[tuple[str, serving.Kernel | serving.Phase, str]]:
    """``(key, point, phase name)`` for each point the roofline shows.

    Merged: one point per phase. Per kernel: each phase's weight matmuls, and its attention when
    attention FLOPs are counted (a kernel with no FLOPs has no place on a log-scale roofline; its
    time still counts).
    """
    if report.conventions.roofline == "merged":
        return [("prefill", report.prefill, "prefill"), ("decode", report.decode, "decode")]
    out = []
    for phase in (report.prefill, report.decode):
        out.append((phase.name, phase.matmuls, phase.name))
        if phase.attention.flops > 0:
            out.append((f"{phase.name}-attention", phase.attention, phase.name))
    return out


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
    out = {
        "ttft": format_seconds(report.ttft),
        "ttft-note": _bound_note(pre, "prefill"),
        "itl": format_seconds(report.itl),
        "itl-note": _bound_note(dec, "one decode step"),
        "latency": format_seconds(report.request_latency),
        "latency-note": f"{_plural(report.output_tokens, 'token')} end to end",
        "throughput": format_rate(report.throughput),
        "throughput-note": f"across {_plural(report.batch, 'request')}",
        "steps": f"prefill = {_fixed(report.prefill_in_decode_steps, 1)} decode steps",
        "ridge": f"ridge {format_intensity(report.ridge_point)}",
        "device": (
            f"{model_label(report.model)} in {dtype} on {report.gpu}: "
            f"{format_rate_si(report.peak_flops, 'FLOP/s')} dense peak against "
            f"{format_rate_si(report.hbm_bandwidth, 'B/s')}."
        ),
        "memory": memory,
    }
    if report.conventions.roofline == "merged":
        out["prefill-label"] = f"prefill, {prefill_what}"
        out["decode-label"] = f"decode, batch {report.batch}"
    else:
        out["prefill-label"] = f"prefill matmuls, {prefill_what}"
        out["prefill-attention-label"] = "prefill attention"
        out["decode-label"] = f"decode matmuls, batch {report.batch}"
        out["decode-attention-label"] = "decode attention"
        out["prefill-split"] = _split(pre, "prefill")
        out["decode-split"] = _split(dec, "one decode step")
    for key, point, _ in roofline_points(report):
        out[f"{key}-point"] = (
            f"{format_intensity(point.intensity)}, {format_percent(point.fraction_of_peak)} of peak"
        )
    if report.weight_bytes > report.memory_bytes:
        # a setting that cannot run has no latency or throughput (as the planner says "none"); one
        # whose cache outgrows the memory keeps its times, which the memory line says do not fit
        for key in ("ttft", "itl", "latency", "throughput"):
            out[key], out[f"{key}-note"] = "none", "the weights do not fit"
    # the labels of points not drawn (attention with no FLOPs counted) are not shown either
    for key in ("prefill-attention", "decode-attention"):
        if f"{key}-point" not in out:
            out.pop(f"{key}-label", None)
    return out


# --- one setting, computed ---------------------------------------------------------------------


def compute(
    model: str = serving.SOURCE_MODEL,
    card: str = serving.SOURCE_CARD,
    count: int = serving.SOURCE_CARD_COUNT,
    prompt_tokens: int = serving.SOURCE_PROMPT,
    output_tokens: int = serving.SOURCE_OUTPUT,
    batch: int = serving.SOURCE_BATCH,
    conventions: serving.Conventions | None = None,
) -> tuple[serving.PhaseReport, dict[str, str]]:
    """The report and the display strings for one setting of the controls."""
    gpu = serving.serving_gpu(card, count)
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
            "memory_bytes": gpu.memory_bytes,
            "source": gpu.source,
        }
        for name, gpu in GPUS.items()
    }
    defaults = serving.DEFAULT
    return {
        "models": models,
        "cards": cards,
        "counts": CARD_COUNTS,
        "prompts": PROMPTS,
        "outputs": OUTPUTS,
        "batches": BATCHES,
        "choices": serving.Conventions.choices(),
        "weight_bytes": defaults.weight_bytes,
        "kv_bytes": defaults.kv_bytes,
        "colours": {"prefill": PREFILL_COLOUR, "decode": DECODE_COLOUR},
    }


def _settings(model, card, count, prompt_tokens, output_tokens, batch, conventions) -> dict:
    """Check a starting setting against the controls' choices; return it as the page's JSON."""
    conv = conventions if conventions is not None else serving.DEFAULT
    if not isinstance(conv, serving.Conventions):
        raise ValueError(f"conventions must be a labsupport.serving.Conventions, got {type(conv).__name__}")
    if (conv.weight_bytes, conv.kv_bytes) != (serving.DEFAULT.weight_bytes, serving.DEFAULT.kv_bytes):
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
        **{name: getattr(conv, name) for name in serving.Conventions.choices()},
    }


# --- the roofline's frame, shared by both drawings ----------------------------------------------


def roofline_frame(report: serving.PhaseReport) -> tuple[float, float, float, float]:
    """Log-axis limits ``(x_min, x_max, y_min, y_max)`` that hold the roof and every point."""
    pts = [point for _, point, _ in roofline_points(report)]
    lo = min(min(p.intensity for p in pts), report.ridge_point)
    hi = max(max(p.intensity for p in pts), report.ridge_point)
    x_min = 10 ** math.floor(math.log10(lo / 2))
    x_max = 10 ** math.ceil(math.log10(hi * 2))
    y_low = min(min(p.attained_flops for p in pts), report.hbm_bandwidth * x_min)
    y_min = 10 ** math.floor(math.log10(y_low))
    y_max = 10 ** math.ceil(math.log10(report.peak_flops * 4))
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
    colours = {"prefill": PREFILL_COLOUR, "decode": DECODE_COLOUR}
    for key, point, phase in roofline_points(report):
        colour = colours[phase]
        hollow = key.endswith("-attention")
        align = "right" if point.intensity > middle else "left"
        ax.plot(
            [point.intensity],
            [point.attained_flops],
            "o",
            ms=10,
            color=colour,
            markerfacecolor="white" if hollow else colour,
            markeredgewidth=2.5,
            zorder=3,
        )
        offset = 0.8 if align == "right" else 1.25
        ax.text(
            point.intensity * offset,
            point.attained_flops * (1.8 if hollow else 1 / 1.6),
            f"{values[key + '-label']}\n{values[key + '-point']}",
            ha=align,
            va="bottom" if hollow else "top",
            fontsize=9,
            color=colour,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
        )
    ax.set_xlabel("arithmetic intensity (FLOP per byte read from memory)")
    ax.set_ylabel("attained FLOP/s")
    title = (
        "Prefill and decode on the roofline"
        if report.conventions.roofline == "merged"
        else "Each kernel on the roofline (filled: weight matmuls; hollow: attention)"
    )
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


# --- the static version (HTML book, no kernel) -------------------------------------------------


def _static(name: str) -> str:
    """A file of ``labsupport/explainer_static/`` (package data), as text."""
    return widget.package_text("explainer_static", name)


def _json_block(name: str, value) -> str:
    return widget.json_block("xp", name, value)


def _range(key: str, title: str) -> str:
    return (
        f'<label><span class="xp-head">{title} <output data-for="{key}"></output></span>'
        f'<input type="range" min="0" max="0" step="1" value="0" data-control="{key}" aria-label="{title}"></label>'
    )


_CONVENTION_TITLES = {
    "roofline": (
        "Roofline",
        {
            "per-kernel": "each kernel on its own, times summed",
            "merged": "one point per phase (the source's)",
        },
    ),
    "attention": (
        "Attention FLOPs",
        {"causal": "counted, causal", "full": "counted, no mask", "none": "left out (the source's)"},
    ),
    "params": (
        "Parameters",
        {"nominal": "nominal (the size in the name)", "counted": "counted (every weight)"},
    ),
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
}


def static_html(
    model: str = serving.SOURCE_MODEL,
    card: str = serving.SOURCE_CARD,
    count: int = serving.SOURCE_CARD_COUNT,
    prompt_tokens: int = serving.SOURCE_PROMPT,
    output_tokens: int = serving.SOURCE_OUTPUT,
    batch: int = serving.SOURCE_BATCH,
    conventions: serving.Conventions | None = None,
    element_id: str | None = None,
) -> str:
    """A self-contained HTML+JS explainer for a page without a kernel, starting at this setting.

    Slider values must be among :data:`PROMPTS`, :data:`OUTPUTS` and :data:`BATCHES`; ``card`` a
    name in :data:`labsupport.hardware.GPUS`; ``count`` in :data:`CARD_COUNTS`.
    """
    start = _settings(model, card, count, prompt_tokens, output_tokens, batch, conventions)
    element_id = widget.element_id(element_id, "c05x")
    # Starting values are rendered server-side too, so the page reads right before the script runs.
    _, text = compute(model, card, count, prompt_tokens, output_tokens, batch, conventions)
    return (
        f'<div id="{element_id}" class="c05x-explainer">'
        f"<style>{_static('explainer.css')}</style>"
        + _controls_html(start)
        + f'<div class="xp-bar"><div class="xp-bar-prefill" style="background:{PREFILL_COLOUR}"></div>'
        f'<div class="xp-bar-decode" style="background:{DECODE_COLOUR}"></div></div>'
        '<div class="xp-bar-legend">one request, start to finish: '
        f'<span style="color:{PREFILL_COLOUR}">prefill</span> then '
        f'<span style="color:{DECODE_COLOUR}">decode</span>; '
        f'<span class="xp-text" data-out="steps">{html.escape(text["steps"])}</span></div>'
        '<div class="xp-metrics">'
        + "".join(widget.metric("xp", key, name, text) for key, name in _METRICS)
        + "</div>"
        + _split_line("prefill-split", text)
        + _split_line("decode-split", text)
        + f'<p class="xp-memory xp-text" data-out="memory">{html.escape(text["memory"])}</p>'
        '<div class="xp-svg"></div>'
        f'<p class="xp-device xp-text" data-out="device">{html.escape(text["device"])}</p>'
        + _json_block("data", explainer_data())
        + _json_block("start", start)
        + widget.script("explainer_static", "explainer.js", "labsupportExplainer", element_id)
        + "</div>"
    )


_METRICS = [
    ("ttft", "Time to first token"),
    ("itl", "Inter-token latency"),
    ("latency", "Request latency"),
    ("throughput", "Throughput"),
]


def _controls_html(start: dict) -> str:
    """The sliders and selects, set at the starting setting, then the conventions folded away."""
    counts = widget.options(CARD_COUNTS, start["count"], lambda n: f"{n} card" + ("" if n == 1 else "s"))
    conventions_html = "".join(
        widget.select(key, title, widget.options(serving.Conventions.choices()[key], start[key],
                                                 lambda v, labels=labels: labels[v]))
        for key, (title, labels) in _CONVENTION_TITLES.items()
    )
    return (
        '<div class="xp-controls">'
        + _range("prompt", "Prompt")
        + _range("output", "Output")
        + _range("batch", "Requests in the batch")
        + widget.select("model", "Model", widget.options(MODELS, start["model"], model_label))
        + widget.select("card", "GPU", widget.options(list(GPUS), start["card"]))
        + widget.select("count", "Cards", counts)
        + "</div>"
        "<details><summary>Conventions (how the numbers are counted)</summary>"
        f'<div class="xp-controls">{conventions_html}</div></details>'
    )


def _split_line(key: str, text: dict[str, str]) -> str:
    """A phase's time split between its kernels; hidden (and empty) where ``text`` has none."""
    shown = key in text
    return (
        f'<p class="xp-split" data-split="{key}"'
        + (f' data-out="{key}">' if shown else " hidden>")
        + (html.escape(text[key]) if shown else "")
        + "</p>"
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
        + "".join(
            f'<div style="font-size:13px;color:#57606a">{html.escape(values[key])}</div>'
            for key in ("prefill-split", "decode-split")
            if key in values
        )
        + f'<div style="font-size:13px;color:{colour}">{html.escape(values["memory"])}</div>'
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
        conventions: serving.Conventions | None = None,
    ) -> None:
        import ipywidgets as w  # only for the live widget: the book and the labs' other code need it not

        start = _settings(model, card, count, prompt_tokens, output_tokens, batch, conventions)
        self._make_controls(w, start)
        self.metrics = w.HTML()
        self.figure = w.Image(format="png")
        controls = [self.prompt, self.output, self.batch, self.model, self.card, self.count,
                    *self.conventions.values()]
        for control in controls:
            control.observe(lambda _change: self.update(), names="value")
        conventions_box = w.Accordion(children=[w.VBox(list(self.conventions.values()))])
        conventions_box.set_title(0, "Conventions (how the numbers are counted)")
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

    def _make_controls(self, w, start: dict) -> None:
        """The sliders and dropdowns (``w`` is ipywidgets), set at the starting setting."""
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

        def dropdown(title, options, value):
            return w.Dropdown(options=options, value=value, description=title, style=wide, layout=layout)

        self.prompt = slider("Prompt (tokens)", PROMPTS, start["prompt"], token_label)
        self.output = slider("Output (tokens)", OUTPUTS, start["output"], token_label)
        self.batch = slider("Requests in batch", BATCHES, start["batch"], str)
        self.model = dropdown("Model", [(model_label(m), m) for m in MODELS], start["model"])
        self.card = dropdown("GPU", list(GPUS), start["card"])
        self.count = dropdown("Cards", CARD_COUNTS, start["count"])
        self.conventions = {
            key: dropdown(title, [(labels[v], v) for v in serving.Conventions.choices()[key]], start[key])
            for key, (title, labels) in _CONVENTION_TITLES.items()
        }

    def update(self) -> serving.PhaseReport:
        """Recompute from the controls, refresh the metrics and the roofline, return the report."""
        conv = serving.Conventions(**{k: c.value for k, c in self.conventions.items()})
        report, values = compute(
            self.model.value,
            self.card.value,
            self.count.value,
            self.prompt.value,
            self.output.value,
            self.batch.value,
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
