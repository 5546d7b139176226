# Lab 15 source of truth. Edit this file, then run `python -m labsupport release 15_production` to
# regenerate labs/15_production.ipynb (learners) and solutions/15_production.ipynb (instructors).

# %% [markdown]
# # Lab 15: production
#
# A server that answers one request well can still fail its users under load. In this lab you
# load-test a real server the way an operator does, and overload it on purpose. You will
#
# 1. **load-test the course server** at rising rates while scraping its Prometheus `/metrics`,
#    plot latency percentiles against load and find the knee;
# 2. **overload it on purpose** with a small queue bound and see what HTTP 429, the queue and a
#    graceful drain do for the requests that were admitted;
# 3. write an **open-loop Poisson schedule** of send times (checked);
# 4. write a **sender that keeps to a schedule** whatever the server does (checked against a slow
#    real service), and see what a closed loop hides when the server stalls: *coordinated omission*;
# 5. compute the **goodput** of a run against a service-level objective (SLO), with nearest-rank
#    percentiles (checked), and measure it on the server at a planned rate and past capacity.
# 6. compute a **percentile from the server's histogram** between two scrapes, as Prometheus's
#    `histogram_quantile` does (checked against Prometheus's own semantics);
# 7. write a **client that honours `Retry-After`**, with a capped, jittered exponential backoff
#    (checked against a real four-slot service's log of arrivals);
# 8. test lab 14's plan once more: the **goodput of the continuous engine at the rate the planner
#    predicts** (measured, not graded).
#
# The server is chapter 03's `python -m labsupport.serve` (random weights: its text is meaningless),
# on the CPU, with `--step-delay` adding a fixed pause to every forward pass so that its speed
# depends less on how busy this machine is. Every timing here is a CPU timing on this machine, not a
# GPU server's.
#
# **Run All** (*Run > Run All Cells*) stops at the first exercise you have not written: its check
# cell raises with a short message saying so, nothing below it runs, and JupyterLab scrolls back to
# that cell. Sections 1 and 2 need none of your code, so a first Run All already load-tests the
# server.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
from labsupport.serve import install_missing

installed = install_missing()  # fastapi, uvicorn, openai and prometheus-client, only where missing (a fresh Colab)

# %%
import math
import os
import platform
import random
import threading
import time

import httpx
import matplotlib.pyplot as plt
from tqdm.auto import tqdm

from labsupport import ledger
from labsupport.bench_serving import arrival_times, run_benchmark
from labsupport.checks import check_open_loop, check_poisson_arrivals, check_slo_report
from labsupport.load_testing import (
    SlowService,
    burst,
    fifo_latencies,
    histogram_quantile,
    knee_rate,
    load_sweep,
    metric,
    request_latencies,
    scrape_metrics,
)
from labsupport.serve import ServerProcess

WHERE = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
print(f"timings below are taken on: {WHERE}")

# %% [markdown]
# ## 1. Load-test the course server
#
# We start the course server with chapter 03's FIFO engine (one request at a time), every answer
# 8 tokens, and a 10 ms pause per forward pass. First its unloaded speed: four requests one after
# another.

# %%
OPTIONS = ["--context", "128", "--max-tokens-limit", "32", "--step-delay", "0.01", "--max-requests", "64"]
server = ServerProcess(OPTIONS, threads=1).start()
LOAD = dict(input_words=8, output_tokens=8)
alone = run_benchmark(server.base_url, "course-tiny", num_prompts=4, max_concurrency=1, **LOAD)
service_s = alone["e2e_s"]["mean"]  # one request alone: its whole time in the server
capacity = 1 / service_s  # one at a time: at most this many requests per second
print(f"unloaded ({WHERE}): TTFT p50 {alone['ttft_s']['p50'] * 1e3:.0f} ms, TPOT p50 "
      f"{alone['tpot_s']['p50'] * 1e3:.1f} ms, E2E mean {service_s * 1e3:.0f} ms: capacity about "
      f"{capacity:.1f} requests/s")

# %% [markdown]
# Now Poisson arrivals at rates from half that capacity to beyond it, 16 requests each,
# while a background thread scrapes `/metrics` every 100 ms and parses it with
# `prometheus_client`'s own parser (`scrape_metrics`). `load_sweep` keeps, for each rate, the
# benchmark's summary, the peak `course:num_requests_waiting` the scrapes saw, and the server's own
# TTFT p90 estimated from its histogram as Prometheus's `histogram_quantile` does (interpolated
# within a bucket, so it is coarser than the client's nearest rank).

# %%
LOAD_FACTORS = (0.5, 0.7, 0.85, 1.0, 1.2)  # offered load over the capacity
RATES = [round(capacity * f, 1) for f in LOAD_FACTORS]
rows = [load_sweep(server, [rate], num_prompts=16, **LOAD)[0] for rate in tqdm(RATES, desc="load sweep", unit="rate")]
print(f"{'rate/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'E2E p90':>8} {'peak waiting':>13} {'server TTFT p90':>16}")
for r in rows:
    s = r["summary"]
    server_p90 = r["server_ttft_p90"]
    print(f"{r['rate']:7.1f} {s['ttft_s']['p50'] * 1e3:7.0f}ms {s['ttft_s']['p90'] * 1e3:5.0f}ms "
          f"{s['ttft_s']['p99'] * 1e3:5.0f}ms {s['e2e_s']['p90'] * 1e3:6.0f}ms {r['peak_waiting']:13.0f} "
          f"{(server_p90 or 0) * 1e3:14.0f}ms")

# %%
KNEE_LIMIT = alone["ttft_s"]["p50"] + service_s  # the p90 request waited behind at least one other
knee = knee_rate([r["rate"] for r in rows], [r["summary"]["ttft_s"]["p90"] for r in rows], KNEE_LIMIT)
fig, ax = plt.subplots(figsize=(6.5, 3.8))
for q, style in (("p50", "o-"), ("p90", "s-"), ("p99", "^-")):
    ax.plot([r["rate"] for r in rows], [r["summary"]["ttft_s"][q] * 1e3 for r in rows], style, label=f"TTFT {q}")
ax.axvline(capacity, color="grey", ls=":", label="1 / unloaded service time")
if knee is not None:
    ax.axvline(knee, color="red", ls="--", label=f"knee: {knee} /s")
ax.axhline(KNEE_LIMIT * 1e3, color="red", ls=":", lw=0.8, label="unloaded TTFT + one service time")
ax.set(xlabel="offered load (requests/s, Poisson)", ylabel="TTFT (ms, nearest rank)",
       title=f"Latency against load, FIFO course server ({WHERE})")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_RESULTS` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# The server runs on the CPU, so the file names the CPU.

# %%
sweep = "FIFO course server, course-tiny, 10 ms step delay, 8 output tokens, 16 Poisson requests per rate"
ledger.record("15_production", [
    ledger.Figure("unloaded_ttft_p50", alone["ttft_s"]["p50"] * 1e3, "ms", f"{sweep}; 4 requests one at a time; nearest rank"),
    ledger.Figure("unloaded_e2e_mean", service_s * 1e3, "ms", f"{sweep}; 4 requests one at a time; mean"),
    ledger.Figure("capacity", capacity, "requests/s", "1 / unloaded mean E2E (one request at a time)"),
    *([ledger.Figure("knee", knee, "requests/s", "lowest offered rate whose TTFT p90 exceeds unloaded TTFT + one service time")]
      if knee is not None else []),
    *(ledger.Figure(f"ttft_p90_load{factor:g}", r["summary"]["ttft_s"]["p90"] * 1e3, "ms",
                    f"{sweep}; offered load {factor:g} x capacity; nearest rank") for factor, r in zip(LOAD_FACTORS, rows)),
], on_cpu=True)

# %% [markdown]
# Below the knee, TTFT is the prefill plus a short wait; past it, requests queue behind each other
# and the percentiles climb steeply, the p99 first. The knee sits below the capacity: at a
# utilisation $\rho$ a one-at-a-time server with a fixed service time under Poisson arrivals (the
# M/D/1 queue of the chapter) keeps each request waiting $\rho / (2(1 - \rho))$ service times on
# average, two of them at 80 %, and twice that if service times vary as much as exponential ones. (The convention for the knee here: the lowest rate whose TTFT p90 is above
# the unloaded TTFT plus one whole service time, so that the p90 request waited behind at least
# one other. With 16 requests per rate the p90 is the 15th of 16: expect it to wobble between runs.)
#
# The server keeps running: section 5 measures its goodput at a planned rate with your own
# `slo_report`.

# %% [markdown]
# ## 2. Overload on purpose: 429, the queue, and a drain
#
# An unbounded queue turns overload into latency for everybody. The course server bounds it:
# `--max-requests 4` slots (queued, running, or still sending their answer); a request beyond them is
# answered at once with HTTP 429 and a `Retry-After` header, so the client can back off or go to another
# replica.
# We send 24 streamed requests at once, with no retries, while scraping the queue.

# %%
small = ServerProcess(["--context", "128", "--max-tokens-limit", "32", "--step-delay", "0.02",
                       "--max-requests", "4"], threads=1).start()
before = scrape_metrics(small.url)
peaks = {"running": 0.0, "waiting": 0.0}
stop = threading.Event()


def watch():
    while not stop.is_set():
        s = scrape_metrics(small.url)
        peaks["running"] = max(peaks["running"], metric(s, "course:num_requests_running"))
        peaks["waiting"] = max(peaks["waiting"], metric(s, "course:num_requests_waiting"))
        time.sleep(0.05)


watcher = threading.Thread(target=watch)
watcher.start()
answers = burst(small.base_url, 24, max_tokens=16)
stop.set()
watcher.join()
after = scrape_metrics(small.url)
admitted = [a for a in answers if a["status"] == 200]
refused = [a for a in answers if a["status"] == 429]
print(f"admitted {len(admitted)}, refused with 429: {len(refused)} (Retry-After: "
      f"{sorted({a['retry_after'] for a in refused})} s)")
print(f"admitted requests that ran to their end: {sum(a['done'] and a['finish_reason'] is not None for a in admitted)}"
      f" of {len(admitted)}, the last after {max(a['finished_s'] for a in admitted):.2f} s")
print(f"the slowest 429 came back after {max(a['answered_s'] for a in refused) * 1e3:.0f} ms")
print(f"queue seen by the scrapes: peak running {peaks['running']:.0f}, peak waiting {peaks['waiting']:.0f}")
burst_p90 = histogram_quantile(after, "course:time_to_first_token_seconds", 0.9, before)
bounds = sorted(float(dict(labels)["le"]) for sample, labels in after
                if sample == "course:time_to_first_token_seconds_bucket")
bucket = (max((b for b in bounds if b < burst_p90), default=0.0), min(b for b in bounds if b >= burst_p90))
print("server counters over the burst: rejected (server_full)",
      metric(after, "course:request_rejected_total", reason="server_full")
      - metric(before, "course:request_rejected_total", reason="server_full"),
      f"| TTFT p90 from its histogram {burst_p90 * 1e3:.0f} ms, interpolated inside the bucket "
      f"{bucket[0]:g} s to {bucket[1]:g} s")

# %% [markdown]
# The server's TTFT p90 can come out later than the last request finished: a histogram keeps only
# how many observations fell in each bucket, and `histogram_quantile` (Prometheus's, and the one
# here) finds the bucket where the 90th percentile falls and interpolates linearly inside it, as if
# that bucket's observations were spread evenly between its bounds. It is an estimate somewhere in
# that bucket, not one of the measured times; the client's nearest-rank percentiles are.
#
# The admitted requests (one per slot) all finished, at the latency of a four-deep queue; the others
# learned at once (one HTTP round trip, slower only when this machine is busy) that the server was
# full, long before the admitted ones finished, instead of waiting seconds to time out.
# That fast "no" is backpressure: it pushes the overload back to where it can be handled (a retry
# later, another replica, a smaller request).
#
# **A graceful drain.** To restart a replica (a rollout, a node going away) without failing the
# requests it holds, it stops taking new ones and lets the admitted ones finish: `SIGTERM`, or
# `POST /admin/drain`. While it drains, `/ready` answers 503 (a load balancer stops sending work),
# new completions get 503 with `Retry-After`, and the admitted streams run to their end; then the
# process exits with status 0.

# %%
during = {}
drained = threading.Thread(target=lambda: during.update(answers=burst(small.base_url, 4, max_tokens=24)))
drained.start()
while small.health()["slots_used"] < 4:  # the four are admitted
    time.sleep(0.01)
print("drain:", httpx.post(small.url + "/admin/drain", timeout=10).json())
print("/ready while draining: HTTP", httpx.get(small.url + "/ready", timeout=10).status_code)
late = httpx.post(small.base_url + "/completions", json={"model": "course-tiny", "prompt": "too late", "max_tokens": 2},
                  timeout=10)
print(f"a new request: HTTP {late.status_code}, code {late.json()['error']['code']!r}, "
      f"Retry-After {late.headers['retry-after']} s")
drained.join()
finished = [a["finish_reason"] for a in during["answers"]]
print(f"the admitted streams: {len(finished)} finished with {finished}")
print(f"the server exited with status {small.process.wait(30)}")

# %% [markdown]
# ## 3. Exercise: an open-loop Poisson schedule
#
# Users do not wait for each other: each sends when they want to. Many independent users together
# make a **Poisson process**: the gaps between arrivals are independent and exponential, with mean
# $1/\lambda$ at a rate of $\lambda$ requests per second. A load generator draws the send times
# **before** the run (an *open loop*), so that how fast the server answers cannot change when
# requests arrive.
#
# Complete `poisson_arrivals(n, rate, rng)`: return `n` send times in seconds, the first at `0.0`,
# each next one the previous plus an exponential gap of mean `1 / rate` drawn from `rng` (a
# `random.Random`; `rng.expovariate(lambd)` takes the **rate** $\lambda$, not the mean). Draw every
# gap from `rng`, so that the same seed gives the same schedule.

# %%
def poisson_arrivals(n, rate, rng):
    # BEGIN SOLUTION: t = 0; n times: append t, then t += rng.expovariate(rate)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times
    # END SOLUTION


# %%
check_poisson_arrivals(poisson_arrivals)

# %% [markdown]
# Poisson arrivals are already bursty: in one-second windows at 10 requests per second, some
# windows get far more than 10. `labsupport.bench_serving.arrival_times` (chapter 12's benchmark)
# draws gamma gaps of the same mean; its `burstiness` below 1 makes the bursts worse, as real
# traffic often is. The count per window has a standard deviation of $\sqrt{10} \approx 3.2$ for
# Poisson.

# %%
def per_second(times):
    counts = [0] * (int(times[-1]) + 1)
    for t in times:
        counts[int(t)] += 1
    return counts[:-1]  # the last window is cut short


for label, times in (("Poisson (yours)", poisson_arrivals(600, 10.0, random.Random(0))),
                     ("gamma, burstiness 0.25", arrival_times(600, 10.0, burstiness=0.25, seed=0))):
    c = per_second(times)
    mean = sum(c) / len(c)
    sd = math.sqrt(sum((x - mean) ** 2 for x in c) / len(c))
    print(f"{label:<24} per-second counts: mean {mean:5.1f}, standard deviation {sd:4.1f}, busiest {max(c)}")

# %% [markdown]
# ## 4. Exercise: keep to the schedule
#
# A schedule helps only if the sender keeps to it. Complete `open_loop(times_s, send)`: call
# `send(i)` at `times_s[i]` seconds after your function starts, for every `i`, **without waiting
# for earlier calls to return** (each call in its own thread, `threading.Thread`, which sleeps until
# its time and then calls `send(i)`), and return the list of the results, `results[i] = send(i)`,
# once every call has returned.
#
# The check sends 34 requests 5 ms apart to a real HTTP service that holds each of them for most of
# a second, and looks at when each request reached it. A loop that waits for each answer before the
# next send (a *closed loop*) arrives late, and so does a pool of fewer threads than requests in
# flight: `concurrent.futures.ThreadPoolExecutor()` makes at most 32 workers (6 on a 2-core machine).

# %%
def open_loop(times_s, send):
    # BEGIN SOLUTION: one thread per send; each sleeps until start + times_s[i], then stores send(i); join all
    start = time.perf_counter()
    results = [None] * len(times_s)

    def worker(i):
        time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
        results[i] = send(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(times_s))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
    # END SOLUTION


# %%
check_open_loop(open_loop)

# %% [markdown]
# ### What a closed loop hides
#
# A service that normally answers in 50 ms stops for one second (a garbage collection, a stuck
# rank, a deploy). We measure it twice for 3 seconds: with your open loop at 20 requests per
# second, and with one closed-loop client that sends again as soon as it has an answer. Each
# latency is taken by the client, from just before the call to just after it.

# %%
BASE_S, STALL = 0.05, (1.0, 1.0)  # normal service time; the stall: from 1 s after the start, for 1 s


def stalling(start):
    def delay(i):
        now = time.perf_counter() - start
        if STALL[0] <= now < STALL[0] + STALL[1]:
            return STALL[0] + STALL[1] - now + BASE_S  # wait out the stall, then serve
        return BASE_S
    return delay


def timed(service, latencies):
    def send(i):
        t = time.perf_counter()
        service.send(i)
        latencies.append(time.perf_counter() - t)
    return send


def p(values, q):  # nearest rank, for printing (your percentile is in exercise 3)
    data = sorted(values)
    return data[max(1, math.ceil(q * len(data) / 100)) - 1]


measured = {}
schedule = [i / 20 for i in range(60)]  # 20 per second for 3 s
with SlowService(stalling(time.perf_counter())) as service:
    measured["open loop, 20/s"] = []
    open_loop(schedule, timed(service, measured["open loop, 20/s"]))
measured["closed loop, 1 client"] = []
with SlowService(stalling(time.perf_counter())) as service:
    send, i, deadline = timed(service, measured["closed loop, 1 client"]), 0, time.perf_counter() + 3.0
    while time.perf_counter() < deadline:  # the next request only once the answer is back
        send(i)
        i += 1
for name, lat in measured.items():
    print(f"{name:<22} {len(lat):4d} requests: p50 {p(lat, 50) * 1e3:6.0f} ms, p90 {p(lat, 90) * 1e3:6.0f} ms, "
          f"p99 {p(lat, 99) * 1e3:6.0f} ms")

# %% [markdown]
# Both runs met the same one-second stall. The open loop kept sending, so every request that
# arrived during the stall waited for its end: a third of its requests were slow, and its p90
# shows it. The closed-loop client was stuck inside one call for the whole second and sent
# nothing else, so it recorded **one** slow request among a few dozen fast ones: its p50 and p90
# look healthy, and with so few requests its p99 is its maximum, that one request. That is
# coordinated omission: the load generator coordinated with the server and omitted exactly the
# measurements that mattered.

# %% [markdown]
# ## 5. Exercise: goodput against an SLO
#
# An SLO names targets and a percentile: here "TTFT at most `ttft_s` and TPOT at most `tpot_s`,
# judged at the `p`-th percentile". **Goodput** is the number of requests per second that met
# *every* target; throughput counts requests whatever their latency.
#
# Complete `slo_report(requests, slo, duration_s)`. `requests` has one item per request sent:
# `None` if it failed or was refused (HTTP 429), else `{"ttft": s, "tpot": s}`, with `tpot` None for
# a one-token answer. `slo` is `{"ttft_s": ..., "tpot_s": ..., "p": ...}`. A request **meets** the
# SLO when it completed, `ttft <= ttft_s`, and `tpot` is None or `tpot <= tpot_s` (a target is met
# when it is not exceeded). Return a dict:
#
# * `"goodput"`: requests that met the SLO per second, over `duration_s`;
# * `"attainment"`: the fraction of **all** requests sent that met it (refused ones count as missed);
# * `"ttft_p"`, `"tpot_p"`: the `p`-th percentiles of the completed requests' TTFTs and of their
#   TPOTs (skip the None ones), by **nearest rank**: sort the $n$ values and take the
#   $\lceil p n / 100\rceil$-th smallest, counting from 1 (compute `p * n / 100` in that order:
#   `7 / 100 * 100` is `7.000000000000001` in floating point, rank 8). Not numpy's default, which
#   interpolates, nor `method="inverted_cdf"`, which divides first. The check has a case of 100
#   requests at `p = 7`.

# %%
def slo_report(requests, slo, duration_s):
    # BEGIN SOLUTION: count completed requests meeting both targets (<=, None TPOT meets); nearest-rank percentiles
    def nearest_rank(values, p):
        data = sorted(values)
        return data[max(1, math.ceil(p * len(data) / 100)) - 1]

    done = [r for r in requests if r is not None]
    met = [r for r in done if r["ttft"] <= slo["ttft_s"] and (r["tpot"] is None or r["tpot"] <= slo["tpot_s"])]
    tpots = [r["tpot"] for r in done if r["tpot"] is not None]
    return {
        "goodput": len(met) / duration_s,
        "attainment": len(met) / len(requests),
        "ttft_p": nearest_rank([r["ttft"] for r in done], slo["p"]),
        "tpot_p": nearest_rank(tpots, slo["p"]) if tpots else None,
    }
    # END SOLUTION


# %%
check_slo_report(slo_report)

# %% [markdown]
# **The goodput at a planned rate.** A planner sizes a deployment so that each replica runs below
# its knee. Chapter 14's planner (`labsupport.planning`) sizes batched GPU replicas from the cost
# of a decode step and a TPOT target, fitting the requests in flight (Little's law) into batches
# with headroom for bursts; it has no queue in it, so for this server, which serves one request at
# a time and makes the others wait, it says nothing about the wait. (It also predicts a mean TPOT,
# where an SLO like the one below is judged at a percentile.) So we plan with a utilisation
# target instead, 60 % of the measured capacity, and set the SLO from this
# machine's unloaded speed so that it means the same on a fast and a slow CPU: TTFT at most two
# unloaded service times, TPOT at most 1.5 times the unloaded p50, judged at p90. Then 24 requests
# at the planned rate, and the same at 1.3 times capacity.

# %%
SLO = {"ttft_s": 2 * service_s, "tpot_s": 1.5 * alone["tpot_s"]["p50"], "p": 90}
planned = round(0.6 * capacity, 1)
for label, rate in (("planned, 0.6 x capacity", planned), ("overloaded, 1.3 x capacity", round(1.3 * capacity, 1))):
    run = run_benchmark(server.base_url, "course-tiny", num_prompts=24, request_rate=rate, seed=3, **LOAD)
    report = slo_report(request_latencies(run), SLO, run["duration_s"])
    print(f"{label:<27} {rate:5.1f}/s: throughput {run['request_throughput']:5.2f}/s, goodput "
          f"{report['goodput']:5.2f}/s, attainment {report['attainment']:.0%}, TTFT p90 "
          f"{report['ttft_p'] * 1e3:.0f} ms (target {SLO['ttft_s'] * 1e3:.0f})")

# %% [markdown]
# Past capacity the server still completes requests, so throughput holds up, but they come late:
# goodput falls, which is why an SLO is stated as goodput and not as throughput.
#
# **Short runs flatter a server.** Each run above starts with an empty queue and stops after a few
# seconds, before the queue has reached its long-run behaviour. The chapter's exact queue
# arithmetic (`fifo_latencies`, a fixed service time, Poisson arrivals) shows what the long run
# holds at the same utilisation:

# %%
for rho in (0.6, 1.3):
    first = fifo_latencies(poisson_arrivals(24, rho, random.Random(3)), 1.0)  # 24 requests, service time 1
    long_run = fifo_latencies(poisson_arrivals(20000, rho, random.Random(3)), 1.0)
    print(f"utilisation {rho:.0%}: p90 wait {p([x - 1 for x in first], 90):5.2f} service times over the first 24 "
          f"requests, {p([x - 1 for x in long_run], 90):7.2f} over 20,000")

# %% [markdown]
# At 60 % the long-run p90 wait is about two service times, so the p90 TTFT (the wait plus the
# prefill) would miss this SLO's target of two service times, where 24 requests saw much less; past capacity the queue, and the wait, grow for as long as the run lasts,
# so a short overload test understates it. Load tests in production run for minutes at each rate
# and leave out a warm-up.

# %% [markdown]
# ## 6. Exercise: the server's percentile, as Prometheus computes it
#
# The client measured every request; a dashboard only has the server's histograms. A Prometheus
# histogram is one counter per bucket, `course:time_to_first_token_seconds_bucket{le="0.25"}`: how many
# requests so far had a TTFT of **at most** 0.25 s. The counts are cumulative (the `le="+Inf"` bucket
# counts every request) and they only grow, from the moment the server started. So a percentile *of
# the last five minutes* is computed from the **increase** of every bucket over those five minutes,
# `histogram_quantile(0.9, rate(course:time_to_first_token_seconds_bucket[5m]))` (`rate` is the increase
# per second; dividing every bucket by the same window changes no percentile).
#
# What `histogram_quantile` returns, as Prometheus's own code (`promql/quantile.go`, at commit `d15adb9`,
# version 3.14.0) computes it. Say 40 requests arrived in the window; the 90th percentile is the one of
# **rank** $0.9 \times 40 = 36$. Walk up the buckets (ordered by their bound, as numbers) to the first
# whose increase **reaches** 36: say `le="0.5"` reached 38 and `le="0.25"` only 30. Prometheus does not
# know where in (0.25, 0.5] those 8 requests fell, so it assumes they are spread evenly and
# **interpolates linearly**: $0.25 + (0.5 - 0.25) \times (36 - 30) / (38 - 30) = 0.4375$ s. Three edges:
#
# * **the lowest bucket** starts at 0 (for a positive bound), so a rank in it is interpolated from 0
#   (`q = 0`, rank 0, lands there: 0); a lowest bound at or below 0 leaves nothing to interpolate from,
#   and Prometheus answers with that bound itself;
# * **the +Inf bucket** has no upper bound to interpolate to: a rank that lands there gives the largest
#   finite bound (here 60 s), an answer that says only "at least";
# * **an empty window** (no request between the scrapes) has no percentile: NaN, which a graph shows as a
#   gap, where 0 would read as a perfect latency.
#
# And one edge of counters: a count that went **down** between the scrapes means the server restarted and
# counted from 0 again; Prometheus's `rate` and `increase` then take the new count as the increase, for each
# bucket on its own.
#
# Complete `histogram_quantile_between(q, before, after)`. `before` and `after` are two scrapes of one
# histogram, `{le: cumulative count}` with the `le` labels as the server writes them (strings such as
# `"0.005"` and `"+Inf"`; `float()` reads both), not necessarily in order. Return the `q` quantile (0 to 1)
# of the observations made between them, a float.

# %%
from labsupport.checks import check_histogram_quantile, check_retry_after
from labsupport.prometheus import bucket_counts
from labsupport.retries import RetryAfterService


# %%
def histogram_quantile_between(q, before, after):
    # BEGIN SOLUTION: each bucket's increase (a fall is a reset), sorted by bound; rank q * total; interpolate in the bucket that reaches it
    increase = {le: after[le] - before[le] if after[le] >= before[le] else after[le] for le in after}
    buckets = sorted((float(le), count) for le, count in increase.items())  # (bound, cumulative count)
    total = buckets[-1][1]  # the +Inf bucket counts every observation
    if total == 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for i, (upper, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(upper):
                return lower  # no bound above: the largest finite one
            if i == 0 and upper <= 0:
                return upper  # a lowest bound at or below 0: no start to interpolate from
            if count == below:
                return math.nan  # q = 0 reaching an empty bucket: 0 / 0, NaN as Prometheus gives
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
    # END SOLUTION


# %%
check_histogram_quantile(histogram_quantile_between)

# %% [markdown]
# Now on the server of section 1: scrape its TTFT histogram, send 16 requests at its capacity,
# scrape again, and compare the server's p50 and p90 of those requests with the client's own nearest-rank
# ones. The server starts its clock when a request reaches it and the client when it sends, and the
# histogram only knows buckets, so expect them to agree to within a bucket, not exactly.

# %%
TTFT = "course:time_to_first_token_seconds"
before = bucket_counts(scrape_metrics(server.url), TTFT)
run = run_benchmark(server.base_url, "course-tiny", num_prompts=16, request_rate=round(capacity, 1), seed=5, **LOAD)
after = bucket_counts(scrape_metrics(server.url), TTFT)
client_ttfts = [r["ttft"] for r in request_latencies(run) if r is not None]
for q in (0.5, 0.9):
    print(f"TTFT p{q * 100:.0f}: server's histogram {histogram_quantile_between(q, before, after) * 1e3:6.1f} ms, "
          f"client's nearest rank {p(client_ttfts, q * 100) * 1e3:6.1f} ms ({WHERE})")
print("buckets that grew:", {le: after[le] - before[le] for le in sorted(after, key=float) if after[le] > before[le]})

# %% [markdown]
# Two rules follow for dashboards. A percentile over **several replicas** is taken from their buckets
# added together, `histogram_quantile(0.9, sum by (le) (rate(...[5m])))`, never as the mean of each
# replica's percentile: a busy replica and an idle one average to a latency nobody saw. And a bucket's
# bounds cap what it can say: with bounds at 0.25 and 0.5 s, a target of 0.3 s cannot be checked from this
# histogram at all. Choose the bounds around your targets.

# %% [markdown]
# ## 7. Exercise: a client that honours Retry-After
#
# Section 2's server answered a request beyond its four slots with HTTP 429 and `Retry-After: 1`: *come
# back in a second*. What the clients do next decides whether the overload passes. A client that retries at
# once, in a loop, is refused again and again and adds a refused request each time. And if every client
# waits exactly the second it was told, those refused together all come back in the same instant, and are
# refused together again: a **thundering herd**. So a good client
#
# * retries only the answers that mean *try again later*: **429** (too many requests) and **503** (the
#   server is draining); anything else (a 200, a 400, a 500) is returned as it is;
# * waits at least what `Retry-After` asks for (seconds; 0 when the header is missing);
# * adds on top a random **jitter**, drawn afresh from `rng` before every retry (so that a seeded `rng`
#   repeats the waits), uniform from 0 to an envelope that doubles at every retry and is capped: before
#   retry $k$ ($k = 0$ for the first) the envelope is
#   $\min(\text{cap}_s,\ \text{base}_s \cdot 2^k)$ (*full jitter*: Marc Brooker, "Exponential Backoff And
#   Jitter", AWS Architecture Blog, 2015);
# * gives up after `max_attempts` attempts in all, returning the last answer, with no wait after it.
#
# Complete `send_with_backoff(send, rng, *, max_attempts, base_s, cap_s, sleep)`. `send()` makes one request
# and returns its response (an `httpx.Response`: `.status_code`, and `.headers`, whose names are read
# regardless of case). Wait with `sleep(seconds)`, the function you are given (the check hands in a fake
# clock, so that it runs in no time), not with `time.sleep` itself. Return the last response.
#
# The check runs your client on scripted answers, then ten of them at once against a real service with four
# slots that answers 429 with `Retry-After: 1`, and reads the service's log of when each attempt arrived. On
# a busy machine everything can arrive late; nothing can arrive *early* by accident, so that is what it
# judges.

# %%
def send_with_backoff(send, rng, *, max_attempts=6, base_s=0.25, cap_s=4.0, sleep=time.sleep):
    # BEGIN SOLUTION: send; return unless 429/503 (or last attempt); sleep Retry-After + rng.uniform(0, min(cap, base * 2**k))
    for attempt in range(max_attempts):
        response = send()
        if response.status_code not in (429, 503) or attempt == max_attempts - 1:
            return response
        try:
            asked = max(0.0, float(response.headers.get("retry-after")))
        except (TypeError, ValueError):  # no header, or not a number of seconds
            asked = 0.0
        sleep(asked + rng.uniform(0, min(cap_s, base_s * 2 ** attempt)))
    # END SOLUTION


# %%
check_retry_after(send_with_backoff)

# %% [markdown]
# **What it buys.** Eight clients at once against the four-slot service (each admitted request holds a slot
# for 0.5 s): first clients that retry at once, up to six attempts, then your client. The service's log says
# how many attempts it saw, how many it refused, and who was never served.

# %%
def retry_at_once(send, rng, *, max_attempts=6, **_):
    for _ in range(max_attempts):
        response = send()
        if response.status_code not in (429, 503):
            break
    return response


for label, client in (("retry at once", retry_at_once), ("your backoff", send_with_backoff)):
    with RetryAfterService(slots=4, service_s=0.5, retry_after_s=1) as service:
        start = time.perf_counter()
        finals = {}
        threads = [threading.Thread(target=lambda i=i: finals.update(
            {i: client(lambda: service.send(f"c{i}"), random.Random(i), max_attempts=6, base_s=0.1, cap_s=1.0)}))
            for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - start
        log = service.attempts
    served = sum(r.status_code == 200 for r in finals.values())
    print(f"{label:<14} {len(log):3d} attempts, {sum(a.status == 429 for a in log):3d} refused; "
          f"{served} of 8 clients served, in {took:.1f} s ({WHERE})")

# %% [markdown]
# Retrying at once spends its six attempts in a fraction of a second, while the slots are still taken: the
# clients refused in the first round are usually never served, and every refusal cost the service a
# connection. The backoff waits out the second it was asked to and comes back spread out, so the slots serve
# everyone in two rounds, at the price of a few refusals. (On a very busy machine the clients start late and
# spread out by themselves, and retrying at once does better than it deserves: run the cell twice.) (Real
# clients differ: OpenAI's Python client, openai 2.54.0, waits what `Retry-After` says when it is at most two
# minutes, without jitter, and otherwise backs off from 0.5 s, doubling, capped at 8 s, less up to a quarter at
# random.)

# %% [markdown]
# ## 8. The plan, tested: goodput at the rate lab 14 predicts
#
# Lab 14's planner predicted the highest request rate chapter 13's continuous engine sustains on this
# machine under a TPOT target, and load-tested it at the target's percentile. Here the loop closes with the
# measure an SLO is stated in, **goodput**, using your `slo_report`: the same calibration (closed-loop decode
# steps at batch 1 and 4, this machine's copy and matmul rates), the same prediction, then an open-loop
# Poisson run at the predicted rate and one at twice it.
#
# This part is **measured, not graded**. Each run lasts a few seconds on a CPU that other programs share: a
# calibration or a run that lands on a busy moment moves the prediction or the goodput by tens of percent, so
# no threshold on them could tell a right answer from a wrong one reliably. Read the numbers, and run the part
# again to see how much they move.

# %%
from labsupport import costs
from labsupport.roofline import measure_copy, measure_matmul
from labsupport.serve.served_model import MODEL_NAME, course_model_config
from labsupport.server_calibration import calibrate, predicted_rate
from labsupport.tokenizer import course_tokenizer

engine_server = ServerProcess(["--engine", "continuous", "--context", "256", "--max-tokens-limit", "64",
                               "--max-running", "64", "--num-blocks", "1100", "--block-size", "16"], threads=1).start()
engine_cfg = course_model_config(course_tokenizer().vocab_size)
OUT = 12
cal = calibrate(engine_server.base_url, MODEL_NAME, engine_cfg, output_tokens=OUT,
                copy_bandwidth=max(measure_copy([64 * 2**20], progress=False)),
                matmul_rate=max(measure_matmul([512], progress=False)))
target = 3 * (cal.overhead_s + cal.per_sequence_s)  # lab 14's TPOT target: three batch-1 steps
# the weights and the server's cache (1,100 blocks of 16 tokens), fp32
memory = costs.param_count(engine_cfg) * 4 + 1100 * 16 * costs.kv_bytes_per_token(engine_cfg, 4)
rate = predicted_rate(cal, engine_cfg, target, OUT, memory_bytes=memory)
print(f"steps {[f'{t * 1e3:.2f} ms' for t in cal.step_s]} at batches {cal.batches}; admission "
      f"{cal.admission_s * 1e3:.1f} ms; TPOT target {target * 1e3:.2f} ms at p90; predicted rate {rate:.1f}/s ({WHERE})")

# %%
ENGINE_SLO = {"ttft_s": 10 * target, "tpot_s": target, "p": 90}  # TPOT as lab 14 targets it; TTFT ten steps' worth
for label, asked in (("the predicted rate", rate), ("twice the predicted rate", 2 * rate)):
    if asked <= 0:
        print("no rate was predicted sustainable on this machine: nothing to test")
        break
    run = run_benchmark(engine_server.base_url, MODEL_NAME, num_prompts=max(10, min(16, int(2 * asked))),
                        request_rate=asked, input_words=16, output_tokens=OUT, ignore_eos=True, seed=9)
    report = slo_report(request_latencies(run), ENGINE_SLO, run["duration_s"])
    print(f"{label:<25} {asked:6.1f}/s: throughput {run['request_throughput']:5.1f}/s, goodput "
          f"{report['goodput']:5.1f}/s, attainment {report['attainment']:.0%}, TPOT p90 "
          f"{report['tpot_p'] * 1e3:.2f} ms (target {target * 1e3:.2f}) ({WHERE})")
engine_server.stop()

# %% [markdown]
# What to look for. At the predicted rate the planner expects the *mean* TPOT to meet the target, so most
# requests should meet it but not all: the SLO is judged at the 90th percentile, which sits above the mean
# (lab 14's part 2 said why), so an attainment well short of 100% is what a plan sized on the mean gives. At
# twice the rate the batch grows past what the target allows and the admissions take more of the server's
# time: the goodput falls further below the throughput, and the gap between them is the traffic the plan did
# not provision for. If even the predicted rate's attainment is low, either the run landed on a busy moment
# (run the two cells again) or the calibration did (the planner predicted from a step slower or faster than the
# one the load met): a plan is tested by its goodput, not by its throughput.

# %%
server.stop()

# %% [markdown]
# ## What you built and measured
#
# * An open-loop Poisson schedule, and a sender that keeps to it whatever the server does; a
#   closed loop measured the same stall as one slow request (coordinated omission).
# * Goodput and attainment against an SLO, with nearest-rank percentiles.
# * A load test of a real server, with its own metrics scraped during the run: latency against
#   load, the knee, and the goodput at a planned rate and past capacity.
# * Admission control: a bounded queue answers 429 at once, the admitted requests all finish, and
#   a drain lets them finish while the replica goes away.
# * A percentile from the server's own histogram, as Prometheus computes it (and why per-replica
#   percentiles are never averaged).
# * A client that backs off: it honours `Retry-After`, spreads its retries with jitter, and stops.
# * The plan of lab 14 tested against the SLO's own measure, goodput, at the predicted rate.
#
# ### Questions
#
# 1. A benchmark with 64 closed-loop clients reports p99 TTFT of 2 s at 30 requests per second.
#    What can you say about the p99 your users would see at 30 requests per second?
# 2. Why does the knee come before the capacity, and why does the p99 leave first?
# 3. With a queue bound of 4, what happens to a client that retries a 429 at once, in a loop, and
#    what does `Retry-After` ask of it?
#
# <!-- BEGIN SOLUTION -->
# 1. By Little's law, 64 clients that each always have one request out, at 30 requests per second,
#    spend 64 / 30 = 2.1 s per request: the rate is what the server let them send, not a rate
#    chosen in advance, and its latencies miss the queue open arrivals would build during
#    every slow spell. Users at an open 30 requests per second would see that queue, and most
#    likely a higher p99, possibly much higher; measure with an open loop at that rate.
# 2. Arrivals are random: even below capacity, bursts come faster than the server serves, and the
#    queue they leave takes time to drain; the mean wait is rho / (2 (1 - rho)) service times for a
#    fixed service time (M/D/1), twice that for exponential ones (M/M/1). The tail is
#    made of the requests that arrive behind the largest bursts: it sits far above the mean, so it
#    crosses any fixed target first.
# 3. It is refused again and again while the slots stay full, adding load (each refusal still costs
#    a connection and a parse) without getting served sooner; `Retry-After` asks it to wait that many
#    seconds (better, with jitter and exponential backoff), or to try another replica.
# <!-- END SOLUTION -->

# %% [markdown]
# ### Questions on sections 6 to 8
#
# 4. Two replicas report a TTFT p90 of 0.1 s and 2 s. Is the service's p90 about 1 s? What would you
#    compute instead, and from what?
# 5. A thousand clients are refused in the same second with `Retry-After: 1`. What does the server see
#    one second later if they all honour it exactly, and what does the jitter change?
#
# <!-- BEGIN SOLUTION -->
# 4. No: a percentile of the union is not the mean of the percentiles. If the fast replica serves most of
#    the traffic, the service's p90 is near 0.1 s; if the slow one does, near 2 s. Add the replicas' bucket
#    increases and take one quantile of the sum:
#    `histogram_quantile(0.9, sum by (le) (rate(course:time_to_first_token_seconds_bucket[5m])))`.
# 5. A thousand requests in the same few milliseconds: the same overload, one second later, refused again
#    (a thundering herd). With full jitter they arrive spread over the envelope, so the server admits them
#    at the rate its slots free, and each later round of retries is spread wider still.
# <!-- END SOLUTION -->
