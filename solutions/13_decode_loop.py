# Lab 13 source of truth. Edit this file, then run `python -m labsupport release 13_decode_loop` to
# regenerate labs/13_decode_loop.ipynb (learners) and solutions/13_decode_loop.ipynb (instructors).

# %% [markdown]
# # Lab 13: the decode loop
#
# A serving engine is a loop: pick what runs, run one forward pass, sample, stream, retire. The
# course's engine (`labsupport.engine.Engine`) runs that loop with continuous batching and
# chunked prefill on chapter 10's paged cache. In this lab you will
#
# 1. write the **sampler** (temperature, top-k, top-p), checked statistically and at its edges;
# 2. write the **scheduler's step decision** (which sequences run, how many tokens each, whom to
#    preempt), checked on traces against the invariants a scheduler must keep, then run the real
#    engine with it and confirm that every request gets exactly the tokens it gets alone;
# 3. **measure** static against continuous batching on the same trace of requests: throughput,
#    TTFT and TPOT percentiles;
# 4. write **speculative acceptance**, checked with a chi-squared test, then run speculative
#    decoding end to end with a small draft model and compare its speed-up with the acceptance.
#
# The models have random weights (seeded): the text is meaningless, but timing and the tokens'
# bookkeeping are what a trained model of the same shape would show. The models run on the CPU,
# even on a machine with a GPU, and every timing in this lab is a CPU timing, labelled so: it shows
# the engine's own overheads and a CPU's arithmetic, not a GPU's.
#
# **Run All** (*Run > Run All Cells*) stops at the first exercise you have not written: its check
# cell raises with a short message saying so, nothing below it runs, and JupyterLab scrolls back to
# that cell.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import dataclasses
import os
import platform

import matplotlib.pyplot as plt
import torch

from labsupport import ledger
from labsupport.checks import check_sample, check_schedule_step, check_speculative_accept
from labsupport.engine import Engine, poisson_trace, run_trace, trace_summary
from labsupport.models import get_model
from labsupport.sampling import SamplingParams
from labsupport.scheduler import SeqView, TraceItem, blocks_for, simulate, static_batch_step
from labsupport.speculative import (
    autoregressive_generate,
    expected_tokens_per_step,
    make_draft,
    measured_alpha,
    speculative_generate,
)
from labsupport.timing import benchmark
from labsupport.transformer import Transformer

torch.set_num_threads(1)  # the tiny model's steps take milliseconds; one thread keeps timings steady
# The course's tiny shape with its own output head: tied to the embeddings, a random model's
# greedy text would just repeat its last token.
CFG = dataclasses.replace(get_model("tiny-2m"), tied_embeddings=False, name="tiny-2m-untied")
model = Transformer(CFG, seed=0)  # fp32, on the CPU (even beside a GPU): the lab is about the loop, not the kernels
WHERE = f"CPU ({platform.machine()}, {os.cpu_count()} cores), fp32, one thread"
print(model)
print(f"timings below are taken on: {WHERE}")

# %% [markdown]
# ## 0. The loop, watched
#
# Five requests of different lengths arrive together. The engine's token budget is 16 tokens per
# step, so the long prompts are prefilled in chunks while the short ones already decode. Each row
# of the table is one forward pass: how many sequences it held, how many of its tokens were
# prompt (prefill) and how many were decodes. The clock counts steps (`clock="steps"`), so the
# table is the same on every machine.

# %% tags=["nbval-check-output"]
prompts = [list(range(3, 3 + n)) for n in (5, 40, 9, 23, 3)]
# the prompts all start 3, 4, 5, ...: chapter 10's prefix cache would skip their shared first
# blocks, so it is off here and the table shows every prompt token computed
engine = Engine(model, num_blocks=64, block_size=8, token_budget=16, max_running=4, clock="steps",
                prefix_caching=False)
ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6)) for p in prompts]
for _ in engine.stream():
    pass
print("step  seqs  prefill  decode  waiting  free blocks")
for s in engine.steps:
    print(f"{s.step:4d} {s.num_seqs:5d} {s.prefill_tokens:8d} {s.decode_tokens:7d} {s.waiting:8d} {s.free_blocks:12d}")
print("TTFT in steps per request:", [engine.requests[i].metrics()["ttft"] for i in ids])

# %% [markdown]
# ### One decode step against the batch size
#
# How long does one step take when it decodes one token for each of `B` sequences? The engine
# first prefills `B` prompts, then every step is a pure decode step; `benchmark` times those.
# If a step cost the same whatever the batch, a token's cost would fall as $1/B$; how far it falls
# here shows how much of a step is fixed cost (the loop, Python, a few hundred small operations per
# forward pass) and how much grows with the batch.

# %%
decode_ms = {}
for B in (1, 2, 4, 8, 16):
    eng = Engine(model, num_blocks=256, block_size=16, token_budget=16 * B, max_running=B)
    for b in range(B):
        eng.add_request(list(range(b, b + 16)), SamplingParams(temperature=0, max_tokens=200))
    eng.step()  # the prefills; from here on every step decodes B tokens
    decode_ms[B] = benchmark(eng.step, repeats=20, warmup=2).median_s * 1e3
    print(f"batch {B:3d}: {decode_ms[B]:6.2f} ms per step, {decode_ms[B] / B:6.2f} ms per token")
print(f"(measured on {WHERE})")

# %% [markdown]
# ## 1. Sampling
#
# For one sequence's logits $z$ (a vector of $V$ numbers):
#
# 1. **temperature** $T$: probabilities $\mathrm{softmax}(z / T)$; the division is on the
#    *logits*, before the softmax. $T = 0$ means greedy: return the argmax and draw nothing.
# 2. **top-k** $k$: keep the $k$ largest logits, drop the rest ($k = 0$ keeps every token).
# 3. **top-p** $p$: sort what is left by probability, largest first, and keep the shortest prefix
#    whose probabilities sum to at least $p$: the token whose probability carries the running sum
#    across $p$ is **kept**, and so is the most likely token, always. $p = 1.0$ keeps every token.
# 4. renormalise what is kept and draw one token.
#
# A spec in plain torch for step 3: with `probs_sorted` in decreasing order,
# `keep = torch.cumsum(probs_sorted, -1) - probs_sorted < top_p` (the mass of the tokens ranked
# above each one is still below `top_p`), then `keep[..., 0] = True`: a `top_p` as small as 1e-300
# is valid but is 0 in float32, and without that line it would cut every token, leaving nothing to
# draw (vLLM keeps at least one token too). Ties between equal logits do not occur in the check.
#
# ### Exercise 1: `sample`
#
# `sample(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None)` takes `logits` of shape
# `(B, V)` and returns `(B,)` int64 token ids, one per row, drawn with
# `torch.multinomial(probs, 1, generator=generator)`. The check draws 20,000 tokens per case from
# a seeded generator and compares their counts with the exact probabilities; the tolerance comes
# from the sample size (a correct sampler fails less than once in a million runs).

# %%
def sample(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    # BEGIN SOLUTION: temperature 0 -> argmax; else logits / T, top-k, softmax, top-p (keep the crossing token), draw
    if temperature == 0:
        return logits.argmax(-1)
    z = logits.float() / temperature  # (B, V)
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest logit
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ranked above each token
        cut = above >= top_p
        cut[..., 0] = False  # the most likely token always stays (a tiny top_p is 0 in float32)
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]  # multinomial renormalises
    # END SOLUTION

# %%
check_sample(sample)

# %% [markdown]
# Your sampler on one set of logits: temperature reshapes the whole distribution, top-k and top-p
# cut its tail.

# %%
logits = torch.tensor([[3.0, 2.5, 2.0, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])
settings_to_show = [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0),
                    dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8)]
fig, axes = plt.subplots(1, len(settings_to_show), figsize=(13, 2.6), sharey=True)
gen = torch.Generator().manual_seed(0)
for ax, kw in zip(axes, settings_to_show):
    draws = sample(logits.expand(5000, -1), generator=gen, **kw)
    ax.bar(range(10), torch.bincount(draws, minlength=10) / 5000)
    ax.set_title(", ".join(f"{k}={v}" for k, v in kw.items()), fontsize=8)
axes[0].set_ylabel("share of 5,000 draws")
fig.tight_layout()

# %% [markdown]
# ## 2. The scheduler's step decision
#
# Each step the engine hands the scheduler what it knows and asks what runs. Every sequence is a
# `SeqView` with
#
# * `request_id`;
# * `num_tokens`: its prompt plus the tokens it has generated so far;
# * `num_computed`: how many of those have keys and values in the cache;
# * `num_blocks`: cache blocks it holds now, `ceil(num_computed / block_size)`;
# * `left` (a property): `num_tokens - num_computed`, the tokens still to compute. A decoding
#   sequence has exactly 1 left (the token it sampled last step); one in prefill has its prompt
#   (or what remains of it).
#
# Running `n` more tokens of a sequence needs `blocks_for(num_computed + n, block_size) - num_blocks`
# new blocks.
#
# ### Exercise 2: `schedule_step`
#
# `schedule_step(running, waiting, token_budget, free_blocks, block_size, max_running)` gets the
# running sequences (oldest admitted first), the waiting ones (in the order to admit them), the
# step's token budget, the free blocks, the block size and the most sequences that may run at
# once. It returns `(scheduled, preempted)`: a dict `{request_id: tokens to run}` and a list of
# the ids preempted this step. The rule (vLLM's, simplified):
#
# 1. **Running first**, oldest first: each gets `min(left, budget left)` tokens. When the budget
#    is spent, the rest wait for the next step.
# 2. If a running sequence needs more blocks than are free, **preempt the newest** running
#    sequence (the last of `running` not yet given tokens): its blocks become free (add its
#    `num_blocks`) and it goes into `preempted`. Repeat until the blocks suffice; if the sequence
#    that needs them is itself the newest left, preempt it and stop.
# 3. If nothing was preempted, **admit** waiting sequences in order, each with
#    `min(left, budget left)` tokens (a chunk of a long prompt: chunked prefill), while the budget
#    lasts, fewer than `max_running` sequences run and its blocks are free. The **first** that
#    does not fit stops admission: nobody behind it jumps ahead, so a long prompt cannot be
#    starved by a stream of short ones.
#
# The check replays four traces through a model-free simulation and checks every step: the
# decision is possible (budget, blocks, slots), no running sequence or waiting request is left
# idle while budget, a slot and blocks remain, admission is first come first served, and every
# request finishes.

# %%
def schedule_step(running, waiting, token_budget, free_blocks, block_size, max_running):
    # BEGIN SOLUTION: running first (preempting the newest when blocks run out), then admit waiting in order
    scheduled, preempted = {}, []
    budget, free = token_budget, free_blocks
    queue = list(running)
    while queue and budget > 0:
        seq = queue.pop(0)
        n = min(seq.left, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        while need > free and queue:
            victim = queue.pop()  # the newest running sequence
            free += victim.num_blocks
            preempted.append(victim.request_id)
        if need > free:
            preempted.append(seq.request_id)
            break
        scheduled[seq.request_id] = n
        budget -= n
        free -= need
    if preempted:
        return scheduled, preempted
    n_running = len(running)
    for seq in waiting:
        if budget <= 0 or n_running >= max_running:
            break
        n = min(seq.left, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        if need > free:
            break
        scheduled[seq.request_id] = n
        budget -= n
        free -= need
        n_running += 1
    return scheduled, preempted
    # END SOLUTION

# %%
check_schedule_step(schedule_step)

# %% [markdown]
# Your scheduler on one decision: two sequences decode, one is half-way through its prompt, two
# wait. With a budget of 8 tokens the decodes and the unfinished prompt come first.

# %% tags=["nbval-check-output"]
running = [SeqView("a", num_tokens=12, num_computed=11, num_blocks=3),
           SeqView("b", num_tokens=30, num_computed=8, num_blocks=2),
           SeqView("c", num_tokens=7, num_computed=6, num_blocks=2)]
waiting = [SeqView("d", num_tokens=20), SeqView("e", num_tokens=3)]
print(schedule_step(running, waiting, token_budget=8, free_blocks=10, block_size=4, max_running=8))
print(schedule_step(running, waiting, token_budget=32, free_blocks=10, block_size=4, max_running=8))
print(schedule_step(running, waiting, token_budget=32, free_blocks=0, block_size=4, max_running=8))

# %% [markdown]
# Now the real engine with **your** scheduler and **your** sampler, on a trace with mixed
# arrivals and lengths, a budget small enough to chunk every long prompt and a cache too small
# for everyone (so sequences get preempted and recomputed). With greedy sampling each request
# must get exactly the tokens the model gives it alone (`Transformer.generate`): batching,
# chunking and preemption may change *when* a token comes, never *which*.

# %%
trace = poisson_trace(10, rate=0.5, prompt_lens=[3, 12, 30, 45], output_lens=[4, 8, 12], vocab_size=CFG.vocab_size,
                      seed=1, temperature=0.0)
yours = Engine(model, num_blocks=14, block_size=4, token_budget=8, max_running=4, clock="steps",
               scheduler=schedule_step, sampler=sample)
done = run_trace(yours, trace)
same = 0
for t, r in zip(trace, done):
    alone = model.generate(torch.tensor([t.prompt_ids]), t.params.max_tokens)[0, len(t.prompt_ids):].tolist()
    same += r.output_ids == alone
print(f"{same} of {len(done)} requests got exactly their tokens from running alone")
print(f"preemptions: {sum(r.preemptions for r in done)}, steps: {len(yours.steps)}, "
      f"largest step: {max(s.prefill_tokens + s.decode_tokens for s in yours.steps)} tokens")
assert same == len(done)

# %% [markdown]
# ### The token budget sets the TTFT/ITL trade
#
# A long prompt that arrives while others decode: with a large budget it is prefilled in one
# step, and every decoding sequence waits for that big step (a long gap between two of their
# tokens); with a small one it is cut into chunks that ride along with the decodes, and its own
# first token comes later. The simulation counts steps and the largest step in tokens, the
# quantity the decoding sequences' inter-token gap grows with.

# %% tags=["nbval-check-output"]
busy = [TraceItem(0, 8, 60) for _ in range(6)] + [TraceItem(10, 512, 4)]
print("budget  long prompt's TTFT (steps)  largest step (tokens)")
for budget in (32, 128, 512, 1024):
    steps = []
    result = simulate(schedule_step, busy, token_budget=budget, num_blocks=256, block_size=16, max_running=8,
                      observe=steps.append)
    long = result["requests"][-1]
    biggest = max(sum(s.scheduled.values()) for s in steps)
    print(f"{budget:6d} {long['first_token'] - long['arrival'] + 1:27d} {biggest:22d}")

# %% [markdown]
# ## 3. Static against continuous batching
#
# Static batching forms a batch, runs it until its **last** sequence finishes, and only then
# admits the next: short requests leave their slots empty, and newcomers wait for the whole batch.
# Continuous (iteration-level) batching, Orca's idea, admits and retires at every step.
# Both engines below replay the same trace of Poisson arrivals. The clock is virtual: it advances
# by each step's measured time and skips idle gaps, so no time is spent sleeping. Throughput is
# output tokens per second from the first arrival to the last token; TTFT and TPOT are
# nearest-rank percentiles over the requests (chapter 03).

# %%
n_requests = settings.pick(small=24, full=48)
bench_trace = poisson_trace(n_requests, rate=40.0, prompt_lens=[8, 16, 48, 96], output_lens=[4, 16, 32, 48],
                            vocab_size=CFG.vocab_size, seed=2, temperature=0.0)
policies = {
    "static": dict(scheduler=static_batch_step, token_budget=None),
    "continuous": dict(scheduler=schedule_step, token_budget=128),
}
summaries, engines = {}, {}
for name, kw in policies.items():
    engines[name] = Engine(model, num_blocks=256, block_size=16, max_running=8, clock="virtual", **kw)
    summaries[name] = trace_summary(run_trace(engines[name], bench_trace))
print(f"{len(bench_trace)} requests, max 8 running; timings on {WHERE}")
print(f"{'':11s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}  (ms)")
for name, s in summaries.items():
    print(f"{name:11s} {s['throughput']:7.0f} {s['ttft'].p50 * 1e3:9.1f} {s['ttft'].p99 * 1e3:9.1f} "
          f"{s['tpot'].p50 * 1e3:9.2f} {s['tpot'].p99 * 1e3:9.2f}")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# This lab runs its model on the CPU even beside a GPU, so the file names the CPU.

# %%
trace = f"{len(bench_trace)} Poisson requests at 40/s, max 8 running, {CFG.name} fp32 on the CPU, virtual clock"
ledger.record("13_decode_loop", [
    *(ledger.Figure(f"decode_step_b{B}", ms, "ms", f"{CFG.name} fp32 engine decode step, one thread; median time")
      for B, ms in decode_ms.items()),
    *(figure for name, s in summaries.items() for figure in (
        ledger.Figure(f"{name}_throughput", s["throughput"], "tokens/s", f"{name} batching; {trace}; output tokens "
                      "from first arrival to last token"),
        ledger.Figure(f"{name}_ttft_p50", s["ttft"].p50 * 1e3, "ms", f"{name} batching; {trace}; nearest-rank median"),
        ledger.Figure(f"{name}_tpot_p50", s["tpot"].p50 * 1e3, "ms", f"{name} batching; {trace}; nearest-rank median"))),
], on_cpu=True)

# %% [markdown]
# On a CPU, a step's time grows with the tokens in it almost from the first token (the CPU is
# compute-bound even at small batch), so continuous batching's fuller steps are slower steps:
# its TPOT is higher, and its throughput gain is small. On a GPU a decode step costs about the
# same for 1 or 8 sequences (chapter 05: decode is bound by reading the weights), and then the
# number of steps is what counts. The same trace, timed in steps (`clock="steps"`; the arrivals
# are spread to the same number of requests per step as above):

# %% tags=["nbval-check-output"]
step_trace = [dataclasses.replace(t, arrival_s=round(t.arrival_s * 40)) for t in bench_trace]  # 1 step per arrival gap
print(f"{'':11s} {'tok/step':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}  (steps)")
for name, kw in policies.items():
    s = trace_summary(run_trace(Engine(model, num_blocks=256, block_size=16, max_running=8, clock="steps", **kw),
                                step_trace))
    print(f"{name:11s} {s['throughput']:8.2f} {s['ttft'].p50:9.0f} {s['ttft'].p99:9.0f} "
          f"{s['tpot'].p50:9.2f} {s['tpot'].p99:9.2f}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
for name, eng in engines.items():
    ax1.plot([s.time_s * 1e3 for s in eng.steps], [s.num_seqs for s in eng.steps], drawstyle="steps-post", label=name)
ax1.set(xlabel="time (ms, virtual clock)", ylabel="sequences in the step", title="batch size over time")
ax1.legend()
steps = engines["continuous"].steps
ax2.scatter([s.prefill_tokens + s.decode_tokens for s in steps], [s.duration_s * 1e3 for s in steps], s=8)
ax2.set(xlabel="tokens in the step", ylabel="step time (ms)", xscale="log",
        title="continuous: step time (CPU)")
fig.tight_layout()

# %% [markdown]
# The right-hand plot shows where the time goes at small batch: a step with a handful of tokens
# costs nearly as much as one with dozens. On a CPU with a 2M-parameter model that floor is
# Python and per-operation overhead (the engine's loop and the step's metadata, and the
# operations of one forward pass, each of which costs microseconds however few its tokens); on a
# GPU it is kernel launches and the weights' read. Either way, below some batch
# size the hardware waits on the host, which is why engines capture CUDA graphs for decode and
# overlap scheduling with the forward pass (chapter 12).
#
# ## 4. Speculative decoding
#
# A cheap draft model proposes $k$ tokens, $x_i \sim q_i$; the target runs **once** over them and
# gives its own distributions $p_1, \dots, p_{k+1}$. Proposal $i$ is accepted with probability
# $\min(1, p_i(x_i) / q_i(x_i))$. At the first rejection the step emits a token drawn from the
# **residual** $\max(0, p_i - q_i)$, renormalised, and stops; if all $k$ are accepted it emits a
# bonus token from $p_{k+1}$. This keeps every emitted token distributed exactly as the target
# alone would sample it (Leviathan et al. 2023; Chen et al. 2023).
#
# ### Exercise 3: `speculative_accept`
#
# `speculative_accept(draft_tokens, draft_probs, target_probs, generator=None)`: `draft_tokens`
# `(k,)`, `draft_probs` `(k, V)`, `target_probs` `(k + 1, V)`; return the emitted tokens, a `(m,)`
# int64 tensor with `1 <= m <= k + 1`. Draw the uniform numbers with
# `torch.rand((), generator=generator)` and the residual or bonus token with
# `torch.multinomial(..., 1, generator=generator)`. The check runs 4,000 steps per case and tests
# with chi-squared that the first and second emitted tokens follow the target's distributions,
# and that the mean number of tokens per step is $(1 - a^{k+1}) / (1 - a)$.

# %%
def speculative_accept(draft_tokens, draft_probs, target_probs, generator=None):
    # BEGIN SOLUTION: ratio test per proposal; on rejection draw from max(0, p - q) normalised; bonus from p_{k+1}
    out = []
    k = draft_tokens.shape[0]
    for i in range(k):
        x = int(draft_tokens[i])
        p, q = target_probs[i], draft_probs[i]
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[x] / q[x])):
            out.append(x)
            continue
        residual = (p - q).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return torch.tensor(out, dtype=torch.long)
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return torch.tensor(out, dtype=torch.long)
    # END SOLUTION

# %%
check_speculative_accept(speculative_accept)

# %% [markdown]
# ### Tokens per step against the formula
#
# When every position is accepted independently with the same probability $a$, a step emits
# $1 + a + \dots + a^k = (1 - a^{k+1}) / (1 - a)$ tokens on average. With fixed distributions that
# holds exactly; your function reproduces it:

# %%
p = torch.tensor([0.5, 0.2, 0.2, 0.1])
q = torch.tensor([0.3, 0.3, 0.1, 0.3])
a = float(torch.minimum(p, q).sum())
gen, draws = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
for k in (1, 2, 4):
    lengths = [len(speculative_accept(torch.multinomial(q.expand(k, 4), 1, generator=draws)[:, 0], q.expand(k, 4),
                                      p.expand(k + 1, 4), generator=gen)) for _ in range(4000)]
    print(f"a = {a:.2f}, k = {k}: measured {sum(lengths) / len(lengths):.2f} tokens per step, "
          f"formula {expected_tokens_per_step(a, k):.2f}")

# %% [markdown]
# ### End to end, with a draft model
#
# There is no trained small model of our random target, so the draft is built from it: the
# target's first layer (with its embeddings and output head), plus Gaussian noise on every
# weight matrix; more noise, less agreement. The target has 8 layers, so a draft step does about
# an eighth of the layer work. Sampling is at temperature 0.3 (the random model's distributions
# are nearly flat at 1.0, which would make any draft look good). The speed-up is wall time of
# plain decoding over speculative decoding, both on this device (CPU timings).

# %%
TARGET = dataclasses.replace(CFG, n_layers=8, name="tiny-2m-untied-8-layers")
target = Transformer(TARGET, seed=1)
prompt = target.random_prompt(1, 16, seed=0)[0].tolist()
new_tokens, K, TEMP = settings.pick(small=48, full=96), 4, 0.3
autoregressive_generate(target, prompt, 8, temperature=TEMP)  # warm-up
plain = min((autoregressive_generate(target, prompt, new_tokens, temperature=TEMP, seed=s) for s in range(2)),
            key=lambda r: r["seconds"])
rows = []
for noise in (0.0, 0.25, 0.5, 1.0, 2.0):
    draft = make_draft(target, 1, noise=noise, seed=2)
    spec = speculative_generate(target, draft, prompt, new_tokens, k=K, temperature=TEMP, seed=3,
                                accept=speculative_accept)
    a = measured_alpha(spec)
    rows.append((noise, a, len(spec["tokens"]) / spec["steps"], expected_tokens_per_step(a, K),
                 plain["seconds"] / spec["seconds"]))
print(f"k = {K}, {new_tokens} tokens; plain decoding {plain['seconds'] * 1e3:.0f} ms on {WHERE}")
print(" noise  acceptance  tokens/step  formula  speed-up (CPU)")
for noise, a, tps, formula, speedup in rows:
    print(f"{noise:6.2f} {a:11.2f} {tps:12.2f} {formula:8.2f} {speedup:10.2f}x")

# %%
fig, ax = plt.subplots(figsize=(5, 3.4))
ax.plot([r[1] for r in rows], [r[4] for r in rows], "o-", label="measured speed-up (CPU)")
ax.plot([r[1] for r in rows], [r[2] for r in rows], "s--", label="tokens per target pass")
ax.axhline(1, color="grey", linewidth=0.8)
ax.set(xlabel="acceptance rate a (measured)", ylabel="x plain decoding", title=f"speculative decoding, k = {K}")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# Two things to notice. The measured tokens per step sit near the formula but not on it:
# acceptance is not the same at every position (some stretches are easy for the draft, some are
# not), and the formula assumes it is. And the speed-up is below the tokens per step: every step
# also pays $k$ draft passes, and here a draft pass is not much cheaper than a target pass,
# because at batch 1 on a CPU the fixed cost per pass dominates both.
#
# ## What you built and measured
#
# * A sampler whose frequencies match temperature, top-k and top-p to within what 20,000 draws
#   can tell apart, and that is exactly greedy at temperature 0.
# * A scheduler that keeps the budget, never idles a slot while work waits, never lets a short
#   request overtake a long one, and preempts when blocks run out; in the real engine it changes
#   when tokens come, never which.
# * Continuous batching against static batching on one trace: the same tokens, a much shorter
#   TTFT, and, counted in steps (what a GPU's decode-bound steps cost), more tokens per step.
# * Speculative acceptance that keeps the target's distribution exactly, and the speed-up it buys,
#   which depends on acceptance and on what a draft pass costs.
#
# ### Questions
#
# 1. In section 3, why does static batching's TTFT grow so much more than its TPOT?
# 2. Why does the scheduler preempt the *newest* running sequence rather than the oldest?
# 3. With $a = 0.8$, how many tokens per step do $k = 4$ and $k = 8$ give, and why might $k = 8$
#    still be slower?
#
# <!-- BEGIN SOLUTION -->
# 1. A newcomer waits for the whole current batch to finish, which takes as long as its longest
#    output; once its batch starts, each of its steps is a normal decode step, so TPOT changes
#    little.
# 2. The newest has the least work done, so recomputing it wastes the least, and the oldest
#    requests (who have waited longest) keep making progress: no request is preempted forever.
# 3. $(1 - 0.8^5)/0.2 \approx 3.36$ and $(1 - 0.8^9)/0.2 \approx 4.33$: doubling $k$ adds less than
#    one token per step, while the draft's cost doubles and the target's verification pass grows.
# <!-- END SOLUTION -->
