"""One request fails alone (issue 20), in-process with the real back ends: an exception while the
continuous engine admits one request, or while it steps, fails that request (or the requests of
that step) with an error to their clients, frees their slots and blocks, and the worker goes on;
a worker that dies anyway turns ``/health`` and ``/ready`` into 503s, fails what was in flight and
logs its traceback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

import httpx
import pytest

from labsupport.engine import sampler as sampler_module
from labsupport.engine.sampler import RowSamplingError
from labsupport.serve import fifo as fifo_module
from labsupport.serve.app import create_app
from labsupport.serve.continuous import ContinuousEngine
from labsupport.serve.fifo import FifoEngine
from labsupport.serve.served_model import MODEL_NAME, course_model


@pytest.fixture(scope="module")
def served():
    return course_model()  # one model for every back end below


def run(coro):
    # a fresh thread: other tests in this worker may leave an event loop marked running in this one
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def collect(handle) -> list | BaseException:
    try:
        return [out async for out in handle]
    except Exception as exc:
        return exc


def continuous(served) -> ContinuousEngine:
    return ContinuousEngine(served, context_tokens=64, max_tokens_limit=16, num_blocks=16, block_size=8,
                            max_requests=8)


def test_a_request_the_engine_refuses_to_admit_fails_alone(served):
    backend = continuous(served)
    admit = backend.engine.add_request

    def refuse_one(prompt_ids, params, request_id=None):
        if prompt_ids[0] == 7:
            raise RuntimeError("admission bug")
        return admit(prompt_ids, params, request_id=request_id)

    backend.engine.add_request = refuse_one

    async def body():
        await backend.start()
        handles = [backend.submit(backend.prepare([first, 3, 4], max_tokens=6)) for first in (5, 7, 9)]
        results = await asyncio.gather(*(collect(h) for h in handles))
        stats = backend.stats()
        await backend.stop()
        return results, stats

    results, stats = run(body())
    assert isinstance(results[1], RuntimeError) and "admission bug" in str(results[1])
    assert [len(results[0]), len(results[2])] == [6, 6]
    assert stats["slots_used"] == 0 and stats["failed"] == 1 and stats["served"] == 2
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and backend.failure is None


def test_a_step_that_raises_fails_the_requests_of_that_step_and_the_next_step_goes_on(served):
    backend = continuous(served)
    sample = backend.engine.sampler
    calls = {"n": 0}

    def fails_on_the_third_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise FloatingPointError("sampling bug")
        return sample(*args, **kwargs)

    backend.engine.sampler = fails_on_the_third_step

    async def body():
        await backend.start()
        first = backend.submit(backend.prepare([5, 6, 7], max_tokens=8))
        failed = await collect(first)
        later = await collect(backend.submit(backend.prepare([5, 6, 7], max_tokens=8)))
        stats = backend.stats()
        await backend.stop()
        return failed, later, stats

    failed, later, stats = run(body())
    assert isinstance(failed, FloatingPointError)
    assert len(later) == 8 and later[-1].finish_reason == "length"
    assert stats["failed"] == 1 and stats["served"] == 1 and stats["slots_used"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and backend.engine.requests == {}


def test_a_dead_worker_turns_health_and_ready_into_503s_and_is_logged(served, caplog):
    class Dies(FifoEngine):
        async def _work(self):
            await self._queue.get()  # takes a request, then a bug outside every per-request guard
            raise RuntimeError("the worker itself broke")

    backend = Dies(served, context_tokens=64, max_tokens_limit=16)
    app = create_app(backend)
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4}

    async def drive():
        await backend.start()  # the ASGI transport runs no lifespan
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            assert (await c.get("/health")).status_code == 200
            in_flight = await c.post("/v1/completions", json=body)
            out = [in_flight, await c.get("/health"), await c.get("/ready"),
                   await c.post("/v1/completions", json=body)]
        await backend.stop()
        return out

    with caplog.at_level(logging.ERROR, logger="labsupport.serve"):
        in_flight, health, ready, after = run(drive())
    assert in_flight.status_code == 500 and "worker itself broke" in in_flight.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "worker itself broke" in health.json()["error"] and health.json()["slots_used"] == 0
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "worker_failed"
    assert after.status_code == 503 and after.json()["error"]["code"] == "worker_failed"
    worker_logs = [r for r in caplog.records if "model worker stopped" in r.getMessage()]
    assert worker_logs and worker_logs[0].exc_info is not None  # with its traceback


def test_a_request_whose_sampling_fails_fails_alone_and_its_step_neighbours_keep_their_text(served, monkeypatch):
    """A fault planted in one request's row of the sampling stage (its probabilities NaN): that request
    gets an error naming its settings, and the greedy requests in the same steps get the text they get
    with no fault at all."""
    async def body(backend, temperatures):
        await backend.start()
        handles = [backend.submit(backend.prepare([first, 3, 4], max_tokens=6, temperature=t))
                   for first, t in zip((5, 7, 9), temperatures)]
        results = await asyncio.gather(*(collect(h) for h in handles))
        stats = backend.stats()
        await backend.stop()
        return results, stats

    clean, _ = run(body(continuous(served), (0.0, 0.0, 0.0)))
    real = sampler_module.batched_sampling_probs
    monkeypatch.setattr(sampler_module, "batched_sampling_probs", lambda logits, temperature, *rest: real(
        logits, temperature, *rest).masked_fill((temperature == 0.7)[:, None], float("nan")))
    results, stats = run(body(continuous(served), (0.0, 0.7, 0.0)))
    assert isinstance(results[1], RowSamplingError) and "sampling failed for this request" in str(results[1])
    assert "temperature=0.7" in str(results[1])
    for i in (0, 2):
        assert "".join(o.text for o in results[i]) == "".join(o.text for o in clean[i]) and len(results[i]) == 6
    assert stats["failed"] == 1 and stats["served"] == 2 and stats["slots_used"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_on_the_fifo_back_end_a_failed_draw_names_the_requests_settings_and_the_next_request_goes_on(
        served, monkeypatch):
    def broken_sample(logits, temperature, top_k, top_p, generator=None, min_p=0.0):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    monkeypatch.setattr(fifo_module, "sample", broken_sample)
    backend = FifoEngine(served, context_tokens=64, max_tokens_limit=16)

    async def body():
        await backend.start()
        failed = await collect(backend.submit(backend.prepare([5, 6, 7], max_tokens=4, temperature=0.8, top_p=0.5)))
        later = await collect(backend.submit(backend.prepare([5, 6, 7], max_tokens=4)))
        stats = backend.stats()
        await backend.stop()
        return failed, later, stats

    failed, later, stats = run(body())
    assert isinstance(failed, RowSamplingError) and "temperature=0.8" in str(failed) and "top_p=0.5" in str(failed)
    assert len(later) == 4 and stats["failed"] == 1 and stats["served"] == 1 and stats["slots_used"] == 0
