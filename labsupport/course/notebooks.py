"""Execute a notebook headlessly: used by the tests and by ``python -m labsupport grade``.

Kernels always run this process's own Python (``sys.executable``), through a private kernelspec,
so a ``python3`` kernelspec installed elsewhere (``python -m ipykernel install --user``) cannot
swap in another interpreter, and with a private IPython folder, so no user profile or startup
script runs in them.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from ..ledger import FOLDER_VAR as LEDGER_VAR
from .sandbox import environment_for_kernel

KERNEL_NAME = "labsupport-python"  # the private kernelspec's name (never "python3")
KERNEL_PYTHON = sys.executable  # the interpreter every kernel runs
# What the kernel runs: ipykernel, with a message packer that cannot fail on text. jupyter_client's
# own refuses a lone surrogate (``raise ValueError('\ud800')``), and the kernel then drops the
# message, or never answers; this one falls back to ASCII JSON, where a surrogate is an escape. And
# a cell too deeply nested to compile (``x = 1+1+...+1``) is an error of that cell, where IPython's
# own test for ``await`` would fail outside it and leave the cell without an answer until its timeout.
KERNEL_MAIN = """\
import json, jupyter_client.session as s
_packer = s.json_packer
def json_packer(obj):
    try:
        return _packer(obj)
    except ValueError:
        return json.dumps(s.json_clean(obj), default=s.json_default, ensure_ascii=True, allow_nan=False).encode()
s.json_packer = s.Session.pack.default_value = json_packer
from IPython.core.interactiveshell import InteractiveShell
_should_run_async = InteractiveShell.should_run_async
def should_run_async(self, *args, **kwargs):
    try:
        return _should_run_async(self, *args, **kwargs)
    except (RecursionError, MemoryError):
        return False
InteractiveShell.should_run_async = should_run_async
from ipykernel import kernelapp
kernelapp.launch_new_instance()
"""


MAX_OUTPUT_BYTES = 64 * 2**20  # outputs kept of one notebook's run; past this they are dropped, with a note


class KernelStartError(RuntimeError):
    """No kernel could be started (or it died before running a cell): nothing can be executed."""


def first_line(source: str, width: int = 60) -> str:
    """The first non-blank line of a cell, stripped and cut to ``width`` characters."""
    line = next((s.strip() for s in source.splitlines() if s.strip()), "")
    return line if len(line) <= width else line[: width - 3].rstrip() + "..."


@dataclass
class CellError:
    index: int  # position among all cells
    ename: str
    evalue: str
    source: str

    @property
    def first_line(self) -> str:
        return first_line(self.source)


@dataclass
class Execution:
    notebook: nbformat.NotebookNode
    errors: list[CellError] = field(default_factory=list)
    timed_out: CellError | None = None  # the first cell that ran past its limit (or the notebook's)
    timeouts: list[CellError] = field(default_factory=list)  # every cell interrupted at its limit
    notebook_timed_out: str | None = None  # the whole notebook ran past its limit
    died: str | None = None  # the kernel died
    skipped: list[CellError] = field(default_factory=list)  # cells not run after a timeout (``after_timeout``)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.timed_out and not self.died


def _kernel_manager(spec_root: Path, sandbox=None, writable: list[str] = (), cwd: str = ""):
    """A kernel manager whose only kernelspec runs ``KERNEL_PYTHON`` (user kernelspecs are ignored).

    With a ``sandbox`` (:class:`labsupport.course.sandbox.Sandbox`) the kernel runs inside it, talks
    over Unix sockets in ``spec_root`` (no TCP there), is interrupted by a message (a signal to the
    sandbox would not reach it), and may write only ``writable`` folders.
    """
    spec_dir = spec_root / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    argv = [KERNEL_PYTHON, "-c", KERNEL_MAIN, "-f", "{connection_file}"]
    spec = {"display_name": f"Python ({KERNEL_PYTHON})", "language": "python"}
    name = spec_root.parent.name  # a container's name: the private folder's (labsupport-kernel-...) is unique
    if sandbox is not None:
        argv = sandbox.wrap(argv, [str(spec_root), *writable], cwd, name=name)
        spec["interrupt_mode"] = "message"
    spec["argv"] = argv
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    specs = KernelSpecManager(kernel_dirs=[str(spec_root)], ensure_native_kernel=False)
    if sandbox is None:
        if os.name != "posix":  # no Unix sockets: TCP on localhost, ports picked by jupyter_client
            return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)
        # Unix sockets in the private folder, not TCP: jupyter_client picks free ports by binding and
        # releasing them, and a kernel started at the same moment elsewhere (the grader's -j workers,
        # another test) can take one first; this kernel then dies before its first reply.
        km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs, transport="ipc",
                                ip=str(spec_root / "ipc"))
        km.connection_file = str(spec_root / "connection.json")
        return km

    class SandboxedKernelManager(AsyncKernelManager):
        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart)
            if not restart:  # the engine's client may be gone while its container runs on: remove it
                await asyncio.to_thread(sandbox.stop, name)

    km = SandboxedKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs, transport="ipc",
                                ip=str(spec_root / "ipc"))
    km.connection_file = str(spec_root / "connection.json")
    return km


class _RunState:
    """What one :func:`execute` run learns as it goes, shared by its client and the report after it."""

    def __init__(self, nb: nbformat.NotebookNode, result: Execution, after_timeout) -> None:
        self.nb = nb
        self.result = result
        self.after_timeout = after_timeout
        self.cell = -1  # the code cell running now (-1: none yet)
        self.timed_out_cells: list[int] = []  # every cell interrupted at its limit, in order
        self.skip_tests: list[Callable[[str], str]] = []  # from after_timeout: which later cells not to run
        self.replied_error: dict[int, tuple[str, str]] = {}  # cell index -> (ename, evalue) of the kernel's reply
        self.output_bytes_left = MAX_OUTPUT_BYTES
        self.results_left = 5000  # check results kept past the output budget
        self.overdue = False  # the whole notebook ran past its limit


class _Client(NotebookClient):
    """nbclient's client, with what grading needs: errors read from the kernel's replies, outputs
    bounded, and cells that hung once not run again."""

    def __init__(self, nb, state: _RunState, **kwargs) -> None:
        super().__init__(nb, on_cell_execute=self._started, **kwargs)
        self.state = state

    def _started(self, cell, cell_index, **_) -> None:
        self.state.cell = cell_index

    async def _check_raise_for_error(self, cell, cell_index, exec_reply):
        # a cell failed when the kernel's reply says so, whatever its outputs show: a learner can
        # hide the error output (IPython's set_custom_exc, clear_output) but not the reply's status
        content = (exec_reply or {}).get("content", {})
        if content.get("status") == "error":
            self.state.replied_error[cell_index] = (str(content.get("ename", "")), str(content.get("evalue", "")))
        return await super()._check_raise_for_error(cell, cell_index, exec_reply)

    def output(self, outs, msg, display_id, cell_index):
        # the outputs kept are bounded, so a notebook printing gigabytes cannot exhaust the grader's memory
        state = self.state
        size = len(json.dumps(msg.get("content", {}), ensure_ascii=False, default=str))
        data = msg.get("content", {}).get("data") or {}
        if size < 2**16 and any("vnd.labsupport" in key for key in data) and state.results_left > 0:
            state.results_left -= 1  # a check's result is kept past the budget (a few thousand at most)
            return super().output(outs, msg, display_id, cell_index)
        if state.output_bytes_left < 0:
            return None
        state.output_bytes_left -= size
        if state.output_bytes_left < 0:
            note = nbformat.v4.new_output("stream", name="stderr", text=(
                f"[labsupport: outputs past {MAX_OUTPUT_BYTES // 2**20} MiB were dropped]\n"))
            outs.append(note)
            return None
        return super().output(outs, msg, display_id, cell_index)

    async def _async_handle_timeout(self, timeout, cell=None):
        state = self.state
        if cell is not None and state.cell not in state.timed_out_cells:
            state.timed_out_cells.append(state.cell)
            test = state.after_timeout(state.nb.cells[state.cell].source) if state.after_timeout else None
            if test is not None:
                state.skip_tests.append(test)
        return await super()._async_handle_timeout(timeout, cell)

    async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
        if cell.cell_type == "code":
            reason = next((r for r in (test(cell.source) for test in self.state.skip_tests) if r), "")
            if reason:
                self.state.result.skipped.append(CellError(cell_index, "Skipped", reason, cell.source))
                return cell
        return await super().async_execute_cell(cell, cell_index, *args, **kwargs)


def _launch_options(private: str, env: dict[str, str] | None, quiet: bool, sandbox) -> dict:
    """How the kernel process is started: its environment (a private IPython folder, the ledger's
    figures sent to a throwaway folder) and where its own output goes."""
    base = environment_for_kernel() if sandbox is not None else os.environ
    ledger = str(Path(private) / "ledger")  # the figures a lab saves go here, not to the grader's own folder
    launch = {"env": {**base, "IPYTHONDIR": str(Path(private) / "ipython"), LEDGER_VAR: ledger, **(env or {})},
              "cleanup_kc": True}
    if quiet or sandbox is not None:  # a sandboxed kernel writes nothing to the grader's terminal
        launch["stderr"] = subprocess.DEVNULL
    if sandbox is not None:
        launch["stdout"] = subprocess.DEVNULL
    return launch


def _run_within(client: _Client, launch: dict, notebook_timeout: float | None) -> None:
    """Run the whole notebook; past ``notebook_timeout`` stop it (the kernel is shut down on the way
    out) and mark the run overdue. Raises what the run raised."""

    async def run():
        task = asyncio.ensure_future(client.async_execute(**launch))
        done, _ = await asyncio.wait({task}, timeout=notebook_timeout)
        if not done:
            client.state.overdue = True
            task.cancel()
            try:
                await task
            except BaseException:  # cancelled, or the kernel died as it was stopped
                pass
            return
        task.result()

    run_sync(run)()


def _record_timeouts(state: _RunState, timeout: int) -> None:
    result, cells = state.result, state.nb.cells
    for index in state.timed_out_cells:
        result.timeouts.append(CellError(index, "CellTimeoutError", f"ran past {timeout} s", cells[index].source))
    if result.notebook_timed_out and state.cell >= 0 and state.cell not in state.timed_out_cells:
        result.timeouts.append(CellError(state.cell, "NotebookTimeout", result.notebook_timed_out,
                                         cells[state.cell].source))
    result.timed_out = result.timeouts[0] if result.timeouts else None


def _record_errors(state: _RunState) -> None:
    """Every failed cell: its error outputs, or, where those were hidden, the kernel's reply."""
    result = state.result
    for index, cell in enumerate(state.nb.cells):
        if cell.cell_type != "code":
            continue
        shown = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        for output in shown:
            result.errors.append(CellError(index, output.get("ename", ""), output.get("evalue", ""),
                                           cell.source))
        if index in state.replied_error and not shown:  # failed, but its error output was hidden or cleared
            ename, evalue = state.replied_error[index]
            result.errors.append(CellError(index, ename or "Error", evalue or "the cell failed (its kernel "
                                           "replied with an error, but no error output was shown)", cell.source))
    result.errors.sort(key=lambda e: e.index)


def execute(
    nb: nbformat.NotebookNode,
    *,
    cwd: Path | None = None,
    timeout: int = 300,
    stop_on_error: bool = True,
    env: dict[str, str] | None = None,
    quiet: bool = False,
    notebook_timeout: float | None = None,
    after_timeout: Callable[[str], Callable[[str], str] | None] | None = None,
    sandbox=None,
) -> Execution:
    """Run every code cell of ``nb`` in a fresh kernel (in place) and report what failed.

    A cell that runs past ``timeout`` seconds is a failure (``timed_out``), never a pass. With
    ``stop_on_error`` the run ends at the first error or timeout; otherwise (as a grader needs) an
    error is recorded and the next cell runs, and a cell past its time is interrupted
    (``KeyboardInterrupt``) and the next cell runs. ``notebook_timeout`` bounds the whole run:
    past it the kernel is shut down and the cell then running is ``timed_out``.
    ``cwd`` defaults to a fresh temporary folder, so nothing is written next to the notebook.
    ``after_timeout(source)`` is asked about each cell interrupted at its limit; it may return a
    test of later cells' sources, and a later cell for which that test returns a reason is not run
    (it is listed in ``skipped`` with the reason): what hung once is not run again.
    ``env`` adds variables to the kernel's environment (this process's own is left alone, so
    several notebooks can run at once); ``quiet`` drops the kernel process's own stderr (start-up
    warnings), which never holds a cell's output. ``sandbox`` runs the kernel inside it (see
    :mod:`labsupport.course.sandbox`), with only its working folder writable. Figures a lab saves
    with :func:`labsupport.ledger.record` go to a temporary folder, deleted afterwards.

    Raises KernelStartError when the kernel cannot start or dies before its first cell.
    """
    result = Execution(nb)
    state = _RunState(nb, result, after_timeout)
    with tempfile.TemporaryDirectory(prefix="labsupport-run-") as tmp, \
            tempfile.TemporaryDirectory(prefix="labsupport-kernel-") as private:
        workdir = str(cwd or tmp)
        client = _Client(
            nb,
            state,
            km=_kernel_manager(Path(private) / "kernels", sandbox, [private, workdir], workdir),
            timeout=timeout,
            allow_errors=not stop_on_error,
            interrupt_on_timeout=not stop_on_error,
            extra_arguments=["--HistoryManager.hist_file=:memory:"],
            resources={"metadata": {"path": workdir}},
        )
        try:
            _run_within(client, _launch_options(private, env, quiet, sandbox), notebook_timeout)
            if state.overdue:
                result.notebook_timed_out = f"the notebook ran past its {notebook_timeout:g} s limit"
        except CellTimeoutError:
            pass  # recorded by the client (stop_on_error: the run ends at the first timeout)
        except CellExecutionError:
            pass  # recorded below from the cell outputs
        except Exception as exc:  # the kernel could not start, or died
            reason = "the kernel died" if isinstance(exc, DeadKernelError) else f"{type(exc).__name__}"
            message = f"{reason}: {str(exc).strip()[:300]}"
            if state.cell < 0:
                # nbclient leaves an exit hook behind when a kernel fails to start; it would fail at exit
                atexit.unregister(client._cleanup_kernel)
                raise KernelStartError(
                    f"could not start a Python kernel with {KERNEL_PYTHON} ({message}). Check that "
                    f"ipykernel is installed for that Python (`{KERNEL_PYTHON} -m pip install ipykernel`)."
                ) from exc
            result.died = f"{message} (in the cell starting `{first_line(nb.cells[state.cell].source)}`)"
    _record_timeouts(state, timeout)
    _record_errors(state)
    return result


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
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from exc
    return nb
