"""A ``--max-requests`` slot lasts until the HTTP response has been sent, not only until the last token
is made: against a real server in a subprocess, streams whose tokens are all made but whose responses
cannot finish (their clients read nothing, so flow control holds the rest of the bytes) keep their
slots, a burst of requests beyond them is refused with HTTP 429, and one is accepted as soon as one
stream has been read to its end."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from labsupport.serve import ServerProcess
from labsupport.serve.served_model import MODEL_NAME

SLOTS = 1  # --max-requests 1, as when a request beyond it was once answered 200 while the first streamed
RECEIVE_BUFFER = 4096  # the client's socket: its window closes at once when nothing is read
EVENT_BYTES = 340  # a streamed token's event with its usage (continuous_usage_stats), at least


def _tokens() -> int:
    """Enough tokens that a stream's bytes overflow what the kernel's send buffer (at most tcp_wmem's
    largest size, overhead included), the client's receive buffer and uvicorn's write buffer (64 KiB)
    can hold for a client that reads nothing."""
    try:
        send_max = int(open("/proc/sys/net/ipv4/tcp_wmem").read().split()[2])
    except (OSError, IndexError, ValueError):
        send_max = 4 << 20  # Linux's default
    return (send_max + (256 << 10)) // EVENT_BYTES


TOKENS = _tokens()


@pytest.fixture(scope="module")
def server():
    if TOKENS > 40_000:
        pytest.skip(f"this machine's TCP send buffers hold up to {TOKENS * EVENT_BYTES >> 20} MiB: a stream long "
                    f"enough to fill them would take minutes")
    with ServerProcess(["--context", str(TOKENS + 64), "--max-tokens-limit", str(TOKENS),
                        "--max-requests", str(SLOTS)], threads=1) as srv:
        yield srv


def wait_for(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def unread_stream(url: str) -> socket.socket:
    """A streamed completion of TOKENS tokens on a raw socket whose client reads nothing yet."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.connect((parts.hostname, parts.port))
    body = json.dumps({"model": MODEL_NAME, "prompt": "hold the slot", "max_tokens": TOKENS, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock


def read_to_the_end(sock: socket.socket) -> bytes:
    """Everything the server sends until its chunked body's last chunk, then the socket closed."""
    sock.settimeout(60)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        more = sock.recv(65536)
        if not more:
            break
        data += more
    sock.close()
    return data


def test_a_slot_is_held_until_the_response_is_sent_and_freed_after(server):
    health = server.health
    wait_for(lambda: health()["slots_used"] == 0, "an idle server")
    served = health()["served"]
    streams = [unread_stream(server.url) for _ in range(SLOTS)]
    try:
        # the back end makes every token and finishes both requests; their responses are still being sent
        wait_for(lambda: health()["served"] == served + SLOTS, "both generations to finish")
        assert health()["slots_used"] == SLOTS and health()["running"] == 0

        answers = []  # a burst beyond the slots, at once: every one refused while both streams are open

        def one_more():
            answers.append(httpx.post(server.url + "/v1/completions", timeout=60,
                                      json={"model": MODEL_NAME, "prompt": "one more", "max_tokens": 2}))

        burst = [threading.Thread(target=one_more) for _ in range(8)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(60)
        assert [a.status_code for a in answers] == [429] * 8
        assert {a.json()["error"]["code"] for a in answers} == {"server_full"}
        assert health()["in_flight"] == SLOTS  # the responses were still being sent all along

        first = read_to_the_end(streams[0])  # one client reads its answer to the end: its slot is free
        assert first.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in first
        assert first.count(b'"finish_reason": "length"') == 1
        wait_for(lambda: health()["slots_used"] == SLOTS - 1, "the read stream's slot to be freed")
        accepted = httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"model": MODEL_NAME, "prompt": "one more", "max_tokens": 2})
        assert accepted.status_code == 200 and accepted.json()["choices"][0]["text"] is not None
    finally:
        for sock in streams[1:]:
            read_to_the_end(sock)
    wait_for(lambda: health()["slots_used"] == 0, "every slot to be freed")
