"""The figures of the book's chapters, drawn at build time from the course's own code.

Each ``*_figure()`` returns a matplotlib figure computed from ``labsupport`` (no number typed in,
nothing measured on a device: a figure that needs a GPU reads its results file elsewhere), in well
under a second on a CPU. A chapter page shows one in a hidden cell with :func:`glue` and a
``{glue:figure}`` directive whose caption says what was computed, the convention and the source.
:func:`glue` stores the PNG at twice the pixels it is shown at (sharp on high-density screens).
"""

from __future__ import annotations

import io
import math
import random

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Patch

from .. import planning, serving
from ..anatomy import COMPONENTS, param_count_by_component
from ..cache_waste import concurrent_usage
from ..collectives import ring_bytes_sent
from ..load_testing import closed_loop_latencies, fifo_latencies, poisson_arrivals
from ..quantize import fake_quantize, outlier_weight, relative_error
from ..scheduler import TraceItem, schedule_step, simulate
from ..speculative import expected_tokens_per_step

DPI = 200  # pixels per inch of the stored PNG; it is shown at half that (IPython's retina Image)
STYLE = {
    "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
    "xtick.labelsize": 9, "ytick.labelsize": 9, "axes.spines.top": False, "axes.spines.right": False,
    "figure.dpi": 100, "savefig.dpi": DPI, "savefig.bbox": "tight",
}
BLUE, ORANGE, GREEN, GREY, RED = "#0969da", "#d1600f", "#1a7f37", "#6e7781", "#b42318"


def glue(name: str, fig) -> None:
    """Glue ``fig`` under ``name`` as a PNG at :data:`DPI`, shown at half its pixels, and close it."""

    from IPython.display import Image  # only where a book page is built (IPython, myst-nb)
    from myst_nb import glue as myst_glue

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    myst_glue(name, Image(data=buffer.getvalue(), format="png", retina=True), display=False)


def _figure(width: float, height: float, ncols: int = 1):
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained")
    for ax in np.atleast_1d(axes):
        for key, value in STYLE.items():
            if key.startswith("axes.spines."):
                ax.spines[key.rsplit(".", 1)[1]].set_visible(value)
    return fig, axes


# --- 00 Start, 01 Tokens, 02 Anatomy ------------------------------------------------------------------


def request_timeline_figure(model: str = "llama-3.1-8b", card: str = "H100", prompt_tokens: int = 2000,
                            output_tokens: int = 200):
    """Chapter 00: one request's life as the course's roofline model counts it (chapter 05; a model,
    not a measurement): one prefill, then one decode step per further token, each step reading the
    weights again."""

    report = serving.phases(model, serving.serving_gpu(card, 1), prompt_tokens, output_tokens, 1)
    steps = output_tokens - 1
    ttft, itl = report.ttft * 1e3, report.itl * 1e3
    fig, ax = _figure(6.9, 2.0)
    ax.barh(0, ttft, color=ORANGE, height=0.5)
    ax.barh(0, steps * itl, left=ttft, color=BLUE, height=0.5)
    ax.vlines(ttft + itl * np.arange(1, steps), -0.25, 0.25, color="white", lw=0.3)  # one line per step
    ax.annotate(f"prefill: the {prompt_tokens:,} prompt tokens at once, {ttft:.0f} ms (time to first token)",
                (ttft / 2, 0.25), (0, 0.62), textcoords=("data", "data"), fontsize=9, color=ORANGE,
                arrowprops={"arrowstyle": "-", "color": ORANGE})
    ax.text(ttft + steps * itl / 2, -0.45, f"decode: {steps} steps of {itl:.1f} ms, one token each",
            ha="center", va="top", fontsize=9, color=BLUE)
    ax.set(yticks=[], xlabel="ms after the request starts", ylim=(-0.95, 0.9),
           title=f"One request on {model}, bf16, one {card}: chapter 05's roofline model")
    ax.spines["left"].set_visible(False)
    return fig


def tokens_by_kind_figure(by_size: dict):
    """Chapter 01: characters per token for each kind of text, for tokenizers of several vocabulary
    sizes trained on the course corpus (``by_size``: vocabulary size -> :func:`compression_by_kind`)."""
    sizes = sorted(by_size)
    kinds = list(by_size[sizes[0]])
    fig, ax = _figure(6.9, 3.2)
    width = 0.8 / len(sizes)
    for i, (v, colour) in enumerate(zip(sizes, (GREY, BLUE, ORANGE))):
        ax.bar(np.arange(len(kinds)) + (i - (len(sizes) - 1) / 2) * width,
               [by_size[v][k].chars_per_token for k in kinds], width, color=colour, label=f"{v:,} ids")
    ax.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right")
    ax.set(ylabel="characters per token", title="The same tokenizer compresses each kind of text differently")
    ax.legend(frameon=False, title="vocabulary", title_fontsize=9)
    return fig


def parameters_by_component_figure(models=("qwen3-0.6b", "llama-3.1-8b", "qwen3-8b", "llama-3.1-70b")):
    """Chapter 02: where each model's parameters are, by component (chapter 02's formulas,
    :func:`labsupport.anatomy.param_count_by_component`)."""

    colours = {"embedding": GREY, "attention": BLUE, "feed_forward": ORANGE, "norms": GREEN, "output": RED}
    fig, ax = _figure(6.9, 2.7)
    for row, name in enumerate(models):
        counts = param_count_by_component(name)
        total, left = sum(counts.values()), 0.0
        for part in COMPONENTS:
            share = counts.get(part, 0) / total
            ax.barh(row, share, left=left, color=colours[part], label=part.replace("_", "-") if row == 0 else None)
            left += share
        ax.text(1.01, row, f"{total / 1e9:.2f} B", va="center", fontsize=9)
    ax.set_yticks(range(len(models)), models)
    ax.invert_yaxis()
    ax.set(xlabel="share of the parameters", xlim=(0, 1), title="Where the parameters are")
    ax.legend(frameon=False, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.32), fontsize=8.5)
    return fig


# --- 09 Precision -------------------------------------------------------------------------------


def _positive_values(dtype: torch.dtype) -> np.ndarray:
    """Every finite positive value ``dtype`` can hold, from its bit patterns, in increasing order."""
    bits = torch.iinfo(torch.int16).bits if torch.finfo(dtype).bits == 16 else 8
    raw = torch.arange(2**bits, dtype=torch.int32).to(torch.int16 if bits == 16 else torch.uint8)
    values = raw.view(dtype).float()
    values = values[torch.isfinite(values) & (values > 0)]
    return np.unique(values.double().numpy())


def precision_formats_figure():
    """Chapter 09: the grid each format rounds to (the gap to the next value, relative to the value,
    against the value) and what rounding costs a weight matrix with outliers, by quantisation group."""

    fig, (grid, error) = _figure(6.9, 3.6, 2)
    for dtype, label, colour in ((torch.float16, "fp16", BLUE), (torch.bfloat16, "bf16", GREEN),
                                 (torch.float8_e4m3fn, "fp8 e4m3", ORANGE), (torch.float8_e5m2, "fp8 e5m2", RED)):
        v = _positive_values(dtype)
        gap = np.diff(v) / v[:-1]
        at = np.log2(v[:-1]) % 1 == 0  # at each power of two: the largest relative gap of its binade
        grid.plot(v[:-1][at], gap[at], color=colour, label=f"{label}, to {v[-1]:.3g}", lw=1.6)
    grid.set(xscale="log", yscale="log", xlabel="value", ylabel="relative gap to the next value",
             title="The grid each format rounds to", xlim=(1e-8, 1e6), ylim=(1e-5, 2))
    grid.legend(frameon=False, loc="lower right", fontsize=8.5)
    w = outlier_weight()
    sizes = (32, 64, 128, 512)
    for bits, colour in ((8, BLUE), (4, ORANGE)):
        errs = [relative_error(fake_quantize(w, bits, g, True), w) for g in sizes]
        error.plot(sizes, errs, "o-", color=colour, label=f"int{bits}, per group")
        error.axhline(relative_error(fake_quantize(w, bits, "channel", True), w), color=colour, ls="--", lw=1,
                      label=f"int{bits}, per row")
    error.set(xscale="log", yscale="log", xlabel="group size (weights sharing one scale)",
              ylabel="relative error of the weights", title="Quantisation error")
    error.minorticks_off()
    error.set_xticks(sizes, [str(s) for s in sizes])
    error.legend(frameon=False, fontsize=8.5)
    return fig


# --- 10 Cache ops ---------------------------------------------------------------------------------


def cache_day_figure(requests: dict, *, max_len: int, block_size: int = 16):
    """Chapter 10: tokens the cache holds over the day, against what a paged cache (blocks of
    ``block_size``) and a contiguous one (``max_len`` slots per request) keep reserved for them."""

    use = concurrent_usage(requests, max_len=max_len, block_size=block_size)
    per = 15  # samples (minutes) averaged into one point: a quarter of an hour
    mean = {k: v[: len(v) // per * per].reshape(-1, per).mean(axis=1) for k, v in use.items()}
    hours = mean["time_s"] / 3600 + per / 120
    fig, ax = _figure(6.9, 3.2)
    ax.plot(hours, mean["reserved"] / 1e3, color=RED, label=f"contiguous: {max_len:,} slots reserved per request")
    ax.plot(hours, mean["paged"] / 1e3, color=BLUE, lw=3, label=f"paged: blocks of {block_size} tokens")
    ax.plot(hours, mean["held"] / 1e3, color="black", lw=1, label="tokens the requests hold")
    ax.set(xlabel="hour of the day", ylabel="thousand token slots (15-minute mean)", xlim=(0, 24), ylim=(0, None),
           title="Cache slots in use over a day of requests")
    ax.set_xticks(range(0, 25, 3))
    ax.legend(frameon=False, loc="upper left")
    return fig


# --- 11 Many GPUs ---------------------------------------------------------------------------------


def all_reduce_bytes_figure(max_gpus: int = 16):
    """Chapter 11: a ring all-reduce on n GPUs: what each GPU sends, as a share of the message
    (2(n - 1)/n), and how many steps it waits through one after another (2(n - 1)), against n. A
    time is the first over one link's bandwidth plus the second times one hop's latency."""

    gpus = np.arange(2, max_gpus + 1)
    fig, ax = _figure(6.4, 3.2)
    ax.plot(gpus, [ring_bytes_sent(1.0, int(n)) for n in gpus], "o-", color=BLUE,
            label="bytes each GPU sends, per byte of the message")
    ax.axhline(2, color=BLUE, ls=":", lw=1)
    ax.set(xlabel="GPUs in the ring (n)", ylabel="bytes sent / message size", ylim=(0, 2.2),
           title="A ring all-reduce: bytes level off, steps keep growing")
    ax.set_xticks(gpus[::2])
    steps = ax.twinx()
    steps.plot(gpus, 2 * (gpus - 1), "s--", color=ORANGE, label="steps in sequence, 2(n - 1)")
    steps.set_ylabel("steps (each pays a hop's latency)", color=ORANGE)
    steps.spines["top"].set_visible(False)
    lines = ax.get_lines()[:1] + steps.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], frameon=False, loc="lower right")
    return fig


# --- 12 / 13 Engines and the decode loop -----------------------------------------------------------


def engine_steps_figure(prompt_lengths=(5, 40, 9, 23, 3), *, output_len: int = 6, token_budget: int = 16,
                        max_running: int = 4):
    """Chapters 12 and 13: the course scheduler's steps (:func:`labsupport.scheduler.schedule_step`,
    the decision the engine takes each step, simulated without a model, so counted in steps and the
    same on every machine) for requests that arrive together: each request's prefill chunks and
    decodes, step by step, and the tokens in each step against the budget."""

    trace = [TraceItem(0, n, output_len) for n in prompt_lengths]
    steps = []
    simulate(schedule_step, trace, token_budget=token_budget, num_blocks=64, block_size=8,
             max_running=max_running, observe=steps.append)
    with plt.rc_context(STYLE):
        fig, (lanes, totals) = plt.subplots(2, 1, figsize=(6.9, 4.4), sharex=True, layout="constrained",
                                            gridspec_kw={"height_ratios": [3, 1.3]})
    prefill_total, decode_total = np.zeros(len(steps)), np.zeros(len(steps))
    for s in steps:
        views = {v.request_id: v for v in (*s.running, *s.waiting)}
        for rid, n in s.scheduled.items():
            prefill = views[rid].num_computed < trace[rid].prompt_len
            colour = ORANGE if prefill else BLUE
            lanes.barh(rid, 0.9, left=s.step - 0.45, height=0.7, color=colour)
            if prefill:
                lanes.text(s.step, rid, str(n), ha="center", va="center", fontsize=7.5, color="white")
                prefill_total[s.step] += n
            else:
                decode_total[s.step] += n
        for v in s.waiting:
            if v.request_id not in s.scheduled:
                lanes.barh(v.request_id, 0.9, left=s.step - 0.45, height=0.7, color="#eaeef2")
    lanes.set_yticks(range(len(trace)), [f"request {i} ({n} tokens)" for i, n in enumerate(prompt_lengths)])
    lanes.invert_yaxis()
    lanes.set_title(f"The scheduler's steps: budget {token_budget} tokens, at most {max_running} running")
    lanes.legend(handles=[Patch(color=ORANGE, label="prefill chunk (its tokens)"),
                          Patch(color=BLUE, label="decode (one token)"), Patch(color="#eaeef2", label="waiting")],
                 frameon=False, loc="upper right", fontsize=8.5)
    x = np.arange(len(steps))
    totals.bar(x, prefill_total, color=ORANGE)
    totals.bar(x, decode_total, bottom=prefill_total, color=BLUE)
    totals.axhline(token_budget, color="black", ls="--", lw=1)
    totals.set(xlabel="step (one forward pass)", ylabel="tokens")
    for ax in (lanes, totals):
        ax.spines[["top", "right"]].set_visible(False)
    return fig


def speculative_figure(alphas=(0.5, 0.7, 0.8, 0.9), max_k: int = 8):
    """Chapter 13: tokens a speculative step yields against the draft length ``k``, for several
    acceptance rates (each drafted token accepted with probability alpha, independently)."""

    ks = np.arange(0, max_k + 1)
    fig, ax = _figure(6.4, 3.2)
    for alpha, colour in zip(alphas, (GREY, BLUE, GREEN, ORANGE)):
        ax.plot(ks, [expected_tokens_per_step(alpha, int(k)) for k in ks], "o-", color=colour,
                label=f"acceptance {alpha:.0%}: at most {1 / (1 - alpha):.0f}")
    ax.set(xlabel="draft length k (tokens proposed per step)", ylabel="tokens per target step",
           title="What a speculative step yields", ylim=(0, None))
    ax.set_xticks(ks)
    ax.legend(frameon=False, title="(1 - alpha^(k+1)) / (1 - alpha)", title_fontsize=8.5)
    return fig


# --- 14 Planning ----------------------------------------------------------------------------------


def planner_figure(model, context_tokens: int, tpot_target_s: float, *, memory_gib: float, **hardware):
    """Chapter 14: the planner's decode step against the batch (the memory and compute rooflines'
    maximum plus overhead), with the TPOT target and the batch ``memory_gib`` of memory holds. The
    step is the plan's (``read_exact``: the bytes a step reads, as :func:`labsupport.planning.plan`
    and the chapter's figures price it)."""

    batches = np.unique(np.logspace(0, 10, 60, base=2).astype(int))
    steps = [planning.decode_step_time(model, int(b), context_tokens, **hardware, read_exact=True) * 1e3
             for b in batches]
    by_tpot = planning.max_batch_for_tpot(model, context_tokens, tpot_target_s, **hardware, read_exact=True)
    memory = {k: v for k, v in hardware.items() if k in ("weight_dtype_bytes", "kv_dtype_bytes")}
    by_memory = planning.max_batch_in_memory(model, context_tokens, memory_gib=memory_gib, **memory)
    fig, ax = _figure(6.4, 3.3)
    ax.plot(batches, steps, color=BLUE, lw=2, label="decode step (planner)")
    ax.axhline(tpot_target_s * 1e3, color=ORANGE, ls="--", label=f"TPOT target {tpot_target_s * 1e3:.0f} ms")
    ax.axvline(by_tpot, color=ORANGE, lw=1, ls=":", label=f"largest batch for the target: {by_tpot}")
    ax.axvline(by_memory, color=RED, lw=1, ls=":", label=f"largest batch the memory holds: {by_memory}")
    ax.set(xscale="log", xlabel="batch (sequences decoding together)", ylabel="ms per decode step",
           title=f"Decode step against batch, {context_tokens:,} tokens of context")
    ax.legend(frameon=False, loc="upper left")
    return fig


# --- 15 Production --------------------------------------------------------------------------------


def _p(values, q):
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values) / 100) - 1)]


def knee_figure(service_s: float = 0.1, n: int = 4000, seed: int = 0, *, duration_s: float = 60.0,
                stall: tuple[float, float] = (20.0, 5.0), load: float = 0.5):
    """Chapter 15: (left) latency percentiles of a one-at-a-time server (each request takes
    ``service_s``) under Poisson arrivals, against the offered load; (right) the same stall (the
    server stops at ``stall[0]`` s for ``stall[1]`` s of a ``duration_s`` run at ``load`` of its
    capacity) seen by an open-loop and a closed-loop load generator (coordinated omission)."""


    fig, (knee, omission) = _figure(6.9, 3.6, 2)
    loads = np.linspace(0.1, 0.95, 18)
    for q, colour in ((50, BLUE), (90, ORANGE), (99, RED)):
        lat = [_p(fifo_latencies(poisson_arrivals(n, rho / service_s, random.Random(seed)), service_s), q)
               for rho in loads]
        knee.plot(loads * 100, np.array(lat) / service_s, "o-", ms=3, color=colour, label=f"p{q}")
    knee.set(xlabel="offered load (% of capacity)", ylabel="latency (service times)", yscale="log",
             title="The knee")
    knee.legend(frameon=False, loc="upper left")
    duration, rate = duration_s, load / service_s
    sent = sorted(poisson_arrivals(int(rate * duration), rate, random.Random(seed)))
    open_lat = fifo_latencies(sent, service_s, stall)
    closed_lat = closed_loop_latencies(duration, service_s, stall)
    closed_sent = np.concatenate([[0.0], np.cumsum(closed_lat)[:-1]])
    omission.axvspan(stall[0], stall[0] + stall[1], color="#eaeef2", label="the server stalls")
    omission.plot(sent, open_lat, ".", ms=4, color=ORANGE,
                  label=f"open loop: p90 {_p(open_lat, 90):.2f} s")
    omission.plot(closed_sent, closed_lat, ".", ms=3, color=BLUE,
                  label=f"closed loop: p90 {_p(closed_lat, 90):.2f} s")
    omission.set(yscale="log", xlabel="time the request was sent (s)", ylabel="latency (s)",
                 title=f"A {stall[1]:.0f} s stall at {load:.0%} of the capacity")
    omission.legend(frameon=False, fontsize=8.5, loc="upper right")
    return fig


# --- 16 Your stack ------------------------------------------------------------------------------------


def capstone_figure(figures_: dict, costs: dict[str, dict[str, float]]):
    """Chapter 16: a recorded run (``labsupport.capstone``): (left) each stack's latency percentiles
    from the report's figures; (right) the milliseconds per engine step of each of the learner's parts
    (``stack_profile``, :func:`labsupport.capstone.slot_costs`), the whole step of each stack beside them."""
    fig, (latency, parts) = _figure(6.9, 3.4, 2)
    labels = ["TTFT p50", "TTFT p90", "TPOT p50"]
    width = 0.38
    for k, (name, colour) in enumerate((("yours", ORANGE), ("course", BLUE))):
        f = figures_[name]
        values = [f["ttft_s"][50] * 1e3, f["ttft_s"][90] * 1e3, f["tpot_s"][50] * 1e3]
        latency.bar(np.arange(3) + (k - 0.5) * width, values, width, color=colour,
                    label="the solutions' stack" if name == "yours" else "the course's stack")
    latency.set_xticks(np.arange(3), labels)
    latency.set(ylabel="ms", title="Latency, same trace")
    latency.set_ylim(0, latency.get_ylim()[1] * 1.3)  # room for the legend above the bars
    latency.legend(frameon=False, fontsize=8.5, loc="upper left", ncols=1)
    # the parts the trace called (a kernel checked once at start-up has no time in the run)
    mine = sorted((k for k, v in costs["yours"].items() if k != "step" and v > 0), key=costs["yours"].get)
    rows = [*mine, "step (yours)", "step (course)"]
    values = [costs["yours"][k] * 1e3 for k in mine] + [costs["yours"]["step"] * 1e3, costs["course"]["step"] * 1e3]
    colours = [ORANGE] * len(mine) + [GREY, BLUE]
    parts.barh(np.arange(len(rows)), values, color=colours)
    parts.set_yticks(np.arange(len(rows)), rows)
    parts.set(xscale="log", xlabel="ms per engine step (log)", title="Profile by slot")
    return fig
