"""A learner's own copy of the labs (`make lab`), and the book served locally (`make serve`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"course_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

my_labs = load_script("my_labs")
serve_book = load_script("serve_book")


def _lab(path: Path, digest: str, text: str = "") -> None:
    nb = {"cells": [{"cell_type": "code", "source": text, "metadata": {}, "outputs": [], "execution_count": None}],
          "metadata": {"labsupport": {"digest": digest}}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


def test_first_run_copies_every_lab(tmp_path):
    labs, mine = tmp_path / "labs", tmp_path / "my-labs"
    labs.mkdir()
    _lab(labs / "00_a.ipynb", "d0")
    _lab(labs / "04_b.ipynb", "d4")
    copied, kept = my_labs.sync(labs, mine, log=lambda *_: None)
    assert sorted(p.name for p in copied) == ["00_a.ipynb", "04_b.ipynb"] and kept == []
    assert (mine / "00_a.ipynb").read_bytes() == (labs / "00_a.ipynb").read_bytes()


def test_work_is_never_overwritten_and_new_labs_arrive(tmp_path):
    labs, mine = tmp_path / "labs", tmp_path / "my-labs"
    labs.mkdir()
    _lab(labs / "00_a.ipynb", "d0")
    my_labs.sync(labs, mine, log=lambda *_: None)
    _lab(mine / "00_a.ipynb", "d0", "my answer")  # the learner works in their copy
    _lab(labs / "00_a.ipynb", "d0-new", "the course's new version")  # git pull brings a new release
    _lab(labs / "05_c.ipynb", "d5")  # and a new lab
    said = []
    copied, kept = my_labs.sync(labs, mine, log=said.append)
    assert [p.name for p in copied] == ["05_c.ipynb"] and [p.name for p in kept] == ["00_a.ipynb"]
    assert "my answer" in (mine / "00_a.ipynb").read_text()
    assert any("00_a.ipynb has changed since you copied it" in line for line in said), said


def test_unchanged_lab_is_not_reported(tmp_path):
    labs, mine = tmp_path / "labs", tmp_path / "my-labs"
    labs.mkdir()
    _lab(labs / "00_a.ipynb", "d0")
    my_labs.sync(labs, mine, log=lambda *_: None)
    said = []
    my_labs.sync(labs, mine, log=said.append)
    assert not any("has changed since" in line for line in said)


def test_make_lab_opens_the_ignored_copy():
    recipe = (ROOT / "Makefile").read_text().split("\nlab:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/my_labs.py labs my-labs --open $(VENV)/bin/jupyter" in recipe
    command = my_labs.lab_command("jupyter", Path("my-labs"))
    assert command[:2] == ["jupyter", "lab"] and command[-1] == "my-labs"
    ignored = subprocess.run(["git", "check-ignore", "-q", "my-labs/00_first_kernel.ipynb"], cwd=ROOT)
    assert ignored.returncode == 0, "my-labs/ must be git-ignored"


def test_serve_listens_on_localhost_only_and_serves_the_book(tmp_path):
    (tmp_path / "index.html").write_text("<title>the book</title>")
    server = serve_book.make_server(tmp_path, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=10) as response:
            assert response.status == 200 and b"the book" in response.read()
    finally:
        server.shutdown()
        server.server_close()


def test_serve_without_a_built_book_says_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="make book"):
        serve_book.make_server(tmp_path, port=0)


@pytest.mark.book
def test_search_shows_snippets_when_served(page, book_url):
    """Over file:// the search finds pages but cannot fetch their text; served, each result has one."""
    page.goto(f"{book_url}/search.html?q=bandwidth", wait_until="load")
    page.wait_for_selector("ul.search li", timeout=20_000)
    page.wait_for_function("document.querySelector('ul.search li p.context') !== null", timeout=20_000)
    snippets = page.eval_on_selector_all("ul.search li p.context", "ps => ps.map(p => p.textContent)")
    assert snippets and any("bandwidth" in s.lower() for s in snippets), snippets
    assert not [e for e in page.js_errors if "CORS" in e or "Failed to fetch" in e], page.js_errors


def test_jupyterlab_starts_as_root_with_the_courses_settings(tmp_path):
    """`make lab`'s command, started for real: as root it needs --allow-root, and the course's
    overrides.json turns off the news pop-up that would cover a fresh start's first outputs."""
    import json
    import os
    import socket
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jupyter = str(Path(sys.executable).with_name("jupyter"))
    command = my_labs.lab_command(jupyter, tmp_path, "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
                                  "--IdentityProvider.token=")
    assert ("--allow-root" in command) == (os.geteuid() == 0)
    env = {**os.environ, **{v: str(tmp_path / v.lower()) for v in (
        "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR")}}
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"JupyterLab exited: {server.stdout.read()[-2000:]}"
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    schema = json.loads(response.read())["schema"]["properties"]
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer within 60 s"
                time.sleep(0.3)
        assert schema["fetchNews"]["default"] == "false" and schema["checkForUpdates"]["default"] is False
    finally:
        server.terminate()
        server.wait(timeout=30)
