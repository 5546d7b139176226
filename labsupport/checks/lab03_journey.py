"""Checks for the request-journey lab: the learner's server-sent-events client (on a real course
server and on raw byte streams), the latency metrics of one streamed request, and the nearest-rank
percentile used across many."""

from __future__ import annotations

import contextvars
import json
import math
import numbers
import random
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..latency import latency_metrics, percentile
from ..sse import stream_events
from ._byte_server import ByteServer, Script
from .framework import Case, ForbiddenCall, graded

if TYPE_CHECKING:
    import httpx

METRICS_RULE = (
    "measure everything from the send time: TTFT ends at the first token, E2E at the last; ITL holds the "
    "n - 1 gaps between consecutive tokens (the wait for the first token is TTFT, not a gap); TPOT is the "
    "mean of those gaps, which is the time after the first token over n - 1, and None for a single token (no "
    "gap to average). The first token comes from the prefill; the first decode step makes the second."
)
PERCENTILE_RULE = (
    "nearest rank: sort the values; the p-th percentile of n values is the ceil(p * n / 100)-th smallest "
    "(1-based; the smallest for p = 0). It is always one of the values, never an interpolation."
)
KEYS = ("ttft", "tpot", "itl", "e2e")


def _stream(rng: random.Random, sent: float, n: int, ttft: float, gap: float) -> list[float]:
    times, t = [], sent + ttft
    for _ in range(n):
        times.append(t)
        t += gap * rng.uniform(0.5, 2.5)
    return times


def _metric_cases():
    rng = random.Random(3)
    return [
        ("five tokens, uneven gaps", 100.0, [100.35, 100.37, 100.40, 100.46, 100.47]),
        ("one-token answer", 5.0, [5.2]),
        ("two tokens", 2.0, [2.5, 2.75]),
        ("a long queue wait, then fast tokens", 0.0, [3.0, 3.01, 3.02, 3.04]),
        ("two tokens in the same instant", 7.0, [7.1, 7.3, 7.3, 7.6]),
        ("monotonic-clock times, 40 tokens", 123456.0, _stream(rng, 123456.0, 40, 0.8, 0.02)),
    ]


def _tpot_mistakes(sent: float, times: list[float]) -> dict[str, float]:
    n, ttft, e2e = len(times), times[0] - sent, times[-1] - sent
    return {
        "(E2E - TTFT) is divided by n instead of n - 1 (n tokens have n - 1 gaps between them)": (e2e - ttft) / n,
        "TPOT is E2E / n, the whole request spread over every token (TTFT included)": e2e / n,
        "TPOT is E2E / (n - 1) (the time to the first token is not subtracted)": e2e / (n - 1),
        "TPOT is measured from the first decode step's token: (E2E - (t[1] - s)) / (n - 1)": (
            (e2e - (times[1] - sent)) / (n - 1)
        ),
    }


def _as_float(value):
    """A numpy or torch scalar as a plain number; anything else as it is."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple)):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # an array of several values: let the comparison say so
            return value
    return value


@graded(points=6, bans=(latency_metrics,))
def check_latency_metrics(fn, checker):
    """``fn(sent_s, token_times_s)`` must return ``{"ttft", "tpot", "itl", "e2e"}`` in seconds, with
    ``tpot`` None for a one-token answer."""
    for label, sent, times in _metric_cases():
        case = Case(stream=label, sent_s=sent, tokens=len(times))
        got = checker.call(fn, sent, list(times), case=case)
        want = latency_metrics(sent, times)
        if not isinstance(got, Mapping):
            checker.fail(case, f"your function returned a {type(got).__name__}, expected a dict with keys "
                               f"{', '.join(KEYS)}.", METRICS_RULE)
        missing = [k for k in KEYS if k not in got]
        if missing:
            checker.fail(case, f"the dict has no key {', '.join(repr(k) for k in missing)} (it has "
                               f"{', '.join(repr(k) for k in got) or 'none'}).", METRICS_RULE)
        n = len(times)
        ttft_mistakes = {"TTFT is measured at the second token, which the first decode step makes (the first "
                         "token comes from the prefill)": times[1] - sent} if n > 1 else {}
        ttft_mistakes["TTFT is measured from the first token itself (it is 0)"] = 0.0
        checker.expect_number(_as_float(got["ttft"]), want["ttft"], case=case, rel=1e-9, what="TTFT",
                              hint=METRICS_RULE, mistakes=ttft_mistakes)
        checker.expect_number(_as_float(got["e2e"]), want["e2e"], case=case, rel=1e-9, what="E2E", hint=METRICS_RULE,
                              mistakes={"E2E is measured from the first token, not from sending the request":
                                        times[-1] - times[0]})
        itl = got["itl"]
        if isinstance(itl, (str, bytes, Mapping)) or not hasattr(itl, "__len__"):
            checker.fail(case, f"ITL is a {type(itl).__name__}, expected a list of {n - 1} gaps.", METRICS_RULE)
        itl = [_as_float(x) for x in itl]
        if len(itl) != n - 1:
            extra = ""
            if len(itl) == n and itl and math.isclose(itl[0], want["ttft"], rel_tol=1e-9):
                extra = " Its first value is TTFT: the wait for the first token is not an inter-token gap."
            checker.fail(case, f"ITL has {len(itl)} values; {n} tokens have {n - 1} gaps between them.{extra}",
                         METRICS_RULE)
        for i, (g, w) in enumerate(zip(itl, want["itl"])):
            checker.expect_number(g, w, case=case, rel=1e-9, what=f"ITL[{i}]", hint=METRICS_RULE)
        tpot = _as_float(got["tpot"])
        if want["tpot"] is None:
            if tpot is not None:
                checker.fail(case, f"TPOT is {tpot!r}; with one token there is no gap to average, so TPOT is "
                                   f"None (0 would claim an infinitely fast decode).", METRICS_RULE)
        else:
            if tpot is None:
                checker.fail(case, f"TPOT is None; with {n} tokens it is (E2E - TTFT) / {n - 1}.", METRICS_RULE)
            checker.expect_number(tpot, want["tpot"], case=case, rel=1e-9, what="TPOT", hint=METRICS_RULE,
                                  mistakes={d: v for d, v in _tpot_mistakes(sent, times).items()
                                            if not math.isclose(v, want["tpot"], rel_tol=1e-9)})


def _percentile_mistakes(values: list[float], p: float) -> dict[str, float]:
    data, n = sorted(values), len(values)
    pos = p / 100 * (n - 1)
    lo = math.floor(pos)
    interpolated = data[lo] + (data[min(lo + 1, n - 1)] - data[lo]) * (pos - lo)
    return {
        "p / 100 is rounded before it is multiplied by n: ceil(p / 100 * n) lands one rank too high where "
        f"p * n / 100 is a whole number ({p} / 100 * {n} = {p / 100 * n!r} in floating point). Multiply first, "
        "ceil(p * n / 100), or stay in integers, -(-p * n // 100)":
            data[min(n, max(1, math.ceil(p / 100 * n))) - 1],
        "p = 0 gives rank 0, and ordered[0 - 1] is the LARGEST value (index -1): the rank must be at least 1, "
        "so p = 0 is the smallest value": data[math.ceil(p * n / 100) - 1],
        "the value is interpolated between two ranks (numpy's default), not the nearest rank": interpolated,
        "the rank is rounded down, not up (floor(p / 100 * n) as a 1-based rank)": data[max(0, math.floor(p / 100 * n) - 1)],
        "the rank ceil(p * n / 100) is used as a 0-based index (one rank too high)": data[min(n - 1, math.ceil(p / 100 * n))],
        "the values are not sorted first": values[max(1, math.ceil(p / 100 * n)) - 1],
        "the mean is returned": sum(values) / n,
    }


@graded(points=4, bans=(percentile,))
def check_percentile(fn, checker):
    """``fn(values, p)`` must return the ``p``-th percentile of ``values`` by nearest rank."""
    rng = random.Random(7)
    ttfts = [round(rng.lognormvariate(-2.5, 0.6), 4) for _ in range(37)] + [1.9, 2.4]  # a slow tail
    rng.shuffle(ttfts)
    cases = [
        ([0.30, 0.10, 0.50, 0.20, 0.40], 50),
        ([0.30, 0.10, 0.50, 0.20, 0.40], 90),
        ([4.0, 1.0, 3.0, 2.0], 25),  # p / 100 * n is a whole number: no rounding up
        ([4.0, 1.0, 3.0, 2.0], 75),
        (ttfts, 50),
        (ttfts, 99),
        (ttfts, 100),
        ([0.2, 0.2, 0.9, 0.2], 99),
        ([0.25], 99),
        ([0.3, 0.1, 0.5], 0),  # the largest value is not the first: a rank of 0 and unsorted values differ
        (list(range(100, 0, -1)), 7),  # 7 / 100 * 100 is 7.000000000000001 in floating point, 7 * 100 / 100 is 7
        ([float(v) for v in random.Random(28).sample(range(1, 26), 25)], 28),  # 0.28 * 25 = 7.000000000000001
    ]
    for values, p in cases:
        shown = f"{len(values)} values" if len(values) > 6 else values
        if len(values) > 6 and sorted(values) == list(range(1, len(values) + 1)):
            shown = f"1 to {len(values)} in some order"
        case = Case(values=shown, p=p)
        got = checker.call(fn, list(values), p, case=case)
        want = percentile(values, p)
        mistakes = {d: v for d, v in _percentile_mistakes(values, p).items() if not math.isclose(v, want)}
        checker.expect_number(_as_float(got), want, case=case, rel=1e-12, what=f"p{p}", hint=PERCENTILE_RULE,
                              mistakes=mistakes)


# --- the server-sent-events client -------------------------------------------------------------------

SSE_RULE = (
    "read the body as bytes; keep the incomplete end of each network chunk until the rest arrives; a line "
    "ends at \\n (drop a \\r before it); a `data:` line adds its value (one space after the colon dropped) "
    "to the event, a line starting with `:` is a comment, other fields are ignored, and a blank line ends "
    "the event. Yield (time.monotonic() when the chunk completing the event arrived, json.loads(data)); "
    "events completed by one read share its time; stop at data: [DONE]; raise RuntimeError with the "
    "server's message for an error event or a status other than 200, and ConnectionError when the body "
    "ends or breaks before [DONE]. When the body ends, a last line or event without its newline still counts."
)
HANG_S = 2.0  # how long after data: [DONE] was sent a client may keep reading (the byte server holds it 3.5 s)
CALL_S = 8.0  # how long one streamed request may take in all


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-raw", "object": "text_completion", "created": 1700000000, "model": "raw",
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}], "usage": None}


def _event(chunk: dict, newline: str = "\n", space: str = " ") -> bytes:
    return f"data:{space}{json.dumps(chunk, ensure_ascii=False)}{newline}{newline}".encode()


DONE_EVENT = b"data: [DONE]\n\n"
SERVER_FAILED = "the server failed on this request: RuntimeError: the model worker died"


def _split(body: bytes, cuts: list[int], delay: float = 0.02) -> list[tuple[float, bytes]]:
    """``body`` sent in pieces cut at the byte offsets ``cuts``."""
    bounds = [0, *cuts, len(body)]
    return [(delay if i else 0.0, body[a:b]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


class _Raw:
    """One raw stream: its script, the chunks a client must yield, and how it must end."""

    def __init__(self, label: str, pieces, chunks: list[dict], ending: str = "end", outcome: str = "done",
                 trap: str = "", hold_s: float = HANG_S + 1.5):
        self.label, self.chunks, self.outcome, self.trap = label, chunks, outcome, trap
        self.script = Script(pieces=pieces, ending=ending, hold_s=hold_s)


# What each raw stream tests, named in the message when a client fails on it: the mistake it catches
_PITFALLS = {
    "after data: [DONE] nothing more comes, but the server may keep the connection open: stop there and close "
    "the response": "hold",
    "a network chunk can end anywhere, inside `data:`, inside the JSON or between the two newlines: keep the "
    "incomplete end of each chunk until the next one arrives": "split",
    "lines may end in \\r\\n: drop the \\r, or `[DONE]\\r` is not [DONE] and `\\r` is not a blank line": "crlf",
    "only `data:` lines carry the payload: a line starting with `:` is a comment and `event:`, `id:`, `retry:` "
    "are other fields, none of them data": "fields",
    "the space after `data:` is optional (drop one if it is there), and an event's data lines join with \\n "
    "before json.loads": "space",
    "decode complete lines, not each network chunk: a UTF-8 character can be cut in two; and an event whose "
    "text is empty is still an event (a token whose text the detokenizer held back)": "utf8",
    "a failure after the status line has gone arrives as an event {\"error\": {...}}: raise RuntimeError with "
    "its message, never yield it as a chunk or skip it": "error",
    "when the body ends, a last line (or event) that lacks its newline still counts": "last",
    "a broken connection makes httpx raise (httpx.RemoteProtocolError, a TransportError): turn it into "
    "ConnectionError, and never yield the half-received event": "cut",
    "an OpenAI-style stream always ends with data: [DONE]; a body that ends without it was cut short (a proxy, "
    "a restart): raise ConnectionError instead of returning as if complete": "nodone",
    "stamp each event with time.monotonic() as its chunk arrives, inside the loop that reads the body, not once "
    "the body has been read": "timing",
    "read the clock once per network read (each item of response.iter_bytes()), not when your generator "
    "yields: events that one read completes share its time, however long the caller takes to ask for the next": \
    "batched",
    "stamp an event with the time of the network read that completes it (the read that brings its blank line), "
    "not the read where its first bytes came: the chunk is not usable before it is whole": "completed",
}


def _trap(key: str) -> str:
    return next(sentence for sentence, k in _PITFALLS.items() if k == key)

def _raw_cases() -> list[_Raw]:
    three = [_chunk("The"), _chunk(" journey"), _chunk(" ends", "length")]
    body = b"".join(_event(c) for c in three) + DONE_EVENT
    crlf = b"".join(_event(c, "\r\n") for c in three) + b"data: [DONE]\r\n\r\n"
    held = b": keep-alive\n\n" + _event(three[0]) + b"event: completion\nid: 7\n" + _event(three[1])[:-1] + \
        b"retry: 3000\n\n" + b": ping\n\n\n" + _event(three[2]) + DONE_EVENT
    two_lines = json.dumps(three[1], indent=1).split("\n")
    spaced = _event(three[0], space="") + "".join(f"data: {line}\n" for line in two_lines).encode() + b"\n" + \
        _event(three[2], space="") + b"data:[DONE]\n\n"
    unicode_chunks = [_chunk("caf\u00e9 "), _chunk(""), _chunk("\u2615", "stop")]
    unicode_body = b"".join(_event(c) for c in unicode_chunks) + DONE_EVENT
    cup = unicode_body.index("\u2615".encode())
    failure = _event({"error": {"message": SERVER_FAILED, "type": "server_error", "param": None, "code": None}})
    mid = len(_event(three[0])) + 9
    return [
        _Raw("one event per chunk, the connection held open after [DONE]",
             [(0.0, _event(c)) for c in three] + [(0.0, DONE_EVENT)], three, ending="hold",
             trap=_trap("hold")),
        _Raw("lines split across network chunks", _split(body, [3, 40, mid, len(_event(three[0])) * 2 - 1,
                                                                len(body) - 5]), three,
             trap=_trap("split")),
        _Raw("CRLF line endings", _split(crlf, [len(crlf) // 2]), three,
             trap=_trap("crlf")),
        _Raw("keep-alive comments, blank lines and event:, id:, retry: fields", _split(held, [20]), three,
             trap=_trap("fields")),
        _Raw("`data:` without its space, and one event in two data lines", _split(spaced, [30]), three,
             trap=_trap("space")),
        _Raw("a character split between chunks, and an empty text", _split(unicode_body, [cup + 1, cup + 2]),
             unicode_chunks,
             trap=_trap("utf8")),
        _Raw("the server's error event after two tokens",
             [(0.0, _event(three[0])), (0.0, _event(three[1])), (0.02, failure), (0.0, DONE_EVENT)],
             three[:2], outcome="error",
             trap=_trap("error")),
        _Raw("[DONE] as the last line, with no newline after it", _split(body[:-2], [len(body) - 14]), three,
             trap=_trap("last")),
        _Raw("the connection cut in the middle of the third event",
             [(0.0, _event(three[0])), (0.0, _event(three[1])), (0.02, _event(three[2])[:17])], three[:2],
             ending="cut", outcome="cut",
             trap=_trap("cut")),
        _Raw("a body that ends cleanly without [DONE]", [(0.0, _event(three[0])), (0.0, _event(three[1]))],
             three[:2], outcome="cut",
             trap=_trap("nodone")),
    ]


TIMED = 0.2  # seconds between the events of the timing case


def _timed_case() -> _Raw:
    three = [_chunk("one"), _chunk(" two"), _chunk(" three", "length")]
    return _Raw(f"three events {TIMED:g} s apart", [(TIMED if i else 0.0, _event(c)) for i, c in enumerate(three)]
                + [(0.0, DONE_EVENT)], three,
                trap=_trap("timing"))


def _completed_case() -> _Raw:
    """An event whose bytes come in two reads TIMED s apart, its whole data line in the first and the blank
    line that ends it in the second: its time is the second read's."""
    two = [_chunk("half"), _chunk(" whole", "length")]
    first = _event(two[0])
    return _Raw(f"an event cut across two network reads {TIMED:g} s apart (its data line, then its blank line)",
                [(0.0, first[:-1]), (TIMED, first[-1:] + _event(two[1])), (0.0, DONE_EVENT)], two,
                trap=_trap("completed"))


def _check_completed(checker, times: list[float], script: Script, case: Case, hint: str) -> None:
    """Chunk 0's last bytes were sent with the second piece: it cannot be stamped before that was sent."""
    if times[0] < script.sent_at[1]:
        checker.fail(case, f"chunk 0 is stamped {_duration(script.sent_at[1] - times[0])} before the network read "
                           f"that completed it was sent (its data line came {TIMED:g} s earlier, its blank line "
                           f"then): you stamped the read where the event began.", hint)


SLOW_S = 0.1  # how long the slow consumer of the batched case takes over each chunk


def _batched_case() -> _Raw:
    """One event, then three in one network read, taken by a consumer that spends SLOW_S on each."""
    four = [_chunk("one"), _chunk(" two"), _chunk(" three"), _chunk(" four", "length")]
    return _Raw(f"three events in one network read, the caller taking {SLOW_S:g} s over each chunk",
                [(0.0, _event(four[0])), (0.05, b"".join(_event(c) for c in four[1:])), (0.0, DONE_EVENT)], four,
                trap=_trap("batched"))


class _Run:
    """What one call of the learner's client gave: (time, chunk) items, the exception it raised
    (RuntimeError or ConnectionError; None), when the call began and ended, and when the caller took
    each item (``taken``)."""

    def __init__(self, items, error, began, ended, hung, taken=()):
        self.items, self.error, self.began, self.ended, self.hung = items, error, began, ended, hung
        self.taken = list(taken)


def _drive(checker, fn, client: httpx.Client, url: str, payload: dict, case: Case, limit_s: float,
           sent: Script | None = None, slow_s: float = 0.0) -> _Run:
    """Run ``fn(client, url, payload)`` to its end in a thread (the checks' guards go with it), for at
    most ``limit_s`` seconds; with ``sent``, ``limit_s`` counts from when that script's last piece
    was sent (a loaded machine's slow start is not the client's fault). The caller spends ``slow_s``
    seconds over each item before it asks for the next, as one that draws or prints would."""
    items: list = []
    taken: list[float] = []

    def drain(client, url, payload):
        try:
            for item in fn(client, url, payload):
                items.append(item)
                taken.append(time.monotonic())
                if slow_s:
                    time.sleep(slow_s)
        except (RuntimeError, ConnectionError) as exc:  # what the spec asks for: the check inspects it
            if isinstance(exc, (NotImplementedError, ForbiddenCall)):
                raise
            return exc
        return None

    drain.__name__ = getattr(fn, "__name__", "your function")
    box: dict = {}
    context = contextvars.copy_context()

    def work():
        try:
            box["error"] = context.run(checker.call, drain, client, url, payload, case=case)
        except BaseException as exc:  # handed to the check's own thread
            box["raised"] = exc

    began = time.monotonic()
    thread = threading.Thread(target=work, daemon=True, name="labsupport sse check")
    thread.start()
    if sent is not None:
        deadline = time.monotonic() + CALL_S
        while len(sent.sent_at) < len(sent.pieces) and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    thread.join(limit_s)
    ended = time.monotonic()
    if "raised" in box:
        raise box["raised"]
    return _Run(list(items), box.get("error"), began, ended, thread.is_alive(), taken)


def _chunks_of(checker, run: _Run, case: Case) -> tuple[list[float], list]:
    times, chunks = [], []
    for i, item in enumerate(run.items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            checker.fail(case, f"item {i} your client yielded is {item!r:.120}; yield (arrival time, chunk) pairs.",
                         SSE_RULE)
        t, chunk = item
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            checker.fail(case, f"the time of item {i} is {t!r:.80}, not a number: yield (time.monotonic(), chunk).",
                         SSE_RULE)
        if isinstance(chunk, (str, bytes)):
            checker.fail(case, f"chunk {i} is a {type(chunk).__name__} ({chunk!r:.80}); yield the event's data "
                               f"parsed as JSON (a dict).", SSE_RULE)
        times.append(float(t))
        chunks.append(chunk)
    for i, t in enumerate(times):
        if not run.began <= t <= run.ended:
            checker.fail(case, f"chunk {i} is stamped {t:.3f}, outside the call ({run.began:.3f} to {run.ended:.3f} "
                               f"on time.monotonic()): stamp arrivals with time.monotonic(), the clock the server "
                               f"and the lab use (not time.time() or time.perf_counter()).", SSE_RULE)
    if any(b < a for a, b in zip(times, times[1:])):
        checker.fail(case, f"the arrival times go backwards: {[round(t - run.began, 4) for t in times]} s after "
                           f"the call began.", SSE_RULE)
    return times, chunks


def _expect_outcome(checker, run: _Run, raw: _Raw, case: Case, chunks: list) -> None:
    hint = f"{raw.trap}.\n{SSE_RULE}"
    error = run.error
    if raw.outcome == "done":
        if isinstance(error, ConnectionError):
            checker.fail(case, f"your client raised ConnectionError ({error}) but the stream ended with data: "
                               f"[DONE] after {len(raw.chunks)} chunks (you yielded {len(chunks)}).", hint)
        if error is not None:
            checker.fail(case, f"your client raised {type(error).__name__}: {error}; this stream has no error.",
                         hint)
    elif raw.outcome == "error":
        if error is None:
            checker.fail(case, f"your client ended without raising, having yielded {len(chunks)} chunks: the "
                               f"server's error event was swallowed (or yielded as a chunk).", hint)
        if not isinstance(error, RuntimeError) or SERVER_FAILED not in str(error):
            checker.fail(case, f"your client raised {type(error).__name__}: {error}; the error event must raise "
                               f"RuntimeError with the server's message ({SERVER_FAILED!r}) in it.", hint)
    else:
        if error is None:
            checker.fail(case, f"your client returned normally after {len(chunks)} chunks, but the stream never "
                               f"sent data: [DONE]: it was cut, and the caller must be told (ConnectionError).",
                         hint)
        if not isinstance(error, ConnectionError) or not str(error).strip():
            checker.fail(case, f"your client raised {type(error).__name__}: {error!r:.200}; a stream that breaks "
                               f"or ends before [DONE] must raise ConnectionError with a message saying so.", hint)
    want = raw.chunks
    if raw.outcome == "done" and chunks != want or raw.outcome != "done" and chunks != want[:len(chunks)]:
        extra = [c for c in chunks if c not in want]
        where = f" (for example {extra[0]!r:.160})" if extra else ""
        checker.fail(case, f"your client yielded {len(chunks)} chunks{where}; expected "
                           f"{'these' if raw.outcome == 'done' else 'at most these'} {len(want)}: "
                           f"{[c.get('choices', [{}])[0].get('text') for c in want]} (their texts).", hint)


def _expect_request(checker, script: Script, payload: dict, case: Case) -> None:
    request = script.request
    if request.get("method") != "POST":
        checker.fail(case, f"your client sent {request.get('method')!r}; a completion is a POST.", SSE_RULE)
    try:
        sent = json.loads(request.get("body") or b"null")
    except ValueError:
        sent = request.get("body")
    if sent != payload:
        checker.fail(case, f"your client sent the body {sent!r:.160}; expected the payload as JSON "
                           f"(client.stream('POST', url, json=payload)).", SSE_RULE)


def _check_raw(checker, fn, client, server: ByteServer, raw: _Raw, payload: dict,
               slow_s: float = 0.0) -> tuple[list[float], Script, _Run]:
    case = Case(stream=raw.label)
    script = server.play(raw.script)
    limit = HANG_S if raw.script.ending == "hold" else CALL_S
    run = _drive(checker, fn, client, server.url, payload, case, limit,
                 sent=script if raw.script.ending == "hold" else None, slow_s=slow_s)
    if run.hung:
        if raw.script.ending == "hold":
            checker.fail(case, f"your client was still reading {HANG_S:g} s after data: [DONE] arrived (the server "
                               f"kept the connection open, sending `: keep-alive` comments, as servers may).",
                         f"{raw.trap}.\n{SSE_RULE}")
        checker.fail(case, f"your client did not return within {CALL_S:g} s.", SSE_RULE)
    server.wait(1.0)
    _expect_request(checker, script, payload, case)
    times, chunks = _chunks_of(checker, run, case)
    _expect_outcome(checker, run, raw, case, chunks)
    return times, script, run


def _duration(seconds: float) -> str:
    """A short gap said in a unit that shows it: 0.25 s as 250 ms, 0.0004 s as 400 µs (never "0 ms")."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def _check_timing(checker, times: list[float], script: Script, case: Case, hint: str) -> None:
    sent = script.sent_at
    for i, t in enumerate(times):
        if t < sent[i]:
            checker.fail(case, f"chunk {i} is stamped {_duration(sent[i] - t)} before the server sent it: read "
                               f"the clock when the chunk arrives, not when the request was sent.", hint)
    if times[0] >= sent[-1]:
        checker.fail(case, f"the first chunk is stamped {_duration(times[0] - sent[0])} after the server sent "
                           f"it, once the last had been sent ({_duration(sent[-1] - sent[0])} later): the "
                           f"timestamps were taken at the end, not as each chunk arrived.", hint)


def _check_batched(checker, times: list[float], run: _Run, case: Case, hint: str) -> None:
    """Chunks 1 to 3 came in one network read (one piece of the script, sent whole on the loopback), which
    the client read before it yielded chunk 1: their stamps cannot be later than when the caller took chunk 1.
    The largest excess is reported."""
    late = max(range(2, len(times)), key=lambda i: times[i] - times[1])
    if times[late] > run.taken[1]:
        checker.fail(case, f"chunks 1 to 3 arrived in one network read, but chunk {late} is stamped "
                           f"{_duration(times[late] - times[1])} after chunk 1 (the caller spent {SLOW_S:g} s over "
                           f"each chunk): you read the clock when your generator yields, not when the read "
                           f"arrived.", hint)


def _real_payload(model: str, **extra) -> dict:
    return {"model": model, "prompt": "Stream me a few tokens.", "max_tokens": 6, "temperature": 0.0,
            "stream": True, **extra}


def _check_real(checker, fn, client: httpx.Client, base_url: str) -> None:
    model = client.get(f"{base_url}/models").json()["data"][0]["id"]
    url = f"{base_url}/completions"
    payload = _real_payload(model, stream_options={"include_usage": True})
    case = Case(stream="the course server: a streamed completion of 6 tokens with its usage event")
    want = [chunk for _, chunk in stream_events(client, url, payload)]
    run = _drive(checker, fn, client, url, payload, case, 60.0)
    if run.hung:
        checker.fail(case, "your client did not return within 60 s.", SSE_RULE)
    _, chunks = _chunks_of(checker, run, case)
    if run.error is not None:
        checker.fail(case, f"your client raised {type(run.error).__name__}: {run.error}", SSE_RULE)

    def same(chunk):  # what two identical greedy requests share (ids and creation times differ)
        return {k: v for k, v in chunk.items() if k not in ("id", "created")} if isinstance(chunk, dict) else chunk

    if [same(c) for c in chunks] != [same(c) for c in want]:
        checker.fail(case, f"your client yielded {len(chunks)} chunks, the course's {len(want)} (6 tokens and the "
                           f"usage event); the first that differs: {next((c for c, w in zip(chunks, want) if same(c) != same(w)), None)!r:.200}.",
                     SSE_RULE)
    bad = _real_payload(model, max_tokens=0)
    case = Case(stream="the course server: a request it refuses (max_tokens 0, HTTP 400)")
    run = _drive(checker, fn, client, url, bad, case, 30.0)
    if run.hung:
        checker.fail(case, "your client did not return within 30 s.", SSE_RULE)
    refused = client.post(url, json=bad).json()["error"]["message"]
    if not isinstance(run.error, RuntimeError) or refused not in str(run.error):
        got = "returned normally" if run.error is None else f"raised {type(run.error).__name__}: {run.error}"
        checker.fail(case, f"your client {got}; for a status other than 200 it must raise RuntimeError with the "
                           f"server's message ({refused!r}), read from the JSON body (call response.read() "
                           f"first inside client.stream).", SSE_RULE)


@graded(points=6, bans=(stream_events,))
def check_sse_client(fn, checker, server=None):
    """``fn(client, url, payload)`` must stream a completion over ``httpx`` and yield ``(arrival_s, chunk)``
    per event (see the lab); checked on raw byte streams, then on the course server ``server`` (a running
    :class:`labsupport.serve.ServerProcess`; when it is None, the check starts one, once per Python, and
    keeps it for later calls: it stops when Python exits)."""
    import httpx  # the serve extra's (like the server itself): only this check needs it

    payload = {"model": "raw", "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client, ByteServer() as raw_server:
        for raw in _raw_cases():
            _check_raw(checker, fn, client, raw_server, raw, payload)
        timed = _timed_case()
        times, script, _ = _check_raw(checker, fn, client, raw_server, timed, payload)
        _check_timing(checker, times, script, Case(stream=timed.label), f"{timed.trap}.\n{SSE_RULE}")
        completed = _completed_case()
        times, script, _ = _check_raw(checker, fn, client, raw_server, completed, payload)
        _check_completed(checker, times, script, Case(stream=completed.label), f"{completed.trap}.\n{SSE_RULE}")
        batched = _batched_case()
        times, _, run = _check_raw(checker, fn, client, raw_server, batched, payload, slow_s=SLOW_S)
        _check_batched(checker, times, run, Case(stream=batched.label), f"{batched.trap}.\n{SSE_RULE}")
    if server is not None and not server.running():
        checker.fail(Case(stream="the course server"), f"the server passed to the check is not running ({server!r}).",
                     "start it again (server = start_server(threads=1)), or call the check without server= to let it "
                     "start its own.")
    with httpx.Client(timeout=httpx.Timeout(30.0)) as client:
        _check_real(checker, fn, client, (server or _shared_server()).base_url)


# the course server this Python started for the check (kept for later calls); a dict that is never
# replaced, so the grader's watch on the checks' module variables (framework.replaced) sees no change
_SERVER: dict = {}


def _shared_server():
    """A course server for checks called without one: started on first use, stopped when Python exits."""
    from ..serve.process import ServerProcess  # the server's stack, only when the check starts one

    server = _SERVER.get("process")
    if server is None or not server.running():
        server = _SERVER["process"] = ServerProcess(["--max-tokens-limit", "16"], threads=1).start()
    return server
