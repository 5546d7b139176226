"""The engine-side slots of the learner's stack (issue 31): lab 10's block allocator serving as the
engine's block pool, lab 10's prefix cache checked by replay, lab 13's speculative acceptance verifying
the engine's drafts; and one planted mistake for every slot, all in one assembly.

Cost: one assembly of all twelve labs with a planted mistake in every slot (each check fails on its
first wrong answer), one assembly of labs 01, 10, 12 and 13 for the server, one started server with
the real model, and a few steps of the course model in this process."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from testhelpers import copy_solutions, plant_part
from transformers import AutoTokenizer

from labsupport.course import stack as course_stack
from labsupport.engine import Engine
from labsupport.engine.speculative import verify_drafts
from labsupport.sampling import SamplingParams
from labsupport.serve import ServerProcess
from labsupport.serve.continuous import ContinuousBackend
from labsupport.serve.stack import PartFailed, load_parts, plug_in
from labsupport.serve.stack_engine import LearnerVerifier
from labsupport.stack import BY_NAME, SLOTS, labs

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a fruit."}]
LONG = "Write a long story about a cat. " * 20  # its sequence reaches the planted allocator's breaking length

# One planted mistake per slot: (kind, name, the code that replaces it, built on the solution renamed
# _solution_<name>). Each is a mistake a learner could make; each fails its check on an early case.
MISTAKES = {
    "stop_strings": ("class", "StopStringFilter", '''
class StopStringFilter(_solution_StopStringFilter):
    def push(self, text):  # planted: never looks for a stop string
        return text, False
'''),
    "detokenizer": ("class", "StreamDetokenizer", '''
class StreamDetokenizer(_solution_StreamDetokenizer):
    def push(self, token_id):  # planted: decodes each token's bytes alone, splitting multi-byte characters
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
'''),
    "weight_names": ("def", "course_state_dict", '''
def course_state_dict(hf_state, cfg):  # planted: the first tensor is lost
    out = dict(_solution_course_state_dict(hf_state, cfg))
    out.pop(next(iter(out)))
    return out
'''),
    "sse_client": ("def", "stream_events", '''
def stream_events(client, url, payload):  # planted: the last event before [DONE] is dropped
    yield from list(_solution_stream_events(client, url, payload))[:-1]
'''),
    "latency_metrics": ("def", "latency_metrics", '''
def latency_metrics(sent_s, token_times_s):  # planted: TTFT from the first token, not from the send
    out = _solution_latency_metrics(sent_s, token_times_s)
    out["ttft"] = out["ttft"] + sent_s - token_times_s[0] + 0.5
    return out
'''),
    "kv_bytes_per_token": ("def", "kv_bytes_per_token", '''
def kv_bytes_per_token(cfg, dtype_bytes=2):  # planted: keys only, no values
    return _solution_kv_bytes_per_token(cfg, dtype_bytes) // 2
'''),
    "flash_attention": ("def", "flash_attention", '''
def flash_attention(q, k, v, causal=False):  # planted: the scores scaled by 2 / sqrt(D)
    return _solution_flash_attention(q * 2, k, v, causal)
'''),
    "rope": ("def", "apply_rope", '''
def apply_rope(x, positions, theta, layout):  # planted: positions counted from 1
    return _solution_apply_rope(x, positions + 1, theta, layout)
'''),
    "fused_rope": ("def", "fused_rope", '''
def fused_rope(q, k, positions, inv_freq):  # planted: positions counted from 1
    return _solution_fused_rope(q, k, positions + 1, inv_freq)
'''),
    "dequantize_q8_0": ("def", "dequantize_q8_0", '''
def dequantize_q8_0(raw):  # planted: the scale applied twice
    return _solution_dequantize_q8_0(raw) * 2
'''),
    "dequantize_q4_1": ("def", "dequantize_q4_1", '''
def dequantize_q4_1(raw):  # planted: the minimum left out (every weight shifted)
    return _solution_dequantize_q4_1(raw) + 1
'''),
    "block_allocator": ("class", "BlockAllocator", '''
class BlockAllocator(_solution_BlockAllocator):
    def free(self, seq_id):  # planted: the sequence is forgotten, its blocks never go back
        del self.tables[seq_id], self.lengths[seq_id]
'''),
    "prefix_cache": ("class", "PrefixCachingAllocator", '''
class PrefixCachingAllocator(_solution_PrefixCachingAllocator):
    def cached_tokens(self, seq_id):  # planted: the hits are never reported
        return 0
'''),
    "paged_attention": ("def", "paged_attention", '''
def paged_attention(q, k_cache, v_cache, block_tables, seq_lens):  # planted: the last key masked out
    return _solution_paged_attention(q, k_cache, v_cache, block_tables, (seq_lens - 1).clamp(min=1))
'''),
    "ring_all_reduce": ("def", "ring_all_reduce", '''
def ring_all_reduce(x):  # planted: the mean, not the sum
    return _solution_ring_all_reduce(x) / dist.get_world_size()
'''),
    "shard_layer": ("def", "shard_layer", '''
def shard_layer(layer, rank, world_size):  # planted: each rank takes its neighbour's shard
    return _solution_shard_layer(layer, (rank + 1) % world_size, world_size)
'''),
    "tp_layer_forward": ("def", "tp_layer_forward", '''
def tp_layer_forward(shards, x, cos, sin, cfg):  # planted: the residual added twice
    return _solution_tp_layer_forward(shards, x, cos, sin, cfg) + x
'''),
    "kv_capacity": ("def", "kv_capacity", '''
def kv_capacity(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16,
                kv_dtype_bytes=2, weight_dtype_bytes=2, reserve_gib=0.0):  # planted: the weights not subtracted
    return _solution_kv_capacity(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization, block_size,
                                 kv_dtype_bytes, 0, reserve_gib)
'''),
    "prepare_step": ("def", "prepare_step", '''
def prepare_step(seqs, block_size):  # planted: slots computed with twice the block size
    return _solution_prepare_step(seqs, block_size * 2)
'''),
    "scheduler": ("def", "schedule_step", '''
def schedule_step(running, waiting, token_budget, free_blocks, block_size, max_running):  # planted: no budget
    return _solution_schedule_step(running, waiting, 10**9, free_blocks, block_size, max_running)
'''),
    "sampler": ("def", "sample", '''
def sample(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):  # planted: temperature ignored
    return _solution_sample(logits, 1.0 if temperature else 0, top_k, top_p, generator)
'''),
    "speculative_accept": ("def", "speculative_accept", '''
def speculative_accept(draft_tokens, draft_probs, target_probs, generator=None):  # planted: accepts every draft
    bonus = torch.multinomial(target_probs[-1], 1, generator=generator)
    return torch.cat([draft_tokens.long(), bonus])
'''),
    "poisson_arrivals": ("def", "poisson_arrivals", '''
def poisson_arrivals(n, rate, rng):  # planted: half the rate
    return [2 * t for t in _solution_poisson_arrivals(n, rate, rng)]
'''),
    "open_loop": ("def", "open_loop", '''
def open_loop(times_s, send):  # planted: closed loop, one request after the other, times ignored
    return [send(i) for i in range(len(times_s))]
'''),
    "histogram_quantile": ("def", "histogram_quantile_between", '''
def histogram_quantile_between(q, before, after):  # planted: the counts before are not subtracted
    return _solution_histogram_quantile_between(q, {le: 0 for le in before}, after)
'''),
    "slo_report": ("def", "slo_report", '''
def slo_report(requests, slo, duration_s):  # planted: goodput over twice the duration
    return _solution_slo_report(requests, slo, 2 * duration_s)
'''),
}

# lab 10's allocator that passes its check but raises once a sequence in a pool of 64 blocks or more
# reaches 120 tokens (the check's pools are smaller): it serves until a long prompt arrives
RAISING_ALLOCATOR = '''
class BlockAllocator(_solution_BlockAllocator):
    def append_token(self, seq_id):
        if len(self.refs) >= 64 and self.lengths[seq_id] >= 120:
            raise MemoryError("planted: this allocator breaks at 120 tokens")
        return super().append_token(seq_id)
'''
FAILS_FAST = '''
def paged_attention(q, k_cache, v_cache, block_tables, seq_lens):  # not wired: fails its check at once
    raise RuntimeError("planted: not written yet")
'''
SERVER_LABS = ("01_tokens", "10_cache_ops", "12_engines", "13_decode_loop")
SERVER = ["--model", NAME, "--context", 256, "--engine", "continuous", "--max-running", 4, "--num-blocks", 64,
          "--num-speculative-tokens", 3]


def test_a_planted_mistake_in_every_slot_fails_its_check_and_the_course_part_takes_each_slot(tmp_path):
    assert set(MISTAKES) == set(BY_NAME)  # every slot of the 26 has its mistake
    labs_dir = copy_solutions(tmp_path / "labs", labs())
    for slot, (kind, name, code) in MISTAKES.items():
        plant_part(labs_dir, BY_NAME[slot].lab, kind, name, code)
    assembly = course_stack.assemble(labs_dir, tmp_path / "cache")
    assert [r.slot for r in assembly.rows] == [s.name for lab in labs() for s in SLOTS if s.lab == lab]
    wrong = {r.slot: (r.source, r.check, r.message[:200]) for r in assembly.rows
             if (r.source, r.check) != ("course", "failed")}
    assert not wrong, wrong  # each failed its own check, none raised on import or was not found
    assert all(r.message and "the lab's cells raised" not in r.message for r in assembly.rows), assembly.table()
    assert json.loads((tmp_path / "cache" / course_stack.MANIFEST_NAME).read_text())["parts"] == {}
    assert assembly.checks_run == len(SLOTS)


@pytest.fixture(scope="module")
def server_labs(tmp_path_factory):
    """Labs 01, 10, 12 and 13 solved, with lab 10's allocator raising at 120 tokens in a large pool,
    assembled into a cache (the server's own assembly then runs no check)."""
    root = tmp_path_factory.mktemp("stack-engine")
    labs_dir = copy_solutions(root / "labs", SERVER_LABS)
    plant_part(labs_dir, "10_cache_ops", "class", "BlockAllocator", RAISING_ALLOCATOR)
    plant_part(labs_dir, "10_cache_ops", "def", "paged_attention", FAILS_FAST)
    assembly = course_stack.assemble(labs_dir, root / "cache")
    return labs_dir, root / "cache", assembly


def test_the_server_labs_assemble_with_the_engine_side_parts_as_the_learners(server_labs):
    _, _, assembly = server_labs
    for slot in ("block_allocator", "prefix_cache", "speculative_accept", "sampler", "prepare_step"):
        assert assembly.row(slot).source == "learner", assembly.table()
    assert assembly.row("paged_attention").check == "failed"
    assert assembly.row("block_allocator").serves and assembly.row("speculative_accept").serves
    assert not assembly.row("prefix_cache").serves and assembly.row("prefix_cache").mode == "checked"


def _greedy(smollm2, ids, n) -> str:
    """The course stack's greedy text: the course's engine, no speculation, stopping where the server does."""
    engine = Engine(smollm2.model, num_blocks=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=n, stop_token_ids=smollm2.tokenizer.eos_token_ids)
    return smollm2.tokenizer.decode(engine.generate([list(ids)], params)[0], skip_special_tokens=True)


@pytest.fixture(scope="module")
def stack_server(server_labs, smollm2, tmp_path_factory):
    labs_dir, cache, _ = server_labs
    name = str(tmp_path_factory.mktemp("served") / NAME)  # served under a path, as guidellm needs
    with ServerProcess([*SERVER, "--served-model-name", name, "--stack", labs_dir, "--stack-cache", cache],
                       threads=1) as srv:
        srv.name = name
        yield srv


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def test_a_stack_server_with_speculation_answers_openai_with_the_course_stacks_greedy_text(stack_server, smollm2):
    srv, tok = stack_server, smollm2.tokenizer
    said = "".join(srv.output)
    assert "Your stack's parts serve: " in said
    serving = said.split("Your stack's parts serve: ")[1].split(".")[0].split(", ")
    assert {"block_allocator", "speculative_accept", "prepare_step", "scheduler"} <= set(serving)
    assert "sampler" not in serving and "your sampler (speculative decoding" in said  # left out, with the reason
    assert "Prefix caching is off: your block_allocator" in said
    client = _client(srv)
    text = client.completions.create(model=srv.name, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    assert text == _greedy(smollm2, tok.encode_prompt(PROMPT), 10)
    chat_expected = _greedy(smollm2, tok.apply_chat_template(CHAT, add_generation_prompt=True), 16)
    whole = client.chat.completions.create(model=srv.name, messages=CHAT, max_tokens=16, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=srv.name, messages=CHAT, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert whole.choices[0].message.content == streamed == chat_expected and streamed
    health = httpx.get(srv.url + "/health").json()
    assert health["spec_draft_tokens"] > 0  # the drafts were verified by the learner's rule
    replay = health["stack_prefix_cache"]
    assert replay["status"] == "agrees" and replay["admissions"] >= 3 and replay["disagreed"] == 0, replay
    metrics = httpx.get(srv.url + "/metrics").text
    assert f'course:stack_prefix_cache_admissions_total{{result="agreed"}} {float(replay["agreed"])}' in metrics


def test_guidellm_talks_to_the_stack_server(stack_server):
    """What guidellm does against a server (as tests/test_serve_real_model.py checks it; guidellm itself
    is not installed with the course): its tokenizer by the served name counts the prompt as the
    server does, its streamed completions request with ignore_eos and usage is answered in full, and
    the command the server prints needs no --tokenizer."""
    srv = stack_server
    tokenizer = AutoTokenizer.from_pretrained(srv.name)
    text = "Benchmarks count tokens with the tokenizer the model's name points at. " * 3
    body = {"model": srv.name, "prompt": text, "max_tokens": 12, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == len(tokenizer(text)["input_ids"]) and usage["completion_tokens"] == 12
    printed = next(line for line in srv.output if "guidellm run" in line)
    assert f"model={srv.name}," in printed and "--tokenizer" not in printed


def test_a_raising_allocator_fails_only_its_steps_requests_and_the_server_keeps_serving(stack_server, smollm2):
    srv = stack_server
    client = _client(srv)
    with pytest.raises(openai.APIError) as failed:
        client.completions.create(model=srv.name, prompt=LONG, max_tokens=4, temperature=0)
    said = str(failed.value)  # the slot, the learner's module file and line, and their exception
    assert "your block_allocator part (lab 10" in said and "lab10_cache_ops_" in said
    assert 'raise MemoryError("planted' in said
    expected = _greedy(smollm2, smollm2.tokenizer.encode_prompt(PROMPT), 10)
    again = client.completions.create(model=srv.name, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    assert again == expected  # the server goes on, with the learner's allocator
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "ok" and health["kv_blocks_free"] == 64  # the failed request's blocks came back


@pytest.fixture(scope="module")
def solved_parts(server_labs):
    _, cache, _ = server_labs
    return load_parts(cache / course_stack.MANIFEST_NAME)


def _shared_prefix_requests(engine):
    system = list(range(5, 45))  # two and a half blocks shared by every prompt
    for i in range(3):
        engine.generate([system + [50 + i, 60, 70]], SamplingParams(temperature=0, max_tokens=6))


def test_the_prefix_cache_replay_agrees_with_the_engine_and_catches_a_cache_that_finds_nothing(solved_parts):
    cls, file = solved_parts["prefix_cache"]
    backend = ContinuousBackend(num_blocks=32, max_running=4, context_tokens=128)  # the course model
    assert plug_in(backend, {"prefix_cache": (cls, file)}) == ["prefix_cache"]
    _shared_prefix_requests(backend.engine)
    report = backend.stats()["stack_prefix_cache"]
    assert report["status"] == "agrees" and report["admissions"] == 3, report
    assert report["hit_tokens_yours"] == report["hit_tokens_engine"] == 2 * 32  # two later prompts, two blocks each

    class FindsNothing(cls):  # passes no check: its hits are never reported
        def cached_tokens(self, seq_id):
            return 0

    backend = ContinuousBackend(num_blocks=32, max_running=4, context_tokens=128)
    plug_in(backend, {"prefix_cache": (FindsNothing, file)})
    _shared_prefix_requests(backend.engine)
    report = backend.stats()["stack_prefix_cache"]
    assert report["status"] == "disagrees" and report["disagreed"] == report["yours_wrong"] == 2, report
    assert "your prefix cache found 0 cached, the course's on the same replay 32, the engine 32" in \
        report["last_disagreement"]

    class Raises(cls):  # a checked part that raises stops the replay; the requests never notice
        def allocate(self, seq_id, token_ids):
            raise KeyError("planted")

    backend = ContinuousBackend(num_blocks=32, max_running=4, context_tokens=128)
    plug_in(backend, {"prefix_cache": (Raises, file)})
    _shared_prefix_requests(backend.engine)
    report = backend.stats()["stack_prefix_cache"]
    assert report["status"] == "stopped" and report["admissions"] == 0, report
    assert report["stopped"].startswith("your prefix_cache part (lab 10, PrefixCachingAllocator) raised KeyError")
    assert "the replay stopped, the requests go on" in report["stopped"]
    assert backend.engine.stats()["prefix_cache_hits"] == 2 * 32  # the engine served on, its own cache hitting


def test_the_learners_acceptance_rule_gives_the_engines_greedy_tokens_and_a_wrong_return_names_its_slot(
        solved_parts):
    fn, file = solved_parts["speculative_accept"]
    verify = LearnerVerifier(BY_NAME["speculative_accept"], fn, file)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        drafts = [torch.randint(0, 6, (k,), generator=g).tolist() for k in (3, 0, 2, 1)]
        logits = torch.randn(sum(len(d) + 1 for d in drafts), 6, generator=g) * 3
        params = [SamplingParams(temperature=0)] * len(drafts)
        gens = [torch.Generator().manual_seed(trial) for _ in drafts]
        assert verify(logits, params, gens, drafts) == verify_drafts(logits, params, gens, drafts)

    def keeps_a_rejected_draft(draft_tokens, draft_probs, target_probs, generator=None):
        return torch.cat([draft_tokens, draft_tokens])

    wrong = LearnerVerifier(BY_NAME["speculative_accept"], keeps_a_rejected_draft, file)
    with pytest.raises(PartFailed, match=r"your speculative_accept part \(lab 13, speculative_accept\) returned"):
        wrong(torch.randn(3, 6), [SamplingParams(temperature=0)], [torch.Generator()], [[1, 2]])
