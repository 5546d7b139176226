"""The course server with the real model (SmolLM2-135M-Instruct), started for real and driven as its
clients drive it (issue 34): a sampling setting the API accepts never fails a request or its
neighbours, the prompt ids and usage counts are what the tokenizer the server publishes (``root`` in
``/v1/models``) gives, special tokens stay out of the text, and big prompts neither stall ``/health``
nor get tokenised past what can fit. The model's conversion is cached by conftest's ``smollm2``
fixture (one load per test worker); each server reads that cache."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from labsupport.serve import ServerProcess

NAME = "smollm2-135m-instruct"
CONTEXT = 512
ENGINES = {
    "fifo": [],
    "continuous": ["--engine", "continuous", "--max-running", "4", "--num-blocks", "128"],
    "speculative": ["--engine", "continuous", "--max-running", "4", "--num-blocks", "128",
                    "--num-speculative-tokens", "3"],
    "fused": ["--engine", "continuous", "--max-running", "4", "--num-blocks", "128", "--cpu-decode", "fused"],
}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=list(ENGINES))
def server(request, smollm2):
    with ServerProcess(["--model", NAME, "--context", CONTEXT, *ENGINES[request.param]], threads=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def published(server):
    """The tokenizer the server publishes, loaded as a benchmark client loads it."""
    root = httpx.get(server.url + "/v1/models").json()["data"][0]["root"]
    return AutoTokenizer.from_pretrained(root)


def test_a_tiny_top_p_gives_the_argmax_and_a_greedy_stream_beside_it_keeps_its_text(client):
    """top_p 1e-300 and 1e-46 are inside (0, 1] but round to 0 in float32: they used to cut every
    token (a 500, "probability tensor contains inf/nan"), and on the continuous engine every request
    sharing the step failed too. Now they keep the most likely token: the answer is the greedy one,
    and a greedy stream running beside them gets the text it gets alone."""
    stream_prompt, prompt = "Write a short list of three fruits:", "The capital of France is"
    alone = client.completions.create(model=NAME, prompt=stream_prompt, max_tokens=40, temperature=0)
    greedy = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    first, pieces, errors = threading.Event(), [], []

    def stream():
        try:
            for chunk in client.completions.create(model=NAME, prompt=stream_prompt, max_tokens=40, temperature=0,
                                                   stream=True):
                pieces.append(chunk.choices[0].text)
                first.set()
        except Exception as exc:  # noqa: BLE001  (the assertion below says what went wrong)
            errors.append(exc)
            first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    first.wait(60)

    def tiny(top_p):
        try:
            return client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, top_p=top_p,
                                             seed=3).choices[0].text
        except openai.APIError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(tiny, (1e-300, 1e-46) * 2))
    thread.join(120)
    assert not errors, errors  # the neighbour first: it used to end with an error event halfway
    assert "".join(pieces) == alone.choices[0].text
    assert answers == [greedy] * 4


SHARED_PATHS = pytest.mark.parametrize("server", ["fifo", "continuous"], indirect=True)  # speculation adds nothing here


@SHARED_PATHS
def test_prompt_ids_and_usage_equal_the_published_tokenizers(client, published):
    """A text prompt gets no BOS the published tokenizer does not add; ids are the prompt as given;
    chat counts the template's own ids; and the answer to text equals the answer to its ids."""
    text = "The capital of France is"
    ids = published(text)["input_ids"]
    by_text = client.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    assert by_text.choices[0].text == by_ids.choices[0].text
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, temperature=0)
    assert chat.usage.prompt_tokens == len(published.apply_chat_template(CHAT, tokenize=True,
                                                                          add_generation_prompt=True)["input_ids"])
    full = client.completions.create(model=NAME, prompt=[ids[0]] * (CONTEXT - 1), max_tokens=1, temperature=0)
    assert full.usage.prompt_tokens == CONTEXT - 1 and full.usage.completion_tokens == 1  # 511 + 1 fit 512


@SHARED_PATHS
def test_special_tokens_are_skipped_unless_asked_for_streamed_and_whole_alike(client):
    """With ignore_eos the model writes past its <|im_end|> (guidellm sends ignore_eos): by default
    the special tokens add no text, streamed and whole alike; with skip_special_tokens false they are
    shown, and removing them gives the default text back."""
    ask = dict(model=NAME, messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True))
    assert whole == streamed and whole.startswith("The capital of France is Paris.")
    assert not any(s in whole for s in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")), whole
    shown = client.chat.completions.create(**{**ask, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}})
    shown = shown.choices[0].message.content
    assert "<|im_end|>" in shown
    assert shown.replace("<|im_end|>", "").replace("<|im_start|>", "").replace("<|endoftext|>", "") == whole


@pytest.fixture(scope="module")
def long_context_server(smollm2, tmp_path_factory):
    """A 4096-token context, served under a folder's path (``--served-model-name``), as guidellm needs."""
    name = str(tmp_path_factory.mktemp("served") / NAME)
    with ServerProcess(["--model", NAME, "--context", "4096", "--served-model-name", name], threads=1) as srv:
        srv.name = name
        yield srv


def test_served_under_a_path_guidellm_finds_the_tokenizer_by_the_name_and_counts_as_the_server(long_context_server):
    """guidellm loads its tokenizer by the model's name (``AutoTokenizer.from_pretrained(name)``) and never
    reads ``root``: served under a folder's path, the name is the tokenizer's folder, the command the server
    prints needs no ``--tokenizer``, and a prompt counts the same tokens on both sides."""
    srv, name = long_context_server, long_context_server.name
    card = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == name
    tokenizer = AutoTokenizer.from_pretrained(card["id"])  # what guidellm does with the name, offline
    text = "Benchmarks count tokens with the tokenizer the model's name points at. " * 4
    answer = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0).completions.create(
        model=name, prompt=text, max_tokens=2, temperature=0)
    assert answer.usage.prompt_tokens == len(tokenizer(text)["input_ids"])
    printed = next(line for line in srv.output if "guidellm run" in line)
    assert f"model={name}," in printed and "--tokenizer" not in printed and f"target={srv.url}" in printed


def test_health_answers_within_a_second_while_eight_maximal_prompts_and_eight_1mb_ones_arrive(long_context_server,
                                                                                              smollm2):
    """Every prompt longer than context x the longest token's bytes is refused before it is tokenised
    (400), and the longest that is tokenised is tokenised without holding Python's interpreter lock:
    /health keeps answering. (The real tokenizer used to have no byte bound, and its encode held the
    lock about two seconds per MB: /health took 2.4-4.3 s.)"""
    url = long_context_server.url
    models = httpx.get(url + "/v1/models").json()["data"][0]
    words = "the journey of a request through a server, "
    most = 4096 * smollm2.tokenizer.max_token_bytes  # the bound the server applies: longer is not tokenised
    maximal = (words * (most // len(words) + 1))[:most]
    huge = (words * (1_000_000 // len(words) + 1))[:1_000_000]
    assert models["context_length"] == 4096
    answers, worst, done = [], 0.0, threading.Event()

    def post(prompt):
        with httpx.Client(timeout=120) as c:
            answers.append(c.post(url + "/v1/completions", json={"model": long_context_server.name, "prompt": prompt,
                                                                  "max_tokens": 1}))

    def watch():
        nonlocal worst
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t = time.monotonic()
                assert c.get(url + "/health").status_code == 200
                worst = max(worst, time.monotonic() - t)
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(post, [maximal] * 8 + [huge] * 8))
    done.set()
    watcher.join()
    assert worst < 1.0, f"/health took {worst:.2f} s"
    assert [a.status_code for a in answers] == [400] * 16
    codes = {a.json()["error"]["code"] for a in answers}
    assert codes == {"context_length_exceeded"}
    assert sum("bytes of text" in a.json()["error"]["message"] for a in answers) == 8  # the 1 MB ones, untokenised
