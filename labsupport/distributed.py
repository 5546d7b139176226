"""Run a function on several processes under ``torch.distributed`` and collect what each returns.

Chapter 11 runs its ring all-reduce, its tensor-parallel model and its measurements on several
processes: gloo on CPU processes, NCCL on GPUs, with the same code. :func:`launch` starts
``world_size`` processes, joins them into one process group, calls ``fn(*args)`` on each (the
function reads its rank with ``dist.get_rank()``), and returns the list of results, rank by rank::

    from labsupport.distributed import launch

    def hello():
        import torch.distributed as dist
        return dist.get_rank() * 10

    launch(hello, world_size=3)          # [0, 10, 20]

When a rank raises, :func:`launch` raises :class:`RankFailed` naming the rank and showing its
traceback; when a rank is still running after ``timeout`` seconds (a deadlock: everyone waiting
on a receive, or everyone sending first with blocking sends), it raises :class:`RankHung` naming
the ranks that had not finished. Either way every process it started is killed and reaped before
it raises: nothing is left running. What the ranks print is printed afterwards by the caller,
each line prefixed with ``[rank r]``.

Functions defined in a notebook
-------------------------------
Each rank is a fresh Python process, never a fork of the caller: a fork after CUDA is initialised
is an error, and a fork of a multi-threaded Jupyter kernel can deadlock. On Linux, gloo ranks (CPU
tensors) are forked from a *zygote*: one helper process per caller, started with ``python -c`` on the
first launch, which imports torch (and the course module whose function is launched) once, asks
about CUDA only through NVML (so the CUDA driver is never initialised in it), forks only while it has
a single thread, and ends the ranks it forked when its caller goes, much as multiprocessing's
``forkserver`` does. Importing torch takes a CPU a couple of seconds; a ring check that starts nine
ranks no longer pays it nine times. NCCL ranks (one GPU each), other platforms, and
``LABSUPPORT_LAUNCH=subprocess`` in the environment start each rank with ``python -c`` through
:mod:`subprocess`, as torchrun starts its workers. Either way,
unlike multiprocessing's ``spawn``, the parent's main script is not re-run in the child, so a script
without ``if __name__ == "__main__":`` works too. The function reaches the child pickled, and pickle sends a function by name: the child
imports its module and looks it up. A function defined in a notebook lives in ``__main__``,
which the child does not have. So :func:`launch` pickles such functions *by source*: their text (from
``inspect.getsource``, which works in Jupyter and IPython), plus the globals they name: modules
by name, other notebook functions the same way, anything else by value. The child runs the text
in a fresh namespace. What this cannot carry is said clearly: a lambda or a function nested in
another (use a ``def`` at the top of a cell), or a global that cannot be pickled. Functions in
importable modules (the course's own, or a ``.py`` file of yours) travel by name, as usual.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import contextlib
import datetime
import importlib
import inspect
import io
import json
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence

from . import _answers
from ._validate import positive_int

DEFAULT_TIMEOUT = 60.0  # seconds a launch may take in all, start-up included
GRACE = 2.0  # seconds the other ranks get to report after one rank fails
POLL = 0.02  # seconds between looks at the children
BACKENDS = ("gloo", "nccl")
# what a rank reports when another rank died under it (not the cause)
SECONDARY_FAILURES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class LaunchError(RuntimeError):
    """A multi-process run did not finish: a rank failed or hung. Every process was ended."""


class RankFailed(LaunchError):
    """A rank raised an exception; ``rank`` and ``remote_traceback`` say which and where."""

    def __init__(self, message: str, rank: int, remote_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class RankHung(LaunchError):
    """Some ranks were still running at the timeout; ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


# --- pickling notebook functions by source ------------------------------------------------------


def _shippable_by_name(fn) -> bool:
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__", "__mp_main__") or module.startswith("<"):
        return False
    try:
        obj = importlib.import_module(module)
        for part in fn.__qualname__.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    return obj is fn


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _function_source(fn) -> str:
    """The text of ``fn``'s ``def``, decorators removed, dedented."""
    name = fn.__name__
    if name == "<lambda>":
        raise ValueError(
            "launch cannot send a lambda to other processes; define the function with `def` at the "
            "top level of a cell (or in a .py file) and pass that"
        )
    if "<locals>" in fn.__qualname__:
        raise ValueError(
            f"launch cannot send `{fn.__qualname__}` to other processes: it is defined inside another "
            f"function. Define it with `def` at the top level of a cell (or in a .py file) and pass that"
        )
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise ValueError(
            f"launch cannot find the source of `{name}` ({exc}), so it cannot send it to other "
            f"processes. Define it in a notebook cell or in an importable .py file"
        ) from exc
    tree = ast.parse(source)
    node = tree.body[0]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        node.decorator_list = []
        source = ast.unparse(node)
    return source


def _rebuild_function(name: str, source: str, namespace: dict, defaults, kwdefaults):
    """Run in the child: define ``name`` from ``source`` in a namespace holding its globals."""
    namespace = dict(namespace)
    namespace.setdefault("__builtins__", builtins)
    namespace["__name__"] = "__notebook__"
    exec(compile(source, f"<notebook function {name}>", "exec"), namespace)
    fn = namespace[name]
    fn.__defaults__, fn.__kwdefaults__ = defaults, kwdefaults
    return fn


def _raw_answer(qualified: str):
    """Run in the child: the course answer ``qualified`` under its guard (what ``unguarded`` gives)."""
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name).__wrapped__


class _SourcePickler(pickle.Pickler):
    """A pickler that sends notebook functions as source and modules by name."""

    def reducer_override(self, obj):
        if isinstance(obj, types.FunctionType) and id(obj) in _answers._RAW:
            return _raw_answer, (_answers._RAW[id(obj)][1],)  # a course answer under its guard
        if isinstance(obj, types.ModuleType):
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, types.FunctionType) and not _shippable_by_name(obj):
            if obj.__closure__:
                raise ValueError(
                    f"launch cannot send `{obj.__qualname__}` to other processes: it uses variables of "
                    f"an enclosing function. Define it at the top level of a cell and pass what it needs "
                    f"as arguments"
                )
            source = _function_source(obj)
            names = _code_names(obj.__code__) - {obj.__name__}
            namespace = {}
            for n in sorted(names):
                if n in obj.__globals__:
                    value = obj.__globals__[n]
                    try:
                        _dumps(value)
                    except Exception as exc:
                        raise ValueError(
                            f"launch cannot send `{obj.__name__}` to other processes: the global `{n}` it "
                            f"uses ({type(value).__name__}) cannot be pickled ({exc}). Pass it as an "
                            f"argument, or build it inside the function"
                        ) from None
                    namespace[n] = value
            return _rebuild_function, (obj.__name__, source, namespace, obj.__defaults__, obj.__kwdefaults__)
        return NotImplemented


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _SourcePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


# --- the child -------------------------------------------------------------------------------


def _child_main() -> None:
    """Entry point of each process: ``python -c "...; _child_main()" RANK WORLD PORT BACKEND DIR TIMEOUT``."""
    rank, world_size, port = (int(a) for a in sys.argv[1:4])
    backend, outdir, timeout = sys.argv[4], sys.argv[5], float(sys.argv[6])
    with open(os.path.join(outdir, "payload.pkl"), "rb") as f:
        payload = f.read()
    path = os.path.join(outdir, f"rank{rank}")
    ok = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # several ranks share the CPU; one thread each keeps them honest
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
        fn, args, kwargs, call_timeout = pickle.loads(payload)
        watchdog = _Watchdog(call_timeout, path) if call_timeout is not None else None
        try:
            result = fn(*args, **kwargs)
        finally:
            if watchdog is not None:
                watchdog.disarm()  # fn has ended (or raised): this rank reports for itself
        data = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        ok = True
    except BaseException as exc:  # noqa: BLE001 (every failure is reported to the parent)
        data = pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        ok = False
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path + ".pkl")  # the parent sees the file only once it is complete
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if ok and dist.is_initialized():
            dist.destroy_process_group()


class _Watchdog:
    """After ``seconds``, report this rank as hung, with where its main thread is, and exit, unless
    :meth:`disarm` was called first. The two never overlap (one lock): a function that raised just
    as the time ran out (its peer hung and was ended) is reported by its own error, not as hung with
    a stack in the error handler."""

    def __init__(self, seconds: float, path: str) -> None:
        self.seconds, self.path, self.main = seconds, path, threading.main_thread().ident
        self.lock = threading.Lock()
        self.armed = True
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if not self.armed:
                return
            frame = sys._current_frames().get(self.main)
            where = "".join(traceback.format_stack(frame)) if frame is not None else ""
            with open(self.path + ".tmp", "wb") as f:
                f.write(pickle.dumps(("hung", f"still running after {self.seconds:g} s", where)))
            os.replace(self.path + ".tmp", self.path + ".pkl")
            os._exit(3)

    def disarm(self) -> None:
        with self.lock:
            self.armed = False
        self.timer.cancel()


# --- the parent --------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """``"nccl"`` when torch sees a CUDA GPU, else ``"gloo"``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _tail(outdir: str, rank: int, chars: int = 3000) -> str:
    """The end of what a rank wrote to stderr (where a C++ error such as gloo's lands)."""
    with contextlib.suppress(OSError), open(os.path.join(outdir, f"rank{rank}.stderr"), "rb") as f:
        text = f.read().decode("utf-8", "replace")
        return ("what it wrote to stderr:\n" + text[-chars:]) if text.strip() else ""
    return ""


def _show_output(outdir: str, ranks: int) -> None:
    """Print what each rank printed, every line prefixed with its rank."""
    for rank in range(ranks):
        with contextlib.suppress(OSError), open(os.path.join(outdir, f"rank{rank}.stdout"), "rb") as f:
            for line in f.read().decode("utf-8", "replace").splitlines():
                print(f"[rank {rank}] {line}")


CHILD_COMMAND = "from labsupport.distributed import _child_main; _child_main()"


# --- the zygote: ranks forked from a process that has imported torch ---------------------------

# PYTORCH_NVML_BASED_CUDA_CHECK: the package's import asks torch.cuda.is_available(), which would
# otherwise initialise CUDA's driver (its threads, and torch's "no CUDA after fork" guard); with it torch
# asks NVML instead, which leaves the process forkable. The ranks get the caller's environment, not this.
ZYGOTE_COMMAND = ("import os; os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'] = '1'; "
                  "from labsupport.distributed import _zygote_main; _zygote_main()")
ZYGOTE_PRELOAD = ("torch", "torch.distributed")
ZYGOTE_START_TIMEOUT = 120.0  # seconds the zygote may take to import torch (a loaded two-core machine)


def _zygote_main() -> None:
    """The zygote's loop: one request per line on stdin, answers on stdout; it forks each rank.

    Requests are JSON: ``{"id": N, "argv": [...], "env": {...}, "cwd": ..., "stdout": path,
    "stderr": path, "preload": [module, ...]}``. Answers: ``ready``, ``started ID PID``, ``failed ID
    MESSAGE`` and ``exited PID CODE`` (``CODE`` as :attr:`subprocess.Popen.returncode` has it). One
    thread only, so that a fork copies no lock another thread holds; it exits at the end of stdin.
    """
    proto = os.dup(1)  # the answers; fd 1 itself goes to /dev/null, so a stray print cannot corrupt them
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    for name in ZYGOTE_PRELOAD:
        importlib.import_module(name)

    def say(line: str) -> None:
        os.write(proto, (line + "\n").encode())

    say("ready")
    pending = b""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([0], [], [], POLL if children else None)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the caller is gone or done: so are the ranks it did not end
                for pid in children:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                for name in request.get("preload", ()):
                    with contextlib.suppress(Exception):
                        importlib.import_module(name)
                if _thread_count() != 1:  # a fork copies one thread; never fork beside another
                    say(f"failed {request['id']} the zygote has {_thread_count()} threads")
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    say(f"failed {request['id']} {exc}")
                    continue
                if pid == 0:
                    os.close(proto)
                    _zygote_child(request)
                children.add(pid)
                say(f"started {request['id']} {pid}")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _thread_count() -> int:
    """This process's threads, native ones included (Linux's /proc; 1 where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 1


def _zygote_child(request: dict) -> None:
    """In the forked rank: its own session, files for its output, the caller's environment and folder,
    then :func:`_child_main` as ``python -c`` would run it. Never returns."""
    code = 1
    try:
        os.setsid()  # its own session: a kill reaches anything the rank started too
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        importlib.invalidate_caches()  # files written since the zygote started (a learner's module) are found
        sys.argv = ["-c", *request["argv"]]
        _child_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 (shown in the rank's stderr, read back by the parent)
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class _ForkedRank:
    """A rank the zygote forked, with the part of :class:`subprocess.Popen` that :func:`launch` uses."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
            time.sleep(POLL)
        return self.returncode


class _Zygote:
    """The launching side of one zygote: starts it, asks it for ranks, learns how they exited."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.owner = env, os.getpid()
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.started: dict[int, str] = {}
        self.exits: dict[int, int] = {}
        self.alive = True
        self.next_id = 0
        self.process = subprocess.Popen([sys.executable, "-c", ZYGOTE_COMMAND], env=env, start_new_session=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True, name="labsupport-zygote").start()

    def _read(self) -> None:
        try:
            for raw in self.process.stdout:
                word, _, rest = raw.decode(errors="replace").strip().partition(" ")
                with self.changed:
                    if word == "ready":
                        self.ready.set()
                    elif word in ("started", "failed"):
                        key, _, value = rest.partition(" ")
                        self.started[int(key)] = f"{word} {value}"
                    elif word == "exited":
                        pid, _, code = rest.partition(" ")
                        self.exits[int(pid)] = int(code)
                    self.changed.notify_all()
        finally:  # the end of the pipe, or an answer this side cannot read: no more ranks from this zygote
            with self.changed:
                self.alive = False
                self.ready.set()
                self.changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: str, stderr: str, preload: list[str]) -> _ForkedRank:
        """Fork one rank; raises OSError if the zygote cannot (the caller then starts it itself)."""
        if not self.ready.wait(ZYGOTE_START_TIMEOUT) or not self.alive:
            raise OSError("the zygote did not start")
        with self.lock:
            request_id, self.next_id = self.next_id, self.next_id + 1
            line = json.dumps({"id": request_id, "argv": argv, "env": env, "cwd": os.getcwd(), "stdout": stdout,
                               "stderr": stderr, "preload": preload}) + "\n"
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
            except (OSError, ValueError) as exc:
                raise OSError(f"the zygote is gone: {exc}") from exc
        with self.changed:  # a preload may import a module first: as long as the zygote's own start
            self.changed.wait_for(lambda: request_id in self.started or not self.alive, timeout=ZYGOTE_START_TIMEOUT)
            answer = self.started.pop(request_id, None)
        if answer is None:  # no answer: end this zygote (and any rank it forks late) before starting one here
            self.close()
            raise OSError("the zygote did not answer")
        word, _, value = answer.partition(" ")
        if word != "started":
            raise OSError(value)
        return _ForkedRank(self, int(value))

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            if pid in self.exits:
                return self.exits.pop(pid)
            if self.alive:
                return None
        try:  # the zygote is gone, and with it the exit codes of its ranks
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return -signal.SIGKILL
        except PermissionError:
            return None

    def close(self) -> None:
        """End the zygote: the end of its stdin makes it end its ranks and exit."""
        with self.changed:
            self.alive = False
            self.changed.notify_all()
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _use_zygote(backend: str) -> bool:
    """Linux, gloo: NCCL ranks each start CUDA, and are started with ``python -c`` as torchrun does."""
    return (backend == "gloo" and sys.platform.startswith("linux")
            and os.environ.get("LABSUPPORT_LAUNCH", "") != "subprocess")


# the variables read while Python starts and torch is imported (the search path, thread pools, the
# allocator, libraries): a rank gets every variable of its caller, but one of these changed means
# the zygote imported torch under other settings, so another zygote is started
IMPORT_TIME_VARIABLES = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "MALLOC_", "TORCH",
                         "PYTORCH_", "CUDA_", "TRITON_", "LABSUPPORT_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                         "LANG", "LC_", "TMPDIR")


def _import_settings(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_VARIABLES)}


def _zygote_for(env: dict[str, str]) -> _Zygote:
    """This process's zygote, started (or restarted) for ``env``'s import-time settings."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is not None and _ZYGOTE.owner != os.getpid():  # a forked caller: the zygote is its parent's
            _ZYGOTE = None
        if _ZYGOTE is not None and (_import_settings(_ZYGOTE.env) != _import_settings(env) or not _ZYGOTE.alive
                                    or _ZYGOTE.process.poll() is not None):
            _ZYGOTE.close()
            _ZYGOTE = None
        if _ZYGOTE is None:
            _ZYGOTE = _Zygote(env)
            atexit.register(_ZYGOTE.close)
        return _ZYGOTE


def _start_rank(argv: list[str], env: dict[str, str], stdout: str, stderr: str, preload: list[str], backend: str):
    """Start one rank: forked by the zygote where it works, else ``python -c`` through subprocess."""
    if _use_zygote(backend):
        with contextlib.suppress(OSError):
            return _zygote_for(env).spawn(argv, env, stdout, stderr, preload)
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        return subprocess.Popen([sys.executable, "-c", CHILD_COMMAND, *argv], env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err)


def _end(processes) -> None:
    """Kill every process still alive (and anything it started, its process group) and reap them."""
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    for p in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def launch(fn: Callable, world_size: int, args: Sequence = (), kwargs: dict | None = None,
           backend: str | None = None, timeout: float = DEFAULT_TIMEOUT, call_timeout: float | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes joined into one process group.

    Returns the list of what each rank returned, rank 0 first (results travel by pickle: return
    tensors, numbers, dicts). ``backend`` is ``"gloo"`` (CPU tensors) or ``"nccl"`` (one GPU per
    rank); the default is NCCL when torch sees a GPU, else gloo. ``timeout`` bounds the whole run,
    start-up included; ``call_timeout``, when given, bounds ``fn`` itself on each rank (timed from
    when the group is joined, so start-up, which takes seconds, does not count): a rank past it
    reports where it was stuck and exits. Raises :class:`RankFailed` or :class:`RankHung` as the module docstring
    says, after ending every process. Chapter 11 explains the rest.
    """
    world_size = positive_int("world_size", world_size)
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if call_timeout is not None and (isinstance(call_timeout, bool) or not isinstance(call_timeout, (int, float))
                                     or not call_timeout > 0):
        raise ValueError(f"call_timeout must be a positive number of seconds or None, got {call_timeout!r}")
    if not callable(fn):
        raise ValueError(f"fn must be a function, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple of arguments, got {type(args).__name__}")
    payload = _dumps((fn, tuple(args), dict(kwargs or {}), call_timeout))
    # the course's own module of fn is imported once by the zygote; a learner's file is imported by
    # each rank, so an edit to it is always seen
    module = getattr(fn, "__module__", None) or ""
    preload = [module] if module.startswith("labsupport.") else []
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _launch_once(payload, world_size, backend, timeout, call_timeout, free_port(), preload)
        except RankFailed as exc:
            # the port was free when chosen, but another program took it before rank 0 listened (or
            # gloo's pairwise connections failed while the group was being joined)
            if attempt + 1 == PORT_ATTEMPTS or not any(m in str(exc) for m in PORT_TAKEN):
                raise
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3
# start-up failures worth a fresh start on a new port: the rendezvous port taken between choosing and
# listening, or gloo's pairwise connections (ephemeral ports, made while joining the group, before
# fn runs on any rank) closed under heavy load ("Connection closed by peer" in connectFullMesh)
PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use", "connectFullMesh failed")


def _launch_once(payload: bytes, world_size: int, backend: str, timeout: float, call_timeout: float | None,
                 port: int, preload: list[str] = ()) -> list:
    """One try of :func:`launch` on ``port``: start, wait, collect, and always end every process."""
    outdir = tempfile.mkdtemp(prefix="labsupport-launch-")
    with open(os.path.join(outdir, "payload.pkl"), "wb") as f:
        f.write(payload)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    processes = []
    try:
        for rank in range(world_size):
            argv = [str(rank), str(world_size), str(port), backend, outdir, repr(float(timeout))]
            # what the rank prints is shown here afterwards (in a notebook a child's own output would
            # go to the kernel's terminal, not the cell); stderr is also read back if the rank dies
            processes.append(_start_rank(argv, env, os.path.join(outdir, f"rank{rank}.stdout"),
                                         os.path.join(outdir, f"rank{rank}.stderr"), preload, backend))
        deadline = time.monotonic() + timeout
        reports: dict[int, tuple] = {}
        first_error = None
        while True:
            for rank in range(world_size):
                path = os.path.join(outdir, f"rank{rank}.pkl")
                if rank not in reports and os.path.exists(path):
                    with open(path, "rb") as f:
                        reports[rank] = pickle.load(f)
                    if reports[rank][0] in ("error", "hung") and first_error is None:
                        first_error = rank
                        deadline = min(deadline, time.monotonic() + GRACE)
            for rank, p in enumerate(processes):
                if rank not in reports and p.poll() is not None and not os.path.exists(
                        os.path.join(outdir, f"rank{rank}.pkl")):
                    reports[rank] = ("error", f"the process exited with code {p.returncode} without reporting "
                                              f"(a crash in C++, killed, or out of memory)", _tail(outdir, rank))
                    if first_error is None:
                        first_error = rank
                        deadline = min(deadline, time.monotonic() + GRACE)
            if len(reports) == world_size or time.monotonic() > deadline:
                break
            time.sleep(POLL)
        hung = sorted(r for r, rep in reports.items() if rep[0] == "hung")
        missing = sorted(set(r for r in range(world_size) if r not in reports) | set(hung))
        if first_error is not None:
            # a rank whose peer died reports a broken connection; name the rank that failed first-hand
            causes = [r for r, rep in sorted(reports.items()) if rep[0] == "error" and not any(
                m in rep[1] + rep[2] for m in SECONDARY_FAILURES)]
            if causes:
                first_error = causes[0]
            elif hung:
                first_error = None  # the others only lost their connection to a rank that hung: report the hang
        if first_error is not None and reports[first_error][0] == "error":
            _, summary, remote_tb = reports[first_error]
            others = sorted(r for r, rep in reports.items() if rep[0] != "ok" and r != first_error)
            also = f" (ranks {others} failed too, probably because rank {first_error} stopped)" if others else ""
            raise RankFailed(
                f"rank {first_error} of {world_size} failed with {summary}{also}. Every process was "
                f"ended. Its traceback:\n{remote_tb}", first_error, remote_tb)
        if missing:
            limit = f"{call_timeout:g} s in your function" if hung else f"{timeout:g} s"
            stack = f" Where rank {hung[0]} was:\n{reports[hung[0]][2]}" if hung else ""
            raise RankHung(
                f"ranks {missing} of {world_size} were still running after {limit}, and were "
                f"ended. A rank that never finishes is usually waiting for a message nobody sends: "
                f"a recv without its matching send, or every rank calling a blocking send first. "
                f"Use isend/irecv (or order the calls by rank) and check that each rank sends "
                f"exactly what its neighbour receives.{stack}", missing)
        return [reports[r][1] for r in range(world_size)]
    finally:
        _end(processes)
        _show_output(outdir, len(processes))
        shutil.rmtree(outdir, ignore_errors=True)
