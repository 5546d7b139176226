"""Run a notebook the way JupyterLab's Run All does, in a real kernel.

What JupyterLab 4 does (read in its source, jupyterlab/jupyterlab at 6ef5a17, August 2026):

* ``NotebookActions.runAll`` (packages/notebook/src/actions.tsx) calls ``Private.runCells`` on every
  cell at once: ``Promise.all(cells.map(runCell))``. Each code cell's ``CodeCell.execute`` clears its
  outputs and sends its ``execute_request`` straight away, so the kernel receives all of them in
  order before the first one has finished; then the view moves to the last cell
  (``notebook.activeCellIndex = lastIndex``).
* ``OutputArea.execute`` (packages/outputarea/src/widget.ts) sends ``stop_on_error: true``, except
  for a cell tagged ``raises-exception``, which is sent with ``stop_on_error: false``.
* The kernel (ipykernel's ``_abort_queues``) answers an error in a request sent with
  ``stop_on_error`` by aborting every execute request already queued: their replies say
  ``"aborted"`` and those cells show no output. A cell tagged ``raises-exception`` fails without
  that, so Run All goes on to the next cells.

nbclient with ``allow_errors=False`` reaches the same cells by another road: it sends one cell at
a time and stops sending after an error, but it also treats a ``raises-exception`` tag as allowed
to fail. Sending everything at once, as here, keeps the kernel's own abort in the loop, which is
what a learner's Run All meets.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client.manager import start_new_kernel

RAISES = "raises-exception"


@dataclass
class CellRun:
    index: int  # the cell's position in the notebook (markdown cells counted)
    status: str = "pending"  # the execute_reply's: "ok", "error" or "aborted"
    outputs: list[dict] = field(default_factory=list)  # what the frontend shows, in order

    @property
    def error(self) -> dict | None:
        return next((o for o in self.outputs if o["output_type"] == "error"), None)

    def text(self) -> str:
        return "".join(o.get("text", "") for o in self.outputs if o["output_type"] == "stream")


class Kernel:
    """One kernel, as a JupyterLab session holds it: Run All can be pressed several times."""

    def __init__(self, cwd: Path, env: dict | None = None):
        environment = {**os.environ, "MPLBACKEND": "Agg", **(env or {})}
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(cwd), env=environment)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def run_all(self, cells: list[dict], timeout: float = 300) -> list[CellRun]:
        """Every code cell of ``cells`` (nbformat cells), sent at once as Run All sends them."""
        runs: dict[str, CellRun] = {}
        for index, cell in enumerate(cells):
            if cell["cell_type"] != "code" or not cell["source"].strip():
                continue  # JupyterLab sends nothing for a markdown cell or an empty code cell
            tags = cell.get("metadata", {}).get("tags", [])
            msg_id = self.client.execute(cell["source"], store_history=True, allow_stdin=False,
                                         stop_on_error=RAISES not in tags)
            runs[msg_id] = CellRun(index)
        replied, idle = set(), set()
        deadline = time.monotonic() + timeout
        while replied != runs.keys() or idle != runs.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Run All did not finish in {timeout:g} s; cells waiting: "
                                   f"{sorted(runs[m].index for m in runs.keys() - replied)}")
            try:
                msg = self.client.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                msg = None
            if msg is not None:
                parent = msg["parent_header"].get("msg_id")
                if parent in runs:
                    if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                        idle.add(parent)
                    else:
                        _show(runs[parent].outputs, msg)
            while self.client.shell_channel.msg_ready():
                reply = self.client.get_shell_msg(timeout=1)
                parent = reply["parent_header"].get("msg_id")
                if parent in runs:
                    runs[parent].status = reply["content"]["status"]
                    replied.add(parent)
        return sorted(runs.values(), key=lambda r: r.index)


def _show(outputs: list[dict], msg: dict) -> None:
    """Add one iopub message to a cell's outputs as the frontend would show it."""
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        if outputs and outputs[-1]["output_type"] == "stream" and outputs[-1]["name"] == content["name"]:
            outputs[-1]["text"] += content["text"]
        else:
            outputs.append({"output_type": "stream", "name": content["name"], "text": content["text"]})
    elif kind in ("display_data", "execute_result"):
        outputs.append({"output_type": kind, "data": content["data"],
                        "display_id": content.get("transient", {}).get("display_id")})
    elif kind == "update_display_data":
        display_id = content.get("transient", {}).get("display_id")
        for output in outputs:
            if output.get("display_id") == display_id:
                output["data"] = content["data"]
    elif kind == "error":
        outputs.append({"output_type": "error", "ename": content["ename"], "evalue": content["evalue"],
                        "traceback": content["traceback"]})
    elif kind == "clear_output":
        outputs.clear()
