"""Test setup. TRITON_INTERPRET must be decided before any kernel is defined, and notebook
kernels started by the tests inherit the environment, so it is set here, first."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")

# Under `pytest -n N` (make test: 2 workers on 2 cores) each worker, and every notebook kernel or
# script it starts, gets its share of the cores. torch otherwise starts one thread per core in
# every process, and on a busy machine those threads spin waiting for each other: two lab 10
# notebooks run side by side took 60 CPU-s with torch's default threads and 28 CPU-s with one
# thread each. Tests that need a thread count set it themselves (test_phases sets two).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import shutil  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from testhelpers import load_script  # noqa: E402

import labsupport  # noqa: E402,F401  (sets TRITON_INTERPRET=1 when there is no CUDA device)

if "OMP_NUM_THREADS" in os.environ:  # torch may already be imported (by the nbval plugin): apply it now too
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ROOT = Path(__file__).resolve().parent.parent


serve_book = load_script("serve_book")
BUILT_BOOK = ROOT / "_build" / "html"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _missing(reason: str):
    """In CI a missing prerequisite is a failure; on a learner's machine, a skip."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def _served_book():
    """The built book (``make book``) served on 127.0.0.1 as ``make serve`` does; yields the base URL."""
    if not (BUILT_BOOK / "index.html").exists():
        _missing(f"the book is not built ({BUILT_BOOK} missing): run `make book` first")
    server = serve_book.make_server(BUILT_BOOK, port=0)  # what `make serve` runs, on a free port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def book_url(request, _served_book):
    """The base URL of the built book, served (see ``_served_book``). Only for tests marked ``book``:
    ``make test`` builds the book while the other tests run, and runs those marked ``book`` after it."""
    if request.node.get_closest_marker("book") is None:
        pytest.fail(f"{request.node.nodeid} reads the built book but is not marked @pytest.mark.book, so "
                    "`make test` may run it before the book is built: mark it")
    return _served_book


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """Headless Chromium (the system one; Playwright never downloads a browser here)."""
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        _missing("Chromium is not installed (apt-get install chromium); .ci/run installs it")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed: run `make setup`")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh page that records console errors and uncaught exceptions in ``page.js_errors``."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.js_errors = []
    pg.on("pageerror", lambda exc: pg.js_errors.append(f"uncaught: {exc}"))
    pg.on(
        "console",
        lambda msg: pg.js_errors.append(f"console.error: {msg.text} ({msg.location.get('url', '')})")
        if msg.type == "error" and "Failed to load resource" not in msg.text
        else None,
    )
    # a missing file is reported by URL (the console message above does not say which)
    pg.on("response", lambda r: pg.js_errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    yield pg
    context.close()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (the course's real model, installed by ``make setup``), loaded once per
    test worker from its cached conversion."""
    from labsupport.checkpoints import CheckpointError, load

    try:
        return load("smollm2-135m-instruct", verbose=False)
    except CheckpointError as exc:
        _missing(f"the course's real model is not installed: {exc}")


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, the caller's count restored after (CPU speed tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
