"""The course server (labsupport.serve), started for real in a subprocess and driven with the
official ``openai`` client and raw HTTP (httpx): completions whole and streamed, the model list,
health, every bad input the issue names, a stream dropped mid-way, FIFO order and timelines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from labsupport.serve import ServerFailed, ServerProcess, cli, guidellm
from labsupport.serve.served_model import MODEL_NAME, course_tokenizer

CONTEXT, LIMIT, SLOTS = 600, 500, 2


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--context", CONTEXT, "--max-tokens-limit", LIMIT, "--max-requests", SLOTS],
                       threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="not-needed", max_retries=0, timeout=30)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def wait_idle(server, timeout_s=10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = server.health()
        if health["slots_used"] == 0 and health["running"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


# --- what a client gets -----------------------------------------------------------------------


def test_completion_with_the_openai_client(client):
    out = client.completions.create(model=MODEL_NAME, prompt="The journey of a request", max_tokens=7)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL_NAME
    assert isinstance(out.choices[0].text, str)
    assert out.choices[0].finish_reason in ("length", "stop")
    prompt_tokens = len(course_tokenizer().encode("The journey of a request"))
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens <= 7
    assert out.usage.total_tokens == prompt_tokens + out.usage.completion_tokens


def test_stream_with_the_openai_client_matches_the_whole_answer(client):
    whole = client.completions.create(model=MODEL_NAME, prompt="Hello, world", max_tokens=12)
    stream = client.completions.create(model=MODEL_NAME, prompt="Hello, world", max_tokens=12, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == whole.usage.completion_tokens  # one chunk per token
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text  # greedy: the same text
    assert [c.choices[0].finish_reason for c in token_chunks[:-1]] == [None] * (len(token_chunks) - 1)
    assert token_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # the usage chunk comes last
    assert len({c.id for c in chunks}) == 1


def test_raw_stream_is_server_sent_events_ending_with_done(http):
    lines = []
    with http.stream("POST", "/v1/completions",
                     json={"model": MODEL_NAME, "prompt": "abc", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(payloads) == 4 and payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["usage"] is None and p["object"] == "text_completion" for p in payloads)  # OpenAI's chunk shape


def test_null_parameters_mean_their_defaults(http):
    """OpenAI's API reads ``null`` as "the default"; clients that serialise every field send it."""
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": None,
                                           "temperature": None, "stream": None, "seed": None, "stop": None})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens


def test_models_and_health_say_the_weights_are_random(client, http):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME
    raw = http.get("/v1/models").json()["data"][0]
    assert "random weights" in raw["description"] and "meaningless" in raw["description"]
    assert raw["context_length"] == CONTEXT
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["slots_total"] == SLOTS


def test_prompt_as_token_ids_and_seeded_sampling(http):
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 1.0, "seed": 3}
    first, second = http.post("/v1/completions", json=body).json(), http.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens"] == 3
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # the same seed, the same sample


# --- bad input: an OpenAI error body, and the server goes on -------------------------------------


def _random_text(chars: int) -> str:
    rng = random.Random(0)
    return "".join(rng.choice(string.ascii_letters + string.digits + " ") for _ in range(chars))


BAD = {
    "malformed JSON": ('{"model": "course-tiny", "prompt": ', 400, None, None),
    "not an object": ("[1, 2]", 400, None, None),
    "missing prompt": ({"model": MODEL_NAME, "max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    "missing model": ({"prompt": "hi"}, 400, "model", "missing_required_parameter"),
    "max_tokens 0": ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    "max_tokens negative": ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", None),
    "max_tokens not a number": ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens", None),
    "max_tokens above the limit": ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": LIMIT + 1}, 400,
                                   "max_tokens", None),
    "prompt longer than the context (ids)": ({"model": MODEL_NAME, "prompt": [1] * (CONTEXT + 5)}, 400,
                                             "prompt", "context_length_exceeded"),
    "prompt longer than the context (text)": ({"model": MODEL_NAME, "prompt": _random_text(8 * CONTEXT)}, 400,
                                              "prompt", "context_length_exceeded"),
    "prompt and max_tokens exceed the context": ({"model": MODEL_NAME, "prompt": [1] * (CONTEXT - 10),
                                                  "max_tokens": 20}, 400, "max_tokens",
                                                 "context_length_exceeded"),
    "empty prompt": ({"model": MODEL_NAME, "prompt": ""}, 400, "prompt", None),
    "token id outside the vocabulary": ({"model": MODEL_NAME, "prompt": [10**9]}, 400, "prompt", None),
    "unknown model": ({"model": "gpt-5", "prompt": "hi"}, 404, "model", "model_not_found"),
    "unsupported parameter": ({"model": MODEL_NAME, "prompt": "hi", "n": 3}, 400, "n", "unsupported_parameter"),
    "temperature out of range": ({"model": MODEL_NAME, "prompt": "hi", "temperature": 9}, 400, "temperature", None),
    "stream_options without stream": ({"model": MODEL_NAME, "prompt": "hi", "stream_options": {"include_usage": True}},
                                      400, "stream_options", None),
    "prompt null": ({"model": MODEL_NAME, "prompt": None}, 400, "prompt", "missing_required_parameter"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(http, name):
    body, status, param, code = BAD[name]
    r = http.post("/v1/completions", content=body) if isinstance(body, str) else http.post(
        "/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param and error["code"] == code
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL_NAME, prompt=[1] * (CONTEXT + 1), max_tokens=2)


def test_unknown_timeline_and_path_are_404_with_an_error_body(http):
    for path in ("/v1/requests/cmpl-nope/timeline", "/v1/nothing"):
        r = http.get(path)
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# --- slots, dropped streams and the queue ----------------------------------------------------------


def _open_stream(server, max_tokens: int):
    """Start a long stream and read its first token; returns (client, response, request id)."""
    c = httpx.Client(base_url=server.url, timeout=30)
    r = c.send(c.build_request("POST", "/v1/completions", json={
        "model": MODEL_NAME, "prompt": "a long answer", "max_tokens": max_tokens, "stream": True}), stream=True)
    return c, r


def test_dropped_streams_free_their_slots(server, http):
    assert wait_idle(server)["slots_used"] == 0
    before = server.health()["cancelled"]
    first_client, first = _open_stream(server, LIMIT)  # running
    lines = first.iter_lines()
    first_chunk = json.loads(next(line for line in lines if line)[6:])
    second_client, second = _open_stream(server, LIMIT)  # queued behind it
    health = server.health()
    assert health["slots_used"] == SLOTS and health["running"] == 1 and health["queued"] == 1
    full = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "one more", "max_tokens": 2})
    assert full.status_code == 429 and full.json()["error"]["code"] == "server_full"
    # the queued client goes away before its first token: its slot is free at once, while the
    # first request is still generating
    second.close()
    second_client.close()
    deadline = time.monotonic() + 10
    while server.health()["slots_used"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    health = server.health()
    assert health["slots_used"] == 1 and health["running"] == 1 and health["queued"] == 0
    first.close()  # then the running one goes away mid-stream
    first_client.close()
    health = wait_idle(server)
    assert health["slots_used"] == 0 and health["running"] == 0 and health["queued"] == 0
    assert health["cancelled"] == before + 2
    outcome = server.timeline(first_chunk["id"])["outcome"]
    assert outcome.startswith("cancelled after") and int(outcome.split()[2]) < LIMIT
    # and the slots serve again: both at once
    results = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(
        server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "next", "max_tokens": 3},
        timeout=30).status_code)) for _ in range(SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * SLOTS
    assert wait_idle(server)["slots_used"] == 0


def test_a_burst_beyond_the_slots_gets_429s_and_every_admitted_request_is_served(server):
    """Many requests at once: each is either served (200) or refused at once as full (429, OpenAI's
    error body); nothing else goes wrong, and the server ends idle and still serving."""
    wait_idle(server)
    statuses = []

    def send(i):
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": MODEL_NAME, "prompt": f"burst {i}", "max_tokens": 8, "stream": i % 2 == 0})
        statuses.append((r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 16 and set(statuses) <= {(200, None), (429, "server_full")}
    assert statuses.count((200, None)) >= SLOTS
    assert wait_idle(server)["slots_used"] == 0


def test_requests_are_served_one_at_a_time_first_in_first_out(server, client):
    wait_idle(server)
    ids = [None] * SLOTS

    def send(i):
        ids[i] = client.completions.create(model=MODEL_NAME, prompt=f"request {i}", max_tokens=20).id

    threads = [threading.Thread(target=send, args=(i,)) for i in range(SLOTS)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    timelines = [server.timeline(i) for i in ids]

    def absolute(tl, stage):
        return [tl["arrival"] + e["t"] for e in tl["events"] if e["stage"] == stage]

    spans = sorted((absolute(tl, "scheduled")[0], absolute(tl, "finished")[0]) for tl in timelines)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end  # the next request starts only after the previous one finished


def test_timeline_has_every_stage_in_order(server, client):
    stream = client.completions.create(model=MODEL_NAME, prompt="waterfall", max_tokens=5, stream=True)
    chunks = list(stream)
    tl = server.timeline(chunks[0].id)
    assert tl["outcome"] == "completed" and tl["clock"] == "time.monotonic"
    stages = [e["stage"] for e in tl["events"]]
    t = {s: e["t"] for e in tl["events"] for s in [e["stage"]] if e["token"] in (None, 0)}
    order = ["arrival", "tokenise_start", "tokenise_end", "queued", "scheduled", "prefill_start", "prefill_end",
             "detokenise_start", "detokenise_end", "chunk_sent"]
    assert [t[s] for s in order] == sorted(t[s] for s in order)
    n = len(chunks)
    assert stages.count("decode_start") == stages.count("decode_end") == n - 1  # the prefill made token 0
    assert stages.count("detokenise_end") == stages.count("chunk_sent") == n
    finished = [e["t"] for e in tl["events"] if e["stage"] == "finished"]
    assert len(finished) == 1 and finished[0] >= max(e["t"] for e in tl["events"] if e["stage"] == "detokenise_end")


def test_a_server_that_cannot_start_says_why():
    with pytest.raises(ServerFailed, match="--context must be at least"):
        ServerProcess(["--context", "0"], startup_timeout_s=60).start()


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_slot(server):
    wait_idle(server)
    before = server.health()["cancelled"]
    # a raw socket, so the client hangs up only once the server holds the request (a read timeout
    # could fire before the request arrived on a loaded machine, and then nothing would be cancelled)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": int(LIMIT)}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while server.health()["slots_used"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.health()["cancelled"] == before  # still being answered when the client goes
    health = wait_idle(server, timeout_s=30)
    assert health["slots_used"] == 0 and health["cancelled"] == before + 1


def test_a_busy_port_and_bad_options_are_refused_with_advice(server, capsys):
    port = server.url.rsplit(":", 1)[1]
    assert cli.main(["--port", port]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert cli.main(["--port", "0", "--model", "no-such-model-anywhere"]) == 2  # said before anything is served
    said = capsys.readouterr().err
    assert "no-such-model-anywhere" in said or "labsupport.checkpoints" in said
    for options, message in ((["--max-requests", "0"], "--max-requests must be at least 1"),
                             (["--header-timeout", "-1"], "--header-timeout must be 0 or more"),
                             (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1"),
                             (["--base-model", "llama-3.1-70b"], "small presets"),
                             (["--port", "70000"], "--port must be from 0 to 65535"),
                             (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be 0"),
                             (["--num-speculative-tokens", "4"], "needs --engine continuous"),
                             (["--served-model-name", " "], "--served-model-name must be a name"),
                             (["--served-model-name", ".."], "--served-model-name must be a name")):
        with pytest.raises(SystemExit):
            cli.parse_args(options)
        assert message in capsys.readouterr().err


def test_the_served_name_and_where_the_tokenizer_goes(tmp_path):
    """vLLM's naming: --served-model-name wins; a --model Hugging Face folder is served under its path
    (its own tokenizer files stay as they are); a registered name or file keeps the model's name. A
    served name that is a path is where the tokenizer is written, so guidellm finds it by the name."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("the model's own")
    assert cli._served_name(cli.parse_args(["--model", str(folder)]), "model") == str(folder)
    assert cli._served_name(cli.parse_args(["--model", "smollm2-135m-instruct"]), "smollm2") == "smollm2"
    assert cli._served_name(cli.parse_args(["--model", str(folder), "--served-model-name", "x"]), "model") == "x"
    served = cli._backend(cli.parse_args(["--served-model-name", str(tmp_path / "tok")]))
    assert served.model_name == str(tmp_path / "tok")
    cli._write_tokenizer(served, None)
    assert served.tokenizer_dir == str(tmp_path / "tok") and (tmp_path / "tok" / "tokenizer.json").is_file()
    served.model_name = str(folder)
    cli._write_tokenizer(served, None, model=str(folder))  # the model's folder: nothing is written over
    assert served.tokenizer_dir == str(folder) and (folder / "tokenizer.json").read_text() == "the model's own"
    command = guidellm.startup_command("http://h:1", str(folder), str(folder), 512, 256)
    assert "--tokenizer" not in command and f"kind=openai_http,target=http://h:1,model={folder}," in " ".join(command)
    assert "--tokenizer" in guidellm.startup_command("http://h:1", "course-tiny", str(folder), 128, 32)


def test_the_tokenizer_is_never_written_over_a_users_files(tmp_path, monkeypatch, capsys):
    """A served name or --tokenizer-dir naming a folder that holds someone's files leaves them as they
    are: the tokenizer goes to the server's cache instead, and the printed guidellm command names it.
    A Hugging Face style name (org/model) is a name, not a folder in the working directory; a folder
    that cannot be made falls back to the cache too; a folder the server wrote before is reused."""
    monkeypatch.setenv("LABSUPPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text("someone's own")
    for args in (["--served-model-name", str(mine)], ["--tokenizer-dir", str(mine)]):
        served = cli._backend(cli.parse_args(args))
        cli._write_tokenizer(served, cli.parse_args(args).tokenizer_dir)
        assert (mine / "tokenizer.json").read_text() == "someone's own" and len(list(mine.iterdir())) == 1
        assert served.tokenizer_dir is not None and Path(served.tokenizer_dir).is_relative_to(tmp_path / "cache")
        assert f"{mine} holds files this server did not write" in capsys.readouterr().out
        command = guidellm.startup_command("http://h:1", served.model_name, served.tokenizer_dir, 128, 32)
        assert command[command.index("--tokenizer") + 1] == f"kind=hf_auto,model={served.tokenizer_dir}"
    served = cli._backend(cli.parse_args(["--served-model-name", "org/model"]))
    cli._write_tokenizer(served, None)
    assert not (tmp_path / "org").exists() and Path(served.tokenizer_dir).is_relative_to(tmp_path / "cache")
    (tmp_path / "a-file").write_text("")
    served = cli._backend(cli.parse_args(["--served-model-name", str(tmp_path / "a-file" / "tok")]))
    cli._write_tokenizer(served, None)  # cannot be made: a file is in the way
    assert Path(served.tokenizer_dir).is_relative_to(tmp_path / "cache")
    ours = tmp_path / "ours"
    for _ in range(2):  # written, then written again at the next start
        served = cli._backend(cli.parse_args(["--served-model-name", str(ours)]))
        cli._write_tokenizer(served, None)
        assert served.tokenizer_dir == str(ours) and (ours / "tokenizer.json").is_file()
    # a relative or ~ name works only where the server was started: the command names the folder itself
    for relative in ("./ours", "~/ours"):
        assert "--tokenizer" in guidellm.startup_command("http://h:1", relative, str(ours), 128, 32)


def test_the_server_goes_when_the_python_that_started_it_dies(tmp_path):
    """A notebook kernel killed outright runs no cleanup: --exit-with-parent stops the server anyway."""
    script = ("import os\nfrom labsupport.serve import ServerProcess\n"
              "s = ServerProcess(threads=1).start()\nprint(s.process.pid, flush=True)\nos._exit(1)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(pid, 9)
        pytest.fail("the orphaned server was still running 15 s after its parent died")


def test_a_failure_mid_stream_is_an_error_event_and_the_stream_still_ends():
    """After the 200 and the first chunks, a failure can only be told inside the stream: one
    ``data: {"error": ...}`` event, then ``[DONE]``; the openai client raises it as an APIError.
    The real FIFO back end, whose sampling fails at the second token of every request."""
    from labsupport.serve.app import create_app
    from labsupport.serve.fifo import FifoEngine

    class Failing(FifoEngine):
        def _choose(self, logits, generator, request, seen):
            if self._outputs[request.request_id].produced >= 1:
                raise RuntimeError("the model broke")
            return super()._choose(logits, generator, request, seen)

    backend = Failing(context_tokens=64, max_tokens_limit=8)
    app = create_app(backend)
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, "stream": True}

    async def drive():
        await backend.start()  # the ASGI transport runs no lifespan
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # as uvicorn: log, answer 500
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            streamed = await c.post("/v1/completions", json=body)
            whole = await c.post("/v1/completions", json={**body, "stream": False})
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport))
        with pytest.raises(openai.APIError, match="model broke"):
            async for _ in await client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, stream=True):
                pass
        await client.close()
        health = backend.stats()
        await backend.stop()
        return streamed, whole, health

    # a fresh thread: other tests in this worker may leave an event loop marked running in this one
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        streamed, whole, health = pool.submit(asyncio.run, drive()).result()
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["finish_reason"] is None
    assert json.loads(events[1])["error"]["type"] == "server_error" and "model broke" in events[1]
    assert whole.status_code == 500 and "model broke" in whole.json()["error"]["message"]
    assert whole.headers["x-request-id"].startswith("cmpl-")
    # each failure failed its own request only: the slots are free, and the worker is still alive
    assert health["slots_used"] == 0 and health["failed"] == 3 and backend.failure is None
    # /metrics counts the three failed requests as aborted by an error, none as a success
    metrics = app.state.metrics.render().decode()
    assert 'course:request_aborted_total{reason="error"} 3.0' in metrics
    assert "course:request_success_total{" not in metrics


# --- installing the server's packages where they are missing (a fresh Colab runtime) ---------------


def test_install_missing_installs_nothing_where_all_are_there(monkeypatch):
    from labsupport.serve import process

    monkeypatch.setattr(process.subprocess, "run", lambda *a, **k: pytest.fail("pip ran with nothing missing"))
    assert process.install_missing() == []


def test_install_missing_pins_torch_and_numpy_as_constraints(monkeypatch, capsys):
    from labsupport.serve import process

    seen = {}

    def fake_pip(command, **_):
        seen["command"] = command
        seen["constraints"] = open(command[command.index("-c") + 1]).read().split()
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(process.subprocess, "run", fake_pip)
    wanted = {"json": "json-is-there", "no_such_module_here": "no-such-package>=1"}
    assert process.install_missing(wanted) == ["no-such-package>=1"]
    assert seen["command"][:4] == [sys.executable, "-m", "pip", "install"] and seen["command"][-1] == "no-such-package>=1"
    import numpy
    import torch

    assert f"torch=={torch.__version__}" in seen["constraints"] and f"numpy=={numpy.__version__}" in seen["constraints"]
    assert "held as they are" in capsys.readouterr().out
    monkeypatch.setattr(process.subprocess, "run",
                        lambda command, **_: subprocess.CompletedProcess(command, 1, "", "no network"))
    with pytest.raises(RuntimeError, match="no network"):
        process.install_missing(wanted)


def test_server_packages_are_the_serve_extra_of_pyproject():
    import pathlib

    from labsupport.serve.process import SERVER_PACKAGES

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert sorted(pyproject["project"]["optional-dependencies"]["serve"]) == sorted(SERVER_PACKAGES.values())


def test_dropped_streams_free_their_slots_under_asgi_2_4():
    """From ASGI 2.4 on, Starlette stops listening for a streaming client's disconnect and learns
    of it only when a send fails, which a queued stream never tries: the server must notice
    itself. Served in-process by uvicorn, with the scope claiming spec 2.4."""

    import uvicorn

    from labsupport.serve.app import create_app
    from labsupport.serve.engine import FifoEngine

    # answers long enough that the running one cannot finish before it is dropped, on a loaded machine too
    app = create_app(FifoEngine(context_tokens=4096, max_requests=2, max_tokens_limit=4000))

    async def asgi_2_4(scope, receive, send):
        if scope["type"] == "http":
            scope = dict(scope, asgi={**scope.get("asgi", {}), "spec_version": "2.4"})
        await app(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(asgi_2_4, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.02)

        def health():
            return httpx.get(url + "/health").json()

        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4000, "stream": True}
        opened = []
        for _ in range(2):
            c = httpx.Client(base_url=url, timeout=30)
            opened.append((c, c.send(c.build_request("POST", "/v1/completions", json=body), stream=True)))
        lines = opened[0][1].iter_lines()
        next(line for line in lines if line)  # the first is generating, the second queued
        assert health()["slots_used"] == 2
        for c, r in reversed(opened):  # the queued one goes first, then the running one
            r.close()
            c.close()
        deadline = time.monotonic() + 30
        while health()["slots_used"] and time.monotonic() < deadline:
            time.sleep(0.05)
        final = health()
        assert final["slots_used"] == 0 and final["cancelled"] == 2 and final["served"] == 0
    finally:
        uv.should_exit = True
        thread.join(10)


def test_the_guidellm_table_reads_the_results_file_or_says_not_yet_measured(tmp_path):
    from labsupport.serve import guidellm

    assert "not yet measured" in guidellm.results_markdown(guidellm.load_results(tmp_path / "none.json"))
    stats = {"mean": 1.0, "p50": 2.0, "p90": 3.0}
    run = {"rate": 2.0, "ttft_ms": stats, "tpot_ms": stats, "e2e_ms": stats, "gap_cv": 1.02, "repeated_gap_share": 0.9,
           "server_ttft_ms_mean": 4.0, "server_itl_ms_mean": 5.0}
    results = {"runs": [{**run, "client": "bench_serving", "workers": None}, {**run, "client": "guidellm", "workers": 1}],
               "date": "2026-12-01 16:00 UTC", "machine": {"cores": 2, "platform": "Linux", "load_average_1min": 3.0},
               "versions": {"guidellm": "0.8.1", "python": "3.11", "torch": "2.13.0", "labsupport_commit": "abc"},
               "load": {"requests": 40, "output_tokens": 16, "prompt_tokens": 12},
               "server": {"command": ["python", "-m", "labsupport.serve"]}, "conventions": "times in ms"}
    table = guidellm.results_markdown(results)
    assert "| 2 requests/s | `bench_serving` | 2.0 | 3.0 | 2.00 | 2 | 4.0 | 5.00 | 1.02 | 90% |" in table
    assert "guidellm, 1 worker" in table and "2026-12-01" in table and "guidellm 0.8.1" in table
    command = guidellm.guidellm_command("guidellm", "http://h:1", "m", "/t", 2.0, 40, 12, 16)
    assert "kind=hf_auto,model=/t" in command and "kind=poisson,rate=2" in command
