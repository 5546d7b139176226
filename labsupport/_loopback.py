"""Small real HTTP services on 127.0.0.1 that labs and checks talk to (``load_testing.SlowService``,
``retries.RetryAfterService``): the server class, its start and stop, and a JSON answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackServer(ThreadingHTTPServer):
    # a class attribute, read when the socket starts listening: http.server's default backlog of 5
    # drops connections when dozens arrive at once on a busy machine, and the client retries 1 s later
    request_queue_size = 128
    daemon_threads = True


class LoopbackService:
    """A context manager's start and stop: :meth:`_start` serves ``handler`` from a thread and sets
    ``url``; leaving the ``with`` block shuts the server down."""

    _server: LoopbackServer | None = None
    url = ""

    def _start(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self._server = LoopbackServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self._server.serve_forever, daemon=True, name=name).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def reply_json(handler: BaseHTTPRequestHandler, status: int, body, headers: dict | None = None) -> None:
    """Answer ``handler``'s request with ``status`` and ``body`` as JSON (and any extra ``headers``)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
