"""The engine's host work per step does not grow with the waiting queue or the requests' lengths
(chapter 13): each request keeps its block hashes (each full block hashed once in its life), the
prefix-cache look-up of a waiting request is dictionary look-ups, the runner hands lab 12's
interface a read-only view of each request's tokens, and sampled draft verification brings its
draws back in one transfer while making exactly the draws plain sampling makes."""

from __future__ import annotations

import hashlib

import pytest
import torch
from test_engine import CFG  # the engine tests' untied tiny model

from labsupport import paged_cache
from labsupport.engine import Engine, ScheduledSeq
from labsupport.engine.sampler import batched_sampling_probs, row_settings
from labsupport.engine.sequence import TokenView
from labsupport.engine.speculative import verify_drafts
from labsupport.phases import cpu_threads
from labsupport.sampling import SamplingParams
from labsupport.scheduler import schedule_step
from labsupport.transformer import Transformer


@pytest.fixture(scope="module")
def model():
    with cpu_threads(1):
        yield Transformer(CFG, seed=3)


class CountingSha:
    """``hashlib`` for the allocator's module, counting SHA-256 objects made (one per block hash)."""

    def __init__(self):
        self.calls = 0

    def sha256(self, *args):
        self.calls += 1
        return hashlib.sha256(*args)


def _sha_per_step(model, waiting: int, monkeypatch) -> list[tuple[int, int]]:
    """SHA-256 calls and prefix-cache look-ups in each of 6 steps of an engine with ``waiting``
    requests queued behind two running ones, every prompt 4 blocks of a shared prefix and one of its own."""
    counter = CountingSha()
    monkeypatch.setattr(paged_cache, "hashlib", counter)
    engine = Engine(model, num_blocks=64, block_size=8, token_budget=16, max_running=2)
    lookups, look_up = [0], engine.allocator.cached_prefix_blocks

    def counted(*args):
        lookups[0] += 1
        return look_up(*args)

    engine.allocator.cached_prefix_blocks = counted  # this engine's allocator only
    shared = torch.randint(0, CFG.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=40)
    engine.add_request(shared + [1] * 9, params)  # runs first: its blocks make the shared prefix findable
    for i in range(1 + waiting):
        engine.add_request(shared + [2 + i % 50] * 9, params)
    engine.step()  # the first running request's prompt
    counts = []
    for _ in range(6):
        before = counter.calls, lookups[0]
        engine.step()
        counts.append((counter.calls - before[0], lookups[0] - before[1]))
    assert len(engine.waiting) >= waiting - 1  # the queue stayed long
    return counts


def test_block_hashes_per_step_do_not_grow_with_the_waiting_queue(model, monkeypatch):
    few = _sha_per_step(model, 4, monkeypatch)
    many = _sha_per_step(model, 64, monkeypatch)
    assert few == many  # only blocks that filled this step are hashed, and a look-up or none, whatever waits
    assert sum(sha for sha, _ in few) > 0  # and blocks are hashed: decoding fills them


def test_a_plugged_in_decision_gets_the_waiting_queue_as_a_list(model):
    """Lab 13's decisions may treat the queue as a list (pop, concatenate): the engine gives one to
    any decision but the course's own, which it reads lazily."""
    seen = []

    def mine(running, waiting, *rest):
        seen.append(type(waiting))
        return schedule_step(running, waiting, *rest)

    engine = Engine(model, num_blocks=32, block_size=8, token_budget=32, max_running=2, scheduler=mine)
    engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=2))
    assert seen and set(seen) == {list}


def test_a_request_keeps_its_block_hashes_and_extends_them(model):
    engine = Engine(model, num_blocks=32, block_size=8, token_budget=64, max_running=2)
    rid = engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=13))
    req = engine.requests[rid]
    assert req.block_hashes == [paged_cache.block_hash(None, list(range(1, 9))),
                                paged_cache.block_hash(req.block_hashes[0], list(range(9, 17)))]
    kept = list(req.block_hashes)
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.hash_blocks(req)  # 20 + 13 tokens: 4 full blocks, the first two unchanged
    assert req.block_hashes[:2] == kept and len(req.block_hashes) == 4
    fresh = paged_cache.BlockAllocator(32, 8, prefix_caching=True)
    fresh.allocate("x", req.all_ids[:32])
    assert fresh._chains["x"] == req.block_hashes  # the allocator's own chain, computed from scratch


def test_a_token_view_reads_like_the_list_it_stands_for():
    prompt, output, draft = [1, 2, 3], [4, 5], [6]
    view = TokenView(prompt, output, draft)
    whole = prompt + output + draft
    assert len(view) == 6 and list(view) == whole and view == whole
    for i in range(-6, 6):
        assert view[i] == whole[i]
    for a in range(-7, 8):
        for b in range(-7, 8):
            assert view[a:b] == whole[a:b]
    assert view[::2] == whole[::2]
    assert view + [7] == whole + [7] and [0] + view == [0] + whole and torch.tensor(view).tolist() == whole
    with pytest.raises(IndexError):
        view[6]
    output.append(9)  # a token appended afterwards is not in the view
    assert len(view) == 6 and list(view) == whole
    with pytest.raises(TypeError):
        view[0] = 7
    seq = ScheduledSeq(TokenView(prompt, [], []), [0], 2, 1)
    assert seq.samples


def _reference(logits, params, generators, drafts):
    """The per-row verification the engine did before: one draw at a time, stopping at a rejection."""
    out, at = [], 0
    for p, g, d in zip(params, generators, drafts):
        n = len(d) + 1
        if p.temperature == 0:  # greedy rows: not this reference's concern
            out.append(None)
            at += n
            continue
        probs = batched_sampling_probs(logits[at:at + n], *row_settings([p] * n, logits.shape[-1], logits.device))
        at += n
        tokens = []
        for j in range(n):
            y = int(torch.multinomial(probs[j:j + 1], 1, generator=g)[0, 0])
            tokens.append(y)
            if j == len(d) or y != d[j]:
                break
        out.append(tokens)
    return out


def test_sampled_verification_makes_the_draws_plain_sampling_makes():
    """Drawn ahead and brought back at once, each request emits what row-by-row drawing emits and its
    generator ends where row-by-row drawing leaves it (the next draws agree), rejections included."""
    torch.manual_seed(0)
    V = 12
    params = [SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=0), SamplingParams(temperature=1.3)]
    for trial in range(40):
        drafts = [[int(t) for t in torch.randint(0, 3, (k,))] for k in (3, 2, 4)]
        logits = torch.randn(sum(len(d) + 1 for d in drafts), V) * 0.5
        logits[:, :3] += 2.0  # the drafts' tokens are likely: some accepted, some not
        ours = [torch.Generator().manual_seed(trial * 3 + i) for i in range(3)]
        theirs = [torch.Generator().manual_seed(trial * 3 + i) for i in range(3)]
        got = verify_drafts(logits, params, ours, drafts)
        want = _reference(logits, params, theirs, drafts)
        assert got[0] == want[0] and got[2] == want[2], trial
        for a, b in ((ours[0], theirs[0]), (ours[2], theirs[2])):
            assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b)), trial
