"""A streaming client for OpenAI-style server-sent events on raw ``httpx`` (chapter 03).

A streamed completion is an HTTP response of type ``text/event-stream``: lines of text, each
ending in ``\\n`` (or ``\\r\\n``), grouped into events by blank lines. In an event, ``data:`` lines
carry the payload (one space after the colon is dropped; several ``data:`` lines join with
``\\n``); a line starting with ``:`` is a comment (servers send ``: keep-alive`` to hold the
connection open); other fields (``event:``, ``id:``, ``retry:``) are not used by OpenAI's streams.
Each payload is a JSON chunk, the payload ``[DONE]`` ends the stream, and a failure after the
status line has gone arrives as a chunk ``{"error": {...}}`` (the course server, like vLLM, sends it
before ``[DONE]``). The rules are the WHATWG HTML standard's "server-sent events" section, with one
leniency: when the body ends, a last line or event that lacks its newline still counts.

:func:`stream_events` is the course's answer to lab 03's exercise; the lab's learners write their
own, and ``labsupport.checks.check_sse_client`` compares the two on a real course server and on raw
byte streams.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ._answers import answer

if TYPE_CHECKING:
    import httpx

DONE = "[DONE]"


def _error_message(body) -> str:
    """The ``message`` of an OpenAI error body ``{"error": {"message": ...}}``, else the body."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(error if error is not None else body)


def _status_error(response: httpx.Response) -> RuntimeError:
    response.read()
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text[:500]
    return RuntimeError(f"the server answered HTTP {response.status_code}: {message}")


@answer
def stream_events(client: httpx.Client, url: str, payload: dict) -> Iterator[tuple[float, dict]]:
    """POST ``payload`` (JSON) to ``url`` and yield ``(arrival_s, chunk)`` for every event of the
    streamed answer, in order, until ``data: [DONE]``.

    ``arrival_s`` is ``time.monotonic()`` when the network chunk that completed the event arrived;
    ``chunk`` is the event's JSON payload. Raises ``RuntimeError`` (with the server's message) for a
    status other than 200 or an error event, and ``ConnectionError`` when the body ends, or the
    connection breaks, before ``[DONE]``."""
    import httpx  # the serve extra's: importing this module (the checks do) must not need it

    with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            raise _status_error(response)
        pending = b""  # bytes of a line not yet complete
        data: list[str] = []  # the data lines of the event being read
        received = 0
        try:
            for piece in response.iter_bytes():
                arrived = time.monotonic()
                *lines, pending = (pending + piece).split(b"\n")
                for line in lines:
                    chunk = _line(line, data)
                    if chunk is DONE:
                        return
                    if chunk is not None:
                        received += 1
                        yield arrived, chunk
        except httpx.TransportError as exc:  # cut, reset or timed out: the chunked body never ended
            raise ConnectionError(f"the stream broke after {received} events, before data: {DONE} "
                                  f"({type(exc).__name__}: {exc})") from exc
        arrived = time.monotonic()
        for line in (pending, b""):  # the body has ended: a last line and event without newlines count
            chunk = _line(line, data) if line or data else None
            if chunk is DONE:
                return
            if chunk is not None:
                received += 1
                yield arrived, chunk
    raise ConnectionError(f"the stream ended after {received} events without data: {DONE} (cut short?)")


def _line(raw: bytes, data: list[str]):
    """Read one line: a blank line ends the event (its chunk, :data:`DONE` or None comes back);
    a ``data:`` line is added to ``data``; comments and other fields change nothing."""
    line = raw.removesuffix(b"\r").decode("utf-8")
    if line:
        field, _, value = line.partition(":")
        if field == "data":  # a comment (":...") has the empty field name
            data.append(value.removeprefix(" "))
        return None
    if not data:
        return None  # a blank line with no event before it (a keep-alive)
    payload = "\n".join(data)
    data.clear()
    if payload == DONE:
        return DONE
    chunk = json.loads(payload)
    if isinstance(chunk, dict) and "error" in chunk:
        raise RuntimeError(f"the server reported an error mid-stream: {_error_message(chunk)}")
    return chunk
