# Lab 03 source of truth. Edit this file, then run `python -m labsupport release 03_journey` to
# regenerate labs/03_journey.ipynb (learners) and solutions/03_journey.ipynb (instructors).

# %% [markdown]
# # Lab 03: the journey of a request, timed
#
# A request to an LLM server passes through many hands before its first word comes back: HTTP,
# the server's front end, the tokenizer, a queue, the prefill, then one decode step and one
# detokenisation per token, each token streamed back as a server-sent event. In this lab you
# run a real server and time all of it. You will
#
# 1. start the course server in the background, send it one streamed request with a client that
#    timestamps every chunk, and draw the request's waterfall from the server's own timestamps;
# 2. write that client yourself, on raw HTTP (`httpx`): read the server-sent events off the wire,
#    with the cases real streams bring (lines split across network reads, keep-alive comments, the
#    server's error event, a dropped connection), and use it for the rest of the lab;
# 3. write the latency metrics (TTFT, TPOT, the inter-token latencies and E2E) from those
#    timestamps, and the nearest-rank percentile, and have both checked;
# 4. send N requests at once and watch the time to first token grow with the queue, at p50 and
#    p99.
#
# The server is `python -m labsupport.serve`, an OpenAI-compatible server you can also start
# from a terminal. It serves the course model with **random weights**: the text it returns is
# meaningless, and that is fine, since every cost measured here depends on the number of tokens,
# not on what they say. It runs on the CPU even on a GPU machine (the model is tiny), so the
# numbers are this machine's, not a production server's. The server and this lab need `fastapi`,
# `uvicorn`, `openai` and `httpx`: `make lab` installs them, and on Colab the cell after the setup installs
# whichever are missing (never torch or triton, which it holds at the versions already there).
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. This lab times its
# first request (section 1) before the first exercise, so a first Run All already draws a
# waterfall. The server keeps running while you work; the last cell stops it, and so does
# restarting or shutting down the kernel.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
from labsupport.serve import install_missing

installed = install_missing()  # fastapi, uvicorn, openai and httpx, only where missing (a fresh Colab runtime)

# %%
import json
import threading
import time

import httpx
import matplotlib.pyplot as plt
import openai

from labsupport.checks import check_latency_metrics, check_percentile, check_sse_client
from labsupport.latency import fifo_ttfts, plot_waterfall, timeline_stages
from labsupport.serve import start_server

# %% [markdown]
# ## 1. One request, from the client's side and the server's
#
# `start_server` runs `python -m labsupport.serve --port 0` as a separate process (port 0: the
# system picks a free port), waits until its `/health` answers, and returns a handle with its
# address. The official `openai` client talks to it unchanged: only `base_url` differs.

# %%
server = start_server(threads=1)  # one CPU thread: steadier timings on a shared machine
client = openai.OpenAI(base_url=server.base_url, api_key="not-needed")
MODEL = client.models.list().data[0].id
print(server)
print("health:", server.health())
print(f"model {MODEL}:", client.models.list().data[0].model_extra["description"])

# %% [markdown]
# A client that timestamps every chunk, on the `openai` package for now (section 2 has you write
# your own). `time.monotonic()` is read when the request is sent and
# each time a chunk arrives; the server stamps its stages with the same clock, so on one machine
# the two sets of times line up. The course server sends one chunk per token (its text can be
# empty while the detokenizer holds back part of a character), so chunk times are token times.

# %%
def timed_stream(prompt: str, max_tokens: int) -> dict:
    """Send one streamed completion; return its id, send time, chunk arrival times and text."""
    sent = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True)
    times, pieces, request_id = [], [], None
    for chunk in stream:
        times.append(time.monotonic())
        pieces.append(chunk.choices[0].text)
        request_id = chunk.id
    return {"id": request_id, "sent": sent, "times": times, "text": "".join(pieces)}


timed_stream("warm-up", 4)  # the first request pays one-off costs (connections, first kernels)
PROMPT = "Tell me, step by step, what happens to a request inside an inference server."
record = timed_stream(PROMPT, max_tokens=24)
print(f"{len(record['times'])} chunks; the (meaningless) text: {record['text']!r}")

# %% [markdown]
# The server kept the timestamps of every stage of that request. They are a course extension,
# `GET /v1/requests/{id}/timeline`, not part of OpenAI's API: seconds after the request arrived.

# %%
timeline = server.timeline(record["id"])
for stage, token, start, end in timeline_stages(timeline)[:8]:
    label = stage if token is None else f"{stage} (token {token})"
    print(f"{label:24s} {start * 1e3:8.3f} -> {end * 1e3:8.3f} ms  ({(end - start) * 1e3:.3f} ms)")
print("...")

# %% [markdown]
# The waterfall: one row per stage, time running left to right from the moment the client sent
# the request. The first token comes out of the prefill; every later one needs a decode step.

# %%
fig, ax = plt.subplots(figsize=(10, 3.8))
plot_waterfall(ax, timeline, record["sent"], record["times"], title=f"one request: {len(record['times'])} tokens")
fig.tight_layout()

# %% [markdown]
# Zoom in on the first few milliseconds: the request's way in, tokenisation, the queue (empty
# here: nothing else was running) and the prefill all happen before the first token.

# %%
fig, ax = plt.subplots(figsize=(10, 3.8))
plot_waterfall(ax, timeline, record["sent"], record["times"], title="up to the second token")
ax.set_xlim(0, (record["times"][1] - record["sent"]) * 1e3 * 1.1)
fig.tight_layout()

# %% [markdown]
# ## 2. A streaming client of your own
#
# The `openai` client hid what came over the wire. Here it is: a streamed completion is one HTTP
# response of type `text/event-stream`, **server-sent events**, read here with `httpx` and shown
# raw, as the bytes arrived.

# %%
http = httpx.Client(timeout=httpx.Timeout(30.0))  # one client, one pool of connections, for the rest of the lab
URL = f"{server.base_url}/completions"
with http.stream("POST", URL, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}) as response:
    print(response.status_code, response.headers["content-type"])
    for piece in response.iter_bytes():
        print(repr(piece[:150]) + ("..." if len(piece) > 150 else ""))

# %% [markdown]
# Each event is one or more lines followed by a blank line. A `data:` line carries the payload,
# here one chunk of the answer as JSON; the payload `[DONE]` says the stream is over. The rules
# (the WHATWG HTML standard's section on server-sent events, which OpenAI-style servers follow)
# have more cases than this quiet loopback shows, and real networks and servers bring all of them:
#
# * **The network cuts bytes anywhere.** One read can end inside a line, inside `data:`, inside the
#   JSON or in the middle of a UTF-8 character, and one read can hold several events. Keep the
#   incomplete end of each read until the rest arrives, and decode whole lines, not reads.
# * **Lines end in `\n` or `\r\n`.** Drop the `\r`.
# * **Not every line is data.** A line starting with `:` is a comment: servers and proxies send
#   `: keep-alive` to hold an idle connection open. Other fields (`event:`, `id:`, `retry:`) do not
#   carry the payload. A blank line ends the event; with no `data:` line before it, it is just a
#   keep-alive.
# * **The space after `data:` is optional** (drop one if it is there), and an event may spread its
#   data over several `data:` lines, which join with `\n`.
# * **A failure can come after the status line.** Once the server has answered 200 and started
#   streaming, it cannot change the status: the course server (like vLLM) sends an event
#   `data: {"error": {"message": ...}}` before `[DONE]`. A request refused before streaming starts
#   gets an ordinary status (400, 429, 503) with OpenAI's error body.
# * **A stream can break.** If the server dies or a proxy drops the connection, `httpx` raises
#   (`httpx.RemoteProtocolError`, a `httpx.TransportError`) or the body just ends: without
#   `[DONE]`, the answer is incomplete, and the caller must be told, not handed half an answer.
# * **`[DONE]` is the end**, even when the server holds the connection open after it.
#
# ### Exercise 1: `stream_events`
#
# Complete `stream_events(client, url, payload)`, a generator: POST `payload` as JSON to `url`
# with `client.stream("POST", url, json=payload)` (an `httpx.Client`), then read
# `response.iter_bytes()` and yield `(arrival_s, chunk)` for each event, in order:
#
# * `arrival_s` is `time.monotonic()` read when the network read that completed the event arrived
#   (the server stamps its timeline with the same clock); events completed by one read share it;
# * `chunk` is the event's data parsed with `json.loads`, a dict.
#
# It returns at `data: [DONE]` (closing the response: leave the `with` block). It raises
# `RuntimeError`, with the server's message in it, for an error event or a status other than 200
# (call `response.read()` first, then `response.json()["error"]["message"]`), and
# `ConnectionError`, saying what happened, when the body breaks (catch `httpx.TransportError`) or
# ends before `[DONE]`. When the body ends, a last line or event that lacks its newline still
# counts. (`response.iter_lines()` would split the lines for you, but it hides which read each line
# came in, so a clock read per line runs late when the caller is slow: split the bytes yourself.)
#
# The check runs your client on raw byte streams from a small server of its own (lines split
# across reads, CRLF, comments, a split character, the error event, a cut connection, a body
# without `[DONE]`, three events 0.2 s apart, and three events in one read taken by a slow caller,
# to check the timestamps), then against the course server, where its chunks must equal the
# course's client's.

# %%
def stream_events(client, url, payload):
    # BEGIN SOLUTION: POST, check the status, split the bytes into lines, events at blank lines; yield (time, chunk) until [DONE]
    with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.json()['error']['message']}")
        pending, data, count = b"", [], 0

        def end_of_event():  # a blank line: the event's chunk, "done" or None
            if not data:
                return None  # a blank line on its own: a keep-alive
            text = "\n".join(data)
            data.clear()
            if text == "[DONE]":
                return "done"
            chunk = json.loads(text)
            if "error" in chunk:
                raise RuntimeError(f"the server failed mid-stream: {chunk['error']['message']}")
            return chunk

        def read_line(raw):  # one complete line: the event it ends, if it is blank
            line = raw.decode("utf-8").removesuffix("\r")
            if not line:
                return end_of_event()
            field, _, value = line.partition(":")  # a comment has the empty field name
            if field == "data":
                data.append(value.removeprefix(" "))
            return None

        try:
            for piece in response.iter_bytes():
                arrived = time.monotonic()
                *lines, pending = (pending + piece).split(b"\n")
                for raw in lines:
                    chunk = read_line(raw)
                    if chunk == "done":
                        return
                    if chunk is not None:
                        count += 1
                        yield arrived, chunk
        except httpx.TransportError as exc:
            raise ConnectionError(f"the stream broke after {count} events: {exc!r}") from exc
        arrived = time.monotonic()
        for chunk in (read_line(pending) if pending else None, end_of_event()):  # the body ended
            if chunk == "done":
                return
            if chunk is not None:
                count += 1
                yield arrived, chunk
    raise ConnectionError(f"the stream ended after {count} events without [DONE]")
    # END SOLUTION

# %%
check_sse_client(stream_events, server=server)

# %% [markdown]
# From here on the lab's requests go through your client: `my_timed_stream` does what
# `timed_stream` did, and its chunk times are the ones your client stamped.

# %%
def my_timed_stream(prompt: str, max_tokens: int) -> dict:
    """Send one streamed completion with your client; return its id, send time, chunk arrival times and text."""
    sent = time.monotonic()
    times, pieces, request_id = [], [], None
    for arrived, chunk in stream_events(http, URL, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                    "stream": True}):
        times.append(arrived)
        pieces.append(chunk["choices"][0]["text"])
        request_id = chunk["id"]
    return {"id": request_id, "sent": sent, "times": times, "text": "".join(pieces)}


my_timed_stream("warm-up", 4)
record = my_timed_stream(PROMPT, max_tokens=24)
timeline = server.timeline(record["id"])
print(f"your client: {len(record['times'])} chunks, first after {(record['times'][0] - record['sent']) * 1e3:.2f} ms")

# %% [markdown]
# ## 3. The latency metrics
#
# From the client's timestamps, with $s$ the time the request was sent and $t_0, \dots, t_{n-1}$
# the arrival times of its $n$ tokens:
#
# * **TTFT**, time to first token: $t_0 - s$;
# * **E2E**, end-to-end latency: $t_{n-1} - s$;
# * **ITL**, inter-token latencies: the $n - 1$ gaps $t_i - t_{i-1}$ for $i = 1, \dots, n-1$ (the wait
#   for the first token is TTFT, not a gap);
# * **TPOT**, time per output token: $(\text{E2E} - \text{TTFT}) / (n - 1)$, the mean of the ITLs.
#   With one token there is no gap to average: TPOT is `None` (not 0, which would claim an
#   infinitely fast decode).
#
# ### Exercise 2: latency metrics
#
# Complete `latency_metrics(sent_s, token_times_s)`: return a dict with keys `"ttft"`, `"tpot"`,
# `"itl"` (a list) and `"e2e"`, all in seconds. `sent_s` is one number, `token_times_s` a list of
# `n >= 1` arrival times on the same clock, in order. For example, sent at `1.0` with tokens at
# `[1.2, 1.25, 1.35]`: TTFT 0.2, E2E 0.35, ITL `[0.05, 0.1]` and TPOT 0.075 (up to rounding);
# with the one token `[1.2]`: ITL `[]` and TPOT `None`.

# %%
def latency_metrics(sent_s, token_times_s):
    # BEGIN SOLUTION: TTFT and E2E from the send time, the ITL gaps between tokens, TPOT over n - 1 gaps (None for one)
    n = len(token_times_s)
    ttft = token_times_s[0] - sent_s
    e2e = token_times_s[-1] - sent_s
    itl = [token_times_s[i] - token_times_s[i - 1] for i in range(1, n)]
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}
    # END SOLUTION

# %%
check_latency_metrics(latency_metrics)

# %% [markdown]
# Your metrics on the request your client just timed, and where its TTFT went. The server's timeline covers
# the time from the request's arrival to the first chunk leaving; the rest is the network and the
# HTTP stacks on both sides (here the loopback interface and two Python programs). Between the
# stages, the server also hands work between its event loop and its model thread.

# %%
m = latency_metrics(record["sent"], record["times"])
print(f"TTFT {m['ttft'] * 1e3:.2f} ms, TPOT {m['tpot'] * 1e3:.2f} ms, E2E {m['e2e'] * 1e3:.2f} ms, "
      f"ITL from {min(m['itl']) * 1e3:.2f} to {max(m['itl']) * 1e3:.2f} ms")
arrived = timeline["arrival"] - record["sent"]  # seconds from sending to the server's arrival stamp
first_chunk_out = next(e["t"] for e in timeline["events"] if e["stage"] == "chunk_sent")
parts = {"network and HTTP, in": arrived}
for stage, token, start, end in timeline_stages(timeline):
    if token in (None, 0):  # the stages before the first token leaves the server
        parts[stage] = parts.get(stage, 0.0) + (end - start)
parts["server: parsing, checks, hand-offs"] = first_chunk_out - sum(v for k, v in parts.items() if k != "network and HTTP, in")
parts["network and HTTP, out; the client"] = m["ttft"] - arrived - first_chunk_out
for part, seconds in parts.items():
    print(f"  {part:36s} {seconds * 1e3:7.3f} ms  {seconds / m['ttft']:6.1%} of TTFT")

# %% [markdown]
# An ITL near zero means two chunks arrived together: the client read them in one go. Gaps are
# what the client sees, not what the server's steps took.

# %% [markdown]
# ### Exercise 3: percentiles by nearest rank
#
# One request tells you little; a server is judged on many, by percentiles. This course uses the
# **nearest-rank** convention: sort the $n$ values; the $p$-th percentile is the
# $\lceil p n / 100 \rceil$-th smallest (counting from 1), and the smallest for $p = 0$. It is
# always one of the measured values. (NumPy's default, `np.percentile(values, p)`, interpolates
# between two values instead; with few samples the two differ.) Mind the order of the arithmetic:
# in floating point `7 / 100 * 100` is `7.000000000000001`, whose ceiling is 8, so compute
# `p * n` first, or stay in integers; NumPy's nearest-rank method (`method="inverted_cdf"`) divides
# first and so returns the 8th of 100 values for `p = 7`, not the 7th.
#
# Complete `percentile(values, p)`: `values` a non-empty list of numbers in any order, `p` from 0
# to 100. For example, `percentile([0.3, 0.1, 0.5, 0.2, 0.4], 90)` is the 5th smallest
# (`ceil(4.5) = 5`), `0.5`; with `p = 50` it is the 3rd smallest, `0.3`.

# %%
def percentile(values, p):
    # BEGIN SOLUTION: sort, then take the ceil(p * n / 100)-th smallest (1-based; the smallest for p = 0)
    data = sorted(values)
    rank = max(1, -(-p * len(data) // 100))  # ceil(p * n / 100), at least 1
    return data[int(rank) - 1]
    # END SOLUTION

# %%
check_percentile(percentile)

# %% [markdown]
# ## 4. Many requests at once: the queue
#
# The course server has one model worker and a first-in, first-out queue: it serves one request
# at a time (chapter 12 replaces it with continuous batching). Send $N$ requests at the same
# moment and the $k$-th must wait for the $k - 1$ before it. Each request here asks for the same
# number of tokens; each level $N$ is sent a few times to collect more samples.

# %%
def concurrent_round(n: int, max_tokens: int) -> list[dict]:
    """Send n streamed requests at once (one thread each, sharing your client's connection pool); return their timed records."""
    records = [None] * n
    start = threading.Barrier(n)

    def one(i):
        start.wait()  # every thread sends at the same moment
        records[i] = my_timed_stream(f"request {i}: {PROMPT}", max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


LEVELS = [1, 2, 4, 8, 16]
ROUNDS = 3
OUT_TOKENS = 16
ttfts = {}  # N -> TTFT of every request sent at that level (seconds)
for n in LEVELS:
    ttfts[n] = []
    for _ in range(ROUNDS):
        for r in concurrent_round(n, OUT_TOKENS):
            ttfts[n].append(latency_metrics(r["sent"], r["times"])["ttft"])
    print(f"N = {n:2d}: {len(ttfts[n]):2d} requests, TTFT p50 {percentile(ttfts[n], 50) * 1e3:7.1f} ms, "
          f"p99 {percentile(ttfts[n], 99) * 1e3:7.1f} ms")
print("health after the rounds:", server.health())

# %% [markdown]
# The FIFO arithmetic predicts the same: if one request takes $S$ seconds in all and $F$ to its
# first token, the $k$-th of $N$ (from 0) sees TTFT $= kS + F$ (`labsupport.latency.fifo_ttfts`).
# We take $S$ and $F$ from lone requests (N = 1).

# %%
solo = [my_timed_stream(PROMPT, OUT_TOKENS) for _ in range(5)]
service_s = sorted(r["times"][-1] - r["sent"] for r in solo)[2]  # median E2E of five lone requests
first_s = sorted(r["times"][0] - r["sent"] for r in solo)[2]  # median TTFT
predicted = {n: fifo_ttfts(n, service_s, first_s) for n in LEVELS}

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(LEVELS, [percentile(ttfts[n], 50) * 1e3 for n in LEVELS], "o-", label="measured p50")
ax.plot(LEVELS, [percentile(ttfts[n], 99) * 1e3 for n in LEVELS], "o-", label="measured p99")
ax.plot(LEVELS, [percentile(predicted[n], 50) * 1e3 for n in LEVELS], "--", color="grey", label="FIFO model p50")
ax.plot(LEVELS, [percentile(predicted[n], 99) * 1e3 for n in LEVELS], ":", color="grey", label="FIFO model p99")
ax.set(xlabel="requests sent at once (N)", ylabel="TTFT (ms)", title="TTFT grows with the queue (nearest-rank percentiles)")
ax.set_ylim(bottom=0)
ax.legend()
fig.tight_layout()

# %% [markdown]
# A caution on the p99 here: with fewer than 100 samples at a level, the nearest-rank p99 is
# simply the largest value measured. More rounds would make it a percentile worth the name.
#
# With $N$ requests at once, the last in the queue waits for $N - 1$ whole requests: p99 grows
# about linearly with $N$, and p50 about half as fast. The mean would sit between them and hide
# the requests that waited longest. Continuous batching (chapter 12) serves the queue together
# instead of one by one, which is why vLLM, SGLang and TensorRT-LLM all do.
#
# Try it yourself: send `OUT_TOKENS = 64` and see the slope grow with the service time; or give
# one request a long answer and the others short ones, and look at who pays.
#
# <!-- BEGIN SOLUTION -->
# With longer answers, $S$ grows and so does every queued request's TTFT ($kS$); the lone TTFT
# ($F$) does not change. A long request at the head of the queue delays every short one behind
# it (head-of-line blocking), which FIFO cannot avoid.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Stop the server

# %%
http.close()
server.stop()
print(server)

# %% [markdown]
# ## What you measured
#
# * A request's first token waits for the way in, tokenisation, the queue and the prefill; on an
#   idle server the prefill and the HTTP layers dominate, on a busy one the queue does.
# * After the first token, each one costs a decode step plus a detokenisation and a chunk: TPOT
#   is their average, the ITLs their spread.
# * TTFT under load follows the queue: with one request served at a time, the $k$-th waits $k$
#   service times, so the tail (p99) grows with $N$ much faster than a lone request suggests.
