# Lab 16 source of truth. Edit this file, then run `python -m labsupport release 16_capstone` to
# regenerate labs/16_capstone.ipynb (learners) and solutions/16_capstone.ipynb (instructors).

# %% [markdown]
# # Lab 16: your stack
#
# Fifteen labs each left you a part of a serving stack: a stop-string filter and a detokenizer
# (lab 01), an SSE client and latency metrics (lab 03), the engine's step assembly (lab 12), a
# scheduler and a sampler (lab 13), a Poisson schedule, an open-loop sender, a histogram quantile and
# an SLO report (lab 15), and more. In this lab they run together, on the course's real model, and
# are measured against the course's own stack on the same trace. You will
#
# 1. **assemble your stack** from your lab notebooks in this folder: each part whose check passes is
#    yours, the others stay the course's;
# 2. **start two servers**, one serving through your parts (`--stack`) and one through the course's,
#    both SmolLM2-135M-Instruct on chapter 13's continuous-batching engine;
# 3. **run the same trace against both** with your own client: your Poisson schedule, your
#    open-loop sender, your SSE client;
# 4. **compare**: every request's greedy answer, TTFT, TPOT and throughput percentiles side by side,
#    the prefix cache's hit rate, what each of your parts cost in the engine's step, and where your
#    stack is slower, which part to look at;
# 5. write the **report** from the run's raw records (checked: your stack served the whole trace,
#    every greedy answer equals the course stack's, and your figures are the ones the records give).
#
# This notebook must sit in the folder that holds your other lab notebooks (`01_tokens.ipynb`,
# `03_journey.ipynb`, ...): that folder is your stack. Nothing in it is written; the assembly's files
# go to a cache folder. On a CPU the trace is small (a few seconds of load); on a GPU a bigger one
# runs. Every timing here is taken on this machine, and says so.
#
# **Run All** (*Run > Run All Cells*) runs sections 1 to 4 with whatever parts you have (an exercise
# not done keeps the course's part), and stops at the first exercise, the report, until you write it.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
from labsupport.serve import install_missing

installed = install_missing()  # fastapi, uvicorn, openai and prometheus-client, only where missing (a fresh Colab)

# %%
import os
import platform
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt

from labsupport import capstone, ledger
from labsupport.checks import check_capstone_figures, check_capstone_greedy, check_capstone_run
from labsupport.serve import ServerProcess

WHERE = f"{settings.device_name} ({platform.machine()}, {os.cpu_count()} CPU cores)"
DATE = time.strftime("%Y-%m-%d", time.gmtime())
print(f"timings below are taken on: {WHERE}, {DATE}")

# %% [markdown]
# ## 1. Assemble your stack
#
# `capstone.assemble` runs `python -m labsupport stack` on this folder (the grader sets
# `LABSUPPORT_LABS_DIR` to your submission's folder) for the slots this run uses: every slot the
# server can plug a part into today, and the client's six. Each of your parts is run against its
# lab's check in a subprocess; the results are cached by your cells' content, so the second time
# takes seconds. The table says, for each slot, whose part it holds and why.

# %%
LABS_DIR = capstone.labs_dir()  # this folder, or the one the grader names
CACHE = capstone.writable_cache()
started = time.perf_counter()
stack = capstone.assemble(LABS_DIR, CACHE)
assembly_s = time.perf_counter() - started
for row in stack["rows"]:
    mode = "serves" if row["serves"] else "client" if row["slot"] in capstone.CLIENT_SLOTS else "checked"
    print(f"{row['slot']:<20} lab {row['lab'][:2]}  {'yours' if row['source'] == 'learner' else 'course':<7}"
          f"{mode:<8} {row['check']}")
print(f"assembled from {LABS_DIR} in {assembly_s:.1f} s")

# %% [markdown]
# ## 2. Two servers, one model
#
# Both servers load the real model and run chapter 13's engine with the same options (where your
# lab 10 block allocator serves, your stack runs with prefix caching off: lab 10's interface never sees
# token ids, so no block can be found by its prefix; the course's keeps it on). Yours is
# started with `--stack` on a folder of links to your notebooks of the labs whose parts serve (so it
# assembles them from the same cache, without checking every lab again); the course's with `--stack`
# on an empty folder, so that it keeps the same profile by slot (`/health`'s `stack_profile`) with
# none of your parts. The client's parts (your SSE client, your schedule, your sender) come from the
# same assembly.

# %%
trace = capstone.PRESETS["gpu" if settings.on_gpu else "cpu"]
parts, whose = capstone.client_parts(stack)
print("client parts:", ", ".join(f"{slot} ({who}'s)" for slot, who in whose.items()))
work = Path(tempfile.mkdtemp(prefix="capstone-"))
serving = capstone.serving_folder(LABS_DIR, work / "yours")
(work / "none").mkdir()
options = capstone.server_options(trace)
yours_server = ServerProcess([*options, "--stack", serving, "--stack-cache", CACHE], threads=1, startup_timeout_s=600)
course_server = ServerProcess([*options, "--stack", work / "none", "--stack-cache", work / "course-cache"],
                              threads=1, startup_timeout_s=600)
started = time.perf_counter()
yours_server.start()
course_server.start()
print(f"both servers up in {time.perf_counter() - started:.1f} s; {trace}")

# %% [markdown]
# ## 3. The same trace, against both
#
# The trace: the prompts of `capstone.PROMPTS`, one chat request each, at Poisson arrivals, greedy,
# each ending at its token limit or at a blank line (`"\n\n"`). `capstone.run_stack` sends it with
# your parts, one stack after the other (never both at once, so neither slows the other), and keeps
# the raw records: each request's send time, the arrival time of each content chunk, its text and
# finish reason, and the token ids the server sampled (read back from its request timeline).

# %%
started = time.perf_counter()
yours_run = capstone.run_stack(yours_server.url, trace, parts)
course_run = capstone.run_stack(course_server.url, trace, parts)
run = capstone.new_run(trace, yours_run, course_run, stack)
yours_server.stop()
course_server.stop()
print(f"both runs in {time.perf_counter() - started:.1f} s")

# %% [markdown]
# ## 4. Compare
#
# **Greedy answers.** Both stacks run the same weights greedily, so where every part is exact the
# texts are almost always equal, request by request. A part that is not bit-exact by nature (a kernel
# that sums in another order, RoPE's angles computed another way), and even exact parts batched
# differently or prefilled over cached blocks, can tip a near-tie the other way. vLLM's model tests
# accept that under one rule (`check_logprobs_close` in `tests/models/utils.py`): compare token by
# token up to the first difference, where each side's token must be among the other's top
# log-probabilities, in both directions. Your stack reports no log-probabilities, so the capstone
# checks one direction: your token must be among the course model's top 5. Where a text differs, the cell below computes the course model's top 5 at each
# position (one forward pass over the prompt and the course's answer) and applies the rule.

# %%
different = [r["i"] for r, c in zip(yours_run["records"], course_run["records"]) if r["text"] != c["text"]]
if different:
    from labsupport.checkpoints import load  # only where an answer differs: the model, in this process

    reference = load(capstone.MODEL, verbose=False)
    capstone.add_reference_logprobs(run, reference.model, reference.tokenizer)
for ref, mine in zip(run["course"]["records"], run["yours"]["records"]):
    ok, at = capstone.greedy_agreement(ref, mine)
    verdict = "equal" if mine["text"] == ref["text"] else ("within the top 5" if ok else f"DIFFERS at token {at}")
    print(f"{mine['i']:>2} {verdict:<16} {mine['text'][:60]!r}")

# %% [markdown]
# **Latency and throughput.** TTFT is the wait for the first content chunk, TPOT the time per
# chunk after it (chapter 03), both as nearest-rank percentiles over the requests; throughput is the
# tokens sampled over the run's wall time. The prefix cache's hit rate is the share of prompt tokens
# the engine found cached: every chat prompt starts with the same template, so some of each prompt
# is shared.

# %%
figures = capstone.report(run)
print(f"{'':<24}{'yours':>12}{'course':>12}   ({WHERE}, {DATE})")
for key, unit, scale in (("ttft_s", "ms", 1e3), ("tpot_s", "ms", 1e3)):
    for p in capstone.PERCENTILES:
        print(f"{key[:4].upper()} p{p:<3} ({unit}){'':<11}" + "".join(
            f"{figures[s][key][p] * scale:>12.1f}" for s in capstone.STACKS))
print(f"{'output tokens/s':<24}" + "".join(f"{figures[s]['output_tokens_per_s']:>12.1f}" for s in capstone.STACKS))
print(f"{'prefix cache hit rate':<24}" + "".join(
    f"{figures[s]['prefix_cache_hit_rate']:>12.0%}" if figures[s]["prefix_cache_hit_rate"] is not None else f"{'none':>12}"
    for s in capstone.STACKS))
print(f"{'requests served':<24}" + "".join(f"{figures[s]['served']:>12}" for s in capstone.STACKS))

# %% [markdown]
# The server's own view: the TTFT p90 of each server's histogram between the run's two scrapes, with
# your `histogram_quantile_between` (lab 15; bucketed, so coarser than the client's), and the share of
# requests that met an SLO of 2 s TTFT and 0.5 s TPOT at p90, with your `slo_report`.

# %%
SLO = {"ttft_s": 2.0, "tpot_s": 0.5, "p": 90}
for name, r in (("yours", yours_run), ("course", course_run)):
    key = "time_to_first_token_seconds"
    server_p90 = parts["histogram_quantile"](0.9, r["histograms_before"][key], r["histograms_after"][key])
    latencies = [parts["latency_metrics"](x["sent_s"], x["token_times_s"]) if x["token_times_s"] else None
                 for x in r["records"]]
    slo = parts["slo_report"](latencies, SLO, r["duration_s"])
    print(f"{name:<7} server TTFT p90 {server_p90 * 1e3:7.1f} ms; SLO attainment {slo['attainment']:.0%}, "
          f"goodput {slo['goodput']:.2f} requests/s")

# %% [markdown]
# **A profile by slot.** Each server adds the time of every engine step, and of every call into one
# of your parts, to its `/health` (`stack_profile`). Divided by the steps of the run, that is what
# each of your parts cost per step, beside the whole step of each stack. Where your steps are slower,
# the part that took the most of them is the one to look at; where your parts take only a small share
# of the difference, the rest is elsewhere (this machine's load, or a course part that your stack
# runs differently), and a second run tells which.

# %%
costs = {name: capstone.slot_costs(run[name]) for name in capstone.STACKS}
for slot, seconds in sorted(costs["yours"].items(), key=lambda x: -x[1]):
    print(f"{slot:<14} {seconds * 1e3:8.3f} ms per step" + ("  (the whole step)" if slot == "step" else ""))
print(f"{'course step':<14} {costs['course'].get('step', float('nan')) * 1e3:8.3f} ms per step")
print(capstone.where_to_look(run))

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
width = 0.38
for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
    for k, name in enumerate(capstone.STACKS):
        values = [figures[name][key][p] * 1e3 for p in capstone.PERCENTILES]
        ax.bar([i + (k - 0.5) * width for i in range(3)], values, width, label=name)
    ax.set_xticks(range(3), [f"p{p}" for p in capstone.PERCENTILES])
    ax.set_ylabel("ms")
    ax.set_title(f"{title}, {trace.requests} requests at {trace.rate:g}/s")
    ax.legend()
mine = {k: v for k, v in costs["yours"].items() if k != "step"}
axes[2].barh(list(mine) + ["your step", "course step"],
             [v * 1e3 for v in mine.values()] + [costs["yours"].get("step", 0) * 1e3, costs["course"].get("step", 0) * 1e3])
axes[2].set_xlabel("ms per engine step")
axes[2].set_title("profile by slot")
fig.suptitle(f"your stack against the course's ({WHERE}, {DATE})", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# ### The class ledger
#
# Your stack's throughput beside the course stack's, measured in the same minute on the same machine,
# goes to the class ledger (`python -m labsupport ledger`), with their ratio: a ratio near 1 says your
# parts cost the engine nothing it notices.

# %%
ledger.record("16_capstone", [
    ledger.Figure("stack_output_tokens_per_s", figures["yours"]["output_tokens_per_s"], "tokens/s",
                  f"your stack: sampled tokens over the run's wall time, {trace.requests} greedy chat requests at "
                  f"{trace.rate:g}/s (Poisson), at most {trace.max_tokens} tokens"),
    ledger.Figure("course_stack_output_tokens_per_s", figures["course"]["output_tokens_per_s"], "tokens/s",
                  "the course's stack on the same trace, run right after yours"),
    ledger.Figure("stack_throughput_ratio",
                  figures["yours"]["output_tokens_per_s"] / figures["course"]["output_tokens_per_s"], "x",
                  "your stack's output tokens per second over the course stack's"),
    ledger.Figure("greedy_answers_equal", sum(figures["agree"]), "requests",
                  f"requests of {trace.requests} whose greedy answer equals the course stack's (vLLM's rule)",
                  timing=False),
], timings_real=True, on_cpu=not settings.on_gpu)

# %% [markdown]
# ## 5. Exercise: the report, from the records
#
# A report is worth what its figures are: each must come from the run, so that anyone holding the
# records can compute it again. Complete `capstone_report(run)`: from `run` (what `capstone.new_run`
# returned: `run["trace"]["requests"]`, and for `"yours"` and `"course"` a dict with `"records"`,
# `"health_before"` and `"health_after"`), return
#
# ```python
# {"requests": the trace's number of requests,
#  "agree": [True or False per request: your answer equals the course's under vLLM's rule],
#  "yours": figures, "course": figures}
# ```
#
# where each stack's figures are `{"served": n, "ttft_s": {50: .., 90: .., 99: ..}, "tpot_s": {50: ..,
# 90: .., 99: ..}, "output_tokens_per_s": .., "prefix_cache_hit_rate": ..}`:
#
# * a record was **served** when it has no `"error"`, at least one time in `"token_times_s"` and a
#   `"finish_reason"` of `"stop"` or `"length"`; the figures are over served records only;
# * **TTFT** is `token_times_s[0] - sent_s`; **TPOT** is `(token_times_s[-1] - token_times_s[0]) /
#   (len(token_times_s) - 1)` for records with two chunks or more (your lab 03 `latency_metrics` gives
#   both); percentiles by **nearest rank** (lab 03), keyed by the int `p`; None where there is no value;
# * **output_tokens_per_s**: the served records' `len(token_ids)` summed, over the wall time from the
#   first `sent_s` of all records to the last chunk of any served record;
# * **prefix_cache_hit_rate**: `health_after["stack_profile"]["prefix_cache"]["prefix_cache_hits"]`
#   minus the same before, over the same change of `"prefix_cache_queries"` (None when no query);
# * **agree[i]**: False when either record has an error, even with equal texts (look at this first);
#   otherwise True when the two records' texts are equal; otherwise walk both `"token_ids"` to the
#   first position where they differ: True only when your token there is a key of the course record's
#   `"top_logprobs"[position]` (compare keys as ints: a run saved as JSON has them as strings); same
#   ids with different texts: False. One entry per request, in the trace's order.
#
# The checks judge the run first (your stack served every request, through the parts it says it
# served; every answer agrees), then call your function on the run and on planted copies of it.

# %%
def capstone_report(run):
    # BEGIN SOLUTION: per stack, served records -> nearest-rank TTFT/TPOT, tokens over wall time, hit rate change; agree per request
    import math

    def rank(values, p):
        data = sorted(values)
        return data[max(1, math.ceil(p * len(data) / 100)) - 1] if data else None

    def served(r):
        return not r.get("error") and bool(r["token_times_s"]) and r.get("finish_reason") in ("stop", "length")

    def figures_of(stack):
        done = [r for r in stack["records"] if served(r)]
        ttft = [r["token_times_s"][0] - r["sent_s"] for r in done]
        tpot = [(r["token_times_s"][-1] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1)
                for r in done if len(r["token_times_s"]) > 1]
        wall = (max(r["token_times_s"][-1] for r in done) - min(r["sent_s"] for r in stack["records"])) if done else 0
        counts = [stack[h].get("stack_profile", {}).get("prefix_cache", {}) for h in ("health_before", "health_after")]
        queries = counts[1].get("prefix_cache_queries", 0) - counts[0].get("prefix_cache_queries", 0)
        hits = counts[1].get("prefix_cache_hits", 0) - counts[0].get("prefix_cache_hits", 0)
        return {"served": len(done), "ttft_s": {p: rank(ttft, p) for p in (50, 90, 99)},
                "tpot_s": {p: rank(tpot, p) for p in (50, 90, 99)},
                "output_tokens_per_s": sum(len(r["token_ids"]) for r in done) / wall if wall > 0 else None,
                "prefix_cache_hit_rate": hits / queries if queries else None}

    def agrees(ref, mine):
        if ref.get("error") or mine.get("error"):
            return False
        if ref["text"] == mine["text"]:
            return True
        for i, (a, b) in enumerate(zip(ref["token_ids"], mine["token_ids"])):
            if a != b:
                top = ref.get("top_logprobs") or []
                return i < len(top) and b in {int(k) for k in top[i]}
        return False

    return {"requests": run["trace"]["requests"],
            "agree": [agrees(ref, mine) for ref, mine in zip(run["course"]["records"], run["yours"]["records"])],
            "yours": figures_of(run["yours"]), "course": figures_of(run["course"])}
    # END SOLUTION


# %%
check_capstone_run(capstone_report, run=run)

# %%
check_capstone_greedy(capstone_report, run=run)

# %%
check_capstone_figures(capstone_report, run=run)

# %% [markdown]
# ## What you built and measured
#
# * Your stack, assembled from your own notebooks: the parts whose checks passed serve the real
#   model, the rest are the course's, and the table says which is which.
# * The same trace against your stack and the course's, driven by your own schedule, sender and SSE
#   client: every greedy answer compared under the rule vLLM's own tests use.
# * Latency and throughput percentiles side by side, the prefix cache's hit rate, and a profile of
#   what each of your parts cost per engine step, with the part to look at where yours is slower.
# * A report whose every figure anyone can compute again from the run's records.
#
# ### Questions
#
# 1. Your sampler is called once per row where the course's samples the whole batch at once. In the
#    profile, how does its cost per step grow with the batch, and at what batch would it matter
#    against the forward pass on this machine?
# 2. Why does vLLM's rule stop comparing at the first differing token, and why is a divergence to the
#    reference's second-best token not a bug in a kernel that sums in another order?
# 3. The two stacks ran one after the other. What could make the second run faster or slower than
#    the first for reasons that are not its parts, and how would you design the run to remove it?
#
# <!-- BEGIN SOLUTION -->
# 1. It grows linearly: one Python call and one small tensor operation per row, about a tenth of a
#    millisecond each on a CPU, against a step of a hundred milliseconds or more on this machine (read
#    both from your profile: the sampler's seconds over its calls, and the step's). On a CPU it reaches
#    a tenth of the step only near a hundred rows; on a GPU, where a step takes milliseconds, a few
#    dozen rows are enough.
# 2. After the first difference the two sequences condition on different text, so later tokens are
#    no longer comparable: any difference after it is a consequence, not a new fault. Floating-point
#    addition is not associative; another summation order moves the logits by a few units in the last
#    place, which can swap two tokens whose logits were nearly tied; so can a batch grouped otherwise or
#    a prefill over cached blocks. The rule is loose: top-5 membership is a rank, not a distance, so a
#    subtly wrong kernel can pass it too (it often still ranks the right tokens near the top); the lab
#    checks of each part are what prove a kernel, and a log-probability gap check would be stricter.
# 3. The machine's load (another program, a throttled CPU), caches warmed by the first run (the
#    operating system's file cache, the allocator), and the order itself. Interleave the requests of
#    the two stacks, or run each several times in alternating order and compare medians; a warm-up
#    request before each run (the course's run_stack sends one) removes the first forward pass's
#    one-off costs.
# <!-- END SOLUTION -->
