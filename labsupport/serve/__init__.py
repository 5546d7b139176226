"""The course server: ``python -m labsupport.serve`` (chapter 03, and the chapters after it).

An OpenAI-compatible HTTP server on 127.0.0.1 serving the course model (a small Llama-style
decoder with **random weights**, so its text is meaningless) and the course tokenizer
(chapter 01). Modules:

* :mod:`~labsupport.serve.app`: the HTTP layer (FastAPI): ``/v1/completions`` (streamed or not),
  ``/v1/models``, ``/health``, ``/ready``, ``/metrics``, the course's ``/v1/requests/{id}/timeline`` and
  ``/v1/requests/{id}/cancel``, ``/admin/drain``; OpenAI error bodies, 429 when full, a graceful drain.
* :mod:`~labsupport.serve.metrics`: the Prometheus metrics, named after vLLM's (chapter 15).
* :mod:`~labsupport.serve.engine`: the back end behind a small interface (``Backend``): this
  chapter's first-in, first-out scheduler, the model worker, and each request's stage timestamps.
* :mod:`~labsupport.serve.cli`: the command line (``--port 0`` picks a free port and prints it).
* :mod:`~labsupport.serve.process`: :class:`ServerProcess` (and :func:`start_server`), which starts the server in the
  background for a lab or a test, waits for ``/health`` and stops it; :func:`install_missing`, which
  installs fastapi, uvicorn and openai where they are missing (a fresh Colab runtime).

Importing this package imports only :mod:`~labsupport.serve.process` (no web framework, no model).
"""

from .process import ServerFailed, ServerProcess, install_missing, start_server

__all__ = ["ServerFailed", "ServerProcess", "install_missing", "start_server"]
