"""The course server's answers to a generation request, whole or streamed, in OpenAI's shapes.

One :class:`Answer` per admitted request turns the :class:`~labsupport.serve.backend.TokenOut`
items of its handle into what the client reads:

* ``/v1/completions``: ``{"object": "text_completion", "choices": [{"text", "finish_reason", ...}]}``;
  streamed, one ``data:`` event per token with the same shape (``usage`` null);
* ``/v1/chat/completions``: ``{"object": "chat.completion", "choices": [{"message": {"role":
  "assistant", "content"}, ...}]}``; streamed (``chat.completion.chunk``), a first event whose
  delta holds the role (and empty content), then one per token with ``delta.content``; the last
  token's event carries ``finish_reason``.

Streams end with ``data: [DONE]``. With ``stream_options.include_usage`` one more event before it
holds the usage and no choices (OpenAI's rule); with vLLM's ``continuous_usage_stats`` every event
also carries the usage so far. Every event and answer names the model and carries a
``system_fingerprint`` that says whether its weights are trained. A request stopped early
(cancelled, or cut by the drain timeout) ends with ``finish_reason: "abort"``, as in vLLM. A failure
after the stream has started cannot change the HTTP status: it arrives as one last event ``data:
{"error": {...}}`` before ``data: [DONE]`` (as vLLM does), which the ``openai`` client raises as an
``APIError``.
"""

from __future__ import annotations

import asyncio
import json
import time

from .backend import GenerationRequest, RequestHandle, TokenOut, log
from .protocol import Call


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Answer:
    """What one admitted request sends back (see the module docstring). ``account`` keeps its
    metrics; ``request`` is the HTTP request, watched for a disconnect."""

    def __init__(self, call: Call, prepared: GenerationRequest, handle: RequestHandle, account, request,
                 model_name: str, fingerprint: str):
        self.call, self.handle, self.account, self.request = call, handle, account, request
        self.timeline = prepared.timeline
        self.id, self.created, self.n_prompt = prepared.request_id, int(time.time()), len(prepared.prompt_ids)
        self.head = {"id": self.id, "object": "", "created": self.created, "model": model_name,
                     "system_fingerprint": fingerprint}
        self.produced = 0

    # -- pieces --

    def usage(self) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": self.produced,
                "total_tokens": self.n_prompt + self.produced}

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if not self.call.chat:
            return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def event(self, choices: list, usage: dict | None = None) -> str:
        kind = "chat.completion.chunk" if self.call.chat else "text_completion"
        if usage is None and self.call.continuous_usage and choices:
            usage = self.usage()
        payload = {**self.head, "object": kind, "choices": choices, "usage": usage}
        return f"data: {json.dumps(payload)}\n\n"

    async def _watch_disconnect(self) -> None:
        """Cancel the request when its client goes away, whether it waits in the queue (no byte
        sent yet) or generates: independent of how the web stack reports disconnects."""
        while not await self.request.is_disconnected():
            await asyncio.sleep(0.1)
        self.handle.cancel()

    # -- streamed --

    async def events(self):
        """The server-sent events of a streamed answer."""
        failed = False
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            try:
                if self.call.chat:
                    yield self.event([self._choice(None, None, role=True)])
                async for out in self.handle:
                    yield self._token_event(out)
                if self.handle.end_reason is not None:  # stopped early: say so, as vLLM does
                    yield self.event([self._choice(self.handle.end_text, self.handle.end_reason)])
                if self.call.include_usage:
                    yield self.event([], self.usage())
            except Exception as exc:  # the status line has gone: say so in the stream itself
                failed = True
                log.error("labsupport.serve: request %s failed mid-stream", self.id, exc_info=exc)
                failure = error_body(f"the server failed on this request: {type(exc).__name__}: {exc}", "server_error")
                yield f"data: {json.dumps(failure)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects: the stream is cancelled, the slot freed
            watcher.cancel()
            self.handle.cancel()
            self.account.end(failed)

    def _token_event(self, out: TokenOut) -> str:
        self.account.token(out)
        self.produced += 1
        self.timeline.mark("chunk_sent", out.index)
        return self.event([self._choice(out.text, out.finish_reason)])

    # -- whole --

    async def whole(self) -> dict:
        """The answer of a request that is not streamed, once it has finished."""
        watcher = asyncio.create_task(self._watch_disconnect())
        pieces, finish, failed = [], None, True
        try:
            async for out in self.handle:
                self.account.token(out)
                self.produced += 1
                pieces.append(out.text)
                finish = out.finish_reason
            if self.handle.end_reason is not None:
                pieces.append(self.handle.end_text)
                finish = self.handle.end_reason
            failed = False
        finally:
            watcher.cancel()
            self.handle.cancel()
            self.account.end(failed)
        self.timeline.mark("response_sent")
        text = "".join(pieces)
        if self.call.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion" if self.call.chat else "text_completion"
        return {**self.head, "object": kind, "choices": [choice], "usage": self.usage()}
