"""Execute a notebook headlessly: used by the tests and by ``python -m labsupport grade``."""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat


@dataclass
class CellError:
    index: int  # position among all cells
    ename: str
    evalue: str
    source: str


@dataclass
class Execution:
    notebook: nbformat.NotebookNode
    errors: list[CellError] = field(default_factory=list)
    timed_out: CellError | None = None
    died: str | None = None  # the kernel died, or could not start

    @property
    def ok(self) -> bool:
        return not self.errors and not self.timed_out and not self.died


def execute(
    nb: nbformat.NotebookNode,
    *,
    cwd: Path | None = None,
    timeout: int = 300,
    stop_on_error: bool = True,
    env: dict[str, str] | None = None,
    quiet: bool = False,
) -> Execution:
    """Run every code cell of ``nb`` in a fresh python3 kernel (in place) and report what failed.

    A cell that runs past ``timeout`` seconds is a failure (``timed_out``), never a pass. With
    ``stop_on_error`` the run ends at the first error; otherwise it goes on, as a grader needs.
    ``cwd`` defaults to a fresh temporary folder, so nothing is written next to the notebook.
    ``env`` adds variables to the kernel's environment (this process's own is left alone, so
    several notebooks can run at once); ``quiet`` drops the kernel process's own stderr (start-up
    warnings), which never holds a cell's output.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    result = Execution(nb)
    launch = {"env": {**os.environ, **(env or {})}}
    if quiet:
        launch["stderr"] = subprocess.DEVNULL
    with tempfile.TemporaryDirectory(prefix="labsupport-run-") as tmp:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            allow_errors=not stop_on_error,
            resources={"metadata": {"path": str(cwd or tmp)}},
        )
        try:
            client.execute(**launch)
        except CellTimeoutError as exc:
            index = _running_cell(nb)
            result.timed_out = CellError(index, "CellTimeoutError", str(exc).splitlines()[0],
                                         nb.cells[index].source if index >= 0 else "")
        except CellExecutionError:
            pass  # recorded below from the cell outputs
        except DeadKernelError as exc:
            result.died = f"the kernel died: {exc}"
        except Exception as exc:  # kernel could not start, etc.
            result.died = f"{type(exc).__name__}: {exc}"
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                result.errors.append(CellError(index, output.get("ename", ""), output.get("evalue", ""),
                                               cell.source))
    return result


def _running_cell(nb) -> int:
    """Index of the last code cell that has an execution count (the one that was running)."""
    last = -1
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.get("execution_count") is not None:
            last = index
    # the cell that timed out gets its count when it starts
    return last


def load(path: Path) -> nbformat.NotebookNode:
    """Read a notebook, raising ValueError with a plain reason if it is not one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not a notebook")
    try:
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
    except Exception as exc:
        raise ValueError(f"{path}: not a readable Jupyter notebook ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]})") from exc
    return nb
