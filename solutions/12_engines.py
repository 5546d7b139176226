# Lab 12 source of truth. Edit this file, then run `python -m labsupport release 12_engines` to
# regenerate labs/12_engines.ipynb (learners) and solutions/12_engines.ipynb (instructors).

# %% [markdown]
# # Lab 12: engines
#
# The engines people deploy (vLLM, SGLang, TensorRT-LLM, llama.cpp, TGI) share one interface,
# OpenAI's HTTP API, and one loop: chapter 13's. In this lab you will
#
# 1. put chapter 13's **engine behind chapter 03's server** (`--engine continuous`), send it
#    concurrent requests, and see them share forward passes;
# 2. run a **benchmark client** in the style of vLLM's serving benchmark against it (open-loop
#    arrivals at a rate, streamed answers, TTFT/TPOT/ITL percentiles, throughput), and compare
#    the continuous engine with chapter 03's one-at-a-time server on the same load. The same client
#    runs unchanged against vLLM or SGLang on a GPU;
# 3. **predict an engine's KV capacity** (blocks, tokens, requests) from its settings and the
#    model's shape, as an engine's startup log reports it (checked);
# 4. **build the engine's step assembly**: turn a scheduled step (prompt chunks and decodes side by
#    side) into the flat tensors the model runs on, slot mapping, block tables, query offsets,
#    positions and the rows to sample, and run the engine with your function in it (checked);
# 5. **measure launch overhead**: how much of a batch-1 decode step is Python and dispatch rather
#    than arithmetic, the cost CUDA graphs and `torch.compile` remove.
#
# The course model has random weights: its text is meaningless. The servers and models run on the
# CPU, also on a machine with a GPU, and every timing here is a CPU timing, labelled so.
#
# **Run All** (*Run > Run All Cells*) stops at the first exercise you have not written: its check
# cell raises with a short message saying so, nothing below it runs, and JupyterLab scrolls back to
# that cell.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
from labsupport.serve import install_missing

installed = install_missing()  # the course server's packages, only where missing (a fresh Colab runtime)

# %%
import dataclasses
import os
import platform
import threading

import openai
import torch

from labsupport import ledger
from labsupport.bench_serving import format_summary, run_benchmark
from labsupport.checks import check_kv_capacity, check_prepare_step
from labsupport.costs import kv_bytes_per_token, param_count
from labsupport.engine import Engine, ScheduledSeq, StepMetadata
from labsupport.launch_overhead import profile_decode_step
from labsupport.models import get_model
from labsupport.sampling import SamplingParams
from labsupport.scheduler import blocks_for
from labsupport.serve import ServerProcess
from labsupport.transformer import Transformer

torch.set_num_threads(1)
WHERE = f"CPU ({platform.machine()}, {os.cpu_count()} cores), one thread"
print(f"timings below are taken on: {WHERE}")

# %% [markdown]
# ## 1. The server runs the engine
#
# `python -m labsupport.serve --engine continuous` serves the course model with chapter 13's
# engine: one worker task owns it, adds new requests and aborts dropped ones between steps, runs
# each step in a thread, and streams every token to its request's response. `--engine fifo` (the
# default) is chapter 03's server, one request at a time. We start one of each.
#
# Four clients then stream a completion each, at the same moment. The timeline endpoint
# (`/v1/requests/{id}/timeline`, a course extension) lists, for every request, the engine steps it
# took part in.

# %%
SERVER_OPTIONS = ["--context", "256", "--max-tokens-limit", "64", "--block-size", "16"]
continuous = ServerProcess(["--engine", "continuous", "--num-blocks", "128", *SERVER_OPTIONS], threads=1).start()
fifo = ServerProcess(["--engine", "fifo", *SERVER_OPTIONS], threads=1).start()
print(continuous.health())


# %%
def stream_one(base_url, prompt, max_tokens, results, i):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(model="course-tiny", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True)
    for chunk in stream:
        results[i] = chunk.id  # every chunk carries the request's id


prompts = ["The cache", "Blocks of keys and values", "A scheduler picks", "Every step"]
ids = [None] * len(prompts)
threads = [threading.Thread(target=stream_one, args=(continuous.base_url, p, 24, ids, i))
           for i, p in enumerate(prompts)]
for t in threads:
    t.start()
for t in threads:
    t.join()

steps = {rid: [e["token"] for e in continuous.timeline(rid)["events"] if e["stage"] == "engine_step"] for rid in ids}
shared = set.intersection(*(set(s) for s in steps.values()))
for rid, s in steps.items():
    print(f"{rid}: {len(s)} steps, {s[0]} to {s[-1]}")
print(f"steps all four requests shared: {len(shared)}")
assert shared, "the four requests never shared a step"

# %% [markdown]
# The four requests ran in the same forward passes: one pass reads the weights once and makes a
# token for each of them. The FIFO server would have run them one after another.
#
# ## 2. A benchmark client
#
# `labsupport.bench_serving` works like vLLM's `benchmark_serving.py` (now `vllm bench serve`):
# arrival times are drawn before the run (open loop: a slow server does not slow the arrivals),
# requests go out at those times, every answer is streamed, and each chunk is timestamped as it
# arrives. The summary gives nearest-rank percentiles of TTFT, TPOT, ITL and E2E, and the request
# and output-token throughput over the run.
#
# Same load, both servers: 24 requests at 40 requests per second (Poisson arrivals), 16 output
# tokens each.

# %%
LOAD = dict(num_prompts=24, request_rate=40.0, burstiness=1.0, input_words=16, output_tokens=16, seed=0)
results = {name: run_benchmark(server.base_url, "course-tiny", **LOAD)
           for name, server in (("fifo", fifo), ("continuous", continuous))}
for name, summary in results.items():
    print(f"--- {name} engine (CPU timings, {WHERE}) ---")
    print(format_summary(summary))

# %%
fifo_s, cont_s = results["fifo"], results["continuous"]
print(f"output-token throughput: continuous / fifo = {cont_s['output_throughput'] / fifo_s['output_throughput']:.2f}x")
print(f"median TTFT: fifo {fifo_s['ttft_s']['p50'] * 1e3:.0f} ms, continuous {cont_s['ttft_s']['p50'] * 1e3:.0f} ms")

# %% [markdown]
# With one request at a time, a request waits for every request ahead of it: TTFT grows with the
# queue. With continuous batching a request joins the running batch at the next step. Its TPOT
# can be a little longer (each step now carries several requests), which is the trade every
# engine makes. An ITL near 0 ms means two chunks reached the client in one read of the socket (the
# server's event loop sent them back to back): ITL is what a client sees, and TPOT, averaged over
# the whole answer, is the steadier figure.
#
# **On a GPU.** The same client runs unchanged against any OpenAI-compatible server. For vLLM:
#
# ```bash
# vllm serve Qwen/Qwen3-0.6B --port 8000 &
# python -m labsupport.bench_serving --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-0.6B \
#     --num-prompts 200 --request-rate 10 --output-tokens 128 --ignore-eos --save vllm.json
# ```
#
# and for SGLang, `python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --port 30000`, then
# the same command with `--base-url http://127.0.0.1:30000/v1`. `--ignore-eos` makes every request
# generate all its tokens, so two servers do the same work.

# %%
continuous.stop()
fifo.stop()

# %% [markdown]
# ## 3. Exercise: predict the KV capacity
#
# An engine's startup log says how much cache it has: vLLM prints `GPU KV cache size: N tokens`
# and `Maximum concurrency for L tokens per request: X.XXx`. You can predict it. The convention
# (the one the check uses; chapter 12 says how vLLM measures the reserve instead):
#
# * the engine may use `gpu_memory_utilization` of the GPU's **total** memory, given in GiB
#   ($2^{30}$ bytes);
# * the weights (`param_count(cfg) * weight_dtype_bytes`) and a reserve for activations and
#   workspaces (`reserve_gib`) come out of that; the KV cache gets the rest;
# * the cache is allocated in whole blocks of `block_size` tokens; one token of cache holds a key
#   and a value for every KV head of every layer: `2 * n_layers * n_kv_heads * head_dim *
#   kv_dtype_bytes`, with the head width read from `cfg.head_dim`: it need not be
#   `d_model / n_heads` (Qwen3's heads are wider; the table after the check shows one);
# * `num_blocks` is the whole number of blocks that fit (0 if none), `tokens = num_blocks *
#   block_size`, and a request of `max_model_len` tokens holds `ceil(max_model_len / block_size)`
#   blocks, so `max_requests = num_blocks // ceil(max_model_len / block_size)`.
#
# Return `{"num_blocks": ..., "tokens": ..., "max_requests": ...}` as integers. You may use
# `param_count(cfg)` and `blocks_for(n, block_size)` (the ceiling), imported above.


# %%
def kv_capacity(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16,
                kv_dtype_bytes=2, weight_dtype_bytes=2, reserve_gib=0.0):
    # BEGIN SOLUTION: budget on the total (GiB) minus weights and reserve, whole blocks, whole requests
    budget = gpu_memory_utilization * gpu_memory_gib * 2**30
    kv_bytes = budget - param_count(cfg) * weight_dtype_bytes - reserve_gib * 2**30
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * kv_dtype_bytes
    num_blocks = max(0, int(kv_bytes // (block_size * per_token)))
    return {"num_blocks": num_blocks, "tokens": num_blocks * block_size,
            "max_requests": num_blocks // blocks_for(max_model_len, block_size)}
    # END SOLUTION


# %%
check_kv_capacity(kv_capacity)

# %% [markdown]
# What the settings buy: Llama 3.1 8B (bf16 weights) on an 80 GiB GPU, 8192-token requests, a
# 2 GiB reserve. A cache in fp8 (one byte) holds twice the tokens; raising the utilisation from 0.9
# to 0.95 gives the cache all of the extra 4 GiB, because the weights do not grow.

# %% tags=["nbval-check-output"]
m8 = get_model("llama-3.1-8b")
print(f"weights {param_count(m8) * 2 / 2**30:.2f} GiB; KV cache per token {kv_bytes_per_token(m8) / 2**10:.0f} KiB (bf16)")
print("utilisation  kv dtype  blocks   tokens     requests of 8192")
for util in (0.9, 0.95):
    for kvb, name in ((2, "bf16"), (1, "fp8")):
        cap = kv_capacity(m8, 80, 8192, gpu_memory_utilization=util, kv_dtype_bytes=kvb, reserve_gib=2.0)
        print(f"{util:<12} {name:<9} {cap['num_blocks']:<8} {cap['tokens']:<10,} {cap['max_requests']}")

# %% [markdown]
# The head width is a field of its own. Qwen3-0.6B's heads are wider than `d_model / n_heads` (the
# cell prints both): a cache sized from the quotient would be smaller than the model needs, and the
# engine would promise more tokens than it can hold.

# %% tags=["nbval-check-output"]
q06 = get_model("qwen3-0.6b")
print(f"{q06.name}: d_model {q06.d_model:,}, {q06.n_heads} query heads, {q06.n_kv_heads} KV heads, "
      f"head_dim {q06.head_dim} (d_model / n_heads = {q06.d_model // q06.n_heads})")
print(f"KV cache per token: {kv_bytes_per_token(q06) / 2**10:.0f} KiB (bf16) with head_dim {q06.head_dim}")
cap = kv_capacity(q06, 16, 4096, reserve_gib=0.5)
print(f"a 16 GiB GPU, 4096-token requests: {cap['tokens']:,} tokens, {cap['max_requests']} requests at once")

# %% [markdown]
# ## 4. Exercise: the engine's step assembly
#
# Every step, the engine's scheduler decides which sequences run and how many tokens each: a
# whole short prompt, a chunk of a long one (chunked prefill), one token for each sequence that
# is decoding. The model does not see sequences. It sees **one flat batch**: the step's tokens laid
# end to end, every weight matrix applied once to all of them. Only attention has to know which
# sequence a token belongs to, where its key and value go in the paged cache, and which keys it
# may read; and the sampler has to know which rows' logits to turn into tokens. The model runner
# (vLLM's `GPUModelRunner._prepare_inputs`, nano-vllm's `ModelRunner.prepare_prefill` and
# `prepare_decode`, the course's `labsupport.engine.model_runner.prepare_step`) builds that
# description once per step, and you will write it.
#
# **What the engine gives you**: a list of `ScheduledSeq`, one per sequence, in batch order, with
#
# * `token_ids`: every token the sequence knows (its prompt, then what it generated so far);
# * `block_table`: its cache blocks in order (block `j` holds positions `j * block_size` to
#   `(j + 1) * block_size - 1`), already long enough for this step's tokens (it may hold more blocks
#   than they fill: an engine can allocate ahead);
# * `num_cached`: how many leading tokens already have their keys and values in the cache (computed
#   in earlier steps, or found in the prefix cache);
# * `num_new`: how many it runs this step: tokens `num_cached .. num_cached + num_new - 1`.
#
# A decode is `num_new = 1` after `len(token_ids) - 1` cached tokens; a prompt's later chunk has
# `num_cached > 0` and `num_new > 1`. A sequence **samples** this step when the step reaches its last
# known token: `num_cached + num_new == len(token_ids)` (a chunk that stops short of the end of its
# prompt has no logits to sample).
#
# **What you return**: a `StepMetadata` (`labsupport.engine.StepMetadata`) of CPU tensors, `N` the
# step's tokens and `B` its sequences:
#
# | field | shape, dtype | what |
# | --- | --- | --- |
# | `input_ids` | (N,) int64 | the tokens each sequence runs, sequence after sequence |
# | `positions` | (N,) int64 | each token's position in its own sequence (RoPE reads it) |
# | `slot_mapping` | (N,) int64 | where its key and value go: `block_table[p // block_size] * block_size + p % block_size` |
# | `block_tables` | (B, W) int32 | each table, padded with -1 to `W`, the most blocks a sequence holds |
# | `seq_lens` | (B,) int32 | `num_cached + num_new`: what each holds once this step's keys are in |
# | `cu_seqlens_q` | (B + 1,) int32 | 0, then the running total of `num_new`: sequence `b`'s rows are `cu[b] .. cu[b+1] - 1` |
# | `logits_indices` | (R,) int64 | for each sequence that samples, in order, the flat row of its last token |
# | `max_q_len` | int | the largest `num_new` |
# | `decode_only` | bool | whether every `num_new` is 1 |
#
# The padding is -1, as in nano-vllm, a value that names no block: attention reads only the blocks
# a sequence's length covers, so a real id there would hide a bug that reads too far.
#
# **A worked example** (block size 4): a decode with 6 cached tokens and table `[7, 2]`, then a
# prompt of 10 tokens whose first 4 are cached, table `[5, 0, 9]`, running its last 6. The decode's
# token sits at position 6, in block 2 at offset 2, slot `2 * 4 + 2 = 10`. The prompt's tokens are
# positions 4 to 9: block 0 (slots 0 to 3) and block 9 (slots 36, 37). So `positions = [6, 4, 5, 6,
# 7, 8, 9]`, `slot_mapping = [10, 0, 1, 2, 3, 36, 37]`, `block_tables = [[7, 2, -1], [5, 0, 9]]`,
# `seq_lens = [7, 10]`, `cu_seqlens_q = [0, 1, 7]`, and both sample: `logits_indices = [0, 6]`.
#
# The check compares every field with the engine's own on named and random mixed batches and names
# the first wrong one, then puts your function into the engine and requires every request to get
# the greedy tokens `generate` gives it alone.

# %%
example = [
    ScheduledSeq(token_ids=[11, 12, 13, 14, 15, 16, 17], block_table=[7, 2], num_cached=6, num_new=1),
    ScheduledSeq(token_ids=list(range(30, 40)), block_table=[5, 0, 9], num_cached=4, num_new=6),
]


# %%
def prepare_step(seqs, block_size):
    # BEGIN SOLUTION: lay the new tokens end to end; slots through the tables; pad with -1; last rows of samplers
    input_ids, positions, slots, rows, cu = [], [], [], [], [0]
    width = max(len(s.block_table) for s in seqs)
    for s in seqs:
        start, n = s.num_cached, s.num_new
        for p in range(start, start + n):
            input_ids.append(s.token_ids[p])
            positions.append(p)
            slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + n)
        if start + n == len(s.token_ids):  # the step reaches its last known token: it samples
            rows.append(cu[-1] - 1)
    tables = [list(s.block_table) + [-1] * (width - len(s.block_table)) for s in seqs]
    q_lens = [s.num_new for s in seqs]
    return StepMetadata(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([s.num_cached + s.num_new for s in seqs], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        logits_indices=torch.tensor(rows, dtype=torch.long),
        max_q_len=max(q_lens),
        decode_only=max(q_lens) == 1,
    )
    # END SOLUTION


# %%
check_prepare_step(prepare_step)

# %% [markdown]
# Your function on the worked example:

# %% tags=["nbval-check-output"]
mine = prepare_step(example, 4)
for field in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "logits_indices"):
    print(f"{field:>15}: {getattr(mine, field).tolist()}")
print(f"{'max_q_len':>15}: {mine.max_q_len}, decode_only: {mine.decode_only}")

# %% [markdown]
# Your function now runs the engine. `engine.runner.assemble` is the model runner's hook for a step
# assembly of your own: three requests, two of them arriving while the first decodes, all greedy.
# With the course model's random weights the tokens mean nothing, but they are exactly those
# `generate` gives each prompt alone.

# %%
# the tiny shape with its own output head: with a tied one, a random model repeats its last token
tiny = Transformer(dataclasses.replace(get_model("tiny-2m"), tied_embeddings=False), seed=0)
engine = Engine(tiny, num_blocks=32, block_size=4, token_budget=8, clock="steps")
engine.runner.assemble = prepare_step
first = engine.add_request(list(range(1, 15)), SamplingParams(temperature=0, max_tokens=5))
for _ in range(3):
    engine.step()
later = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=5)) for p in ([3, 1, 4, 1, 5], [9, 2, 6])]
for _ in engine.stream():
    pass
for rid in (first, *later):
    prompt = engine.requests[rid].prompt_ids
    same = engine.requests[rid].output_ids == tiny.generate(torch.tensor([prompt]), 5)[0, len(prompt):].tolist()
    print(f"request {rid}: {len(prompt)} prompt tokens -> {engine.requests[rid].output_ids}, as generate alone: {same}")
    assert same, f"request {rid}: the engine with your prepare_step gave other tokens than generate alone"
print("steps:", [(s.prefill_tokens, s.decode_tokens) for s in engine.steps], "(prefill, decode tokens)")

# %% [markdown]
# ## 5. Launch overhead
#
# At batch 1 a decode step does little arithmetic, and much of its time goes to issuing it: Python
# runs every module's `forward`, PyTorch's dispatcher finds a kernel for every operator, and on a
# GPU every kernel is launched on its own. `profile_decode_step` profiles decode steps with
# `torch.profiler` and sums the time spent inside the top-level operators; the rest of the step
# is the time between them (Python, getting to the operator, and the profiler's own bookkeeping):
# an estimate of the overhead, comparable between models profiled the same way.
#
# On a GPU the same question is answered by capturing the step (CUDA graphs, or `torch.compile`
# with `mode="reduce-overhead"`) and timing eager against replayed steps; here we measure the CPU.
# Chapter 12 shows that measurement on an H200 (`python -m labsupport.bench_launch_overhead`): for
# the course's small models a replayed step took a small fraction of the eager one, more than the
# profiler's between-operator share suggests, because launches and dispatch inside the operators
# go too.

# %%
profiles = {}
for name in ("tiny-2m", "tiny-20m"):
    model = Transformer(get_model(name), seed=0)
    prof = profiles[name] = profile_decode_step(model, context=64, steps=10)
    print(f"{name:>9} on {prof['device']} ({WHERE}): step {prof['step_s'] * 1e3:.2f} ms, "
          f"{prof['ops_per_step']} top-level operators per step, between operators "
          f"{prof['python_share']:.0%}")

# %% [markdown]
# The tiny model spends a large share of each step between operators. On a GPU that is the kind
# of time a captured step (a CUDA graph) no longer spends, when the GPU would otherwise wait for
# the CPU; on this CPU nothing is captured, so it is only the share. The larger model does more arithmetic per operator
# for the same number of operators, so the share shrinks: launch overhead matters most for small
# models and small batches, exactly where decode is fastest per step.
#
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
load = f"{LOAD['num_prompts']} requests at {LOAD['request_rate']:g}/s (Poisson), {LOAD['output_tokens']} output tokens each"
ledger.record("12_engines", [
    *(figure for engine, summary in results.items() for figure in (
        ledger.Figure(f"{engine}_output_throughput", summary["output_throughput"], "tokens/s",
                      f"course server, {engine} engine, course-tiny; {load}; output tokens over the run's time"),
        ledger.Figure(f"{engine}_ttft_p50", summary["ttft_s"]["p50"] * 1e3, "ms",
                      f"course server, {engine} engine; {load}; nearest-rank median TTFT"))),
    *(ledger.Figure(f"decode_step_{name.replace('-', '_')}", prof["step_s"] * 1e3, "ms",
                    "batch-1 decode step, context 64, eager, under torch.profiler") for name, prof in profiles.items()),
    *(ledger.Figure(f"between_operators_{name.replace('-', '_')}", prof["python_share"], "share",
                    "share of a profiled decode step spent outside top-level operators") for name, prof in profiles.items()),
], on_cpu=True)  # the course server runs its model on the CPU: the file names the CPU, real timings

# %% [markdown]
# ## What you built and measured
#
# * The course server with a continuous-batching engine: concurrent requests share forward passes.
# * A benchmark client that measures any OpenAI-compatible server, and the difference batching
#   makes to throughput and TTFT under the same load.
# * A prediction of an engine's KV capacity from its settings, the numbers its startup log prints.
# * The share of a small decode step that is overhead rather than arithmetic.
#
# ### Questions
#
# 1. Why does the benchmark draw its arrival times before it starts, instead of sending the next
#    request when an answer comes back?
# 2. vLLM logs `Maximum concurrency for 8,192 tokens per request: 3.5x`. Can it serve 20 requests
#    at once?
# 3. Why does a CUDA graph help a batch-1 decode step much more than a long prefill?
#
# <!-- BEGIN SOLUTION -->
# 1. A closed loop slows its arrivals down when the server slows down, so it never sees a queue
#    build: it measures the server at whatever load it can take, not at the load asked for.
# 2. Yes, if they are shorter: the figure counts requests that each fill 8,192 tokens. Requests
#    hold blocks only for the tokens they have, so many short ones fit; if they grow, the engine
#    preempts some.
# 3. A decode step at batch 1 launches hundreds of small kernels that each finish in microseconds,
#    so launching them is a large share of the step; a long prefill runs the same kernels on
#    thousands of tokens, and the launch cost is negligible beside the arithmetic.
# <!-- END SOLUTION -->
