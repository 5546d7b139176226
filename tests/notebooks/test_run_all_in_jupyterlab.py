"""Run All in a real JupyterLab, in headless Chromium: it stops at the first exercise's check, and
the view is on that cell with its short message.

This is the check ``test_run_all.py`` stands in for on every run (the same kernel protocol, without
a browser). It costs about a minute on two cores (JupyterLab's start, the lab's first cells and the
browser), so it runs only when asked: ``LABSUPPORT_JUPYTERLAB_TEST=1 .venv/bin/python -m pytest
tests/notebooks/test_run_all_in_jupyterlab.py``. Run it after upgrading JupyterLab. The screenshot
goes to ``_build/screenshots/jupyterlab_run_all.png``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = "13_decode_loop.ipynb"
pytestmark = [
    pytest.mark.notebook,
    pytest.mark.skipif(not os.environ.get("LABSUPPORT_JUPYTERLAB_TEST"), reason="set LABSUPPORT_JUPYTERLAB_TEST=1"),
]
FAILED = "Array.from(document.querySelectorAll('.jp-Notebook .jp-OutputArea-output'))" \
         ".find(e => e.innerText.includes('CheckFailed'))"


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab as `make lab` starts it (scripts/my_labs.py), on a copy of lab 13."""
    from testhelpers import load_script

    work = tmp_path / "my-labs"
    work.mkdir()
    shutil.copy(ROOT / "labs" / LAB, work / LAB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = load_script("my_labs").lab_command(
        str(Path(sys.executable).with_name("jupyter")), work, "--no-browser", f"--port={port}",
        "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--LabApp.expose_app_in_browser=True")
    env = {**os.environ, **{v: str(tmp_path / v.lower()) for v in (
        "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR")}}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "JupyterLab did not start"
            time.sleep(0.5)
    yield url
    server.terminate()
    server.wait(timeout=30)


def test_run_all_stops_at_the_first_check_with_the_view_there(jupyterlab, page):
    page.goto(f"{jupyterlab}/lab/tree/{LAB}")
    page.wait_for_function("document.body.innerText.includes('Python 3 (ipykernel) | Idle')", timeout=180_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(f"{FAILED} !== undefined", timeout=300_000)
    time.sleep(3)  # the kernel has aborted the rest; the failed cell's script has scrolled
    seen = page.evaluate(f"""() => {{
      const cells = Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell'));
      const cell = {FAILED}.closest('.jp-Cell');
      const view = cell.closest('.jp-WindowedPanel-outer').getBoundingClientRect(), box = cell.getBoundingClientRect();
      const prompts = cells.filter(c => c.classList.contains('jp-CodeCell'))
        .map(c => c.querySelector('.jp-InputPrompt').textContent.trim());
      return {{index: cells.indexOf(cell), inView: box.top >= view.top - 1 && box.bottom <= view.bottom + 1,
               text: {FAILED}.innerText, prompts}};
    }}""")
    shots = ROOT / "_build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / "jupyterlab_run_all.png"))
    assert seen["text"].startswith("CheckFailed: check_sample: `sample` still raises NotImplementedError")
    assert seen["inView"], seen
    ran = [p for p in seen["prompts"] if p not in ("[ ]:", "[*]:", "")]
    assert len(ran) == 6 and seen["prompts"][6:] == ["[ ]:"] * (len(seen["prompts"]) - 6), seen["prompts"]
    assert not page.js_errors, page.js_errors
