# Lab 06 source of truth. Edit this file, then run `python -m labsupport release 06_kv_cache` to
# regenerate labs/06_kv_cache.ipynb (learners) and solutions/06_kv_cache.ipynb (instructors).

# %% [markdown]
# # Lab 06: the KV cache, computed and measured
#
# Decode keeps the keys and values of every earlier token so that each step only has to process
# the new one. In this lab you will
#
# 1. measure generation with the cache against recomputing everything without it;
# 2. measure how a decode step slows down as the context grows, and why;
# 3. write `kv_bytes_per_token`, the size of that cache per token, and have it checked;
# 4. confirm that a real model's cache takes exactly the memory your formula predicts;
# 5. write `max_concurrency`, how many full-length sequences fit next to the weights, and use it
#    on real GPUs.
#
# On a CPU the measurements use a tiny model (random weights: timing does not depend on their
# values); on a GPU, the shape of Llama 3.1 8B when it fits.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. This lab takes its
# measurements (sections 1 and 2) before the first exercise, so a first Run All already times
# decode on your device.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from labsupport import ledger
from labsupport.checks import check_kv_bytes_per_token, check_max_concurrency
from labsupport.costs import decode_step_bytes, param_count
from labsupport.device import device, lab_dtype
from labsupport.hardware import get_gpu
from labsupport.kvcache import with_kv_heads
from labsupport.models import get_model
from labsupport.timing import benchmark
from labsupport.transformer import Transformer

DEVICE = device()
if not settings.on_gpu:
    # The tiny model's steps take about a millisecond. With several threads, a step can stall for
    # many milliseconds whenever another program holds a core; one thread keeps timings steady.
    torch.set_num_threads(1)

# %% [markdown]
# ## The model this lab measures
#
# A Llama-style decoder with random weights (`labsupport.transformer.Transformer`): the tiny preset on a
# CPU, the Llama 3.1 8B shape on a GPU with room for it.

# %%
MODEL_NAME = settings.pick(small="tiny-2m", full="llama-3.1-8b")
DTYPE = lab_dtype()  # bf16 (fp16 before Ampere) on a GPU, fp32 on a CPU
if settings.on_gpu:
    weights_needed = param_count(get_model(MODEL_NAME)) * 2
    if torch.cuda.get_device_properties(0).total_memory < weights_needed * 2:  # room for weights and caches
        MODEL_NAME = "tiny-20m"
        print(f"this GPU has too little memory for the 8B shape; using {MODEL_NAME} instead")
CFG = get_model(MODEL_NAME)
model = Transformer(CFG, device=DEVICE, dtype=DTYPE, seed=0)
DTYPE_BYTES = torch.empty((), dtype=DTYPE).element_size()
print(model)
print(f"weights: {model.param_bytes() / 2**20:,.1f} MiB in {str(DTYPE)[6:]}")

# %% [markdown]
# ## 1. Decode with the cache, and without it
#
# Without a cache, every new token means running the **whole** sequence through the model
# again: the work of step $t$ grows with $P + t$, and generating $n$ tokens grows with $n^2$ (and
# faster, since attention itself is quadratic). With the cache, each step processes one token.
# `model.generate(prompt, n, use_cache=...)` does both. The cache changes how much work is done,
# not the result: greedy decoding picks the same tokens either way.

# %%
prompt_len = settings.pick(small=32, full=256)
new_tokens = settings.pick(small=[16, 32, 64, 128, 192], full=[16, 32, 64, 128])
prompt = model.random_prompt(batch=1, length=prompt_len, seed=0)
model.generate(prompt, 4)  # warm-up: first calls pay one-off costs

times = {True: [], False: []}  # use_cache -> seconds per generate call
for n in tqdm(new_tokens, desc="generate, with and without cache"):
    for use_cache in (True, False):
        t = benchmark(lambda: model.generate(prompt, n, use_cache=use_cache), repeats=2, warmup=0)  # noqa: B023
        times[use_cache].append(t.median_s)

# Greedy decoding on both paths should choose the same tokens. In bf16 on a GPU the two paths
# round differently (different kernels for different shapes), so a near-tie can flip one token,
# and every token after it then differs too.
tokens_cached = model.generate(prompt, new_tokens[-1])[0, prompt_len:]  # (n,): generated tokens only
tokens_recomputed = model.generate(prompt, new_tokens[-1], use_cache=False)[0, prompt_len:]
differ = (tokens_cached != tokens_recomputed).nonzero()
first = int(differ[0]) if len(differ) else len(tokens_cached)
print(f"with and without the cache, the first {first} of {len(tokens_cached)} generated tokens are identical")
for n, with_cache, without in zip(new_tokens, times[True], times[False]):
    print(f"{n:4d} new tokens: {with_cache * 1e3:8.1f} ms with cache, {without * 1e3:8.1f} ms without "
          f"({without / with_cache:4.1f}x)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
ax1.plot(new_tokens, [t * 1e3 for t in times[True]], "o-", label="with cache")
ax1.plot(new_tokens, [t * 1e3 for t in times[False]], "o-", label="without (recompute)")
ax1.set(xlabel="new tokens", ylabel="generate time (ms)", title=f"{CFG.name}, prompt {prompt_len}")
ax1.legend()
ax2.plot(new_tokens, [t * 1e3 / n for t, n in zip(times[True], new_tokens)], "o-", label="with cache")
ax2.plot(new_tokens, [t * 1e3 / n for t, n in zip(times[False], new_tokens)], "o-", label="without")
ax2.set(xlabel="new tokens", ylabel="ms per generated token", title="cost per token")
ax2.legend()
fig.tight_layout()

# %% [markdown]
# With the cache, the time per token stays nearly flat; without it, it grows with the length of
# the sequence, so the total grows faster than linearly. (The prefill is included in both, which
# is why short generations are close.)
#
# ## 2. A decode step slows as the context grows
#
# Each decode step reads every weight and the cache of every sequence in the batch. The weights
# are a constant; the cache grows by a fixed number of bytes per token per sequence (section 3
# has you count them). We time one
# decode step at several context lengths. The cache's *contents* do not change how long a step
# takes, so instead of running a long prefill we allocate a cache of the right size and declare
# its first `context` positions filled (`cache.length = context`).
#
# On a GPU the largest caches may not fit: running out of memory is recorded as a result (the
# cache wall), not a crash.

# %%
step_batch = 8  # sequences decoded together
step_contexts = settings.pick(small=[64, 256, 512, 1024, 2048, 4096], full=[512, 2048, 8192, 16384, 32768, 65536])
token = model.random_prompt(batch=step_batch, length=1, seed=1)

step_ms, out_of_memory = {}, []
for context in tqdm(step_contexts, desc=f"decode step, batch {step_batch}"):
    try:
        cache = model.new_cache(step_batch, context + 1)

        def step(cache=cache, context=context):  # this iteration's cache and context
            cache.length = context
            model.decode_step(token, cache)  # attends to `context` cached positions, adds one

        step_ms[context] = benchmark(step).median_s * 1e3
    except torch.cuda.OutOfMemoryError:
        out_of_memory.append(context)
    finally:
        cache = None
        if settings.on_gpu:
            torch.cuda.empty_cache()

for context, ms in step_ms.items():
    read = decode_step_bytes(CFG, step_batch, context, weight_dtype_bytes=DTYPE_BYTES, kv_dtype_bytes=DTYPE_BYTES)
    print(f"context {context:6,}: {ms:8.3f} ms per step; reads {read.total / 2**20:9.1f} MiB "
          f"({read.cache_share:4.0%} cache) -> {read.total / (ms / 1e3) / 1e9:7.1f} GB/s achieved")
for context in out_of_memory:
    need = decode_step_bytes(CFG, step_batch, context + 1, DTYPE_BYTES, DTYPE_BYTES).cache
    print(f"context {context:6,}: out of memory (the cache alone needs {need / 2**30:.1f} GiB)")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
ledger.record("06_kv_cache", [
    *(ledger.Figure(f"cache_speedup_new{n}", without / with_cache, "x",
                    f"{CFG.name}, prompt {prompt_len}: generate time without the cache over with it; medians")
      for n, with_cache, without in zip(new_tokens, times[True], times[False])),
    *(ledger.Figure(f"decode_step_b{step_batch}_ctx{context}", ms, "ms", f"{CFG.name} decode step; median time")
      for context, ms in step_ms.items()),
], timings_real=True)  # torch code only: real timings on a CPU too

# %%
measured = list(step_ms)
reads = [decode_step_bytes(CFG, step_batch, c, DTYPE_BYTES, DTYPE_BYTES) for c in measured]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
ax1.plot(measured, [step_ms[c] for c in measured], "o-")
ax1.set(xlabel="context (tokens per sequence)", ylabel="ms per decode step",
        title=f"{CFG.name}, batch {step_batch}, measured")
ax1.set_ylim(bottom=0)
ax2.bar(range(len(measured)), [r.weights / 2**20 for r in reads], label="weights")
ax2.bar(range(len(measured)), [r.cache / 2**20 for r in reads], bottom=[r.weights / 2**20 for r in reads],
        label="KV cache")
ax2.set_xticks(range(len(measured)), [f"{c:,}" for c in measured], rotation=45)
ax2.set(xlabel="context", ylabel="MiB read per step", title="what each step reads")
ax2.legend()
fig.tight_layout()

# %% [markdown]
# ## 3. What the cache holds
#
# In every layer, attention turns each token into a key vector and a value vector for each of the
# model's **key/value heads** (`n_kv_heads`, which under grouped-query attention is smaller than
# the number of query heads `n_heads`). Each vector has `head_dim` elements. The model in
# `labsupport.transformer` allocates its cache like this, for `batch` sequences of up to `max_len`
# tokens:

# %% tags=["nbval-check-output"]
def kv_cache_spec(cfg, batch: int, max_len: int, dtype: torch.dtype):
    # keys and values: (n_layers, batch, n_kv_heads, max_len, head_dim) each.
    # device="meta" describes the tensors without allocating any memory.
    k = torch.empty(cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim, dtype=dtype, device="meta")
    v = torch.empty_like(k)
    return k, v


k, v = kv_cache_spec(get_model("llama-3.1-8b"), batch=1, max_len=1, dtype=torch.bfloat16)
print("one token of Llama 3.1 8B in bf16: k", tuple(k.shape), "and v", tuple(v.shape))

# %% [markdown]
# ### Exercise 1: bytes per token
#
# Complete `kv_bytes_per_token(cfg, dtype_bytes=2)`: the bytes of cache **one token** adds, with
# every element taking `dtype_bytes` bytes (2 for bf16, the default; 1 for an fp8 cache; 0.5 for a
# 4-bit one, so `dtype_bytes` need not be a whole number). `cfg` is a `labsupport.models.ModelConfig`
# with fields `n_layers`, `n_heads`, `n_kv_heads` and `head_dim`. Use `head_dim` as the model gives
# it: it is not always `d_model // n_heads` (Qwen3-0.6B has 16 heads of 128 on a width of 1,024).
#
# $$\text{KV bytes per token} = 2 \times n_{\text{layers}} \times n_{\text{kv heads}} \times d_{\text{head}} \times \text{dtype\_bytes}$$
#
# (the 2: one key and one value).

# %%
def kv_bytes_per_token(cfg, dtype_bytes=2):
    # BEGIN SOLUTION: return the bytes of keys and values that one token adds to the cache, all layers together
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    # END SOLUTION

# %%
check_kv_bytes_per_token(kv_bytes_per_token)

# %% [markdown]
# Your function on the real models. A KiB is 1,024 bytes and a GiB 1,024³; the "8k" context is
# 8,192 tokens.

# %% tags=["nbval-check-output"]
for name, context in [("llama-3.1-8b", 2000), ("llama-3.1-70b", 8192), ("llama-3.1-405b", 8192)]:
    cfg = get_model(name)
    per_token = kv_bytes_per_token(cfg)
    print(f"{name:15s}: {per_token / 2**10:6.0f} KiB per token, {per_token * context / 2**30:6.2f} GiB "
          f"for one sequence of {context:,} tokens")

# Grouped-query attention: the same models with one KV head per query head.
for name in ["llama-3.1-8b", "llama-3.1-70b"]:
    cfg = get_model(name)
    mha = with_kv_heads(cfg, cfg.n_heads)
    print(f"{name:15s}: {cfg.n_kv_heads} KV heads -> {kv_bytes_per_token(cfg) / 2**10:.0f} KiB per token; "
          f"{mha.n_kv_heads} KV heads -> {kv_bytes_per_token(mha) / 2**10:.0f} KiB")

# %% [markdown]
# ## 4. The formula against a real cache
#
# Ask the cache of the model measured in sections 1 and 2 how many bytes it allocated. It should
# be exactly your bytes per token, times the batch, times the positions reserved.

# %% tags=["nbval-check-output"]
batch, max_len = 4, 300
cache = model.new_cache(batch, max_len)
predicted = kv_bytes_per_token(CFG, DTYPE_BYTES) * batch * max_len
print(cache)
print(f"allocated {cache.nbytes():,} bytes; your formula predicts {predicted:,}")
assert cache.nbytes() == predicted
del cache

# %% [markdown]
# ## 5. How many sequences fit
#
# The weights are stored once; the cache is per sequence. With `gpu_memory_bytes` of memory,
# weights of `param_count(cfg) * weight_dtype_bytes` bytes and `reserve_bytes` set aside for everything
# else (activations, the runtime, fragmentation), the number of sequences of `context_tokens`
# tokens each that fit is
#
# $$\left\lfloor \frac{\text{gpu\_memory\_bytes} - \text{weights} - \text{reserve\_bytes}}
#   {\text{kv\_bytes\_per\_token}(\text{cfg}, \text{kv\_dtype\_bytes}) \times \text{context\_tokens}} \right\rfloor$$
#
# and **0** when the weights and the reserve leave nothing (never a negative number). A count of
# sequences is a whole number: round down, since a fraction of a sequence cannot be served.
#
# ### Exercise 2: a concurrency calculator
#
# Complete `max_concurrency`. Use `param_count(cfg)` (imported above from `labsupport.costs`)
# for the number of weights, and your own `kv_bytes_per_token`.

# %%
def max_concurrency(cfg, gpu_memory_bytes, context_tokens, weight_dtype_bytes=2, kv_dtype_bytes=2,
                    reserve_bytes=0):
    # BEGIN SOLUTION: subtract weights and reserve from memory, divide by one sequence's cache, floor, >= 0
    free = gpu_memory_bytes - param_count(cfg) * weight_dtype_bytes - reserve_bytes
    if free <= 0:
        return 0
    per_sequence = kv_bytes_per_token(cfg, kv_dtype_bytes) * context_tokens
    return int(free // per_sequence)
    # END SOLUTION

# %%
check_max_concurrency(max_concurrency)

# %% [markdown]
# Now the table the chapter argues from: full-length sequences that fit after the bf16 weights,
# with no reserve (an upper bound), on the GPUs in `labsupport.hardware`. Several GPUs add their
# memory together.

# %% tags=["nbval-check-output"]
deployments = [
    ("llama-3.1-8b", "H100 SXM", 1), ("llama-3.1-8b", "H200", 1), ("llama-3.1-8b", "A100 80GB", 1),
    ("llama-3.1-70b", "H100 SXM", 1), ("llama-3.1-70b", "H200", 2), ("llama-3.1-70b", "H100 SXM", 4),
]
contexts = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]

fig, ax = plt.subplots(figsize=(8, 4.2))
print(f"{'model':15s} {'GPUs':12s}" + "".join(f"{c:>8,}" for c in contexts))
for model_name, gpu_name, count in deployments:
    cfg, gpu = get_model(model_name), get_gpu(gpu_name)
    gpu = gpu.times(count) if count > 1 else gpu
    fits = [max_concurrency(cfg, gpu.memory_bytes, c) for c in contexts]
    print(f"{model_name:15s} {gpu.name:12s}" + "".join(f"{n:8,}" for n in fits))
    if any(fits):
        ax.plot(contexts, fits, "o-", label=f"{model_name} on {gpu.name}")
ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="sequences that fit",
       title="Concurrency after the weights (bf16 weights and cache, no reserve)")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# ## What you measured
#
# * The cache takes exactly `2 x layers x KV heads x head_dim x bytes` per token, per sequence:
#   your formula and the allocator agree to the byte.
# * Memory left after the weights, divided by one sequence's cache, bounds concurrency; long
#   contexts shrink it in proportion, and grouped-query attention multiplies it.
# * Without a cache, generation repeats the prompt's work at every step, and its cost per token
#   grows with the sequence; with the cache it stays nearly flat.
# * With the cache, a step still reads the whole cache: once the cache is larger than the weights,
#   step time grows with the context. On a CPU, fixed per-step overheads (Python, small
#   operations) hide part of this at short contexts; on a GPU, step time follows bytes read much
#   more closely. Chapter 05 compares the achieved bandwidth with the copy bandwidth you measured
#   in lab 04.
