# Lab 05 source of truth. Edit this file, then run `python -m labsupport release 05_phases` to
# regenerate labs/05_phases.ipynb (learners) and solutions/05_phases.ipynb (instructors).

# %% [markdown]
# # Lab 05: prefill and decode, measured
#
# A request is served in two phases. **Prefill** runs every prompt position through the model
# together, in a single forward pass; **decode** then adds the answer token by token, a full
# forward pass for each. Chapter 05 argues from arithmetic that the
# first is limited by arithmetic and the second by memory traffic. In this lab you check that
# argument against a real model running on your device.
#
# You will
#
# 1. measure your device's two ceilings: a copy's bandwidth and a matmul's FLOP/s;
# 2. time prefill against prompt length, fit a linear and a quadratic term, and compare the
#    measured crossover with the predicted one, $N / 2Ld$;
# 3. time decode steps against batch size and against context length;
# 4. write the FLOP count of a prefill, with its quadratic attention term, have it graded, and
#    hold your measured prefill times against it;
# 5. write the bytes one decode step reads, weights plus every sequence's KV cache, have it graded,
#    and turn the decode times into achieved bandwidth;
# 6. place what you measured on your device's roofline, and try the phase explainer.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. This lab takes all
# its measurements (sections 1 to 3) before the first exercise, so a first Run All already times
# both phases on your device; the analysis that needs your functions follows each exercise.
#
# The model is `labsupport.transformer.Transformer`: a Llama-style decoder in one file with random
# weights. How long a pass takes does not depend on the weights' values, so a random model times
# exactly like a trained one of the same shape. On a GPU the lab uses the shape of Llama 3.1 8B;
# on a CPU, small shapes chosen so the same effects appear within seconds.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import math

import matplotlib.pyplot as plt
import torch

from labsupport import ledger
from labsupport.checks import check_decode_bytes, check_prefill_flops
from labsupport.costs import decode_step_flops, param_count
from labsupport.device import device, lab_dtype
from labsupport.hardware import match_device_name
from labsupport.models import get_model
from labsupport.phases import (
    cpu_threads,
    fit_prefill_times,
    measure_decode,
    measure_prefill,
    unread_embedding_bytes,
)
from labsupport.roofline import measure_copy, measure_matmul, plot_roofline
from labsupport.transformer import Transformer

DEVICE = device()
DTYPE = lab_dtype()  # bf16 (fp16 before Ampere) on a GPU, fp32 on a CPU
DTYPE_BYTES = torch.empty((), dtype=DTYPE).element_size()  # 2 for bf16, 4 for fp32
# On a CPU, time with one thread: on a small machine shared with other work, threads waiting for
# a busy core make single timings erratic. On a GPU this setting does nothing.
THREADS = settings.pick(small=1, full=None)
LLAMA_8B = get_model("llama-3.1-8b")
# The GPU preset measures the 8B shape: its weights, plus room for activations and caches.
# A GPU with less than twice that (Colab's T4 has 15 GiB) measures smaller models instead.
BIG_FITS = settings.on_gpu and settings.memory_bytes >= 2 * param_count(LLAMA_8B) * DTYPE_BYTES
if settings.on_gpu and not BIG_FITS:
    print(f"{settings.device_name} has too little memory for the 8B shape; parts 4 and 5 use smaller models")

# %% [markdown]
# ## 1. Your device's two ceilings
#
# To judge a measurement you need the ceilings it is measured against. Lab 04 measures them in
# detail; here a quick version: the FLOP/s of a large matmul, and the bandwidth of a large copy
# (counted as reading and writing every byte). On a CPU the buffers are larger than the
# last-level cache, so the copy measures main memory, as the decode steps below will.

# %%
matmul_sizes = settings.pick(small=[512, 1024], full=[4096, 8192])
copy_mib = settings.pick(small=[128], full=[1024, 4096])
with cpu_threads(THREADS):
    peak = max(measure_matmul(matmul_sizes, dtype=DTYPE, device=DEVICE))
    copy_bandwidth = max(measure_copy([mib * 2**20 for mib in copy_mib], device=DEVICE))
print(f"matmul: {peak / 1e12:.3f} TFLOP/s   copy: {copy_bandwidth / 1e9:.1f} GB/s   ridge: {peak / copy_bandwidth:.0f} FLOP/B")

# %% [markdown]
# ## 2. Prefill time against prompt length
#
# If the time of a prefill follows its FLOPs, it should be `a*P + b*P**2` plus a small fixed
# overhead: the linear term from the weights (a multiply and an add per weight per token), the
# quadratic one from attention (every position scored against every other); section 4 has you
# write the full count. Fit those terms to
# measured times and the *measured* crossover is `a / b`, the length at which attention takes
# as long as everything else.
#
# The model for this part is chosen so the crossover falls inside the lengths measured: on a CPU
# `tiny-2m`, whose $N/2Ld$ is about a thousand tokens; on a GPU, the shape of Llama 3.1 8B in
# bf16, measured up to 32,768 tokens (`tiny-20m` on a GPU with too little memory for the 8B).

# %%
prefill_cfg = get_model(settings.pick(small="tiny-2m", full="llama-3.1-8b" if BIG_FITS else "tiny-20m"))
prefill_model = Transformer(prefill_cfg, device=DEVICE, dtype=DTYPE)
lengths = settings.pick(
    small=[64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096],
    full=[512, 1024, 2048, 4096, 8192, 16384, 32768],
)
print(prefill_model)
prefill_points = measure_prefill(prefill_model, lengths, threads=THREADS, repeats=3)
measured = [pt for pt in prefill_points if not pt.oom]
for pt in prefill_points:
    print(f"P = {pt.prompt_tokens:>6,}: " + ("out of memory" if pt.oom else f"{pt.seconds * 1e3:9.2f} ms"))

# %% [markdown]
# Fit the two terms (and a constant for fixed overheads). The fit weighs every point by its
# relative error, so the short prompts count as much as the long ones.

# %%
fit = fit_prefill_times([pt.prompt_tokens for pt in measured], [pt.seconds for pt in measured])
predicted = param_count(prefill_cfg) / (2 * prefill_cfg.n_layers * prefill_cfg.d_model)
print(fit)
print(f"measured crossover a/b : {fit.crossover:,.0f} tokens")
print(f"predicted N/2Ld        : {predicted:,.0f} tokens (no causal halving); {2 * predicted:,.0f} with it")

# %%
ps = torch.linspace(min(lengths), max(lengths), 200).tolist()
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([pt.prompt_tokens for pt in measured], [pt.seconds * 1e3 for pt in measured], "o", label="measured")
ax.plot(ps, [fit.predict(p) * 1e3 for p in ps], "-", label="fit: a*P + b*P^2 + c")
ax.plot(ps, [fit.linear * p * 1e3 for p in ps], "--", label="linear part a*P")
ax.plot(ps, [fit.quadratic * p * p * 1e3 for p in ps], ":", label="quadratic part b*P^2")
if math.isfinite(fit.crossover) and fit.crossover < 4 * max(lengths):
    ax.axvline(fit.crossover, color="0.3", lw=1, label=f"measured crossover {fit.crossover:,.0f}")
ax.axvline(predicted, color="C3", lw=1, ls="-.", label=f"N/2Ld = {predicted:,.0f}")
ax.set_xlabel("prompt length P (tokens)")
ax.set_ylabel("prefill time (ms)")
ax.set_title(f"Prefill of {prefill_cfg.name} on {settings.device_name}")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 3. Decode step time against batch and against context
#
# A decode step reads every weight and every cache. Each step is timed at a fixed context: the
# cache is allocated and declared full up to that context (its values are zeros, which take as
# long to read as any others). Section 5 turns these times into achieved bandwidth, once you
# have counted the bytes a step reads.
#
# On a CPU this part uses `small-63m`, about 250 MB of fp32 weights: several times a CPU's
# last-level cache, so the weights really stream from memory each step. On a GPU it uses the
# 8B shape, and large batch x context points may not fit: a point that runs out of memory is
# recorded as such. That is the **cache wall**, and it is a result, not a crash.

# %%
decode_cfg = get_model(settings.pick(small="small-63m", full="llama-3.1-8b" if BIG_FITS else "small-63m"))
if decode_cfg is prefill_cfg:
    decode_model = prefill_model
else:
    del prefill_model
    decode_model = Transformer(decode_cfg, device=DEVICE, dtype=DTYPE)
fixed_context = 128  # short, so the weights are nearly all of the read: this sweep is about the batch
batches = settings.pick(small=[1, 2, 4, 8, 16, 32], full=[1, 8, 32, 64, 128])
by_batch = measure_decode(decode_model, batches, [fixed_context], threads=THREADS, repeats=3)
contexts = settings.pick(small=[128, 2048, 8192, 32768], full=[1024, 8192, 32768, 131072])
by_context = measure_decode(decode_model, [1], contexts, threads=THREADS, repeats=3)

# %%
for point in by_batch + by_context:
    where = f"batch {point.batch:>3} x context {point.context:>7,}"
    print(f"{where}: " + ("out of memory" if point.oom else f"{point.seconds * 1e3:8.2f} ms/step"))

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
dtype_name = str(DTYPE)[6:]
ledger.record("05_phases", [
    ledger.Figure("matmul_peak", peak / 1e12, "TFLOP/s", f"best {dtype_name} square matmul, n up to {matmul_sizes[-1]}; 2n^3 FLOPs over median time"),
    ledger.Figure("copy_bandwidth", copy_bandwidth / 1e9, "GB/s", f"best copy, buffers up to {copy_mib[-1]} MiB; bytes read + written over median time"),
    *(ledger.Figure(f"prefill_ms_len{pt.prompt_tokens}", pt.seconds * 1e3, "ms", f"{prefill_cfg.name} prefill, batch 1, {dtype_name}; median time")
      for pt in measured),
    ledger.Figure("prefill_crossover", fit.crossover, "tokens", f"a/b of the fit a*P + b*P^2 + c to the {prefill_cfg.name} prefill times"),
    *(ledger.Figure(f"decode_step_b{pt.batch}_ctx{pt.context}", pt.seconds * 1e3, "ms", f"{decode_cfg.name} decode step, {dtype_name}; median time, eager")
      for pt in {(p.batch, p.context): p for p in by_batch + by_context if not p.oom}.values()),  # (1, 128) is in both
], timings_real=True)  # torch code only: real timings on a CPU too

# %% [markdown]
# ## 4. The FLOPs of a prefill
#
# Prefill applies every weight to every prompt position: a weight is one multiply and one add per
# position, so a model of $N$ parameters costs $2NP$ FLOPs for a prompt of $P$ tokens. That is
# the *linear* term.
#
# Attention adds work that no weight accounts for. In each of the $L$ layers, every position's
# query is scored against every position's key: per head a $(P \times d_{head}) \cdot (d_{head}
# \times P)$ product, $2P^2 d_{head}$ FLOPs, so $2P^2 d_q$ over all the heads, where
# $d_q = n_{heads} \cdot d_{head}$ is the width of the queries together. The resulting weights then
# blend the values, the same again. That is the *quadratic* term, $4LP^2d_q$:
#
# $$\text{prefill FLOPs} = 2NP + 4LP^2d_q.$$
#
# In Llama models, and in every model this lab times, $d_q$ is the model width $d$
# (`cfg.d_model`), which is how the course's source material writes it: $4LP^2d$. Not in every
# model: Qwen3-0.6B puts 16 heads of 128 on a width of 1,024, so its queries are 2,048 wide, and
# counting with $d$ would miss half its attention. The check includes such a model, so count with
# the width the scores really multiply.
#
# This counts attention as if every query saw every key, the convention the course's source
# material uses. A causal model only lets a query see the keys before it, so a kernel that skips
# the masked half does half the attention work: with `causal=True`, halve the quadratic term.
#
# The prompt length at which the quadratic term catches up with the linear one is the
# **crossover**, $P = N / 2Ld_q$ ($N / 2Ld$ in the models timed here). Short of it, a prompt twice as long costs about twice as much;
# far beyond it, close to four times as much.
#
# `param_count(cfg)` gives $N$ (every weight, embeddings included); `cfg.n_layers` is $L$ and
# `cfg.n_heads * cfg.head_dim` is $d_q$ (`cfg.head_dim` is given by the model: do not derive it
# from `cfg.d_model`).

# %% [markdown]
# ### Exercise 1: count the FLOPs of a prefill

# %%
def prefill_flops(cfg, prompt_tokens, causal=False):
    """FLOPs to prefill `prompt_tokens` positions: 2*N*P + 4*L*P**2*d_q, attention halved if causal."""
    # BEGIN SOLUTION: return the FLOPs of the weights plus those of attention, as derived above (mind causal)
    n = param_count(cfg)
    attention = 4 * cfg.n_layers * prompt_tokens**2 * cfg.n_heads * cfg.head_dim
    if causal:
        attention /= 2
    return 2 * n * prompt_tokens + attention
    # END SOLUTION

# %%
check_prefill_flops(prefill_flops)

# %% [markdown]
# Your function now gives the runbook's figures for Llama 3.1 8B. Notice how the ratio of a 32k
# prefill to a 2k one is far above 16, the ratio of the lengths.

# %% tags=["nbval-check-output"]
for p in (2048, 32768):
    full, causal = prefill_flops(LLAMA_8B, p), prefill_flops(LLAMA_8B, p, causal=True)
    share = 1 - 2 * param_count(LLAMA_8B) * p / full
    print(f"8B, {p:>6,} tokens: {full / 1e12:7.1f} TFLOP ({causal / 1e12:6.1f} causal); attention {share:.0%}")
ratio = prefill_flops(LLAMA_8B, 32768) / prefill_flops(LLAMA_8B, 2048)
ratio_causal = prefill_flops(LLAMA_8B, 32768, causal=True) / prefill_flops(LLAMA_8B, 2048, causal=True)
crossover_8b = param_count(LLAMA_8B) / (2 * LLAMA_8B.n_layers * LLAMA_8B.d_model)
print(f"32k / 2k: {ratio:.1f}x ({ratio_causal:.1f}x causal); crossover N/2Ld = {crossover_8b:,.0f} tokens")

# %% [markdown]
# Why might the measured crossover differ from $N / 2Ld$? Three reasons, each worth checking
# against your numbers:
#
# * **The causal mask.** `sdpa` skips (most of) the masked half of the scores, so the attention
#   actually done is half of $4LP^2d$ and the crossover moves towards $2 \cdot N/2Ld$.
# * **Not every weight does work per token.** $N$ counts the embedding table, but looking up a
#   row is not a matmul, and the output head runs only on the last position.
# * **Attention runs at a different speed from a matmul.** Its FLOPs come in many small per-head
#   products and a softmax; a slower attention kernel pulls the crossover to shorter prompts.

# %%
long, short = max(pt.prompt_tokens for pt in measured), None
short = min((pt.prompt_tokens for pt in measured), key=lambda p: abs(p * 16 - long))
print(
    f"{long:,} over {short:,} tokens: measured {fit.predict(long) / fit.predict(short):.1f}x "
    f"(fitted times), FLOP count {prefill_flops(prefill_cfg, long) / prefill_flops(prefill_cfg, short):.1f}x "
    f"({prefill_flops(prefill_cfg, long, True) / prefill_flops(prefill_cfg, short, True):.1f}x causal), "
    f"length ratio {long / short:.0f}x"
)

# %% [markdown]
# ## 5. The bytes a decode step reads
#
# A decode step produces one token for each of the `batch` sequences. To do it, the GPU reads
# every weight once (the whole batch shares that read) and, for attention, the keys and values
# of every earlier token of **every** sequence: each sequence has its own cache.
#
# One token's cache is a key and a value vector in every layer for every *key/value* head.
# Under grouped-query attention several query heads share one key/value head, so the cache uses
# `cfg.n_kv_heads`, not `cfg.n_heads`:
#
# $$\text{cache bytes per token} = 2 \cdot L \cdot H_{kv} \cdot d_{head} \cdot b, \qquad
#   \text{bytes per step} = N b + \text{batch} \cdot \text{context} \cdot 2 L H_{kv} d_{head} b,$$
#
# with $b$ bytes per value: 2 for bf16, the default. `cfg.head_dim` is $d_{head}$, as the model
# gives it (not always `cfg.d_model // cfg.n_heads`: Qwen3-0.6B's heads are 128 wide on a width of
# 1,024 with 16 heads). Context is the number of earlier tokens, whose keys and values are in the
# cache. (Activations are tiny at decode and are left out.)

# %% [markdown]
# ### Exercise 2: count the bytes one decode step reads

# %%
def decode_bytes_per_step(cfg, batch, context, dtype_bytes=2):
    """Bytes read by one decode step: every weight once, plus `batch` caches of `context` tokens."""
    # BEGIN SOLUTION: return the bytes one step reads: all weights, plus each sequence's cached keys and values
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    return param_count(cfg) * dtype_bytes + batch * context * per_token
    # END SOLUTION

# %%
check_decode_bytes(decode_bytes_per_step)

# %% [markdown]
# At a batch of 64 sequences of 8,192 tokens each, the cache is most of what a step reads:

# %% tags=["nbval-check-output"]
weights_only = decode_bytes_per_step(LLAMA_8B, 64, 0)
total = decode_bytes_per_step(LLAMA_8B, 64, 8192)
print(
    f"8B, batch 64 x 8,192: weights {weights_only / 1e9:.2f} GB, cache {(total - weights_only) / 1e9:.1f} GB, "
    f"cache share {1 - weights_only / total:.0%}, {total / weights_only:.1f}x the weights-only read"
)

# %% [markdown]
# ### Achieved bandwidth
#
# If a decode step is limited by memory, its time is about bytes read divided by bandwidth, and
# **achieved bandwidth**, your `decode_bytes_per_step` over the measured step time (section 3),
# should be a large fraction of the copy bandwidth of section 1.
#
# One correction before dividing: your count charges every weight to every step, as the runbook
# does. But a step looks up only one row of the *input* embedding table per sequence. Where that
# table is separate from the output head (Llama 3.1 8B: about 1 GB in bf16) the rest of it is
# never read, so `unread_embedding_bytes` subtracts it. For the CPU preset, whose table doubles as
# the output head and is read in full, it is zero.

# %%
def bytes_really_read(batch, context):
    # your count, minus the embedding rows a step never touches
    counted = decode_bytes_per_step(decode_cfg, batch, context, DTYPE_BYTES)
    return counted - unread_embedding_bytes(decode_cfg, batch, DTYPE_BYTES)


def report(point):
    read = bytes_really_read(point.batch, point.context)
    where = f"batch {point.batch:>3} x context {point.context:>7,}"
    if point.oom:
        return f"{where}: out of memory (the cache alone needs {point.cache_bytes / 1e9:.1f} GB): the cache wall"
    achieved = read / point.seconds
    return (
        f"{where}: {point.seconds * 1e3:8.2f} ms/step, reads {read / 1e9:6.2f} GB "
        f"(cache {1 - bytes_really_read(point.batch, 0) / read:4.0%}), "
        f"{achieved / 1e9:7.1f} GB/s = {achieved / copy_bandwidth:4.0%} of copy"
    )


for point in by_batch + by_context:
    print(report(point))

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, points, key, xlabel in (
    (axes[0], by_batch, "batch", f"batch (context {fixed_context:,})"),
    (axes[1], by_context, "context", "context (batch 1)"),
):
    ok = [pt for pt in points if not pt.oom]
    xs = [getattr(pt, key) for pt in ok]
    ax.plot(xs, [pt.seconds * 1e3 for pt in ok], "o-", color="C0", label="step time")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms per decode step", color="C0")
    twin = ax.twinx()
    bw = [bytes_really_read(pt.batch, pt.context) / pt.seconds / 1e9 for pt in ok]
    twin.plot(xs, bw, "s--", color="C1", label="achieved bandwidth")
    twin.axhline(copy_bandwidth / 1e9, color="C1", lw=1, ls=":", label="copy bandwidth")
    twin.set_ylabel("GB/s", color="C1")
    twin.set_ylim(bottom=0)
    for pt in points:
        if pt.oom:
            ax.axvline(getattr(pt, key), color="C3", lw=6, alpha=0.3)
            ax.annotate("out of memory", (getattr(pt, key), ax.get_ylim()[1]), color="C3", fontsize=8,
                        ha="right", va="top", rotation=90)
    twin.legend(fontsize=8, loc="lower right")
fig.suptitle(f"Decode steps of {decode_cfg.name} on {settings.device_name}")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the two panels:
#
# * Against **batch**, at a short context, the weights are read once whatever the batch, so while
#   memory is the limit the step time barely moves: every extra sequence is almost free. (The
#   sweep keeps the context short on purpose. At a long context every extra sequence brings its
#   own cache to read, and the step time grows from the first extra sequence: chapter 06.) Once the arithmetic
#   per step catches up with the reading (the batch passes your device's ridge point, in FLOP
#   per byte), the time starts to grow with the batch.
# * Against **context**, every extra cached token is more bytes to read, so the step time grows
#   with the context, and at long contexts the cache rather than the weights sets it.
#
# On a CPU, expect the batch panel to bend early. A CPU's ridge point is a few FLOP per byte, so
# a small batch already reaches it, and its matrix library handles batch 1 with a
# matrix-vector routine but larger batches with a general matmul that repacks the weights on
# every call, which costs extra memory traffic. On a GPU the flat region lasts far longer.

# %% [markdown]
# ## 6. Both phases on your roofline
#
# Place the measurements: a prefill's intensity is its FLOPs over the bytes of the weights it
# reads, a decode step's is its FLOPs over the bytes it really reads. Height is what was achieved,
# FLOPs over measured time. The prefill FLOPs are counted causal here, since that is the work the
# model's attention actually does.

# %%
weight_bytes = param_count(prefill_cfg) * DTYPE_BYTES
points = []
for pt in (measured[0], measured[len(measured) // 2], measured[-1]):
    flops = prefill_flops(prefill_cfg, pt.prompt_tokens, causal=True)
    points.append((f"prefill P={pt.prompt_tokens:,}", flops / weight_bytes, flops / pt.seconds))
for pt in [p for p in by_batch if not p.oom][:: max(1, len(by_batch) // 3)] + [p for p in by_context if not p.oom][-1:]:
    flops = decode_step_flops(decode_cfg, pt.batch, pt.context)
    read = bytes_really_read(pt.batch, pt.context)
    points.append((f"decode B={pt.batch} ctx={pt.context:,}", flops / read, flops / pt.seconds))

fig, ax = plt.subplots(figsize=(8, 5))
published = match_device_name(settings.device_name) if settings.on_gpu else None
plot_roofline(ax, peak, copy_bandwidth, points=points, published=published, label="measured roof")
ax.set_title(f"Prefill and decode on {settings.device_name}")
plt.show()

# %% [markdown]
# ## 7. The same questions on a data-centre deployment
#
# Your measurements describe one device and small models. Chapter 05's explainer costs both
# phases of a real deployment (by default the Llama 3 70B shape on four A100 40GB cards) on a
# roofline, each kernel on its own, and shows the four metrics a serving team is judged on.
# Move the prompt, output and batch sliders, switch GPU or model, and watch which kernel is bound
# by what. It needs ipywidgets (installed by `make setup`; Colab has it); without them the cell
# says so, and the same numbers come from `labsupport.serving.phases(...)`.

# %%
try:
    from labsupport.explainer import show

    show()
except ImportError as exc:  # ipywidgets missing: the numbers are still one call away
    from labsupport.serving import phases

    print(f"the live explainer needs ipywidgets ({exc}); the starting point as numbers:")
    print(phases())

# %% [markdown]
# ## Questions
#
# 1. Your measured crossover and $N/2Ld$: which is larger, and which of the three reasons above
#    explains most of the gap on your device?
# 2. At which batch did the decode step time start to grow? Compare it with your device's ridge
#    point: what is the arithmetic intensity of a decode step at batch $B$ in your dtype?
# 3. In the context sweep, at what context does the cache read equal the weights read for this
#    model? Did the step time at that context come out about twice the short-context time?
# 4. Why does a prefill produce only one new token although it processes every prompt position?
#
# <!-- BEGIN SOLUTION -->
# **Answers (instructor notes).**
#
# 1. This depends on the device. The course's own GPU run (chapter 05, "Measured on a GPU",
#    with its device and date) fitted a crossover between $N/2Ld$ and $2 \cdot N/2Ld$, and so
#    did this lab run as a script on the same GPU, as the reasons below predict. On a GPU, expect
#    the measured crossover *above* $N/2Ld$, somewhere towards $2 \cdot N/2Ld$: PyTorch's fused
#    attention skips most of the masked half of the scores, so the quadratic work actually done
#    is about half of $4LP^2d$. Effects pull the other way: $N$ counts the embedding table and
#    the output head, which a prefill does not multiply through every position (the linear work,
#    and so the crossover, is lower than $2NP$ suggests; chapter 05 computes both counts); the
#    attention kernel does fewer FLOP/s than the large matmuls (on the course's H200 run, enough
#    to land the crossover below the performed-FLOP prediction); and at the shortest prompts
#    fixed overheads bend the fit. On a CPU it can
#    fall on either side: attention's many small per-head products and its softmax run well
#    below the large matmuls' FLOP/s, which pulls the crossover to shorter prompts, while the
#    causal skip pushes it out. Compare your fit's $a$ and $b$ with the two FLOP counts before
#    deciding which effect won.
# 2. A decode step does about $2NB$ FLOPs for $N b$ bytes of weights: intensity $2B/b$, which is
#    $B$ in bf16 and $B/2$ in fp32. Time starts to grow once that passes the ridge point: a
#    batch of a few on a CPU with a low ridge; hundreds on an H100. On a GPU in eager PyTorch,
#    small-batch steps are also launch-bound (the CPU issuing kernels sets their time; chapter
#    05's GPU run shows it), so expect little growth until the cache read dominates.
# 3. Where `context * kv_bytes_per_token = N * b`, i.e. context $= N / (2 L H_{kv} d_{head})$ with
#    the same bytes per element for weights and cache: compute it in a cell with
#    `param_count(cfg) / (kv_bytes_per_token(cfg, 1))` (tens of thousands of tokens for
#    `small-63m`, over a hundred thousand for the 8B). At that context the read doubles, so a
#    bandwidth-bound step takes about twice as long.
# 4. Look at `Transformer._run`: the output layer is applied to `x[:, -1]`. The prompt's other
#    positions already have their successors (the rest of the prompt); they are computed only for
#    the keys and values the cache keeps for later steps.
# <!-- END SOLUTION -->
