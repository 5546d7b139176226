"""A real HTTP server on the loopback interface that answers every request with a scripted stream of
bytes: for checks of clients (lab 03's server-sent-events client).

Each :class:`Script` is a list of pieces, each sent as one HTTP chunk (``Transfer-Encoding:
chunked``) after its delay, and an ending: ``"end"`` (the terminating chunk: a complete body),
``"cut"`` (the socket is closed mid-body, as when a proxy or the server dies) or ``"hold"`` (the
connection stays open after the last piece, with a ``: keep-alive`` comment every 0.1 s, until the
client hangs up or ``hold_s`` passes). The server notes when each piece was sent
(``time.monotonic()``, the clock a client stamps arrivals with) and what each request was.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Script:
    pieces: list[tuple[float, bytes]]  # (delay before sending, bytes sent as one chunk)
    ending: str = "end"  # "end", "cut" or "hold"
    hold_s: float = 3.0
    sent_at: list[float] = field(default_factory=list)  # monotonic time each piece was sent
    request: dict = field(default_factory=dict)  # method, path, headers, body of the request received
    hung_up_s: float | None = None  # when a held connection was closed by the client


class ByteServer:
    """``with ByteServer() as srv: srv.play(script)`` then request ``srv.url``; one request at a time."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1/completions"
        self._script: Script | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="labsupport byte server")
        self._thread.start()

    def play(self, script: Script) -> Script:
        """Answer the next request with ``script``."""
        self._done.clear()
        self._script = script
        return script

    def wait(self, timeout: float) -> bool:
        """Whether the last script's connection is over (sent, cut, or hung up by the client)."""
        return self._done.wait(timeout)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    pass
                finally:
                    self._done.set()

    def _answer(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(10)
        script = self._script
        raw = b""
        while b"\r\n\r\n" not in raw:
            more = conn.recv(65536)
            if not more:
                return
            raw += more
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path = (lines[0].split(" ") + ["", ""])[:2]
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        length = int(headers.get("content-length", 0) or 0)
        while len(body) < length:
            more = conn.recv(65536)
            if not more:
                break
            body += more
        script.request = {"method": method, "path": path, "headers": headers, "body": body}
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        for delay, piece in script.pieces:
            if delay:
                time.sleep(delay)
            script.sent_at.append(time.monotonic())
            conn.sendall(_chunk(piece))
        if script.ending == "end":
            conn.sendall(b"0\r\n\r\n")
        elif script.ending == "hold":
            deadline = time.monotonic() + script.hold_s
            while time.monotonic() < deadline:
                time.sleep(0.1)
                try:
                    conn.sendall(_chunk(b": keep-alive\n\n"))
                except OSError:  # the client hung up: what a client should do after [DONE]
                    script.hung_up_s = time.monotonic()
                    return
            conn.sendall(b"0\r\n\r\n")
        # "cut": the socket closes without the terminating chunk

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the serving thread
        except OSError:
            pass
        self._listener.close()

    def __enter__(self) -> ByteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chunk(piece: bytes) -> bytes:
    return f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
