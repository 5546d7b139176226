"""Running a lab's checks against a learner's parts for the stack's assembly (issue 31;
:mod:`labsupport.course.stack`), each lab in a process of its own with a time limit, so a part that
hangs or crashes cannot take the assembly down.

Two ways, with the same results:

* :func:`run_checks`: a new Python per lab (``python -c``), which imports torch, Triton and every
  lab's checks again: about two seconds of a CPU per lab before any check runs;
* :class:`CheckProcess`: one Python imports all that once and **forks** a child per lab, which
  starts with everything imported. The child writes what it reports into a file; the assembly waits
  for it, and kills it when its time limit passes. Forking is safe here only where no GPU is in use
  (a CUDA driver initialised in the parent does not work in a forked child) and before the parent ran
  anything on torch's thread pool: the process forks only on a machine without CUDA, and runs no
  torch operation itself. Elsewhere (or on a system without ``fork``) the assembly runs
  :func:`run_checks`.

A check that never reported (its process crashed or ran past the time limit) failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHECK_TIMEOUT_S = 600.0  # one lab's checks together
RESULTS_PREFIX = "LABSUPPORT_STACK_RESULT "

_RUNNER = r"""
import importlib, io, json, sys, contextlib
folder, module_name, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
pairs = json.loads(sys.argv[4])  # [[check, part], ...]
def say(check, result, message):
    print(prefix + json.dumps({"check": check, "check_result": result, "message": message}), flush=True)
quiet = io.StringIO()
try:
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        sys.path.insert(0, folder)
        module = importlib.import_module(module_name)
except BaseException as exc:
    for check, _ in pairs:
        say(check, "failed", f"the lab's cells raised when run: {type(exc).__name__}: {exc}")
    sys.exit(0)
import labsupport.checks as checks
for check, part in pairs:
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            getattr(checks, check)(getattr(module, part))
        say(check, "passed", "")
    except BaseException as exc:
        reason = getattr(exc, "reason", "failed")
        say(check, "not done" if reason == "not done" else "failed", f"{type(exc).__name__}: {exc}")
"""

# The forking check process: imports the checks, says whether it may fork, then for each job (a JSON
# line on stdin) forks a child that runs _RUNNER with the job's arguments, its output in the job's file.
_FORKER = r"""
import json, os, signal, sys, traceback
runner = sys.argv[1]
import labsupport.checks  # noqa: F401  (torch, Triton and every lab's checks, imported once)
import torch
may_fork = hasattr(os, "fork") and not torch.cuda.is_available()
print("READY " + ("fork" if may_fork else "no-fork"), flush=True)
if not may_fork:
    sys.exit(0)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are reaped as they end
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.environ.update(job["env"])
            if job["threads"]:
                torch.set_num_threads(job["threads"])
            sys.argv = job["argv"]
            exec(compile(runner, "<labsupport stack checks>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
"""


def check_env(folder: Path, threads: int | None) -> dict[str, str]:
    """What a lab's checks' process adds to the environment: the parts' folder on ``PYTHONPATH`` (lab
    11's checks spawn ranks that import the part by its module's name) and, when several labs run at
    once, torch's threads (``OMP_NUM_THREADS``, unless it is set)."""
    env = {"PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _argv(path: Path, pairs) -> list[str]:
    return ["-c", str(path.parent), path.stem, RESULTS_PREFIX, json.dumps([list(p) for p in pairs])]


def parse_results(out: str, pairs, why: str) -> dict:
    """check -> (result, message) from a checks process's output; ``why`` for a check it never reported."""
    results = {}
    for line in out.splitlines():
        if line.startswith(RESULTS_PREFIX):
            got = json.loads(line[len(RESULTS_PREFIX):])
            results[got["check"]] = (got["check_result"], got["message"])
    for check, _ in pairs:
        results.setdefault(check, ("failed", why or "the check did not report"))
    return results


def run_checks(path: Path, lab: str, pairs: list[tuple[str, str]], timeout_s: float = CHECK_TIMEOUT_S,
               threads: int | None = None) -> dict:
    """Run ``pairs`` (check, part) against the module file ``path`` in a new Python: check -> (result,
    message). ``threads``: torch's threads in it, when several labs run at once."""
    env = {**os.environ, **check_env(path.parent, threads)}
    env.pop("LABSUPPORT_GRADING", None)
    why = ""
    try:
        proc = subprocess.run([sys.executable, "-c", _RUNNER, *_argv(path, pairs)[1:]], capture_output=True,
                              text=True, timeout=timeout_s, env=env)
        out = proc.stdout
        if proc.returncode:
            why = f"the checks' process exited with code {proc.returncode}: {proc.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        why = f"the checks ran past {timeout_s:g} s (a part that hangs?)"
    return parse_results(out, pairs, why)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class CheckProcess:
    """One Python with the checks imported, forking a child per lab (module docstring). Use it as a
    context manager; :meth:`run_checks` is :func:`run_checks`'s, safe to call from several threads.
    :attr:`forks` is False where it may not fork: then every call runs :func:`run_checks`."""

    def __init__(self):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("LABSUPPORT_GRADING", None)
        self._lock = threading.Lock()
        self._dir = tempfile.TemporaryDirectory(prefix="labsupport-stack-")
        self._jobs = 0
        self.forks = False
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _FORKER, _RUNNER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            line = "-"
            while line and not line.startswith("READY "):  # whatever an import printed comes first
                line = self._proc.stdout.readline()
            self.forks = line.strip() == "READY fork"
        except OSError:
            self._proc = None

    def run_checks(self, path: Path, lab: str, pairs: list[tuple[str, str]], timeout_s: float = CHECK_TIMEOUT_S,
                   threads: int | None = None) -> dict:
        if not self.forks:
            return run_checks(path, lab, pairs, timeout_s, threads)
        with self._lock:
            self._jobs += 1
            out = Path(self._dir.name) / f"{self._jobs}-{lab}.out"
            job = {"argv": _argv(path, pairs), "env": check_env(path.parent, threads), "threads": threads,
                   "out": str(out)}
            try:
                self._proc.stdin.write(json.dumps(job) + "\n")
                self._proc.stdin.flush()
                pid = json.loads(self._proc.stdout.readline())["pid"]
            except (OSError, ValueError):  # the forking process is gone: a new Python for this lab
                self.forks = False
                return run_checks(path, lab, pairs, timeout_s, threads)
        deadline, why = time.monotonic() + timeout_s, ""
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                why = f"the checks ran past {timeout_s:g} s (a part that hangs?)"
                break
            time.sleep(0.02)
        text = out.read_text(encoding="utf-8", errors="replace") if out.exists() else ""
        if not why:
            rest = "\n".join(line for line in text.splitlines() if not line.startswith(RESULTS_PREFIX)).strip()
            why = f"the checks' process ended before reporting: {rest[-300:]}" if rest else ""
        return parse_results(text, pairs, why)

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
            self._proc = None
        self._dir.cleanup()

    def __enter__(self) -> CheckProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
