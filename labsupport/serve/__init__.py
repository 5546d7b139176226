"""The course server: ``python -m labsupport.serve`` (chapter 03, and the chapters after it).

An OpenAI-compatible HTTP server on 127.0.0.1 serving the course model (a small Llama-style
decoder with **random weights**, so its text is meaningless) and the course tokenizer (chapter 01),
or a real checkpoint (``--model``). Modules, from the wire inwards:

* :mod:`~labsupport.serve.cli`: the command line (``--port 0`` picks a free port and prints it).
* :mod:`~labsupport.serve.timeouts`: a deadline for each request's headers (uvicorn has none).
* :mod:`~labsupport.serve.app`: the HTTP layer (FastAPI): ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/ready``, ``/metrics``, the course's ``/v1/requests/{id}/timeline`` and
  ``/v1/requests/{id}/cancel``, ``/admin/drain``; OpenAI error bodies, 429 when full, a graceful drain,
  the bounds on what one request may cost.
* :mod:`~labsupport.serve.protocol`: every request field checked, with the ranges the engine accepts.
* :mod:`~labsupport.serve.answers`: whole and streamed answers in OpenAI's shapes.
* :mod:`~labsupport.serve.metrics`: the Prometheus metrics, named after vLLM's (chapter 15).
* :mod:`~labsupport.serve.backend`: what both back ends share (slots, handles, timelines, the
  worker's life, stop strings and detokenisation); :mod:`~labsupport.serve.fifo`: chapter 03's
  first-in, first-out back end, ``FifoBackend`` (:mod:`~labsupport.serve.engine` is the module's old
  name); :mod:`~labsupport.serve.continuous`: ``ContinuousBackend``, chapter 13's engine
  (:mod:`labsupport.engine`) behind the server. In code, "engine" means chapter 13's engine; the
  server's classes are back ends (their old names, ``FifoEngine`` and ``ContinuousEngine``, still work).
* :mod:`~labsupport.serve.served_model`: the model served and its tokenizer (the course model and
  its chat template, or a real checkpoint); :mod:`~labsupport.serve.hf_tokenizer`: the course
  tokenizer in Hugging Face format, for benchmark clients.
* :mod:`~labsupport.serve.process`: :class:`ServerProcess` (and :func:`start_server`), which starts the server in the
  background for a lab or a test, waits for ``/health`` and stops it; :func:`install_missing`, which
  installs fastapi, uvicorn and openai where they are missing (a fresh Colab runtime).

Importing this package imports only :mod:`~labsupport.serve.process` (no web framework, no model).
"""

from .process import ServerFailed, ServerProcess, install_missing, start_server

__all__ = ["ServerFailed", "ServerProcess", "install_missing", "start_server"]
