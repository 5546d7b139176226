"""The course server's HTTP layer: OpenAI's completions API on FastAPI, over any back end.

Endpoints:

* ``POST /v1/completions``: a completion, whole or streamed (``"stream": true``: server-sent events,
  one ``data:`` line per token in OpenAI's chunk format, then ``data: [DONE]``). Usage counts come in
  the response, and in a last chunk when the request asks ``"stream_options": {"include_usage": true}``.
* ``GET /v1/models``: the one model served, with a note that its weights are random.
* ``GET /health`` (liveness): ``{"status": "ok", ...}`` (``"draining"`` during a drain) with the
  scheduler's counts (running, queued, slots). ``GET /ready`` (readiness): 200 while the server takes
  new requests, 503 once it drains, so a load balancer stops sending it work.
* ``GET /metrics``: Prometheus text format, names after vLLM's (see :mod:`labsupport.serve.metrics`).
* ``POST /v1/requests/{id}/cancel``: a course extension: abort an admitted request (its stream ends
  with ``data: [DONE]`` and no finish reason; a whole answer returns what was made so far).
* ``POST /admin/drain``: begin a graceful drain, as SIGTERM does (see below).
* ``GET /v1/requests/{id}/timeline``: a course extension, not OpenAI's: the timestamps of every stage
  of a recent request (see :mod:`labsupport.serve.engine`).

Bad input gets an HTTP 4xx with OpenAI's error body,
``{"error": {"message", "type", "param", "code"}}``, and the server goes on serving. A failure
after a stream has started cannot change the HTTP status any more: it arrives as one last event
``data: {"error": {...}}`` before ``data: [DONE]`` (as vLLM does), which the ``openai`` client
raises as an ``APIError``.

Where this server departs from OpenAI's API (on purpose, and said here so no client is surprised):
``temperature`` defaults to 0 (greedy, reproducible) where OpenAI's default is 1 (vLLM's, the
model's generation config, else 1); sampling without a ``seed`` uses the server's seed, so it repeats;
``max_tokens`` defaults to 16, as in OpenAI's and vLLM's completions; one prompt per request; the parameters in :data:`UNSUPPORTED` are refused, not ignored; and a full
server answers HTTP 429, which the ``openai`` client retries by default (``max_retries=2``).
A parameter sent as ``null`` means its default, as in OpenAI's API.

**Back-pressure and drain.** ``--max-requests`` slots bound the requests queued plus running; a
request beyond them gets HTTP 429 (code ``server_full``) with a ``Retry-After`` header instead of
waiting in an unbounded queue. On SIGTERM (or ``POST /admin/drain``) the server drains: new
completions get HTTP 503 (code ``draining``, with ``Retry-After``), ``/ready`` answers 503 and
``/health`` says ``"draining"``, while every admitted request runs to its end (streams finish with
``data: [DONE]``); then the process exits with status 0. Requests still running after
``drain_timeout_s`` are aborted (counted as ``drain_timeout``). A second SIGTERM stops at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Backend, InvalidRequest, RequestHandle, Timeline, new_request_id
from .metrics import CONTENT_TYPE, ServerMetrics

RETRY_AFTER_S = 1  # the Retry-After header of a 429 (server full) or 503 (draining), in seconds

# Parameters of OpenAI's completions API this server does not implement: refused with a clear
# error rather than silently ignored, so a client never believes it got what it asked for.
UNSUPPORTED = {
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "stop": None,
    "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    type_ = {404: "not_found_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    if status >= 500:
        type_ = "server_error"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _parse(body: dict, backend: Backend) -> dict:
    """Validate a completions request; raise InvalidRequest naming the parameter at fault."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "the default", as in OpenAI's API
    model = body.get("model")
    if model is None:
        raise InvalidRequest("you must provide a model parameter", "model", "missing_required_parameter")
    if model != backend.model_name:
        raise InvalidRequest(
            f"The model `{model}` does not exist. This server serves `{backend.model_name}` (GET /v1/models).",
            "model", "model_not_found", status=404,
        )
    if "prompt" not in body:
        raise InvalidRequest("you must provide a prompt parameter", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            raise InvalidRequest(
                "prompt must be a string or a list of token ids; this server takes one prompt per request",
                "prompt",
            )
    elif not isinstance(prompt, str):
        raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidRequest(f"max_tokens must be an integer, got {max_tokens!r}", "max_tokens")
    if max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens > backend.max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens is too large: {max_tokens}. This server generates at most {backend.max_tokens_limit} "
            f"tokens per request.", "max_tokens",
        )
    temperature = body.get("temperature", 0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and 0 <= temperature <= 2
    ):
        raise InvalidRequest(f"temperature must be a number from 0 to 2, got {temperature!r}", "temperature")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidRequest(f"seed must be an integer, got {seed!r}", "seed")
    for name, default in UNSUPPORTED.items():
        if name in body and body[name] != default and not (name == "stop" and body[name] == []):
            raise InvalidRequest(f"{name} is not supported by the course server (leave it out)", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    if options and not stream:
        raise InvalidRequest("stream_options can only be set when stream is true", "stream_options")
    return {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": float(temperature), "seed": seed,
        "stream": stream, "include_usage": bool(options.get("include_usage", False)),
    }


class _Account:
    """One admitted request's bookkeeping: its metrics, and its place among the requests in flight."""

    def __init__(self, app: FastAPI, handle: RequestHandle, arrival: float):
        self.app, self.handle, self.arrival = app, handle, arrival
        self.last: float | None = None
        self.finish: str | None = None
        self.abort_reason = "client_disconnect"  # unless cancel() or the drain says otherwise
        app.state.inflight[handle.request.request_id] = self
        app.state.metrics.prompt_tokens.inc(len(handle.request.prompt_ids))

    def token(self, out) -> None:
        now, m = time.monotonic(), self.app.state.metrics
        (m.ttft.observe(now - self.arrival) if self.last is None else m.itl.observe(now - self.last))
        self.last = now
        m.generation_tokens.inc()
        self.finish = out.finish_reason

    def cancel(self, reason: str) -> None:
        self.abort_reason = reason
        self.handle.cancel()

    def end(self, failed: bool = False) -> None:
        if self.app.state.inflight.pop(self.handle.request.request_id, None) is None:
            return  # already ended
        m = self.app.state.metrics
        if failed:
            m.aborted.labels("error").inc()
        elif self.finish is not None:
            m.success.labels(self.finish).inc()
            m.e2e.observe(time.monotonic() - self.arrival)
        else:
            m.aborted.labels(self.abort_reason).inc()


def create_app(backend: Backend, *, drain_timeout_s: float = 30.0, on_drained=None) -> FastAPI:
    """The FastAPI application serving ``backend``.

    ``on_drained`` is called once a drain has ended (the command line stops uvicorn there); requests
    still in flight ``drain_timeout_s`` after the drain began are aborted first."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        yield
        await backend.stop()

    app = FastAPI(title="labsupport course server", lifespan=lifespan)
    app.state.backend = backend
    app.state.draining = False
    app.state.inflight = {}  # request id -> _Account, for every admitted request not yet ended
    app.state.metrics = ServerMetrics(backend, lambda: app.state.draining)
    app.state.on_drained = on_drained

    async def drain() -> None:
        deadline = time.monotonic() + drain_timeout_s
        while app.state.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for account in list(app.state.inflight.values()):  # out of time: abort what is left
            account.cancel("drain_timeout")
        deadline = time.monotonic() + 5
        while app.state.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if app.state.on_drained is not None:
            app.state.on_drained()

    def begin_drain() -> bool:
        """Stop admitting; return False if a drain had already begun."""
        if app.state.draining:
            return False
        app.state.draining = True
        app.state.drain_task = asyncio.get_running_loop().create_task(drain())
        return True

    app.state.begin_drain = begin_drain

    @app.exception_handler(InvalidRequest)
    async def invalid(request: Request, exc: InvalidRequest):
        if request.url.path == "/v1/completions":
            app.state.metrics.rejected.labels(exc.code if exc.status in (429, 503) else str(exc.status)).inc()
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception):  # a bug: fail this request, keep serving
        return error_response(500, f"the server failed on this request: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health():
        status = "draining" if app.state.draining else "ok"
        return {"status": status, "model": backend.model_name, "in_flight": len(app.state.inflight),
                **backend.stats()}

    @app.get("/ready")
    async def ready():
        if app.state.draining:
            return error_response(503, "the server is draining: it finishes the requests it has and takes no new "
                                  "ones", code="draining")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        return Response(app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/admin/drain")
    async def admin_drain():
        began = begin_drain()
        return {"status": "draining", "began_now": began, "in_flight": len(app.state.inflight)}

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str):
        account = app.state.inflight.get(request_id)
        if account is None:
            raise InvalidRequest(f"no request in flight has id {request_id!r} (it has finished, or never was)",
                                 "request_id", "request_not_found", status=404)
        account.cancel("cancel")
        return {"id": request_id, "object": "cancellation", "cancelled": True}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{
                "id": backend.model_name, "object": "model", "created": 0, "owned_by": "labsupport",
                "context_length": backend.context_tokens, "max_tokens_limit": backend.max_tokens_limit,
                "description": backend.description,
            }],
        }

    @app.get("/v1/requests/{request_id}/timeline")
    async def timeline(request_id: str):
        found = backend.timeline(request_id)
        if found is None:
            raise InvalidRequest(
                f"no recent request has id {request_id!r} (the server keeps the most recent ones only)",
                "request_id", "request_not_found", status=404,
            )
        return found.to_json()

    @app.post("/v1/completions")
    async def completions(request: Request):
        timeline = Timeline(new_request_id())  # "arrival": the request's headers are in
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(
                f"We could not parse the JSON body of your request ({exc}). Send a JSON object such as "
                f'{{"model": "{backend.model_name}", "prompt": "Hello", "max_tokens": 16}}.'
            ) from None
        if app.state.draining:
            raise InvalidRequest("the server is draining (shutting down): it takes no new requests. Retry on "
                                 "another replica, or later.", None, "draining", status=503)
        params = _parse(body, backend)
        prepared = backend.prepare(params["prompt"], params["max_tokens"], params["temperature"],
                                   params["seed"], timeline)
        handle = backend.submit(prepared)
        account = _Account(app, handle, timeline.arrival)
        rid, created, n_prompt = prepared.request_id, int(time.time()), len(prepared.prompt_ids)

        def usage(n_completion: int) -> dict:
            return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                    "total_tokens": n_prompt + n_completion}

        def chunk(choices: list, usage_: dict | None = None) -> str:
            payload = {"id": rid, "object": "text_completion", "created": created,
                       "model": backend.model_name, "choices": choices, "usage": usage_}
            return f"data: {json.dumps(payload)}\n\n"

        async def watch_disconnect() -> None:
            """Cancel the request when its client goes away, whether it waits in the queue (no
            byte sent yet) or generates: independent of how the web stack reports disconnects."""
            while not await request.is_disconnected():
                await asyncio.sleep(0.1)
            handle.cancel()

        if params["stream"]:
            async def events():
                produced, failed = 0, False
                watcher = asyncio.create_task(watch_disconnect())
                try:
                    try:
                        async for out in handle:
                            account.token(out)
                            produced += 1
                            timeline.mark("chunk_sent", out.index)
                            # usage is null on every token chunk (OpenAI's stream format); the counts
                            # come in a last chunk with no choices when the request asks for them
                            yield chunk([{"text": out.text, "index": 0, "logprobs": None,
                                          "finish_reason": out.finish_reason}])
                        if params["include_usage"]:
                            yield chunk([], usage(produced))
                    except Exception as exc:  # the status line has gone: say so in the stream itself
                        failed = True
                        failure = error_body(f"the server failed on this request: {type(exc).__name__}: {exc}",
                                             "server_error")
                        yield f"data: {json.dumps(failure)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # also when the client disconnects: the stream is cancelled, the slot freed
                    watcher.cancel()
                    handle.cancel()
                    account.end(failed)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

        watcher = asyncio.create_task(watch_disconnect())
        pieces, finish, failed = [], None, True
        try:
            async for out in handle:
                account.token(out)
                pieces.append(out.text)
                finish = out.finish_reason
            failed = False
        finally:
            watcher.cancel()
            handle.cancel()
            account.end(failed)
        timeline.mark("response_sent")
        return {
            "id": rid, "object": "text_completion", "created": created, "model": backend.model_name,
            "choices": [{"text": "".join(pieces), "index": 0, "logprobs": None, "finish_reason": finish}],
            "usage": usage(len(pieces)),
        }

    return app
