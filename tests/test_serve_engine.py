"""The course server's back end in-process (labsupport.serve.engine), without HTTP: the streamed
text equals the decoded ids, cancelling frees a slot
whether the request runs or waits, and prompts that do not fit are refused."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from labsupport.serve.backend import InvalidRequest
from labsupport.serve.fifo import FifoEngine


@pytest.fixture(scope="module")
def engine():
    return FifoEngine(context_tokens=300, max_tokens_limit=250, max_requests=3)


async def _collect(handle):
    return [out async for out in handle]


def _run(engine, body):
    async def main():
        await engine.start()
        try:
            return await body()
        finally:
            await engine.stop()

    # A fresh thread: other tests in this worker (nbclient, nbval) may leave an event loop marked
    # as running in the main thread, where asyncio.run would refuse to start.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result()


def test_streamed_pieces_join_to_the_decoded_ids(engine):
    """Sampling at a high temperature produces arbitrary byte tokens, characters split across
    tokens included: the pieces sent, joined, must equal the tokenizer's decode of all ids."""

    async def body():
        request = engine.prepare("Bonjour, naïve café 🙂", max_tokens=200, temperature=2.0, seed=1)
        return await _collect(engine.submit(request))

    outs = _run(engine, body)
    ids = [o.token_id for o in outs if o.token_id not in engine.eos_ids]
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(ids)
    assert [o.index for o in outs] == list(range(len(outs)))
    assert outs[-1].finish_reason in ("stop", "length") and all(o.finish_reason is None for o in outs[:-1])


def test_cancelling_frees_the_slot_of_a_running_and_of_a_queued_request(engine):
    async def body():
        handles = [engine.submit(engine.prepare(f"request {i}", max_tokens=30)) for i in range(3)]
        assert engine.stats()["slots_used"] == 3
        with pytest.raises(InvalidRequest, match="server is full") as full:
            engine.submit(engine.prepare("one too many", max_tokens=2))
        assert full.value.status == 429
        first = await handles[0].__anext__()  # the first request is running
        handles[0].cancel()  # stops at its next step
        handles[2].cancel()  # never leaves the queue
        stats = engine.stats()  # the queued request's slot is free at once, not when its turn comes
        assert stats["slots_used"] == 2 and stats["queued"] == 1
        engine.submit(engine.prepare("takes the freed slot", max_tokens=2)).cancel()
        results = await asyncio.gather(*(_collect(h) for h in handles))
        return first, results

    first, results = _run(engine, body)
    assert first.index == 0 and len(results[0]) < 29  # the rest of the cancelled stream, if any
    assert len(results[1]) == 30 and results[2] == []
    stats = engine.stats()
    assert stats["slots_used"] == 0 and stats["running"] == 0
    events = {}
    for tl in list(engine._timelines.values())[-4:]:
        events[tl.outcome.split()[0]] = events.get(tl.outcome.split()[0], 0) + 1
    assert events == {"cancelled": 3, "completed": 1}


@pytest.mark.parametrize("prompt, max_tokens, param", [
    ([1] * 300, 1, "prompt"),  # fills the whole context: no room for an answer
    ([1] * 290, 20, "max_tokens"),
    ("", 4, "prompt"),
    ([-1], 4, "prompt"),
])
def test_prompts_that_do_not_fit_are_refused(engine, prompt, max_tokens, param):
    with pytest.raises(InvalidRequest) as refused:
        engine.prepare(prompt, max_tokens=max_tokens)
    assert refused.value.param == param and refused.value.status == 400


def test_the_continuous_back_end_speculates_with_the_same_greedy_text_and_counts_it():
    """``--num-speculative-tokens``: the same greedy answer with and without prompt-lookup drafts,
    and the drafts counted in ``stats()`` and on ``/metrics`` as vLLM names them."""
    from prometheus_client.parser import text_string_to_metric_families

    from labsupport.serve.continuous import ContinuousEngine
    from labsupport.serve.metrics import ServerMetrics

    prompt = "the cat sat on the mat; the cat sat on the mat; the cat sat on the"
    texts, backends = [], []
    for k in (0, 4):
        backend = ContinuousEngine(context_tokens=300, max_tokens_limit=250, max_requests=3, speculative_tokens=k)

        async def body(backend=backend):
            return await _collect(backend.submit(backend.prepare(prompt, max_tokens=40, temperature=0.0)))

        texts.append("".join(o.text for o in _run(backend, body)))
        backends.append(backend)
    assert texts[1] == texts[0] and texts[0]
    stats = backends[1].stats()
    assert stats["spec_draft_tokens"] > 0 and 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert backends[0].stats()["spec_draft_tokens"] == 0
    samples = {s.name: s.value for f in text_string_to_metric_families(ServerMetrics(backends[1]).render().decode())
               for s in f.samples}
    assert samples["course:spec_decode_num_draft_tokens_total"] == stats["spec_draft_tokens"]
    assert samples["course:spec_decode_num_accepted_tokens_total"] == stats["spec_accepted_tokens"]
