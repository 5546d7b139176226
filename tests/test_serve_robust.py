"""A course server no request can wedge (issue 20), for both engines, started for real: every class
of bad input (parameters outside what the engine accepts, malformed and oversized bodies, slow
clients on raw sockets, unknown fields) gets a 4xx with OpenAI's error body on both endpoints; a
fuzz test of the whole API; and after each of them the same greedy request still gets the same
text, the slots and KV blocks are free, and ``/health`` answered within a second throughout."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labsupport.serve import ServerProcess
from labsupport.serve.served_model import MODEL_NAME

CONTEXT, LIMIT, BODY_LIMIT, TIMEOUT = 96, 32, 262144, 1.0
ENGINES = {"fifo": [], "continuous": ["--engine", "continuous", "--num-blocks", "32", "--block-size", "8"]}
GREEDY = {"model": MODEL_NAME, "prompt": "The same request", "max_tokens": 8, "temperature": 0}
GREEDY_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "The same request"}], "max_tokens": 8}


# Asks /health every 50 ms until its stdin closes, then prints what it saw. A process of its own, so
# the time it measures is the server's, not this test process's (hypothesis and the tests hold its GIL).
HEALTH_WATCH = """
import json, sys, threading, time, urllib.request
url, done, seen = sys.argv[1], threading.Event(), {"count": 0, "slowest": 0.0, "failures": []}
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.wait(0.05):
    start = time.monotonic()
    try:
        status = urllib.request.urlopen(url + "/health", timeout=10).status
    except Exception as error:
        status = repr(error)
    seen["slowest"] = max(seen["slowest"], time.monotonic() - start)
    seen["count"] += 1
    if status != 200:
        seen["failures"].append(status)
print(json.dumps(seen))
"""


class HealthWatch:
    """``/health`` watched from another process for as long as the server runs (``HEALTH_WATCH``)."""

    def __init__(self, url: str):
        self.process = subprocess.Popen([sys.executable, "-c", HEALTH_WATCH, url], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def results(self) -> dict:
        out, _ = self.process.communicate(timeout=30)  # closing stdin stops it
        return json.loads(out)


@pytest.fixture(scope="module", params=list(ENGINES))
def server(request):
    options = ["--context", CONTEXT, "--max-tokens-limit", LIMIT, "--max-requests", 4, "--max-body-bytes", BODY_LIMIT,
               "--header-timeout", TIMEOUT, "--body-timeout", TIMEOUT, *ENGINES[request.param]]
    with ServerProcess(options, threads=1) as srv:
        srv.engine = request.param
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            srv.baseline = (http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"],
                            http.post("/v1/chat/completions", json=GREEDY_CHAT).json()["choices"][0]["message"])
        srv.watch = HealthWatch(srv.url)
        yield srv
        if srv.watch.process.poll() is None:
            srv.watch.process.kill()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def assert_unharmed(server, http) -> None:
    """The same greedy requests get the same answers, and nothing is left holding a slot or a block."""
    assert http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == server.baseline[0]
    assert http.post("/v1/chat/completions", json=GREEDY_CHAT).json()["choices"][0]["message"] == server.baseline[1]
    deadline = time.monotonic() + 10
    while (health := server.health())["slots_used"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert health["status"] == "ok" and health["slots_used"] == 0 and health["running"] == 0
    if server.engine == "continuous":
        assert health["kv_blocks_free"] == health["kv_blocks_total"]


def assert_openai_error(response, status: int, param="any", code="any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert param == "any" or error["param"] == param, error
    assert code == "any" or error["code"] == code, error
    assert response.headers["x-request-id"]
    return error


def as_chat(body: dict) -> dict:
    body = dict(body)
    prompt = body.pop("prompt", "hi")
    body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else "hi"}]
    return body


# --- parameters outside what the engine accepts ------------------------------------------------------

BAD_PARAMETERS = {
    "seed 2**64 (torch takes up to 2**64 - 1)": ({"seed": 2**64}, "seed"),
    "seed below -2**63": ({"seed": -(2**63) - 1}, "seed"),
    "seed a float": ({"seed": 1.5}, "seed"),
    "seed a string": ({"seed": "7"}, "seed"),
    "temperature above 2": ({"temperature": 2.5}, "temperature"),
    "temperature negative": ({"temperature": -0.1}, "temperature"),
    "temperature a string": ({"temperature": "hot"}, "temperature"),
    "temperature a huge integer": ({"temperature": 10**400}, "temperature"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    "top_p above 1": ({"top_p": 1.5}, "top_p"),
    "top_k below -1": ({"top_k": -2}, "top_k"),
    "max_tokens a float": ({"max_tokens": 4.0}, "max_tokens"),
    "max_tokens a boolean": ({"max_tokens": True}, "max_tokens"),
    "max_tokens of 401 digits": ({"max_tokens": 10**400}, "max_tokens"),
    "stream a string": ({"stream": "yes"}, "stream"),
    "include_usage 'no'": ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
    "stream_options unknown field": ({"stream": True, "stream_options": {"usage": True}}, "stream_options"),
    "stop too many": ({"stop": ["x"] * 17}, "stop"),
    "stop too long": ({"stop": "x" * 257}, "stop"),
    "stop empty": ({"stop": [""]}, "stop"),
    "stop a number": ({"stop": 5}, "stop"),
    "stop with a lone surrogate": ({"stop": ["\ud800"]}, "stop"),
    "stop_token_ids outside the vocabulary": ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    "ignore_eos a number": ({"ignore_eos": 1}, "ignore_eos"),
    "n above 1": ({"n": 2}, "n"),
    "logit_bias set": ({"logit_bias": {"5": 10}}, "logit_bias"),
    "repetition_penalty zero": ({"repetition_penalty": 0}, "repetition_penalty"),
    "repetition_penalty past float32": ({"repetition_penalty": 1e39}, "repetition_penalty"),
    "repetition_penalty below float32": ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    "repetition_penalty a string": ({"repetition_penalty": "1.2"}, "repetition_penalty"),
    "min_p above 1": ({"min_p": 1.5}, "min_p"),
    "min_p negative": ({"min_p": -0.1}, "min_p"),
    "presence_penalty set": ({"presence_penalty": 0.5}, "presence_penalty"),
    "an unknown field": ({"max_token": 5}, "max_token"),
    "model a number": ({"model": 5}, "model"),
    "user not a string": ({"user": 5}, "user"),
}


def test_min_p_and_the_repetition_penalty_are_honoured(server, http):
    """Both back ends: a repetition penalty changes a greedy answer (a repeated token is less likely),
    the same request twice gives the same tokens, and min_p 1 (only the most likely token kept)
    samples what greedy decoding picks."""
    def tokens(**change):
        body = {**GREEDY, "max_tokens": LIMIT, "prompt": "a a a a a a a a", **change}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    plain = tokens()
    penalised = tokens(repetition_penalty=3.0)
    assert penalised != plain and tokens(repetition_penalty=3.0) == penalised
    assert tokens(temperature=1.5, min_p=1, seed=4) == plain


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_parameters_outside_what_the_engine_accepts_are_400s(server, http, endpoint):
    for name, (change, param) in BAD_PARAMETERS.items():
        body = {**GREEDY, **change} if endpoint == "/v1/completions" else {**as_chat(GREEDY), **change}
        response = http.post(endpoint, content=json.dumps(body))
        error = assert_openai_error(response, 400, param=param)
        assert error["type"] == "invalid_request_error", name
    # what must pass: the extremes of each range, and fields sent at their neutral values
    for change in ({"seed": 2**64 - 1}, {"seed": -(2**63)}, {"temperature": 1e-30}, {"temperature": 2, "seed": 1},
                   {"top_p": 1e-9, "temperature": 1}, {"top_k": -1, "temperature": 1}, {"repetition_penalty": 1.0,
                   "logprobs": None, "n": 1}, {"user": "learner"}, {"ignore_eos": True, "stop": None},
                   {"min_p": 1, "temperature": 1, "seed": 2}, {"repetition_penalty": 0.01, "temperature": 2, "seed": 3},
                   {"repetition_penalty": 100, "temperature": 2, "seed": 3}):
        body = {**GREEDY, **change} if endpoint == "/v1/completions" else {**as_chat(GREEDY), **change}
        assert http.post(endpoint, json=body).status_code == 200, change
    assert http.post(endpoint, json={**(GREEDY if "chat" not in endpoint else as_chat(GREEDY)),
                                     "temperature": 1e-30}).json()["choices"][0] == \
        http.post(endpoint, json=GREEDY if "chat" not in endpoint else as_chat(GREEDY)).json()["choices"][0]
    assert_unharmed(server, http)


def test_prompts_that_cannot_be_text_or_ids_are_400s(server, http):
    cases = [({"prompt": "\ud83d"}, "prompt"), ({"prompt": "ok \udfff"}, "prompt"), ({"prompt": [-1]}, "prompt"),
             ({"prompt": [1, True]}, "prompt"), ({"prompt": [[1, 2], [3]]}, "prompt"), ({"prompt": {"a": 1}}, "prompt"),
             ({"prompt": ""}, "prompt"), ({"prompt": [10**400]}, "prompt")]
    for change, param in cases:
        assert_openai_error(http.post("/v1/completions", content=json.dumps({**GREEDY, **change})), 400, param)
    assert_unharmed(server, http)


# --- malformed and oversized bodies -----------------------------------------------------------------

MALFORMED = {
    "truncated JSON": b'{"model": "course-tiny", "prompt": ',
    "an integer of 5,001 digits": b'{"model": "course-tiny", "prompt": "x", "max_tokens": ' + b"9" * 5001 + b"}",
    "JSON nested 100,000 deep": b'{"model": "course-tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "NaN": b'{"model": "course-tiny", "prompt": "x", "temperature": NaN}',
    "not UTF-8": b'{"model": "course-tiny", "prompt": "\xff\xfe"}',
    "a lone surrogate escape": b'{"model": "course-tiny", "prompt": "\\ud800"}',
    "an array": b"[1, 2]",
    "a string": b'"hello"',
    "empty": b"",
}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bodies_are_400s_with_openai_errors(server, http, endpoint):
    for name, raw in MALFORMED.items():
        start = time.monotonic()
        assert_openai_error(http.post(endpoint, content=raw), 400)
        assert time.monotonic() - start < 5, f"{name}: slow"
    assert_unharmed(server, http)


def test_bodies_over_the_limit_are_413_before_they_are_read(server, http):
    error = assert_openai_error(http.post("/v1/completions", content=b"x" * (BODY_LIMIT + 1)), 413, None,
                                "body_too_large")
    assert str(BODY_LIMIT) in error["message"]

    def chunked():  # no Content-Length: counted as it comes
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024

    assert_openai_error(http.post("/v1/completions", content=chunked()), 413, None, "body_too_large")
    assert_unharmed(server, http)


def test_a_prompt_too_long_for_the_context_is_refused_by_its_bytes_before_tokenising(server, http):
    word = "abcdefghijklmnopqrstuvwxyz" * 2000  # 52,000 bytes in one word: quadratic for the course's merge loop
    start = time.monotonic()
    for endpoint, body in (("/v1/completions", {**GREEDY, "prompt": word}),
                           ("/v1/chat/completions", as_chat({**GREEDY, "prompt": word}))):
        error = assert_openai_error(http.post(endpoint, json=body), 400, code="context_length_exceeded")
        assert "bytes" in error["message"]
    # a long word that passes the byte bound is tokenised (fast), then found too long in tokens
    fits_bytes = "q" * (CONTEXT * 5)
    assert_openai_error(http.post("/v1/completions", json={**GREEDY, "prompt": fits_bytes}), 400,
                        code="context_length_exceeded")
    assert time.monotonic() - start < 5
    assert_unharmed(server, http)


# --- slow and broken clients, on raw sockets ----------------------------------------------------------


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=15)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _response(data: bytes) -> tuple[int, dict, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_slow_headers_and_bodies_get_408_and_idle_connections_are_closed(server, http):
    started = time.monotonic()
    with _connect(server) as slow_headers, _connect(server) as slow_body, _connect(server) as idle, \
            _connect(server) as garbage:
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the end of the headers
        body = json.dumps(GREEDY).encode()
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        garbage.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, error = _response(_read_all(slow_headers))
        assert status == 408 and error["error"]["code"] == "header_timeout" and headers["x-request-id"]
        status, headers, error = _response(_read_all(slow_body))
        assert status == 408 and error["error"]["code"] == "body_timeout" and headers["connection"] == "close"
        assert _read_all(idle) == b""  # closed without a word: it never asked anything
        status, _, error = _response(_read_all(garbage))
        assert status == 400 and error["error"]["code"] == "invalid_http"
    assert TIMEOUT * 0.9 < time.monotonic() - started < TIMEOUT + 10  # the deadlines, not a hang
    # a request sent at once is untouched by the deadlines, also on a kept-alive connection
    with _connect(server) as fine:
        body = json.dumps(GREEDY).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        fine.sendall(request)
        time.sleep(TIMEOUT * 0.6)
        fine.sendall(request)  # the second request's deadline counts from the end of the first answer
        fine.settimeout(15)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 and (chunk := fine.recv(65536)):
            data += chunk
        assert data.count(b"HTTP/1.1 200") == 2, data[:300]
    assert_unharmed(server, http)


# --- what every response carries ---------------------------------------------------------------------


def test_every_response_carries_a_request_id_and_models_answer_by_id(server, http):
    responses = [http.post("/v1/completions", json=GREEDY), http.post("/v1/chat/completions", json=GREEDY_CHAT),
                 http.post("/v1/completions", json={"prompt": "no model"}), http.get("/v1/nowhere"),
                 http.put("/v1/completions"), http.get("/health"), http.get("/metrics"), http.get("/ready"),
                 http.get("/v1/models"), http.get(f"/v1/models/{MODEL_NAME}"), http.get("/v1/models/gpt-5")]
    ids = [r.headers.get("x-request-id") for r in responses]
    assert all(ids) and len(set(ids)) == len(ids), ids
    assert ids[0] == responses[0].json()["id"] and ids[1] == responses[1].json()["id"]  # a generation's own id
    card = responses[9].json()
    assert card == responses[8].json()["data"][0] and card["id"] == MODEL_NAME and card["weights"] == "random"
    assert card["root"] and card["max_model_len"] == CONTEXT
    assert_openai_error(responses[10], 404, "model", "model_not_found")
    assert responses[4].status_code == 405 and set(responses[4].json()["error"]) == {"message", "type", "param", "code"}


# --- a fuzz test of the whole API ---------------------------------------------------------------------

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                      st.sampled_from(["\ud800", "a\udfffb", "<|endoftext|>", "user", "text", "image_url", ""]))
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stop_token_ids", "stream", "stream_options", "ignore_eos", "n", "logprobs", "echo", "user", "x"]
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 5]),
                                           "content": st.one_of(st.text(max_size=20), JSON)}), max_size=3)


@st.composite
def requests(draw):
    chat = draw(st.booleans())
    body = dict(GREEDY_CHAT if chat else GREEDY, max_tokens=draw(st.integers(1, 4)))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(MESSAGES if name == "messages" and draw(st.booleans()) else JSON)
    if draw(st.booleans()):
        body["stream"] = True
    raw = draw(st.sampled_from([None, b"", b"{", b"\x00\xff", b'{"model":']))
    return ("/v1/chat/completions" if chat else "/v1/completions"), (json.dumps(body).encode() if raw is None else raw)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(request=requests())
def test_fuzzed_requests_get_an_answer_or_a_4xx_never_a_500(server, http, request):
    endpoint, raw = request
    with http.stream("POST", endpoint, content=raw, headers={"Content-Type": "application/json"}) as response:
        text = response.read().decode()
    assert response.status_code in (200, 400, 404), text
    assert response.headers["x-request-id"]
    if response.status_code != 200:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    else:
        assert json.loads(text)["usage"]["completion_tokens"] >= 1


def test_after_the_fuzz_the_server_is_unharmed_and_health_answered_within_a_second_throughout(server, http):
    assert_unharmed(server, http)
    seen = server.watch.results()
    assert seen["count"] > 20, "the health watcher hardly ran"
    assert not seen["failures"], seen["failures"][:5]
    assert seen["slowest"] < 1.0, f"/health once took {seen['slowest']:.2f} s"
