"""The engine of chapter 13: with greedy sampling every request gets exactly the tokens it gets
alone from ``Transformer.generate`` (fp32, CPU), whatever shares its batches, however its prompt
is chunked and however often it is preempted; and the bookkeeping around that."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labsupport.engine import Engine, Request, TraceRequest, poisson_trace, run_trace, trace_summary
from labsupport.engine import sampler as sampler_module
from labsupport.engine.model_runner import graph_batch_sizes, padded_batch_size
from labsupport.engine.sampler import BatchedSampler, RowSamplingError
from labsupport.engine.speculative import verify_drafts
from labsupport.models import get_model
from labsupport.phases import cpu_threads
from labsupport.sampling import SamplingParams, penalize_repetition, request_generator, sample, sampling_probs
from labsupport.scheduler import static_batch_step
from labsupport.transformer import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# the course's tiny shape with its own output head: with the head tied to the embeddings, a
# random model's greedy text repeats its last token, which would make the comparison weak
CFG = dataclasses.replace(get_model("tiny-2m"), tied_embeddings=False, name="tiny-2m-untied")


@pytest.fixture(scope="module")
def model():
    with cpu_threads(1):
        yield Transformer(CFG, seed=3)


@pytest.fixture(autouse=True)
def _one_thread():
    with cpu_threads(1):
        yield


def alone(model, prompt, n):
    return model.generate(torch.tensor([list(prompt)]), n)[0, len(prompt):].tolist()


def mixed_trace(vocab, n=9):
    gen = torch.Generator().manual_seed(11)
    lengths = [3, 29, 7, 41, 1, 18, 12, 35, 5, 22, 9]
    outputs = [6, 3, 9, 4, 7, 2, 8, 5, 6, 3, 7]
    arrivals = [0, 0, 1, 2, 2, 5, 6, 9, 12, 13, 15]
    return [TraceRequest(arrivals[i], tuple(torch.randint(0, vocab, (lengths[i],), generator=gen).tolist()),
                         SamplingParams(temperature=0.0, max_tokens=outputs[i])) for i in range(n)]


def test_greedy_tokens_equal_generate_alone_under_chunking_and_preemption(model):
    trace = mixed_trace(CFG.vocab_size)
    # a budget of 8 tokens chunks every long prompt; 14 blocks of 4 cannot hold everyone: preemption
    engine = Engine(model, num_blocks=14, block_size=4, token_budget=8, max_running=4, clock="steps")
    decide, generated_when_preempted = engine.scheduler.decide, []

    def recording(*args):
        scheduled, preempted = decide(*args)
        generated_when_preempted.extend(len(engine.requests[rid].output_ids) for rid in preempted)
        return scheduled, preempted

    engine.scheduler.decide = recording
    requests = run_trace(engine, trace)
    for t, r in zip(trace, requests):
        assert r.finish_reason == "length"
        assert r.output_ids == alone(model, t.prompt_ids, t.params.max_tokens), r.request_id
    assert sum(r.preemptions for r in requests) > 0  # the cache really ran out
    assert max(generated_when_preempted) > 0  # a victim had output tokens: the recompute covers them too
    assert any(s.prefill_tokens and s.decode_tokens for s in engine.steps)  # prefill chunks beside decodes
    assert max(s.prefill_tokens + s.decode_tokens for s in engine.steps) == 8  # the budget was used, not exceeded
    assert sum(s.sampled for s in engine.steps) == sum(len(r.output_ids) for r in requests)  # one row per token
    assert engine.allocator.num_free_blocks == 14  # every block came back
    engine.allocator.check_invariants()


def test_static_batching_gives_the_same_tokens_and_waits_longer(model):
    trace = mixed_trace(CFG.vocab_size, n=7)
    cont = run_trace(Engine(model, num_blocks=64, block_size=4, token_budget=16, max_running=4, clock="steps"), trace)
    static = run_trace(Engine(model, num_blocks=64, block_size=4, token_budget=None, max_running=4,
                              scheduler=static_batch_step, clock="steps"), trace)
    assert [r.output_ids for r in cont] == [r.output_ids for r in static]
    assert trace_summary(static)["ttft"].mean > trace_summary(cont)["ttft"].mean


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    prompt = list(range(5, 25))
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234, max_tokens=10)
    solo = Engine(model, num_blocks=32, block_size=8, clock="steps")
    rid = solo.add_request(prompt, params)
    list(solo.stream())
    busy = Engine(model, num_blocks=32, block_size=8, token_budget=12, clock="steps")
    for i in range(3):
        busy.add_request(list(range(i, i + 17)), SamplingParams(temperature=1.0, seed=i, max_tokens=12))
    rid2 = busy.add_request(prompt, params)
    list(busy.stream())
    assert busy.requests[rid2].output_ids == solo.requests[rid].output_ids
    other = Engine(model, num_blocks=32, block_size=8, clock="steps")
    rid3 = other.add_request(prompt, dataclasses.replace(params, seed=99))
    list(other.stream())
    assert other.requests[rid3].output_ids != solo.requests[rid].output_ids


def test_stop_tokens_timestamps_and_abort(model):
    prompt = [7, 8, 9, 10]
    first = alone(model, prompt, 10)
    stop = next(i for i in range(1, 10) if first[i] not in first[:i])  # the first new token after the first
    engine = Engine(model, num_blocks=16, block_size=4, clock="steps")
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first[stop]]))
    keep = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
    events = []
    while engine.requests[rid].finish_reason is None:
        events += engine.step()
    mine = [e for e in events if e.request_id == rid]
    assert [e.token_id for e in mine] == first[:stop + 1] and mine[-1].finish_reason == "stop"
    assert [e.index for e in mine] == list(range(stop + 1))
    assert engine.requests[rid].metrics()["ttft"] == 1.0  # arrived at 0, first token at the end of step 1
    assert engine.abort(keep) is True and engine.requests[keep].finish_reason == "abort"
    assert engine.abort(keep) is False
    assert not engine.has_unfinished() and engine.allocator.num_free_blocks == 16


def test_bad_input_and_bad_scheduler(model):
    engine = Engine(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="at most 16"):
        engine.add_request(list(range(16)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([CFG.vocab_size])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="clock"):
        Engine(model, clock="sundial")

    def greedy_scheduler(running, waiting, token_budget, free_blocks, block_size, max_running):
        return {s.request_id: s.left for s in list(running) + list(waiting)}, []

    bad = Engine(model, num_blocks=8, block_size=4, token_budget=4, scheduler=greedy_scheduler)
    bad.add_request(list(range(10)))
    with pytest.raises(ValueError, match="over the budget"):
        bad.step()
    idle = Engine(model, num_blocks=8, block_size=4, scheduler=lambda *args: ({}, []))
    idle.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="loop forever"):
        idle.step()


def test_poisson_trace_and_summary(model):
    trace = poisson_trace(5, rate=0.5, prompt_lens=[4, 8], output_lens=[2, 3], vocab_size=CFG.vocab_size, seed=1)
    assert [t.arrival_s for t in trace] == sorted(t.arrival_s for t in trace)
    assert trace == poisson_trace(5, 0.5, [4, 8], [2, 3], CFG.vocab_size, seed=1)
    reqs = run_trace(Engine(model, num_blocks=32, block_size=4, clock="virtual"), trace)
    summary = trace_summary(reqs)
    assert summary["output_tokens"] == sum(t.params.max_tokens for t in trace)
    assert summary["throughput"] > 0 and summary["ttft"].p50 > 0
    with pytest.raises(ValueError, match="virtual"):
        run_trace(Engine(model, num_blocks=8, block_size=4), trace)


def test_the_engine_follows_the_models_fields():
    # Qwen-style biases and q/k norms, another RoPE base and a RoPE scaling (linear, strong enough to
    # change short sequences), and the fields of other checkpoints: the engine's forward pass must
    # follow each of them as the model does
    # ones, a head width that is not d_model / n_heads, an output bias, tied embeddings
    cfg = dataclasses.replace(CFG, qkv_bias=True, o_bias=True, qk_norm=True, rope_theta=10000.0, head_dim=48,
                              tied_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 16.0},
                              name="tiny-2m-variant")
    model = Transformer(cfg, seed=4)
    trace = mixed_trace(cfg.vocab_size, n=5)
    requests = run_trace(Engine(model, num_blocks=32, block_size=4, token_budget=8, max_running=3, clock="steps"),
                         trace)
    for t, r in zip(trace, requests):
        assert r.output_ids == alone(model, t.prompt_ids, t.params.max_tokens)


def test_prefix_caching_reuses_blocks_keeps_the_tokens_and_counts_hits(model):
    """Requests sharing a 21-token prefix (five full 4-token blocks): later ones find it cached,
    compute only the rest and still get exactly their tokens alone; the last prompt token is
    always computed (its logits are needed), even when every block of the prompt is cached."""
    shared = list(range(40, 61))
    prompts = [shared + [1, 2, 3], shared[:20], shared + [9], shared + [1, 2, 3]]
    engine = Engine(model, num_blocks=40, block_size=4, token_budget=16, max_running=4, clock="steps")
    first = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=4))
    list(engine.stream())  # the first request's blocks are cached (hashed) once computed
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=4)) for p in prompts[1:]]
    list(engine.stream())
    for rid, p in zip([first, *ids], prompts):
        assert engine.requests[rid].output_ids == alone(model, p, 4), rid
    # the 20-token prompt is five cached blocks but reuses four; the repeated 24-token one five of six
    assert [engine.requests[i].cached_tokens for i in [first, *ids]] == [0, 16, 20, 20]
    stats = engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (sum(map(len, prompts)), 56)
    assert stats["prefix_cache_hit_rate"] == 56 / sum(map(len, prompts)) and stats["free_blocks"] == 40
    off = Engine(model, num_blocks=40, block_size=4, token_budget=16, clock="steps", prefix_caching=False)
    off.generate(prompts)
    assert off.stats()["prefix_cache_hits"] == 0
    engine.allocator.check_invariants()


def test_preempting_a_request_whose_prefix_blocks_are_shared_frees_only_its_own(model):
    """A decision counts a preempted request's blocks as given back; with prefix caching, the ones
    it shares with a request that keeps running free nothing. The decision below is valid by those
    counts (check_decision accepts it), but the blocks it spends are not there: the engine must
    notice, decide again on the real counts, and still give every request its tokens."""
    shared = list(range(40, 48))  # two full blocks of 4
    engine = Engine(model, num_blocks=6, block_size=4, token_budget=32, max_running=4, clock="steps")
    a = engine.add_request(shared + [1], SamplingParams(temperature=0, max_tokens=6))
    engine.step()  # a's prompt: blocks 0 and 1 are hashed
    d = engine.add_request(shared + [2], SamplingParams(temperature=0, max_tokens=3))
    engine.step()  # d finds the two blocks cached and holds one block of its own
    assert engine.requests[d].cached_tokens == 8 and engine.allocator.num_free_blocks == 2
    b = engine.add_request(list(range(60, 76)), SamplingParams(temperature=0, max_tokens=2))  # 16 tokens: 4 blocks
    rounds, decide = [], engine.scheduler.decide

    def greedy_for_b(running, waiting, budget, free, block_size, max_running):
        rounds.append((sorted(s.request_id for s in running), free))
        ids = {s.request_id for s in running}
        if d in ids and any(s.request_id == b for s in waiting):  # d's 3 blocks "back": 2 + 3 >= 4
            return {a: 1, b: 16}, [d]
        return decide(running, waiting, budget, free, block_size, max_running)

    engine.scheduler.decide = greedy_for_b
    record = engine.step()  # d gave back one block, not three: decided again, without admitting b
    assert rounds[-2:] == [([a, d], 2), ([a], 3)]
    assert engine.steps[-1].preempted == 1 and b not in {r.request_id for r in engine.running}
    engine.allocator.check_invariants()
    assert {ev.request_id for ev in record} == {a}
    for _ in engine.stream():
        pass
    assert engine.requests[a].output_ids == alone(model, shared + [1], 6)
    assert engine.requests[d].output_ids == alone(model, shared + [2], 3)
    assert engine.requests[b].output_ids == alone(model, list(range(60, 76)), 2)
    assert engine.allocator.num_free_blocks == 6
    engine.allocator.check_invariants()


def test_a_step_that_raises_fails_its_requests_and_leaves_no_unwritten_block_findable(model):
    """A forward pass that raises before writing the cache: the step's request ends with "error"
    and gives its blocks back, the request that did not run carries on, and a retry of the same
    prompt computes it again (the two blocks hashed when the failed step got its slots hold no
    keys) and gets the tokens it gets alone."""
    prompt = list(range(30, 39))  # two full blocks of 4, and one more token
    engine = Engine(model, num_blocks=16, block_size=4, token_budget=9, clock="steps")
    failed = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3))
    other = engine.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=3))  # over the budget: waits
    forward = engine.runner.forward

    def broken(meta):
        raise torch.cuda.OutOfMemoryError("no memory for the activations")

    engine.runner.forward = broken
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.step()
    engine.runner.forward = forward
    assert engine.requests[failed].finish_reason == "error" and not engine.requests[other].finished
    assert engine.allocator.num_free_blocks == 16
    engine.allocator.check_invariants()
    retry = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3))
    for _ in engine.stream():
        pass
    assert engine.requests[retry].cached_tokens == 0
    assert engine.requests[retry].output_ids == alone(model, prompt, 3)
    assert engine.requests[other].output_ids == alone(model, [3, 4, 5], 3)


def test_release_forgets_a_request_and_frees_a_running_ones_blocks(model):
    engine = Engine(model, num_blocks=16, block_size=4, clock="steps")
    done = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1))
    busy = engine.add_request(list(range(10)), SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.requests[done].finished and not engine.requests[busy].finished
    assert engine.allocator.num_free_blocks < 16  # the busy request holds blocks
    engine.release(done)
    engine.release(busy)  # not finished: aborted first, so its blocks come back
    assert done not in engine.requests and busy not in engine.requests
    assert engine.allocator.num_free_blocks == 16 and not engine.has_unfinished()
    engine.release(busy)  # twice, or never added: nothing to do
    engine.release("never added")


def test_the_batched_sampler_gives_each_request_the_tokens_of_sample_with_its_own_generator():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 97, generator=gen) * 3
    logits[5, :10] = logits[5, 0]  # ties, broken by token id
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.8][i % 4], top_k=[0, 5, 1, 200][i % 3 + (i % 2)],
                             top_p=[1.0, 0.9, 0.3, 1e-300][i // 4 % 4], seed=i) for i in range(40)]
    batched = BatchedSampler()(logits, params, [request_generator(p.seed) for p in params])
    one_by_one = [int(sample(logits[i:i + 1], p.temperature, p.top_k, p.top_p, generator=request_generator(p.seed))[0])
                  for i, p in enumerate(params)]
    assert batched == one_by_one


def test_min_p_and_repetition_penalties_batched_give_each_row_what_the_rule_gives_it_alone():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(36, 61, generator=gen) * 3
    histories = [torch.randint(0, 61, (i % 7,), generator=gen).tolist() for i in range(36)]
    params = [SamplingParams(temperature=[0.0, 0.6, 1.0, 1.7][i % 4], top_k=[0, 9, 3][i % 3], top_p=[1.0, 0.8][i % 2],
                             min_p=[0.0, 0.05, 0.3][(i // 2) % 3], repetition_penalty=[1.0, 1.3, 0.8, 2.0][(i // 3) % 4],
                             seed=i) for i in range(36)]
    batched = BatchedSampler()(logits, params, [request_generator(p.seed) for p in params], histories)
    one_by_one = []
    for i, p in enumerate(params):
        row = penalize_repetition(logits[i:i + 1], [histories[i]], [p.repetition_penalty])
        one_by_one.append(int(sample(row, p.temperature, p.top_k, p.top_p, generator=request_generator(p.seed),
                                     min_p=p.min_p)[0]))
    assert batched == one_by_one
    with pytest.raises(ValueError, match="histories"):
        BatchedSampler()(logits, params, [request_generator(p.seed) for p in params])


def test_the_repetition_penalty_comes_before_greedy_and_treats_signs_as_vllm_does():
    logits = torch.tensor([[4.0, 3.0, -1.0, -0.5]])
    out = penalize_repetition(logits, [[0, 2, 2]], [2.0])  # tokens 0 and 2 seen (a repeat counts once)
    assert out.tolist() == [[2.0, 3.0, -2.0, -0.5]]  # positive divided, negative multiplied, unseen kept
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert BatchedSampler()(logits, [greedy], [request_generator(0)], [[0]]) == [1]  # token 0 no longer wins
    assert BatchedSampler()(logits, [SamplingParams(temperature=0)], [request_generator(0)]) == [0]


def test_min_p_cuts_after_the_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.5, 1.0, 3.0):
        probs = torch.softmax(logits / temperature, dim=-1)[0]
        kept = (probs >= 0.2 * probs.max()).tolist()
        got = sampling_probs(logits, temperature, min_p=0.2)[0] > 0
        assert got.tolist() == kept, temperature
    # the cut on the raw logits would keep 2 at every temperature (ratios e^-1 and e^-2 to the best)
    assert [int((sampling_probs(logits, t, min_p=0.2)[0] > 0).sum()) for t in (0.5, 1.0, 3.0)] == [1, 2, 4]
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)


def test_the_engine_penalises_what_its_requests_have_seen(model):
    prompt = [5, 6, 7, 5, 6]
    engine = Engine(model, num_blocks=16, block_size=4, token_budget=16, clock="steps")
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.8))
    plain = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6))
    for _ in engine.stream():
        pass
    ids = list(prompt)
    for _ in range(6):  # the rule written out: greedy on penalised logits, the sequence so far seen
        logits = model.forward_no_cache(torch.tensor([ids]))[0]  # (V,), the last position
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[sorted(set(ids))] = True
        ids.append(int(torch.where(seen, torch.where(logits > 0, logits / 1.8, logits * 1.8), logits).argmax()))
    assert engine.requests[rid].output_ids == ids[len(prompt):]
    assert engine.requests[plain].output_ids == alone(model, prompt, 6)
    assert engine.requests[rid].output_ids != engine.requests[plain].output_ids  # the penalty changed something


def test_an_engine_with_a_learners_sample_refuses_min_p_when_the_request_is_added(model):
    def learner_sample(logits, temperature, top_k, top_p, generator=None):
        return sample(logits, temperature, top_k, top_p, generator=generator)

    engine = Engine(model, num_blocks=16, block_size=4, token_budget=16, clock="steps", sampler=learner_sample)
    with pytest.raises(ValueError, match="takes no min_p"):
        engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, min_p=0.1))
    greedy = engine.add_request([1, 2, 3], SamplingParams(temperature=0, min_p=0.1, max_tokens=3))  # no effect: kept
    for _ in engine.stream():
        pass
    assert engine.requests[greedy].output_ids == alone(model, [1, 2, 3], 3)
    with pytest.raises(ValueError, match="from 0.01 to 100"):
        SamplingParams(repetition_penalty=1e39)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        penalize_repetition(torch.zeros(1, 5), [[-1]], [1.5])


def test_the_gpu_path_runs_in_the_interpreter_and_gives_the_same_tokens(model):
    """attention="triton": the slot-write kernel, the mixed-batch kernel with its query tiles, and
    split-KV decode, on the engine's strided tensors (what a GPU runs, small)."""
    engine = Engine(model, num_blocks=16, block_size=4, token_budget=16, clock="steps", attention="triton")
    a = engine.add_request([5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=3))
    engine.step()  # a's prompt: the prefill kernel
    b = engine.add_request([11, 12, 13, 14, 15], SamplingParams(temperature=0, max_tokens=2))
    engine.step()  # a decodes beside b's prompt: one mixed batch
    engine.step()  # both decode: split-KV
    assert [s.decode_tokens for s in engine.steps] == [0, 1, 2]
    assert engine.requests[a].output_ids == alone(model, [5, 6, 7, 8, 9, 10], 3)
    assert engine.requests[b].output_ids == alone(model, [11, 12, 13, 14, 15], 2)


def test_decode_graph_padding_on_the_cpu(model):
    """What a captured decode graph records, run eagerly: a batch of 3 decodes copied into the
    static buffers of size 4 (the padded row writes nothing and reads nothing) gives the eager
    step's hidden states."""
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 48] and graph_batch_sizes(3) == [1, 2, 3]
    assert padded_batch_size(3, [1, 2, 4, 8]) == 4 and padded_batch_size(9, [1, 2, 4, 8]) is None
    engine = Engine(model, num_blocks=32, block_size=4, clock="steps")
    for p in ([1, 2, 3], list(range(4, 13)), [20, 21]):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=5))
    engine.step()  # the prompts; the next step decodes all three
    runner = engine.runner
    batch = engine.scheduler.schedule().seqs
    meta = runner.prepare(batch)
    assert meta.decode_only and meta.seq_lens.tolist() == [4, 10, 3]
    k_before = runner.store.k.clone()
    eager = runner.forward(meta)  # (3, d)
    runner.store.k.copy_(k_before)  # the same step again, through the graph's buffers
    runner._make_graph_vars(8)
    runner.fill_graph_inputs(meta, 4)
    runner.graph_body(4)
    g = runner._graph_vars
    assert g["slot_mapping"][3] == -1 and g["seq_lens"][3] == 0
    torch.testing.assert_close(g["hidden"][:3], eager, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(g["hidden"][:4]).all() and torch.isfinite(runner.store.k).all()


def test_fused_projections_change_nothing_but_rounding(model):
    fused = Transformer(CFG, seed=3).fuse_projections()
    assert fused.layers[0].attention.wq is None and fused.layers[0].feed_forward.w13 is not None
    assert fused.param_count() == model.param_count()
    prompt = model.random_prompt(2, 9, seed=4)
    torch.testing.assert_close(fused.forward_no_cache(prompt), model.forward_no_cache(prompt), atol=1e-5, rtol=1e-5)
    trace = mixed_trace(CFG.vocab_size, n=4)
    requests = run_trace(Engine(fused, num_blocks=32, block_size=4, token_budget=8, clock="steps"), trace)
    for t, r in zip(trace, requests):
        assert r.output_ids == alone(model, t.prompt_ids, t.params.max_tokens)



def test_a_requests_token_ids_are_slices_of_all_its_ids():
    req = Request(0, [1, 2, 3], SamplingParams(), 0.0, torch.Generator())
    req.output_ids += [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids(start, end) == req.all_ids[start:end], (start, end)


def test_a_row_whose_sampling_fails_fails_its_request_alone(model, monkeypatch):
    """The sampling stage fails per row: a request whose probabilities are not a distribution (a
    fault planted in its row only) ends with "error" and the reason, gives its blocks back, and the
    requests sharing its steps keep exactly their tokens (greedy, and seeded sampling too)."""
    real = sampler_module.batched_sampling_probs

    def nan_for_temperature_0_7(logits, temperature, *rest):
        probs = real(logits, temperature, *rest)
        return probs.masked_fill((temperature == 0.7)[:, None], float("nan"))

    seeded = SamplingParams(temperature=1.0, seed=4, max_tokens=5)
    want_seeded = Engine(model, num_blocks=16, block_size=4, clock="steps").generate([[9, 8, 7]], seeded)[0]
    monkeypatch.setattr(sampler_module, "batched_sampling_probs", nan_for_temperature_0_7)
    engine = Engine(model, num_blocks=16, block_size=4, token_budget=16, clock="steps")
    greedy = engine.add_request([3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=6))
    bad = engine.add_request([1, 2, 3], SamplingParams(temperature=0.7, top_p=1e-300, max_tokens=6))
    other = engine.add_request([9, 8, 7], seeded)
    events = list(engine.stream())
    assert engine.requests[bad].finish_reason == "error" and engine.requests[bad].output_ids == []
    assert "sampling failed for this request" in engine.requests[bad].error and "top_p=1e-300" in engine.requests[bad].error
    assert not [e for e in events if e.request_id == bad]
    assert engine.requests[greedy].output_ids == alone(model, [3, 4, 5, 6], 6)
    assert engine.requests[other].output_ids == want_seeded
    assert engine.allocator.num_free_blocks == 16


def test_the_draft_verifier_fails_a_request_whose_rows_cannot_be_drawn_alone():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(3))
    logits[2:4] = float("nan")  # the second request's rows: its draft token's and the one after
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0)]
    out = verify_drafts(logits, params, [request_generator(i) for i in range(3)], [[int(logits[0].argmax())], [4], []])
    assert out[0] == [int(logits[0].argmax()), int(logits[1].argmax())]  # the greedy draft accepted, then the bonus
    assert isinstance(out[1], RowSamplingError) and "sampling failed" in str(out[1])
    assert isinstance(out[2], list) and len(out[2]) == 1
