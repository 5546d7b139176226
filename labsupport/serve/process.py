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

:func:`install_missing` pip-installs the server's own packages (fastapi, uvicorn, openai,
prometheus-client) where they
are missing, as on a fresh Colab runtime, with the installed torch, triton and numpy pinned so pip
can never replace them.
"""

from __future__ import annotations

import atexit
import collections
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

LISTENING = "labsupport.serve: listening on"  # the line the server prints once its socket is bound


#: What the server and lab 03's client need beyond the course's own dependencies: the ``serve``
#: extra of pyproject.toml (a test keeps the two the same).
SERVER_PACKAGES = {"fastapi": "fastapi>=0.110", "uvicorn": "uvicorn>=0.30", "openai": "openai>=1.40",
                   "prometheus_client": "prometheus-client>=0.20", "tokenizers": "tokenizers>=0.22",
                   "httpx": "httpx>=0.27"}
PINNED = ("torch", "triton", "numpy")  # what an install must never replace (Colab's builds)


def install_missing(packages: dict[str, str] | None = None) -> list[str]:
    """pip-install those of ``packages`` (module name -> requirement; default
    :data:`SERVER_PACKAGES`) that this Python cannot import, and return their requirements.

    Nothing happens where they are all installed (``make lab``, ``pip install "labsupport[serve]"``).
    The versions of torch, triton and numpy installed now are passed to pip as constraints, so an
    install that would replace one fails instead of changing them."""
    packages = SERVER_PACKAGES if packages is None else packages
    missing = [req for module, req in packages.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return []
    pins = []
    for name in PINNED:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    print(f"installing {', '.join(missing)} (the course server's packages; {', '.join(pins) or 'nothing'} "
          f"held as they are)", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\n".join(pins) + "\n")
    try:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", constraints.name, *missing],
                             capture_output=True, text=True)
    finally:
        os.unlink(constraints.name)
    if pip.returncode:
        raise RuntimeError(f"could not install {', '.join(missing)}; install them yourself "
                           f"(pip install {' '.join(repr(m) for m in missing)}) and rerun. pip said:\n"
                           f"{pip.stderr[-1500:]}")
    importlib.invalidate_caches()
    return missing


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
        self.output: collections.deque[str] = collections.deque(maxlen=500)  # its latest lines
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
        log = "\n".join(list(self.output)[-30:]) or "(no output)"
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
        """Stop the server (SIGTERM: a graceful drain, then by force after 10 s). Safe to call twice."""
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
