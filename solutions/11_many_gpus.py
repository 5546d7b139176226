# Lab 11 source of truth. Edit this file, then run `python -m labsupport release 11_many_gpus` to
# regenerate labs/11_many_gpus.ipynb (learners) and solutions/11_many_gpus.ipynb (instructors).

# %% [markdown]
# # Lab 11: many GPUs
#
# A model too big for one GPU is split across several, and the GPUs talk through collectives.
# In this lab, on `torch.distributed`, you will
#
# 1. write a **ring all-reduce** from point-to-point sends and receives (reduce-scatter, then
#    all-gather), checked against `dist.all_reduce` at 2, 3 and 4 processes on sizes the number
#    of processes does not divide;
# 2. **shard** one layer of the course model for tensor parallelism as Megatron-LM does
#    (column-parallel q/k/v and gate/up, row-parallel output and down projections, KV heads split
#    across ranks), checked weight by weight;
# 3. write the **tensor-parallel layer's forward pass**, checked against the single-process model
#    and for exactly two all-reduces per layer;
# 4. **measure** all-reduce time against message size and number of processes, and a
#    tensor-parallel decode step against one process (section 0: these need none of your code,
#    so they come first).
#
# Every process here is a CPU process talking through gloo, even on a machine with GPUs: the same
# code runs on GPUs with NCCL (`backend="nccl"`, one GPU per rank), which the course's bench
# module does. Timings in this lab are CPU timings, labelled so: gloo over local TCP is far slower
# than NVLink, so they show the shape of the costs, not a GPU's numbers.
#
# **How the processes start.** `labsupport.distributed.launch(fn, world_size, args)` starts
# `world_size` fresh Python processes, joins them into one process group and runs `fn(*args)` on
# each; it returns what each rank returned. Your functions are defined in this notebook, which
# the new processes cannot import, so `launch` sends them *by source*: their text and the globals
# they use (modules by name, other notebook functions the same way). Define them with `def` at
# the top of a cell, and import what they use at the top of the notebook. A rank that raises ends
# the launch with its traceback; a rank stuck for longer than a time limit (a deadlock) ends it
# with a message saying where it was stuck; no process is left behind either way. The first launch
# costs a few seconds of start-up (importing torch); on Linux, CPU (gloo) ranks are then forked from
# a helper process that imported torch once, as Python's `multiprocessing` "forkserver" does, so
# later launches skip that import. The helper never initialises CUDA, and it ends with this kernel;
# NCCL ranks, one GPU each, always start as fresh processes.
#
# **Run All** (*Run > Run All Cells*) stops at the first exercise you have not written: its check
# cell raises with a short message saying so, nothing below it runs, and JupyterLab scrolls back to
# that cell.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import os
import platform

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import ledger
from labsupport.checks import check_ring_all_reduce, check_shard_layer, check_tp_layer_forward
from labsupport.collectives import ring_bytes_sent, ring_chunk_bounds, time_all_reduce
from labsupport.distributed import launch
from labsupport.models import get_model
from labsupport.tensor_parallel import causal_attention, rms_norm, time_decode_step
from labsupport.transformer import Transformer, apply_rope

WHERE = f"CPU ({platform.machine()}, {os.cpu_count()} cores), gloo over local TCP, one thread per process"
print(f"timings below are taken on: {WHERE}")

# %% [markdown]
# ## 0. Measurements first
#
# These use only the course's code, so they run even before you write anything (Run All stops
# at your first unfinished exercise, further down).
#
# ### All-reduce time against message size and number of processes
#
# `time_all_reduce(sizes)` runs on every rank: the median time of `dist.all_reduce` on fp32
# tensors of each size, and the bus bandwidth as nccl-tests defines it, bytes / time $\times
# 2(n-1)/n$ (the ring's traffic per rank, so the number is comparable across $n$). Small messages
# cost a fixed latency whatever their size; large ones approach a bandwidth.

# %%
SIZES = [2**k for k in range(4, settings.pick(small=21, full=25), 2)]  # elements (fp32)
rows = []
for n in (2, 4):
    rows += launch(time_all_reduce, n, args=(SIZES,), backend="gloo")[0]
print(f"all-reduce, gloo, {WHERE}")
print(" n   bytes        time (us)   bus bandwidth (GB/s)")
for row in rows:
    print(f"{row['world_size']:2d} {row['bytes']:10,d} {row['seconds'] * 1e6:12.1f} {row['bus_bandwidth'] / 1e9:14.3f}")

# %%
fig, ax = plt.subplots(figsize=(5, 3.4))
for n in (2, 4):
    mine = [r for r in rows if r["world_size"] == n]
    ax.loglog([r["bytes"] for r in mine], [r["seconds"] * 1e6 for r in mine], "o-", label=f"{n} processes")
ax.set(xlabel="message (bytes)", ylabel="all-reduce time (us)", title="gloo on a CPU (not a GPU figure)")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# ### A tensor-parallel decode step against one process
#
# `time_decode_step` builds the same model on every rank, splits it with the course's
# `TensorParallelModel` (the layers as you will write them in exercises 2 and 3, a
# vocabulary-parallel output head joined
# by an all-gather, a KV cache of $H_{kv}/n$ heads per rank) and times one decode step; it also
# reports the largest difference of its logits from the single-process model's.

# %%
MODEL, BATCH, CONTEXT = "tiny-20m", 1, 64
split = launch(time_decode_step, 2, args=(MODEL, BATCH, CONTEXT), backend="gloo")[0]
torch.set_num_threads(1)  # the single process gets one thread, like each rank
alone = time_decode_step(MODEL, BATCH, CONTEXT, tensor_parallel=False)
print(f"{MODEL} ({get_model(MODEL).n_layers} layers), batch {BATCH}, context {CONTEXT}, on {WHERE}")
print(f"one process:         {alone['seconds'] * 1e3:7.2f} ms per decode step")
print(f"two processes (TP):  {split['seconds'] * 1e3:7.2f} ms per decode step, "
      f"logits within {split['max_logit_difference']:.1e} of one process")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# Everything here ran on the CPU (gloo over local TCP), so the file names the CPU.

# %%
ledger.record("11_many_gpus", [
    *(ledger.Figure(f"all_reduce_n{r['world_size']}_{r['bytes']}B", r["seconds"] * 1e6, "us",
                    f"gloo all-reduce of fp32, {r['world_size']} local processes, one thread each; median time")
      for r in rows),
    ledger.Figure("decode_step_1_process", alone["seconds"] * 1e3, "ms", f"{MODEL}, batch {BATCH}, context {CONTEXT}; median time"),
    ledger.Figure("decode_step_2_processes_tp", split["seconds"] * 1e3, "ms",
                  f"{MODEL}, batch {BATCH}, context {CONTEXT}, tensor parallel over 2 gloo processes; median time"),
], on_cpu=True)

# %% [markdown]
# Compare the two lines with the all-reduce table above. The split halves each process's
# arithmetic but adds two all-reduces per layer and an all-gather for the logits, each paying at
# least the fixed cost of the smallest message in that table; on a CPU with gloo those costs are
# large next to a step of this small model, so the split rarely pays here. On GPUs joined by
# NVLink the fixed cost is far smaller and a decode step of a big model is limited by reading its
# weights, which the split divides: that is where tensor parallelism pays. The chapter works
# through when.

# %% [markdown]
# ## 1. The ring all-reduce
#
# After an all-reduce every rank holds the element-wise sum of every rank's tensor. The ring
# algorithm cuts the tensor into $n$ chunks ($n$ ranks) and passes chunks around a ring, rank $r$
# sending to $r+1$ and receiving from $r-1$ (modulo $n$):
#
# * **reduce-scatter**, $n-1$ steps: at step $s$ rank $r$ sends chunk $(r-s) \bmod n$ and adds the
#   chunk it receives into chunk $(r-s-1) \bmod n$. Afterwards rank $r$ holds the complete sum of
#   one chunk, $(r+1) \bmod n$.
# * **all-gather**, $n-1$ more steps: the complete chunks travel around the ring once, each rank
#   overwriting the chunk it receives (at step $s$ send chunk $(r-s+1) \bmod n$, receive chunk
#   $(r-s) \bmod n$).
#
# Every rank sends $2(n-1)$ chunks of $1/n$ of the tensor: $2(n-1)/n$ of its bytes, whatever $n$ is.
#
# Chunks follow `torch.tensor_split`: when $n$ does not divide the size, the first
# `numel % n` chunks are one element longer. Here are the bounds for 10 elements on 4 ranks:

# %% tags=["nbval-check-output"]
print(ring_chunk_bounds(10, 4))
for n in (2, 4, 8):
    print(f"n = {n}: each rank sends {ring_bytes_sent(1.0, n):.3f} x the tensor's bytes")

# %% [markdown]
# ### Exercise 1: `ring_all_reduce`
#
# `ring_all_reduce(x)` runs on every rank with a tensor `x` of the same shape everywhere; return a
# new tensor of `x`'s shape holding the sum over ranks. Use `dist.get_rank()`,
# `dist.get_world_size()`, and point-to-point messages only: `dist.isend(tensor, dst)` (returns a
# request; call `.wait()` on it) and `dist.recv(tensor, src)` (blocking). Collectives
# (`dist.all_reduce`, `dist.reduce_scatter`, `dist.all_gather`, ...) are refused while the check
# runs your function. The check also counts what each rank sends: only to its right neighbour,
# and no more than $2(n-1)$ chunks in all (a rank that sends its whole tensor to every other rank
# and adds gets the right sum, but moves $n-1$ times the tensor: that is not a ring).
#
# A trap: `dist.send` is blocking, it returns only once the receiver has received. If every rank
# calls `send` before `recv`, every rank waits for a receiver that never comes: a deadlock. The
# check ends such a run after 20 seconds and says so.

# %%
def ring_all_reduce(x):
    # BEGIN SOLUTION: chunks by tensor_split; n-1 reduce-scatter steps, then n-1 all-gather steps
    rank, n = dist.get_rank(), dist.get_world_size()
    out = x.clone().reshape(-1)  # (numel,)
    chunks = list(out.tensor_split(n))  # n views of out
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):  # reduce-scatter
        send, recv = (rank - step) % n, (rank - step - 1) % n
        request = dist.isend(chunks[send], right)
        incoming = torch.empty_like(chunks[recv])
        dist.recv(incoming, left)
        request.wait()
        chunks[recv] += incoming
    for step in range(n - 1):  # all-gather
        send, recv = (rank - step + 1) % n, (rank - step) % n
        request = dist.isend(chunks[send], right)
        dist.recv(chunks[recv], left)
        request.wait()
    return out.view(x.shape)
    # END SOLUTION

# %%
check_ring_all_reduce(ring_all_reduce)

# %% [markdown]
# ## 2. Splitting a layer: which weights go where
#
# Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) splits every layer's matrices so that
# each rank does $1/n$ of the work and the ranks talk only twice per layer:
#
# * **column-parallel** (split the *output* features, the rows of a `nn.Linear` weight): `wq`,
#   `wk`, `wv`, and the feed-forward's gate `w1` and up `w3`. Rank $r$ computes its own heads and
#   its own slice of the SwiGLU features, with no communication.
# * **row-parallel** (split the *input* features, the columns): the output projection `wo` and
#   the down projection `w2`. Rank $r$'s product covers only its inputs: it is a *partial sum*,
#   and one all-reduce adds the $n$ partial sums.
#
# With grouped-query attention, query head $h$ reads KV head $h // G$ ($G = H / H_{kv}$). Rank $r$
# owns query heads $[rH/n, (r+1)H/n)$; the KV heads they read are $[rH_{kv}/n, (r+1)H_{kv}/n)$, a
# contiguous block too. Each rank keeps only those KV heads, and its KV cache holds only them:
# the cache is split across ranks as well.
#
# The course model's layer (`Transformer(...).layers[i]`) has `attention.wq`, `.wk`, `.wv`, `.wo`
# (`nn.Linear`; biases when the model has them), `attention.q_norm` and `.k_norm` (Qwen3-style
# norms, or `None`), `attention_norm`, `feed_forward.w1`, `.w3`, `.w2` and `ffn_norm`.
#
# ### Exercise 2: `shard_layer`
#
# `shard_layer(layer, rank, world_size)` returns a dict of tensors, this rank's part:
# `wq wk wv w1 w3` (the rank's rows), `wo w2` (the rank's columns), `bq bk bv` when
# `layer.attention.wq.bias` is not None (split like their weights), and, whole:
# `attention_norm ffn_norm` (the norms' weights), `q_norm k_norm` when the model has them, `bo`
# (the output projection's bias) when it has one: a row-parallel bias is added once, after the
# sum. Head width: `layer.attention.head_dim`; head counts: `layer.attention.n_heads`,
# `.n_kv_heads`. The check runs every rank of world sizes 2 and 4, on a model with 8 query heads,
# 4 KV heads, biases and q/k norms, and on `tiny-2m`.

# %%
def shard_layer(layer, rank, world_size):
    # BEGIN SOLUTION: rows of wq/wk/wv/w1/w3, columns of wo/w2, KV heads [r*Hkv/n, (r+1)*Hkv/n)
    attn, ffn = layer.attention, layer.feed_forward
    n, D = world_size, attn.head_dim
    hq, hkv, f = attn.n_heads // n, attn.n_kv_heads // n, ffn.w1.out_features // n
    q = slice(rank * hq * D, (rank + 1) * hq * D)
    kv = slice(rank * hkv * D, (rank + 1) * hkv * D)
    ff = slice(rank * f, (rank + 1) * f)
    shards = {
        "wq": attn.wq.weight[q], "wk": attn.wk.weight[kv], "wv": attn.wv.weight[kv], "wo": attn.wo.weight[:, q],
        "w1": ffn.w1.weight[ff], "w3": ffn.w3.weight[ff], "w2": ffn.w2.weight[:, ff],
        "attention_norm": layer.attention_norm.weight, "ffn_norm": layer.ffn_norm.weight,
    }
    if attn.wq.bias is not None:
        shards.update(bq=attn.wq.bias[q], bk=attn.wk.bias[kv], bv=attn.wv.bias[kv])
    if attn.wo.bias is not None:
        shards["bo"] = attn.wo.bias
    if attn.q_norm is not None:
        shards.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight)
    return {key: value.detach().clone() for key, value in shards.items()}
    # END SOLUTION

# %%
check_shard_layer(shard_layer)

# %% [markdown]
# What each rank of `tiny-2m` holds at two ranks ($H = 4$, $H_{kv} = 2$, $d_{ff} = 448$):

# %% tags=["nbval-check-output"]
tiny = Transformer(get_model("tiny-2m"), seed=0)
for key, value in shard_layer(tiny.layers[0], 0, 2).items():
    print(f"{key:15s} {tuple(value.shape)}")

# %% [markdown]
# ## 3. The tensor-parallel layer
#
# ### Exercise 3: `tp_layer_forward`
#
# `tp_layer_forward(shards, x, cos, sin, cfg)` runs one decoder layer on this rank's `shards`:
# `x` is `(B, S, d)`, the same on every rank; `cos, sin` are the rotary tables `(S, D)` of
# positions `0 .. S-1`; `cfg` is the model's `ModelConfig` (`cfg.n_heads`, `cfg.n_kv_heads`,
# `cfg.head_dim`). Return the layer's output `(B, S, d)`, the same on every rank and equal to the
# single-process layer's. The steps, with `h = H/n` and `hkv = Hkv/n` heads on this rank:
#
# 1. `rms_norm(x, shards["attention_norm"])`; q, k, v with `F.linear(h, w, b)` (biases may be
#    absent: `shards.get("bq")`), reshaped to `(B, heads, S, D)`; the q/k norms when present
#    (`rms_norm` over the last dimension); `apply_rope(q, cos, sin)` and the same for k;
# 2. `causal_attention(q, k, v)` (it repeats each KV head for its group) and the row-parallel
#    output projection `F.linear(out, shards["wo"])`: a partial sum; all-reduce it, then add `bo`
#    if present, then the residual;
# 3. `rms_norm` with `ffn_norm`, the SwiGLU on this rank's features, the row-parallel `w2`, one
#    all-reduce, the residual.
#
# The check runs your layer on two processes, layer by layer and as the whole model, and counts
# `dist.all_reduce` calls: exactly two per layer.

# %%
def tp_layer_forward(shards, x, cos, sin, cfg):
    # BEGIN SOLUTION: local heads and features; all-reduce after wo and after w2, nowhere else
    n = dist.get_world_size()
    B, S, _ = x.shape
    D, hq, hkv = cfg.head_dim, cfg.n_heads // n, cfg.n_kv_heads // n
    h = rms_norm(x, shards["attention_norm"])
    q = F.linear(h, shards["wq"], shards.get("bq")).view(B, S, hq, D).transpose(1, 2)  # (B, hq, S, D)
    k = F.linear(h, shards["wk"], shards.get("bk")).view(B, S, hkv, D).transpose(1, 2)  # (B, hkv, S, D)
    v = F.linear(h, shards["wv"], shards.get("bv")).view(B, S, hkv, D).transpose(1, 2)
    if "q_norm" in shards:
        q, k = rms_norm(q, shards["q_norm"]), rms_norm(k, shards["k_norm"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = causal_attention(q, k, v).transpose(1, 2).reshape(B, S, hq * D)  # (B, S, hq*D)
    partial = F.linear(out, shards["wo"])  # (B, S, d): a partial sum
    dist.all_reduce(partial)
    if "bo" in shards:
        partial = partial + shards["bo"]
    x = x + partial
    h = rms_norm(x, shards["ffn_norm"])
    partial = F.linear(F.silu(F.linear(h, shards["w1"])) * F.linear(h, shards["w3"]), shards["w2"])
    dist.all_reduce(partial)
    return x + partial
    # END SOLUTION

# %%
check_tp_layer_forward(tp_layer_forward)

# %% [markdown]
# ## What you built and measured
#
# * A ring all-reduce from point-to-point messages, equal to `dist.all_reduce` at 2, 3 and 4
#   processes on sizes they do not divide, and the deadlock that blocking sends cause.
# * Megatron's split of the course model's layer: column-parallel q/k/v and gate/up, row-parallel
#   output and down, KV heads with their query heads, two all-reduces per layer, outputs equal to
#   one process's.
# * All-reduce time against size and processes, and a tensor-parallel decode step against one
#   process, on a CPU with gloo.
#
# ### Questions
#
# 1. Why does each rank send $2(n-1)/n$ of the tensor, and why is that close to the best possible?
# 2. A model has 8 KV heads. What goes wrong at tensor-parallel size 16, and what do engines do?
# 3. Why do the two all-reduces sit after `wo` and `w2`, and not after `wq` or `w1`?
#
# <!-- BEGIN SOLUTION -->
# 1. Each of the $n-1$ reduce-scatter steps and each of the $n-1$ all-gather steps sends one chunk
#    of $1/n$ of the tensor. Every rank must receive the other ranks' contributions to its chunk,
#    $(n-1)/n$ of the data, and must receive the finished chunks it does not own, $(n-1)/n$ more:
#    the ring sends exactly that lower bound.
# 2. 16 ranks cannot each own a distinct block of 8 KV heads: some rank would own half a head.
#    Engines (vLLM, for one) replicate each KV head on $16 / 8 = 2$ ranks instead, which costs
#    cache memory.
# 3. After a column-parallel layer each rank holds complete values for its own heads or
#    features, which the next operation (attention, the SwiGLU product) consumes locally. After
#    a row-parallel layer each rank holds a partial sum over its inputs of every output: only
#    there does anything need adding.
# <!-- END SOLUTION -->
