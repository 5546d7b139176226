"""A deadline for a request's headers, which uvicorn does not have.

uvicorn bounds the size of a request's headers (``h11_max_incomplete_event_size``, 16 KB) and closes a
keep-alive connection idle for ``timeout_keep_alive`` seconds after a response, but that timer is reset
by every byte received and does not run at all on a fresh connection: a client that opens a
connection and sends its headers one byte every few seconds (slow loris) holds it for ever. In front
of a real deployment a proxy does this job (nginx's ``client_header_timeout`` and
``client_body_timeout``, 60 s each by default); the course server does it itself:

* :func:`timed_protocol` makes a subclass of uvicorn's h11 protocol that gives each request
  ``header_timeout_s`` seconds, from the connection's opening (or the end of the previous
  response), to deliver its whole header block. Past that the server answers HTTP 408 with OpenAI's
  error body and closes the connection; an idle connection between requests is closed silently.
  uvicorn's own 400 for a request it cannot parse gets OpenAI's error body too.
* The body has its own deadline, counted from the end of the headers, in the HTTP layer
  (:func:`labsupport.serve.app.read_body`: HTTP 408).
"""

from __future__ import annotations

import json
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode("ascii")
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-request-id: req-{uuid.uuid4().hex[:24]}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def timed_protocol(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline of ``header_timeout_s`` for each request's headers."""

    class TimedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived: its body has the app's deadline
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return  # a request is being answered
            if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
                self.transport.close()  # an idle connection: nothing was asked
                return
            self.transport.write(_raw_response(
                408, "Request Timeout", f"the request's headers did not arrive within {header_timeout_s:g} s "
                f"(--header-timeout); send them whole, at once", "header_timeout"))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(_raw_response(
                400, "Bad Request", f"{msg} It is not HTTP/1.1 this server can read (or its headers are over "
                f"16 KB).", "invalid_http"))
            self.transport.close()

    return TimedH11Protocol
