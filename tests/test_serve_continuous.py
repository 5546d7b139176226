"""The course server with chapter 13's engine (``--engine continuous``), started for real in a
subprocess and driven with the ``openai`` client: concurrent streamed requests share engine steps,
each gets exactly the greedy tokens it gets alone (with speculative decoding too), and a client that
drops its stream frees its request's cache blocks."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from labsupport.serve import ServerProcess
from labsupport.serve.cli import parse_args
from labsupport.serve.served_model import course_model_config
from labsupport.tokenizer import course_tokenizer
from labsupport.transformer import Transformer

PROMPTS = [[5, 17, 99, 3], [250, 251] * 10, [42], list(range(60, 100))]
MAX_TOKENS = [24, 12, 30, 18]
MAX_DROPPED = 240  # long, so the client hangs up well before the request could finish


OPTIONS = ["--engine", "continuous", "--context", "384", "--max-tokens-limit", "240", "--num-blocks", "64",
           "--block-size", "8"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(OPTIONS, threads=1) as srv:
        yield srv


def _stream(client, prompt, max_tokens, out, i, barrier=None):
    if barrier is not None:
        barrier.wait()
    stream = client.completions.create(model="course-tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                       temperature=0)
    rid, pieces = None, []
    for chunk in stream:
        rid = chunk.id
        pieces.append(chunk.choices[0].text)
    out[i] = (rid, "".join(pieces))


def _sampled(timeline):
    return [e["token"] for e in timeline["events"] if e["stage"] == "sampled"]


def _steps(timeline):
    return {e["token"] for e in timeline["events"] if e["stage"] == "engine_step"}


def _alone(prompt, max_tokens, eot):
    """What Transformer.generate gives the prompt alone (greedy), cut after an end-of-text token."""
    tok = course_tokenizer()
    model = Transformer(course_model_config(tok.vocab_size), seed=0)
    ids = model.generate(torch.tensor([prompt]), max_tokens)[0, len(prompt):].tolist()
    return ids[:ids.index(eot) + 1] if eot in ids else ids


def test_the_default_engine_is_still_chapter_03s():
    assert parse_args([]).engine == "fifo"
    assert parse_args(["--engine", "continuous"]).engine == "continuous"
    with pytest.raises(SystemExit):
        parse_args(["--engine", "continuous", "--num-blocks", "2", "--block-size", "8"])  # 16 < 512 tokens


def test_concurrent_requests_share_steps_and_keep_their_greedy_tokens(server):
    _concurrent_requests_keep_their_greedy_tokens(server)


def test_speculative_decoding_keeps_the_greedy_tokens_and_counts_its_drafts():
    """``--num-speculative-tokens 4``: the same streamed greedy tokens, drafts counted on /metrics."""
    with ServerProcess([*OPTIONS, "--num-speculative-tokens", "4"], threads=1) as srv:
        _concurrent_requests_keep_their_greedy_tokens(srv)
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                   for s in f.samples}
    drafted = samples["course:spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and 0 <= samples["course:spec_decode_num_accepted_tokens_total"] <= drafted


def _concurrent_requests_keep_their_greedy_tokens(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    out = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))
    threads = [threading.Thread(target=_stream, args=(client, p, m, out, i, barrier))
               for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)  # generous: a loaded 2-core machine
    assert all(o is not None for o in out), "a streamed request did not finish"
    timelines = [server.timeline(rid) for rid, _ in out]
    assert all(tl["outcome"] == "completed" for tl in timelines)
    steps = [_steps(tl) for tl in timelines]
    # on a loaded machine one request may finish before the last arrives, so ask only that some
    # two of them shared a step (they start together behind a barrier and run for many steps)
    shared = [(i, j) for i in range(len(steps)) for j in range(i + 1, len(steps)) if steps[i] & steps[j]]
    assert shared, f"no two requests ever ran in the same step: {steps}"
    tok = course_tokenizer()
    eot = tok.end_of_text_id
    lengths = [len(_sampled(tl)) for tl in timelines]
    assert max(lengths) > 5, f"too few tokens to compare: {lengths}"
    for (prompt, max_tokens), tl, (_, text) in zip(zip(PROMPTS, MAX_TOKENS), timelines, out):
        got = _sampled(tl)
        expected = _alone(prompt, max_tokens, eot)
        assert got == expected, f"prompt {prompt[:4]}...: batched tokens differ from the tokens alone"
        assert text == tok.decode([t for t in got if t != eot])
    health = server.health()
    assert health["engine"] == "continuous" and health["slots_used"] == 0
    assert health["kv_blocks_free"] == health["kv_blocks_total"]


def test_a_dropped_stream_aborts_its_request_and_frees_its_blocks(server):
    body = {"model": "course-tiny", "prompt": list(range(1, 100)), "max_tokens": MAX_DROPPED, "stream": True,
            "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            rid = response.headers["x-request-id"]
            lines = response.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got == 2:
                    break
        # leaving the block closes the connection mid-stream (no health query before it: the
        # request could finish during that round trip on a loaded machine)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tl = server.timeline(rid)
        if tl["outcome"] != "in progress":
            break
        time.sleep(0.05)
    assert tl["outcome"].startswith("cancelled"), tl["outcome"]
    assert len(_sampled(tl)) < MAX_DROPPED
    health = server.health()
    assert health["kv_blocks_free"] == health["kv_blocks_total"] and health["slots_used"] == 0
    assert health["cancelled"] >= 1
