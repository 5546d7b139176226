"""The course server's HTTP layer: OpenAI's completions and chat completions APIs on FastAPI.

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: a completion, whole or streamed
  (``"stream": true``: server-sent events in OpenAI's chunk format, then ``data: [DONE]``; see
  :mod:`labsupport.serve.answers`).
* ``GET /v1/models`` and ``GET /v1/models/{id}``: the one model served, whether its weights are
  trained, its context length, and (``root``, as vLLM names a model's folder) the folder holding its
  tokenizer in Hugging Face format, for benchmark clients (``--processor``/``--tokenizer``).
* ``GET /health`` (liveness): ``{"status": "ok", ...}`` (``"draining"`` during a drain) with the
  scheduler's counts (running, queued, slots); HTTP 503 with ``"status": "failed"`` once the model
  worker has stopped. ``GET /ready`` (readiness): 200 while the server takes new requests, 503 while
  it drains or after the worker has stopped, so a load balancer stops sending it work.
* ``GET /metrics``: Prometheus text format, names after vLLM's (see :mod:`labsupport.serve.metrics`).
* ``POST /v1/requests/{id}/cancel``: a course extension: abort an admitted request (it ends with
  ``finish_reason: "abort"``).
* ``POST /admin/drain``: begin a graceful drain, as SIGTERM does (see below).
* ``GET /v1/requests/{id}/timeline``: a course extension, not OpenAI's: the timestamps of every stage
  of a recent request (see :mod:`labsupport.serve.backend`).

Every response carries ``X-Request-Id`` (for a generation, its ``id``). Bad input gets an HTTP 4xx
with OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, and the server goes on
serving; a 500 means a bug, and its traceback is logged. What a request may carry, and in which
ranges, is in :mod:`labsupport.serve.protocol`.

**The work one request can cause** is bounded before it is done: a body of at most
``max_body_bytes`` (HTTP 413), read within ``body_timeout_s`` (HTTP 408; the headers have their own
deadline, :mod:`labsupport.serve.timeouts`); JSON parsed by Python's parser (nesting beyond its
limit is a 400); a prompt of at most ``context x max_token_bytes`` UTF-8 bytes (longer cannot fit,
refused before tokenising; every served tokenizer says its ``max_token_bytes``); tokenised in a thread,
off the event loop, by a tokenizer linear-logarithmic in the text that lets go of Python's interpreter
lock while it works (so ``/health`` answers meanwhile); then at most ``max_tokens`` (at most
``--max-tokens-limit``) forward passes.

Where this server departs from OpenAI's API (on purpose, and said here so no client is surprised):
``temperature`` defaults to 0 (greedy, reproducible) where OpenAI's default is 1 (vLLM's, the
model's generation config, else 1); sampling without a ``seed`` uses the server's seed, so it repeats;
completions' ``max_tokens`` defaults to 16, as in OpenAI's and vLLM's; chat's to the rest of the
context (up to ``--max-tokens-limit``), as in vLLM; one prompt per request; a full server answers HTTP
429, which the ``openai`` client retries by default (``max_retries=2``); special-token strings typed in a
completions prompt (``<|im_start|>``) are text, by chapter 01's rule for text from a user, where vLLM and the
published tokenizer make them special ids (so such a prompt counts more tokens here): send token ids to
put a special token in a prompt.

**Back-pressure and drain.** ``--max-requests`` slots bound the requests queued, running, or still
being sent: a slot is held until the response's last byte has been handed to the connection (or the
client has gone), not only until the last token is made; a request beyond them gets HTTP 429 (code
``server_full``) with a ``Retry-After`` header instead of waiting in an unbounded queue. On SIGTERM
(or ``POST /admin/drain``) the server drains: new completions get HTTP 503 (code ``draining``, with
``Retry-After``), ``/ready`` answers 503 and ``/health`` says ``"draining"``, while every admitted
request runs to its end (streams finish with
``data: [DONE]``); then the process exits with status 0. Requests still running after
``drain_timeout_s`` are aborted (``finish_reason: "abort"``, counted as ``drain_timeout``). A second
SIGTERM stops at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .answers import Answer, error_body
from .backend import Backend, InvalidRequest, Timeline, log
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import parse_body, parse_chat, parse_completion

RETRY_AFTER_S = 1  # the Retry-After header of a 429 (server full) or 503 (draining), in seconds
MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than a prompt that fits the context takes
BODY_TIMEOUT_S = 30.0
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class _SafeJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message quoting a lone surrogate a
    client sent still renders (Starlette's JSONResponse would fail to encode it, a 500)."""

    def render(self, content) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   close: bool = False, request_id: str | None = None) -> JSONResponse:
    type_ = {404: "not_found_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    if status >= 500:
        type_ = "server_error"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}
    if close:
        headers["Connection"] = "close"
    if request_id:
        headers["X-Request-Id"] = request_id
    return _SafeJSON(error_body(message, type_, param, code), status_code=status, headers=headers)


class RequestIds:
    """ASGI middleware: every response carries ``X-Request-Id``: the generation's id where the
    handler set one (``request.state.request_id``), else ``req-`` and a fresh hex id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["request_hex"] = uuid.uuid4().hex[:24]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    rid = state.get("request_id") or f"req-{state['request_hex']}"
                    message = {**message, "headers": [*headers, (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _Account:
    """One admitted request's bookkeeping: its metrics, and its place among the requests in flight."""

    def __init__(self, app: FastAPI, handle, arrival: float):
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


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request's body: HTTP 413 past ``limit`` bytes (told by Content-Length, or counted as it
    comes), 408 if it has not all arrived within ``timeout_s`` seconds of the handler starting.

    A body over the limit is still read to its end (within the deadline), but not kept: closing a
    connection with unread bytes makes the kernel reset it, and the client would never see the 413."""
    declared = request.headers.get("content-length")
    size, chunks = 0, []

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)

    timed_out = False
    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        timed_out = True
    except ClientDisconnect:
        raise InvalidRequest("the client went away before its request body arrived", None, "client_disconnected",
                             close=True) from None
    if size > limit or (declared is not None and declared.isdigit() and int(declared) > limit):
        told = f"has {int(declared)} bytes" if declared is not None and declared.isdigit() else f"is over {limit} bytes"
        raise InvalidRequest(f"the request body {told}; this server takes at most {limit} (--max-body-bytes)",
                             None, "body_too_large", status=413, close=True)
    if timed_out:
        raise InvalidRequest(f"the request body did not arrive within {timeout_s:g} s (--body-timeout); send it "
                             f"whole, at once", None, "body_timeout", status=408, close=True)
    return b"".join(chunks)


def create_app(backend: Backend, *, drain_timeout_s: float = 30.0, on_drained=None,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
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
    app.state.limits = {"max_body_bytes": max_body_bytes, "body_timeout_s": body_timeout_s}
    app.state.begin_drain = _drainer(app, drain_timeout_s)
    _error_handlers(app)
    _service_routes(app)
    _generation_routes(app)
    app.add_middleware(RequestIds)
    return app


def _drainer(app: FastAPI, drain_timeout_s: float):
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

    return begin_drain


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InvalidRequest)
    async def invalid(request: Request, exc: InvalidRequest):
        if request.url.path in GENERATION_PATHS:
            app.state.metrics.rejected.labels(exc.code if exc.status in (429, 503) else str(exc.status)).inc()
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.close)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # a bug: fail this request, keep serving
        rid = request.scope.get("state", {}).get("request_id") or f"req-{request.scope.get('state', {}).get('request_hex', '')}"
        log.error("labsupport.serve: request %s failed with a bug", rid, exc_info=exc)
        # Connection: close, because Starlette re-raises after this answer and uvicorn then drops the
        # connection: a client that kept it alive would see its next request fail with a connection error
        return error_response(500, f"the server failed on this request: {type(exc).__name__}: {exc}",
                              request_id=rid, close=True)


def _model_card(backend: Backend) -> dict:
    served = backend.served_model
    return {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "labsupport",
            "root": backend.tokenizer_dir, "parent": None, "max_model_len": backend.context_tokens,
            "context_length": backend.context_tokens, "max_tokens_limit": backend.max_tokens_limit,
            "trained": served.trained, "weights": "trained" if served.trained else "random",
            "source": served.source, "description": backend.description}


def _service_routes(app: FastAPI) -> None:
    backend: Backend = app.state.backend

    @app.get("/health")
    async def health():
        body = {"status": "draining" if app.state.draining else "ok", "model": backend.model_name,
                "in_flight": len(app.state.inflight), **backend.stats()}
        if backend.failure is not None:
            return _SafeJSON({**body, "status": "failed", "error": backend.failure}, status_code=503)
        return body

    @app.get("/ready")
    async def ready():
        if backend.failure is not None:
            return error_response(503, f"the model worker has stopped ({backend.failure}); restart the server",
                                  code="worker_failed")
        if app.state.draining:
            return error_response(503, "the server is draining: it finishes the requests it has and takes no new "
                                  "ones", code="draining")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        return Response(app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/admin/drain")
    async def admin_drain():
        began = app.state.begin_drain()
        return {"status": "draining", "began_now": began, "in_flight": len(app.state.inflight)}

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str):
        account = app.state.inflight.get(request_id)
        if account is None:
            raise InvalidRequest(f"no request in flight has id {ascii(request_id)} (it has finished, or never was)",
                                 "request_id", "request_not_found", status=404)
        account.cancel("cancel")
        return {"id": request_id, "object": "cancellation", "cancelled": True}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(backend)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != backend.model_name:
            raise InvalidRequest(f"The model {ascii(model_id)} does not exist. This server serves "
                                 f"`{backend.model_name}`.", "model", "model_not_found", status=404)
        return _model_card(backend)

    @app.get("/v1/requests/{request_id}/timeline")
    async def timeline(request_id: str):
        found = backend.timeline(request_id)
        if found is None:
            raise InvalidRequest(f"no recent request has id {ascii(request_id)} (the server keeps the most recent "
                                 f"ones only)", "request_id", "request_not_found", status=404)
        return found.to_json()


def _generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(app, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(app, request, chat=True)


async def _generate(app: FastAPI, request: Request, chat: bool):
    """One generation request: read, validate, take a slot, tokenise off the loop, submit, answer."""
    backend: Backend = app.state.backend
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.scope['state']['request_hex']}"
    timeline = Timeline(rid)  # "arrival": the request's headers are in
    request.state.request_id = rid
    limits = app.state.limits
    raw = await read_body(request, limits["max_body_bytes"], limits["body_timeout_s"])
    example = (f'{{"model": "{backend.model_name}", ' +
               ('"messages": [{"role": "user", "content": "Hello"}]}' if chat else '"prompt": "Hello"}'))
    body = parse_body(raw, example)
    if app.state.draining:
        raise InvalidRequest("the server is draining (shutting down): it takes no new requests. Retry on "
                             "another replica, or later.", None, "draining", status=503)
    parse = parse_chat if chat else parse_completion
    call = parse(body, backend.model_name, backend.cfg.vocab_size, backend.max_tokens_limit)
    backend.check_size(call.prompt, call.messages)  # before taking a slot: a prompt too long is a 400, not a 429
    backend.reserve()
    try:
        prepared = await backend.prepare_async(chat, call.messages if chat else call.prompt, timeline=timeline,
                                               **call.options)
        handle = backend.submit(prepared, reserved=True, until_sent=True)
    except BaseException:
        backend.unreserve()
        raise
    try:
        answer = Answer(call, prepared, handle, _Account(app, handle, timeline.arrival), request,
                        backend.model_name, backend.served_model.fingerprint)
        if call.stream:
            return _SlotHeld(StreamingResponse(answer.events(), media_type="text/event-stream",
                                               headers={"Cache-Control": "no-cache", "X-Request-Id": rid}),
                             lambda: backend.sent(handle))
        return _SlotHeld(JSONResponse(await answer.whole()), lambda: backend.sent(handle))
    except BaseException:
        backend.sent(handle)
        raise


class _SlotHeld(Response):
    """``response``, whose request keeps its ``--max-requests`` slot until the response has ended: its
    last byte sent, or its client gone (``release`` runs either way)."""

    def __init__(self, response: Response, release):
        self.response, self.release = response, release
        self.status_code, self.raw_headers, self.background = response.status_code, response.raw_headers, None

    async def __call__(self, scope, receive, send):
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()
        if self.background is not None:  # what FastAPI may have attached to the answer
            await self.background()
