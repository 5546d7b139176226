"""Start the course server in the background and stop it: for labs and tests.

``ServerProcess`` runs ``python -m labsupport.serve --port 0`` in a subprocess, waits until its
``/health`` answers, and stops it with :meth:`ServerProcess.stop`, when a ``with`` block ends
(also on an error), when the Python that started it exits, and (``--exit-with-parent``) even when
that Python is killed outright::

    with ServerProcess() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        ...

In a notebook, ``server = ServerProcess().start()`` then ``server.stop()`` in the last cell; if
Run All stops early, the server still goes when the kernel shuts down or restarts.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

LISTENING = "labsupport.serve: listening on"  # the line the server prints once its socket is bound


class ServerFailed(RuntimeError):
    """The server did not start; the message carries its output."""


class ServerProcess:
    """The course server as a child process (see the module docstring).

    ``options`` are passed to ``python -m labsupport.serve`` (``["--max-requests", "4"]``).
    """

    def __init__(self, options=(), *, startup_timeout_s: float = 120.0, threads: int | None = None):
        self.options = [str(o) for o in options]
        if threads is not None:
            self.options += ["--threads", str(threads)]
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.output: list[str] = []
        self._listening = threading.Event()

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url``: ``http://127.0.0.1:PORT/v1``."""
        if self.url is None:
            raise RuntimeError("the server is not running; call start() first")
        return self.url + "/v1"

    def start(self) -> ServerProcess:
        if self.process is not None and self.process.poll() is None:
            return self
        command = [sys.executable, "-m", "labsupport.serve", "--port", "0", "--exit-with-parent", *self.options]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, stdin=subprocess.DEVNULL)
        atexit.register(self.stop)
        threading.Thread(target=self._drain, daemon=True, name="labsupport.serve output").start()
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while not self._listening.wait(0.1):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise ServerFailed(self._why("did not start"))
            while not self._healthy():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise ServerFailed(self._why("started but /health did not answer"))
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.output.append(line.rstrip("\n"))
            if line.startswith(LISTENING):
                self.url = line[len(LISTENING):].split()[0]
                self._listening.set()

    def _why(self, what: str) -> str:
        code = self.process.poll()
        status = f"exited with code {code}" if code is not None else f"still running after {self.startup_timeout_s:g} s"
        log = "\n".join(self.output[-30:]) or "(no output)"
        return f"the course server {what} ({status}). Its output:\n{log}"

    def _healthy(self) -> bool:
        try:
            return self.health().get("status") == "ok"
        except (OSError, ValueError):
            return False

    def health(self) -> dict:
        """The server's ``GET /health`` as a dict (running, queued, slots_total, slots_used...)."""
        with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
            return json.loads(response.read())

    def timeline(self, request_id: str) -> dict:
        """``GET /v1/requests/{request_id}/timeline``: the stages of a recent request."""
        with urllib.request.urlopen(f"{self.url}/v1/requests/{request_id}/timeline", timeout=5) as response:
            return json.loads(response.read())

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Stop the server (politely, then by force after 10 s). Safe to call twice."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
        atexit.unregister(self.stop)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"running at {self.url}" if self.running() else "stopped"
        return f"ServerProcess({state})"


_started: ServerProcess | None = None  # the server start_server() started last, in this Python


def start_server(options=(), *, threads: int | None = None) -> ServerProcess:
    """Start the course server in the background and return its :class:`ServerProcess`.

    For notebooks: running the cell again first stops the server the previous call started, so a
    kernel never collects stray servers. Stop it with ``server.stop()``; it also stops when the
    kernel exits."""
    global _started
    if _started is not None:
        _started.stop()
    _started = ServerProcess(options, threads=threads).start()
    return _started
