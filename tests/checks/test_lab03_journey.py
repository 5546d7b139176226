"""The request-journey checks pass the references and reject each planted mistake."""

from __future__ import annotations

import codecs
import json
import math
import time

import httpx
import numpy as np
import pytest

from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_latency_metrics, check_percentile, check_sse_client
from labsupport.latency import latency_metrics, percentile
from labsupport.sse import stream_events

# --- check_latency_metrics -------------------------------------------------------------------------


def ref_metrics(sent_s, token_times_s):
    t = token_times_s
    ttft, e2e = t[0] - sent_s, t[-1] - sent_s
    return {
        "ttft": ttft,
        "e2e": e2e,
        "itl": [b - a for a, b in zip(t, t[1:])],
        "tpot": (e2e - ttft) / (len(t) - 1) if len(t) > 1 else None,
    }


def mutant(**changes):
    """The reference with some values replaced: ``changes[key](sent, times, reference)``."""

    def fn(sent_s, token_times_s):
        out = ref_metrics(sent_s, token_times_s)
        for key, change in changes.items():
            out[key] = change(sent_s, token_times_s, out)
        return out

    return fn


def test_metrics_references_pass(capsys):
    check_latency_metrics(ref_metrics)
    check_latency_metrics(unguarded(latency_metrics))
    assert "PASSED check_latency_metrics" in capsys.readouterr().out


def test_numpy_results_are_accepted(capsys):
    def with_numpy(sent_s, token_times_s):
        t = np.asarray(token_times_s)
        gaps = np.diff(t)
        return {"ttft": t[0] - sent_s, "e2e": t[-1] - sent_s, "itl": gaps,
                "tpot": float(gaps.mean()) if len(gaps) else None}

    check_latency_metrics(with_numpy)
    assert "PASSED" in capsys.readouterr().out


METRIC_MUTANTS = {
    "TPOT divided by n": (
        mutant(tpot=lambda s, t, o: (o["e2e"] - o["ttft"]) / len(t) if len(t) > 1 else None),
        "divided by n instead of n - 1",
    ),
    "TTFT from the first decode step": (
        mutant(ttft=lambda s, t, o: (t[1] if len(t) > 1 else t[0]) - s),
        "second token, which the first decode step makes",
    ),
    "TPOT 0 for one token": (
        mutant(tpot=lambda s, t, o: 0.0 if len(t) == 1 else o["tpot"]),
        "TPOT is None",
    ),
    "TPOT is E2E / n": (
        mutant(tpot=lambda s, t, o: o["e2e"] / len(t) if len(t) > 1 else None),
        "spread over every token",
    ),
    "ITL includes TTFT": (
        mutant(itl=lambda s, t, o: [o["ttft"], *o["itl"]]),
        "Its first value is TTFT",
    ),
    "E2E from the first token": (
        mutant(e2e=lambda s, t, o: t[-1] - t[0]),
        "E2E is measured from the first token",
    ),
    "TTFT is zero": (mutant(ttft=lambda s, t, o: 0.0), "measured from the first token itself"),
    "a tuple, not a dict": (lambda s, t: tuple(ref_metrics(s, t).values()), "expected a dict"),
    "a key missing": (lambda s, t: {k: v for k, v in ref_metrics(s, t).items() if k != "itl"}, "no key 'itl'"),
    "milliseconds": (mutant(ttft=lambda s, t, o: o["ttft"] * 1000), "TTFT is"),
}


@pytest.mark.parametrize("name", list(METRIC_MUTANTS))
def test_metrics_mutant_is_rejected(name):
    fn, message = METRIC_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_latency_metrics(fn)


def test_metrics_stub_says_not_implemented():
    def stub(sent_s, token_times_s):
        raise NotImplementedError("Exercise 1")

    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_latency_metrics(stub)
    assert info.value.reason == "not done"


def test_metrics_refuses_the_course_answer():
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_latency_metrics(lambda s, t: latency_metrics(s, t))


# --- check_percentile --------------------------------------------------------------------------------


def ref_percentile(values, p):
    data = sorted(values)
    return data[max(1, math.ceil(p * len(data) / 100)) - 1]


def test_percentile_references_pass(capsys):
    check_percentile(ref_percentile)
    check_percentile(unguarded(percentile))
    check_percentile(lambda v, p: sorted(v)[max(1, -(-p * len(v) // 100)) - 1])  # in integers
    assert "PASSED check_percentile" in capsys.readouterr().out


PERCENTILE_MUTANTS = {
    "numpy's default interpolation": (lambda v, p: float(np.percentile(v, p)), "interpolated"),
    "rank rounded down": (
        lambda v, p: sorted(v)[max(0, math.floor(p / 100 * len(v)) - 1)], "rounded down"),
    "0-based rank": (lambda v, p: sorted(v)[min(len(v) - 1, math.ceil(p / 100 * len(v)))], "0-based index"),
    "unsorted": (lambda v, p: v[max(1, math.ceil(p / 100 * len(v))) - 1], "not sorted"),
    "the mean": (lambda v, p: sum(v) / len(v), "mean"),
    "p = 0 not handled": (lambda v, p: sorted(v)[math.ceil(p * len(v) / 100) - 1],
                          "(?s)p0 is 0.5, expected 0.1.*p = 0 gives rank 0.*LARGEST"),
    # p / 100 rounded first: 7 / 100 * 100 = 7.000000000000001, one rank too high (red team, issue 26)
    # numpy's nearest-rank method computes p / 100 * n in floating point too (issue 26)
    "numpy's inverted_cdf": (lambda v, p: float(np.percentile(v, p, method="inverted_cdf")),
                             r"(?s)p7 is 8, expected 7.*p / 100 is rounded before"),
    "p / 100 before n": (lambda v, p: sorted(v)[max(1, math.ceil(p / 100 * len(v))) - 1],
                         r"(?s)p7 is 8, expected 7.*p / 100 is rounded before it is multiplied by n"),
    "numpy's nearest method (rounds half to even)": (
        lambda v, p: float(np.percentile(v, p, method="nearest")), r"the p\d+ is .*, expected"),
}


@pytest.mark.parametrize("name", list(PERCENTILE_MUTANTS))
def test_percentile_mutant_is_rejected(name):
    fn, message = PERCENTILE_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_percentile(fn)


def test_percentile_stub_says_not_implemented():
    def stub(values, p):
        raise NotImplementedError("Exercise 2")

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_percentile(stub)


# --- check_sse_client --------------------------------------------------------------------------------


def make_client(*, buffer=True, strip_cr=True, comments=True, space_optional=True, done=True, flush_eof=True,
                need_done=True, errors=True, stamp="arrival", decode="line", wrap_cut=True, status=True,
                parse=True):
    """A learner's client written on response.iter_bytes(); each flag off plants one mistake."""

    def client_fn(client, url, payload):
        events = []
        with client.stream("POST", url, json=payload) as response:
            if status and response.status_code != 200:
                response.read()
                raise RuntimeError(f"HTTP {response.status_code}: {response.json()['error']['message']}")
            if not status:
                response.raise_for_status()
            pending, data, began = b"", [], []  # began: the stamp of the read where the open event began

            def line_of(raw):
                return raw.decode("utf-8")

            def handle(line, t):
                if strip_cr:
                    line = line.removesuffix("\r")
                if line == "":
                    if not data:
                        return None
                    text = "\n".join(data)
                    data.clear()
                    if stamp == "first":  # the mutant: the read where the event began, not the one that ended it
                        t = began.pop()
                    began.clear()
                    if text == "[DONE]" and done:
                        return "done"
                    if text == "[DONE]":
                        return None
                    chunk = json.loads(text) if parse else text
                    if errors and isinstance(chunk, dict) and "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    if not errors and isinstance(chunk, dict) and "error" in chunk:
                        return None
                    events.append((t, chunk))
                    return None
                if comments:
                    field, _, value = line.partition(":")
                    if field != "data":
                        return None
                else:
                    value = line.partition(":")[2]
                if not data:
                    began.append(t)
                data.append(value[1:] if not space_optional or value.startswith(" ") else value)
                return None

            try:
                for piece in response.iter_bytes():
                    t = time.time() if stamp == "wall" else time.monotonic()
                    if decode == "chunk":  # each read decoded alone: a split character is lost
                        piece = piece.decode("utf-8", errors="replace").encode()
                    if buffer:
                        *lines, pending = (pending + piece).split(b"\n")
                    else:
                        lines = piece.split(b"\n")
                    for raw in lines:
                        if handle(line_of(raw), t) == "done":
                            yield from _emit(events, stamp)
                            return
                    yield from _emit(events, stamp, final=False)
            except httpx.TransportError as exc:
                if wrap_cut:
                    raise ConnectionError(f"stream cut: {exc}") from exc
                raise
            t = time.monotonic()
            if flush_eof:
                for raw in (pending, b""):
                    if handle(line_of(raw), t) == "done":
                        yield from _emit(events, stamp)
                        return
            yield from _emit(events, stamp)
        if need_done:
            raise ConnectionError("the stream ended before [DONE]")

    return client_fn


def _emit(events, stamp, final=True):
    """Hand over the events read so far (all at the end when the mutant stamps at the end)."""
    if stamp == "end":
        if final:
            now = time.monotonic()
            yield from ((now, c) for _, c in events)
            events.clear()
        return
    if stamp == "yield":  # the clock read as each chunk is handed over, not when its read arrived
        yield from ((time.monotonic(), c) for _, c in events)
    else:
        yield from events
    events.clear()


def lines_client(client, url, payload):
    """A client on httpx's iter_lines (which buffers, decodes and splits itself), stamping each line as it comes
    out: lines of one read come out as the caller asks for them, so a slow caller's chunks are stamped late."""
    with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(response.json()["error"]["message"])
        data = []
        try:
            for line in response.iter_lines():
                t = time.monotonic()
                if line.startswith(":"):
                    continue
                if line:
                    if line.startswith("data:"):
                        data.append(line[5:].removeprefix(" "))
                    continue
                if not data:
                    continue
                text, data = "\n".join(data), []
                if text == "[DONE]":
                    return
                chunk = json.loads(text)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                yield t, chunk
        except httpx.TransportError as exc:
            raise ConnectionError("cut") from exc
        if data and "\n".join(data) == "[DONE]":
            return
    raise ConnectionError("no [DONE]")


def text_buffer_client(client, url, payload):
    """Another correct client: an incremental UTF-8 decoder and a text buffer cut with str.partition, one clock
    reading per network read, the events of a read collected first and yielded after."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(response.json()["error"]["message"])
        buffer, data = "", []

        def lines_of(text):
            nonlocal buffer
            buffer += text
            while "\n" in buffer:
                line, _, buffer = buffer.partition("\n")
                yield line.rstrip("\r")

        def events_of(lines):
            ready = []
            for line in lines:
                if line.startswith("data:"):
                    data.append(line[5:][1:] if line[5:6] == " " else line[5:])
                elif not line and data:
                    text = "\n".join(data)
                    data.clear()
                    if text == "[DONE]":
                        return ready, True
                    chunk = json.loads(text)
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    ready.append(chunk)
            return ready, False

        try:
            for piece in response.iter_bytes():
                now = time.monotonic()
                ready, done = events_of(lines_of(decoder.decode(piece)))
                yield from ((now, chunk) for chunk in ready)
                if done:
                    return
        except httpx.TransportError as exc:
            raise ConnectionError(f"the stream broke: {exc}") from exc
        now = time.monotonic()
        ready, done = events_of([*lines_of(decoder.decode(b"", final=True) + "\n"), ""])
        yield from ((now, chunk) for chunk in ready)
        if done:
            return
    raise ConnectionError("the stream ended without [DONE]")


def test_sse_references_pass(capsys):
    check_sse_client(make_client())  # the check's own course server, started once per Python
    check_sse_client(text_buffer_client)
    check_sse_client(unguarded(stream_events))
    assert capsys.readouterr().out.count("PASSED check_sse_client") == 3


@pytest.mark.parametrize("client_fn", [make_client(stamp="yield"), lines_client], ids=["stamped_at_yield", "iter_lines"])
def test_sse_stamps_taken_when_the_caller_asks_are_refused(client_fn):
    """Events that one read completes share its time, however slowly the caller takes them."""
    with pytest.raises(CheckFailed, match="arrived in one network read, but chunk 3 is stamped 2.* ms after chunk 1"):
        check_sse_client(client_fn, server=NoServer())


def test_a_gap_under_a_millisecond_is_said_in_microseconds():
    from labsupport.checks.lab03_journey import _duration

    assert _duration(0.0004) == "400 µs" and _duration(0.25) == "250 ms" and _duration(1.5) == "1.5 s"


class NoServer:
    """Stands for a server the mutants never reach (the check would fail on it if they did)."""

    def running(self):
        raise AssertionError("this mutant passed every raw stream and reached the server")


NO_SERVER = NoServer()

SSE_MUTANTS = {
    "ignores [DONE] and keeps reading": (make_client(done=False), r"still reading 2 s after data: \[DONE\]"),
    "treats every line as data": (make_client(comments=False), r"(?s)raised JSONDecodeError.*keep-alive comments"),
    "drops a last line without newline": (
        make_client(flush_eof=False), r"(?s)\[DONE\] as the last line.*raised ConnectionError"),
    "timestamps at the end": (make_client(stamp="end"), "the timestamps were taken at the end"),
    "swallows the error event": (make_client(errors=False), "the server's error event was swallowed"),
    "no buffering across chunks": (make_client(buffer=False), r"(?s)lines split across network chunks"),
    "keeps the \\r of CRLF": (make_client(strip_cr=False), r"(?s)CRLF line endings"),
    "decodes each chunk": (make_client(decode="chunk"), r"(?s)a character split between chunks.*caf"),
    "needs the space after data:": (make_client(space_optional=False), r"(?s)`data:` without its space"),
    "lets httpx's error out": (make_client(wrap_cut=False), r"(?s)raised RemoteProtocolError.*connection cut"),
    "no [DONE] is fine": (make_client(need_done=False), r"never sent data: \[DONE\]: it was cut"),
    "wall-clock stamps": (make_client(stamp="wall"), r"outside the call .*time\.monotonic"),
    "stamped at the read where an event began": (
        make_client(stamp="first"), r"(?s)an event cut across two network reads.*you stamped the read where the event began"),
    "raw JSON text": (make_client(parse=False), "yield the event's data parsed as JSON"),
}


@pytest.mark.parametrize("name", list(SSE_MUTANTS))
def test_sse_mutant_is_rejected(name):
    fn, message = SSE_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_sse_client(fn, server=NO_SERVER)  # the raw streams reject it first


def test_sse_status_ignored_is_rejected():
    with pytest.raises(CheckFailed, match=r"(?s)raised HTTPStatusError.*refuses"):
        check_sse_client(make_client(status=False))


def test_sse_stub_and_answer():
    def stub(client, url, payload):
        raise NotImplementedError("Exercise 1")

    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_sse_client(stub)
    assert info.value.reason == "not done"
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_sse_client(lambda c, u, p: stream_events(c, u, p))
