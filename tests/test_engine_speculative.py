"""Speculative decoding inside the engine (labsupport.engine.speculative): n-gram drafts verified in
the step's forward pass, the rejected ones rolled back from the paged cache. With greedy sampling
every request still gets exactly the tokens ``Transformer.generate`` gives it alone; a sampled one
gets tokens from the same distribution (the rejection rule, checked by counting)."""

from __future__ import annotations

import pytest
import torch
from test_engine import CFG, alone  # the engine tests' untied tiny model and their reference: generate alone

from labsupport.drafts import greedy_speculative, ngram_proposal
from labsupport.engine import Engine, SpeculativeConfig, TraceRequest, run_trace
from labsupport.engine.sampler import RowSamplingError
from labsupport.engine.speculative import accepted_greedy, draft_room, verify_drafts
from labsupport.paged_cache import BlockAllocator
from labsupport.phases import cpu_threads
from labsupport.sampling import SamplingParams, sample
from labsupport.transformer import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def model():
    with cpu_threads(1):
        yield Transformer(CFG, seed=3)


@pytest.fixture(autouse=True)
def _one_thread():
    with cpu_threads(1):
        yield


def repetitive_trace(vocab, n=8, seed=5):
    """Prompts that repeat a phrase, so prompt lookup finds matches; arrivals staggered so prefill
    chunks share steps with speculative decodes."""
    gen = torch.Generator().manual_seed(seed)
    trace = []
    for i in range(n):
        phrase = torch.randint(0, vocab, (3 + i % 4,), generator=gen).tolist()
        prompt = phrase * (2 + i % 3) + torch.randint(0, vocab, (i % 5,), generator=gen).tolist()
        trace.append(TraceRequest(i // 2, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=10 + 3 * (i % 4))))
    return trace


class CheckedEngine(Engine):
    """An engine that checks the allocator's bookkeeping after every step."""

    def step(self):
        events = super().step()
        self.allocator.check_invariants()
        for req in self.running:  # what the cache holds is exactly the computed tokens
            assert self.allocator.seq_len(req.request_id) == req.num_computed, req.request_id
        return events


@pytest.mark.parametrize("budget, blocks", [(12, 20), (5, 64)])
def test_greedy_speculation_gives_generates_tokens_with_drafts_accepted_and_rejected(model, budget, blocks):
    trace = repetitive_trace(CFG.vocab_size)
    # 4-token blocks; a budget of 12 and 20 blocks: chunked prompts, preemption, drafts crossing blocks;
    # a budget of 5: drafts the decision cuts short (four decoding requests cannot all run 1 + 4)
    engine = CheckedEngine(model, num_blocks=blocks, block_size=4, token_budget=budget, max_running=4,
                           clock="steps", speculative=SPEC)
    requests = run_trace(engine, trace)
    for t, r in zip(trace, requests):
        assert r.output_ids == alone(model, t.prompt_ids, t.params.max_tokens), r.request_id
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0  # some drafts were right ...
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]  # ... and some were rolled back
    assert sum(s.sampled + s.accepted_tokens for s in engine.steps) == sum(len(r.output_ids) for r in requests)
    assert any(s.accepted_tokens >= 2 for s in engine.steps)  # a step emitted several tokens for one request
    assert any(s.prefill_tokens and s.draft_tokens for s in engine.steps)  # drafts beside prefill chunks
    assert max(s.prefill_tokens + s.decode_tokens + s.draft_tokens for s in engine.steps) <= budget
    assert engine.allocator.num_free_blocks == blocks
    if budget == 12:  # fewer forward passes for the same tokens (under a budget of 5, drafts delay prefills)
        plain = Engine(model, num_blocks=blocks, block_size=4, token_budget=budget, max_running=4, clock="steps")
        run_trace(plain, trace)
        assert len(engine.steps) < len(plain.steps)


def test_acceptance_is_prompt_lookups_as_one_sequence_decodes_it(model):
    """The engine's passes for one request emit what drafts.greedy_speculative emits with the same
    proposer (while no cap by max_tokens applies)."""
    prompt = [5, 9, 2, 7] * 4 + [5, 9]
    n, k = 24, 3
    engine = Engine(model, num_blocks=32, block_size=4, token_budget=64, max_running=2, clock="steps",
                    speculative=SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=2))
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n))
    per_step = [len(events) for events in iter(engine.step, []) if events]
    ref = greedy_speculative(model, prompt, n, k, lambda s, kk: ngram_proposal(s, kk, 1, 2))
    assert engine.requests[rid].output_ids == ref["tokens"]
    uncapped = 0
    while uncapped < len(ref["emitted"]) and sum(ref["emitted"][:uncapped + 1]) + k + 1 <= n:
        uncapped += 1
    assert uncapped >= 3
    assert per_step[:uncapped] == ref["emitted"][:uncapped]


def test_a_stop_token_inside_the_accepted_draft_ends_the_request_there(model):
    prompt = [3, 8, 1] * 5
    full = alone(model, prompt, 20)
    stop = full[7]
    expected = full[:full.index(stop) + 1]
    engine = Engine(model, num_blocks=32, block_size=4, clock="steps", speculative=SPEC)
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,)))
    events = list(engine.stream())
    req = engine.requests[rid]
    assert req.output_ids == expected and req.finish_reason == "stop"
    assert [e.index for e in events] == list(range(len(expected)))
    assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])
    assert engine.allocator.num_free_blocks == 32


def test_max_tokens_and_max_model_len_cap_the_draft(model):
    prompt = [4, 6] * 6
    engine = Engine(model, num_blocks=6, block_size=4, clock="steps", speculative=SPEC)  # 24 positions
    a = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=7))
    b = engine.add_request(prompt[:8], SamplingParams(temperature=0.0, max_tokens=100))
    for _ in engine.stream():
        pass
    assert len(engine.requests[a].output_ids) == 7
    assert engine.requests[b].num_tokens == engine.max_model_len and engine.requests[b].finish_reason == "length"
    assert draft_room(num_tokens=10, num_output=3, max_tokens=5, max_model_len=100, k=4) == 1
    assert draft_room(num_tokens=20, num_output=0, max_tokens=50, max_model_len=23, k=4) == 2
    assert draft_room(num_tokens=22, num_output=0, max_tokens=50, max_model_len=23, k=4) == 0


def test_a_repetition_penalty_sees_the_draft_tokens_before_each_position(model):
    """Greedy with a penalty: the same tokens with and without speculation (each verified row is
    penalised with the drafts before it as seen tokens)."""
    trace = [TraceRequest(0, tuple([2, 4, 6, 8] * 3), SamplingParams(temperature=0.0, max_tokens=16,
                                                                      repetition_penalty=1.3)),
             TraceRequest(0, tuple([1, 3] * 6), SamplingParams(temperature=0.0, max_tokens=16))]
    spec = run_trace(Engine(model, num_blocks=32, block_size=4, clock="steps", speculative=SPEC), trace)
    plain = run_trace(Engine(model, num_blocks=32, block_size=4, clock="steps"), trace)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert sum(r.draft_tokens for r in spec) > 0  # the unpenalised one drafts (prompt lookup copies the
    # context, which a penalty avoids; test_each_verified_row_is_penalised_with_the_drafts_before_it covers rows)


def test_a_draft_never_makes_the_scheduler_preempt(model):
    """Four blocks of 4: A and B hold two each. A's first draft would need a third block while B still
    runs; it is not offered then (B would be preempted for it), and is once B has finished."""
    engine = CheckedEngine(model, num_blocks=4, block_size=4, clock="steps", speculative=SPEC)
    prompt = [411, 866, 977, 766, 796, 352, 969]  # its greedy answer repeats 969: prompt lookup drafts at once
    a = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6))
    b = engine.add_request([9, 8, 7, 6, 5, 4, 3], SamplingParams(temperature=0.0, max_tokens=2))
    for _ in engine.stream():
        pass
    assert sum(s.preempted for s in engine.steps) == 0
    assert engine.requests[a].draft_tokens > 0  # it did speculate, later
    assert engine.requests[a].output_ids == alone(model, prompt, 6)
    assert engine.requests[b].output_ids == alone(model, [9, 8, 7, 6, 5, 4, 3], 2)


def test_each_verified_row_is_penalised_with_the_drafts_before_it():
    """Row 1 comes after draft token 2: with the penalty, 2 is seen there and the target picks 3."""
    logits = torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 1.0, 0.9], [0.0, 0.0, 0.0, 1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert verify_drafts(logits, [p], [None], [[2, 2]], histories=[[0]]) == [[2, 3]]
    plain = SamplingParams(temperature=0.0)
    assert verify_drafts(logits, [plain], [None], [[2, 2]], histories=[[0]]) == [[2, 2, 3]]


def test_rejection_sampling_keeps_the_targets_distribution():
    """Draft [x, y] against target rows p0, p1, p2: the first token is distributed as p0, and the
    pair (x, y) comes out with probability p0(x) * p1(y)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, 0.2, 0.3, -0.5], [1.0, 0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(logits, -1)
    x, y = 1, 3
    params = [SamplingParams(temperature=1.0)]
    gen = torch.Generator().manual_seed(1)
    N = 6000
    first, pair = torch.zeros(5), 0
    for _ in range(N):
        out = verify_drafts(logits, params, [gen], [[x, y]])[0]
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        pair += out[:2] == [x, y]
    freq = first / N
    tol = 4 * torch.sqrt(p[0] * (1 - p[0]) / N)
    assert torch.all((freq - p[0]).abs() < tol), (freq, p[0])
    q = float(p[0, x] * p[1, y])
    assert abs(pair / N - q) < 4 * (q * (1 - q) / N) ** 0.5


def test_the_bonus_token_follows_the_last_row():
    """Both drafts accepted: the third token is drawn from the row after the last draft."""
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0], [0.5, -0.5, 1.0, 0.0]])
    p2 = torch.softmax(logits[2], -1)
    gen = torch.Generator().manual_seed(2)
    third = torch.zeros(4)
    for _ in range(4000):
        out = verify_drafts(logits, [SamplingParams(temperature=1.0)], [gen], [[0, 1]])[0]
        if len(out) == 3:
            third[out[2]] += 1
    n = third.sum()
    assert n > 2000
    assert torch.all((third / n - p2).abs() < 4 * torch.sqrt(p2 * (1 - p2) / n)), (third / n, p2)


def test_a_seeded_sampled_request_gets_the_same_tokens_with_and_without_drafts(model):
    """Verification draws from p row by row with the request's generator: the same draws in the same
    order as plain sampling, alone and in a batch whose budget cuts drafts."""
    prompts = [[7, 1, 7, 1, 7, 1, 7], [3, 8, 1] * 4, [5, 9, 2, 7] * 3, [11, 12] * 5]
    for seed in range(6):
        params = SamplingParams(temperature=0.7, top_k=4, max_tokens=12, seed=seed)
        got = {}
        for label, spec, batch in (("plain", None, prompts[:1]), ("alone", SPEC, prompts[:1]),
                                   ("batched", SPEC, prompts)):
            engine = Engine(model, num_blocks=64, block_size=4, token_budget=5, max_running=4, clock="steps",
                            speculative=spec)
            ids = [engine.add_request(p, params) for p in batch]
            for _ in engine.stream():
                pass
            got[label] = engine.requests[ids[0]].output_ids
        assert got["alone"] == got["plain"] == got["batched"], seed


def test_a_stop_token_in_the_middle_of_an_emitted_run_ends_it_there(model, monkeypatch):
    """A verification that emits [a, STOP, b]: the request ends after STOP, b is never sent."""
    import labsupport.engine.model_runner as runner

    real = runner.verify_drafts
    STOP = 1000

    def with_a_stop(logits, params, generators, drafts, histories=None):
        out = real(logits, params, generators, drafts, histories)
        return [[o[0], STOP, 999] if len(d) >= 2 else o for o, d in zip(out, drafts)]

    monkeypatch.setattr(runner, "verify_drafts", with_a_stop)
    engine = Engine(model, num_blocks=32, block_size=4, clock="steps", speculative=SPEC)
    rid = engine.add_request([411, 866, 977, 766, 796, 352, 969], SamplingParams(temperature=0.0, max_tokens=20,
                                                                               stop_token_ids=(STOP,)))
    events = list(engine.stream())
    req = engine.requests[rid]
    assert req.finish_reason == "stop" and req.output_ids[-1] == STOP and 999 not in req.output_ids
    assert [e.index for e in events] == list(range(len(req.output_ids)))
    assert events[-1].finish_reason == "stop" and events[-1].token_id == STOP
    assert engine.allocator.num_free_blocks == 32


def test_drafts_of_several_requests_never_cost_a_preemption(model):
    """Seven blocks of 4, three requests that draft: the blocks one draft takes are not offered to the next."""
    engine = CheckedEngine(model, num_blocks=7, block_size=4, clock="steps", speculative=SPEC, prefix_caching=False)
    for prompt in ([696, 120, 321, 448, 709, 856, 290], [733, 67, 287, 797, 16, 963, 282], [9, 8, 7, 6, 5, 4, 3]):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4))
    for _ in engine.stream():
        pass
    assert sum(s.draft_tokens for s in engine.steps) > 0
    assert not any(s.preempted and s.draft_tokens for s in engine.steps)


def test_blocks_filled_through_drafts_are_found_by_their_real_tokens(model):
    """After a speculative run, the request's full blocks are in the prefix cache under the tokens they
    hold: a follow-up that extends the conversation finds them all."""
    prompt = [411, 866, 977, 766, 796, 352, 969]
    engine = Engine(model, num_blocks=32, block_size=4, clock="steps", speculative=SPEC)
    first = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=14))
    for _ in engine.stream():
        pass
    assert engine.requests[first].accepted_tokens > 0
    turn = prompt + engine.requests[first].output_ids + [5]
    second = engine.add_request(turn, SamplingParams(temperature=0.0, max_tokens=3))
    for _ in engine.stream():
        pass
    known = len(turn) - 1  # what the first request's blocks held: all but the new token
    assert engine.requests[second].cached_tokens == (known - 1) // 4 * 4
    assert engine.requests[second].output_ids == alone(model, turn, 3)


def test_greedy_verification_accepts_while_the_argmax_agrees():
    assert accepted_greedy([5, 6, 7, 8], [5, 6, 9]) == 2
    assert accepted_greedy([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accepted_greedy([1, 2], [2]) == 0
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([5, 6, 7, 8]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert verify_drafts(logits, [greedy, greedy], [None, None], [[5, 9], []]) == [[5, 6], [8]]
    with pytest.raises(ValueError, match="rows of logits"):
        verify_drafts(logits, [greedy], [None], [[5]])


def test_sampled_requests_speculate_and_stay_within_their_filters(model):
    prompt = [7, 1, 7, 1, 7, 1, 7]
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=12, seed=4)
    engine = CheckedEngine(model, num_blocks=32, block_size=4, clock="steps", speculative=SPEC)
    rid = engine.add_request(prompt, params)
    for _ in engine.stream():
        pass
    req = engine.requests[rid]
    assert len(req.output_ids) == 12 and req.draft_tokens > 0
    ctx = list(prompt)  # every token is among the top 3 of the target's logits after its context
    for t in req.output_ids:
        top3 = model.forward_no_cache(torch.tensor([ctx]))[0].topk(3).indices.tolist()
        assert t in top3
        ctx.append(t)
    assert sample(torch.zeros(1, 4), 0.0, 0, 1.0).shape == (1,)  # the per-row sampler's interface is unchanged


def test_bad_configurations_are_refused(model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="must not exceed"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="engine's own sampler"):
        Engine(model, speculative=SPEC, sampler=sample)
    with pytest.raises(ValueError, match="SpeculativeConfig"):
        Engine(model, speculative=4)


def test_truncate_gives_back_slots_and_forgets_the_hash_of_a_block_it_reopens():
    alloc = BlockAllocator(8, 4, prefix_caching=True)
    alloc.allocate("a", [1, 2, 3, 4, 5, 6])
    for t in [7, 8, 9, 10, 11]:  # block 1 fills with 5..8; block 2 opens
        alloc.append_token("a", t)
    assert alloc.num_blocks_of("a") == 3 and alloc.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    alloc.truncate("a", 6)  # back into block 1: block 2 goes, block 1 is no longer full
    alloc.check_invariants()
    assert alloc.seq_len("a") == 6 and alloc.num_blocks_of("a") == 2 and alloc.num_free_blocks == 6
    assert alloc.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4  # its old hash is gone
    alloc.append_token("a", 70)
    alloc.append_token("a", 80)  # block 1 fills again, with other tokens: hashed with them
    assert alloc.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 70, 80, 0]) == 8
    alloc.append_token("a", 9)
    alloc.truncate("a", 8)  # a whole block dropped; the full one kept keeps its hash
    assert alloc.num_blocks_of("a") == 2 and alloc.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 70, 80, 0]) == 8
    alloc.check_invariants()
    with pytest.raises(ValueError, match="truncate it to 0..8"):
        alloc.truncate("a", 9)
    alloc.append_token("a", 9)
    for t in [10, 11, 12, 13]:  # block 2 fills with 9..12 (hashed), block 3 opens
        alloc.append_token("a", t)
    alloc.truncate("a", 8)  # a draft that filled a whole block: both its blocks go, hashes and all
    assert alloc.num_free_blocks == 6 and alloc.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 70, 80, 9, 10, 11, 12, 0]) == 8
    alloc.check_invariants()
    b = alloc.fork("a", "b")  # a block another sequence holds keeps its hash
    alloc.truncate("a", 0)
    alloc.check_invariants()
    assert alloc.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 70, 80, 0]) == 8 and alloc.block_table("b") == b
    alloc.free("b")
    assert alloc.num_free_blocks == 8


def test_the_triton_kernels_verify_drafts_in_the_interpreter(model):
    """attention="triton": a verification chunk of 1 + d queries goes through the mixed-batch kernel
    (what a GPU runs, small); the same tokens, drafts accepted."""
    engine = Engine(model, num_blocks=32, block_size=4, clock="steps", attention="triton", speculative=SPEC)
    prompts = [[411, 866, 977, 766, 796, 352, 969], [5, 9, 2, 7] * 3]
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10)) for p in prompts]
    for _ in engine.stream():
        pass
    assert engine.stats()["spec_accepted_tokens"] > 0
    for rid, prompt in zip(ids, prompts):
        assert engine.requests[rid].output_ids == alone(model, prompt, 10)


def test_a_row_past_the_first_rejection_never_fails_its_request():
    """Plain sampling draws row 0, gets a token other than the draft's, and stops there: a later row
    that is not a distribution (NaN) is never drawn, so the request keeps its token; a NaN row that
    plain sampling does draw (row 0, or a row after accepted drafts) fails the request alone."""
    nan = float("nan")
    sampled = SamplingParams(temperature=1.0)
    logits = torch.tensor([[0.0, 0.0, 40.0, 0.0], [nan] * 4, [0.0] * 4])  # row 0 draws 2 (p > 1 - 1e-16)
    assert verify_drafts(logits, [sampled], [torch.Generator().manual_seed(0)], [[1, 1]]) == [[2]]
    accepted = verify_drafts(logits, [sampled], [torch.Generator().manual_seed(0)], [[2, 1]])[0]
    assert isinstance(accepted, RowSamplingError)  # draft 2 accepted: row 1 is drawn, and is NaN
    first = torch.tensor([[nan] * 4, [0.0] * 4])
    assert isinstance(verify_drafts(first, [sampled], [torch.Generator().manual_seed(0)], [[1]])[0], RowSamplingError)
