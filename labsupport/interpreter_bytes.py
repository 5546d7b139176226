"""Count the bytes Triton kernels load and store, by running them in Triton's interpreter.

On a CPU, Triton's interpreter runs every ``tl.load`` and ``tl.store`` of a kernel as NumPy
operations on real addresses, one program after another. :func:`count_bytes` listens to those
operations and adds up what each kernel moves, so a learner without a GPU can *measure* what
tiling, quantisation or paging saves instead of taking a formula on trust::

    from labsupport.interpreter_bytes import count_bytes

    with count_bytes() as counted:
        add_kernel[grid](x, y, out, n, BLOCK=128)
    counted.loaded, counted.stored          # bytes, every launch inside the block
    counted.by_argument["x_ptr"].loaded     # per kernel parameter (the pointer's name)
    counted.by_kernel["add_kernel"].stored  # per kernel

What is counted, exactly (chapter 07 uses it for FlashAttention against naive attention,
chapter 08 for the rotary-embedding kernel):

* Every lane of every load and store the kernel issues, times the element size of the pointer
  (``tl.float16`` counts 2 bytes, ``tl.int1`` 1). **Masked-off lanes are excluded**: a lane whose
  mask is False moves nothing. Block pointers (``tl.make_block_ptr``) and tensor descriptors go
  through the same path and count the same way, their boundary checks acting as the mask.
* Lanes, not distinct addresses: a tile loaded twice counts twice, and a value broadcast to
  many lanes through identical pointers counts once per lane. That is the traffic the kernel
  *asks* the memory system for; on a GPU, caches (L2) may serve part of it without touching HBM,
  so the count is an upper bound on HBM traffic and exact for kernels that read each byte once.
* An atomic read-modify-write (``tl.atomic_add``, ``tl.atomic_cas``, ...) counts one load and
  one store per active lane. Scalars passed by value (``n``, ``sm_scale``) are not memory
  traffic and are not counted.
* ``by_argument`` attributes each lane to the kernel parameter whose tensor holds the address
  (when two tensor arguments overlap in memory, the first parameter that covers the address
  gets it); lanes outside every tensor argument are listed under ``"(other)"``.

Only in the interpreter. With ``TRITON_INTERPRET`` unset (on a GPU), kernels are compiled and
nothing passes through Python, so :func:`count_bytes` raises :class:`BytesNotCountable` on
entry, and a compiled launch inside the block raises it too. On a GPU the same numbers come
from formulas (bytes each kernel must move, as chapters 05 and 07 derive them) together with
measured time; the course says which it shows.

Tested with Triton 3.6 and 3.9, whose interpreters route every memory operation through
``InterpreterBuilder.create_masked_load`` / ``create_masked_store``. On a Triton whose
interpreter lacks these hooks (or changed their arguments), :func:`count_bytes` raises
:class:`BytesNotCountable` saying so, rather than count wrong.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

import numpy as np

from .device import INTERPRET_VAR, interpreter_mode

__all__ = ["BytesNotCountable", "ByteCount", "Traffic", "count_bytes"]

OTHER = "(other)"

# (method, the names its leading parameters must have) in triton.runtime.interpreter.InterpreterBuilder
_MEMORY_HOOKS = {
    "create_masked_load": ("self", "ptrs", "mask"),
    "create_masked_store": ("self", "ptrs", "value", "mask"),
    "create_atomic_rmw": ("self", "rmwOp", "ptr", "val", "mask"),
    "create_atomic_cas": ("self", "ptr", "cmp", "val"),
}


class BytesNotCountable(RuntimeError):
    """Bytes cannot be counted here: not in Triton's interpreter, or an interpreter this module
    does not know. The message says why and what to do instead."""


@dataclass
class Traffic:
    """Bytes loaded from and stored to memory."""

    loaded: int = 0
    stored: int = 0

    @property
    def total(self) -> int:
        return self.loaded + self.stored


@dataclass
class ByteCount(Traffic):
    """What :func:`count_bytes` measured: totals over every launch inside the ``with`` block,
    per kernel parameter (``by_argument``, keyed by the parameter's name) and per kernel
    (``by_kernel``, keyed by the kernel function's name)."""

    launches: int = 0
    by_argument: dict[str, Traffic] = field(default_factory=dict)
    by_kernel: dict[str, Traffic] = field(default_factory=dict)

    def _add(self, kernel: str, argument: str, loaded: int = 0, stored: int = 0) -> None:
        for bucket in (self, self.by_argument.setdefault(argument, Traffic()),
                       self.by_kernel.setdefault(kernel, Traffic())):
            bucket.loaded += loaded
            bucket.stored += stored


class _Launch:
    """One interpreted launch: the kernel's name and its tensor arguments' address ranges."""

    def __init__(self, kernel: str, arg_names):
        self.kernel = kernel
        self.arg_names = list(arg_names)
        self.regions: list[tuple[str, int, int]] = []  # (parameter, first byte, one past the last)

    def remember(self, args_hst, kwargs_hst) -> None:
        named = list(zip(self.arg_names, args_hst)) + list(kwargs_hst.items())
        for name, value in named:
            extent = _extent(value)
            if extent is not None:
                self.regions.append((name, *extent))

    def attribute(self, addresses: np.ndarray) -> dict[str, int]:
        """Parameter name -> number of the given addresses inside its tensor."""
        counts: dict[str, int] = {}
        left = addresses
        for name, start, stop in self.regions:
            if left.size == 0:
                break
            inside = (left >= start) & (left < stop)
            n = int(inside.sum())
            if n:
                counts[name] = counts.get(name, 0) + n
                left = left[~inside]
        if left.size:
            counts[OTHER] = counts.get(OTHER, 0) + int(left.size)
        return counts


def _extent(value) -> tuple[int, int] | None:
    """The byte range a tensor view can address (None for anything that is not a tensor)."""
    base = getattr(value, "base", None) if type(value).__name__ == "TensorWrapper" else value
    if not (hasattr(base, "data_ptr") and hasattr(base, "stride") and hasattr(base, "element_size")):
        return None
    start = int(base.data_ptr())
    if base.numel() == 0:
        return start, start
    last = sum((size - 1) * abs(stride) for size, stride in zip(base.shape, base.stride()))
    return start, start + (last + 1) * int(base.element_size())


def _element_bytes(ptrs) -> int:
    bits = ptrs.get_element_ty().primitive_bitwidth
    return max(1, bits // 8)  # int1 is stored as one byte


def _interpreter_module():
    try:
        module = importlib.import_module("triton.runtime.interpreter")
    except ImportError as exc:
        raise BytesNotCountable(f"Triton's interpreter cannot be imported here ({exc}).") from exc
    builder = getattr(module, "InterpreterBuilder", None)
    executor = getattr(module, "GridExecutor", None)
    problems = []
    if builder is None or executor is None:
        problems.append("InterpreterBuilder or GridExecutor is missing")
    else:
        for method, wanted in _MEMORY_HOOKS.items():
            fn = builder.__dict__.get(method)
            if fn is None:
                problems.append(f"InterpreterBuilder.{method} is missing")
                continue
            names = tuple(inspect.signature(fn).parameters)[: len(wanted)]
            if names != wanted:
                problems.append(f"InterpreterBuilder.{method} takes {names}, expected {wanted} first")
        for method in ("__call__", "_init_args_hst"):
            if method not in executor.__dict__:
                problems.append(f"GridExecutor.{method} is missing")
    if problems:
        import triton  # only for its version in the message

        raise BytesNotCountable(
            f"labsupport.interpreter_bytes cannot count bytes with Triton {triton.__version__}: its "
            f"interpreter is not laid out as this module expects ({'; '.join(problems)}). It was written "
            f"for Triton 3.6 to 3.9. Use the byte formulas the chapter gives instead, or report this "
            f"version to the course."
        )
    return module


def _compiled_launches_refused() -> list[tuple[type, str, object]]:
    """A compiled launch inside a count_bytes block would go uncounted: refuse it (where this Triton's
    JITFunction is laid out as expected; otherwise nothing to replace)."""
    try:
        jit = importlib.import_module("triton.runtime.jit").JITFunction
        jit.__dict__["run"]  # noqa: B018  (present in every Triton this module knows)
    except (ImportError, AttributeError, KeyError):
        return []

    def compiled(*args, **kwargs):
        raise BytesNotCountable(
            "a compiled (not interpreted) Triton kernel was launched inside count_bytes: its bytes "
            f"cannot be counted. It was defined while {INTERPRET_VAR} was unset; on a GPU take the "
            "bytes from the formula instead."
        )

    return [(jit, "run", compiled)]


class count_bytes:
    """Context manager: count the bytes every interpreted Triton launch inside it loads and stores.

    ``with count_bytes() as counted: ...`` then read ``counted.loaded``, ``counted.stored``,
    ``counted.total``, ``counted.launches``, ``counted.by_argument[name]`` and
    ``counted.by_kernel[name]`` (each a :class:`Traffic`). See the module docstring for what is
    counted. Raises :class:`BytesNotCountable` when kernels are compiled rather than interpreted
    (with ``TRITON_INTERPRET`` unset, as on a GPU), or when this Triton's interpreter is not one
    this module knows. Blocks do not nest.
    """

    _active = False

    def __init__(self):
        self.counted = ByteCount()
        self._patched: list[tuple[type, str, object]] = []
        self._launches: list[_Launch] = []

    def __enter__(self) -> ByteCount:
        if not interpreter_mode():
            raise BytesNotCountable(
                f"count_bytes works only in Triton's interpreter ({INTERPRET_VAR}=1, which `import labsupport` "
                f"sets on a machine without a GPU): compiled kernels run on the GPU without passing through "
                f"Python, so there is nothing to listen to. On a GPU, take the bytes from the formula (what "
                f"the kernel must read and write) and the time from a measurement."
            )
        if count_bytes._active:
            raise BytesNotCountable("count_bytes blocks do not nest: close the first one before opening another.")
        module = _interpreter_module()
        replacements = [
            *self._memory_hooks(module.InterpreterBuilder),
            *self._launch_hooks(module.GridExecutor),
            *_compiled_launches_refused(),
        ]
        for cls, name, replacement in replacements:
            self._patched.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, replacement)
        count_bytes._active = True
        return self.counted

    def _current(self) -> _Launch | None:
        return self._launches[-1] if self._launches else None

    def _record(self, ptrs, mask, *, load: bool, store: bool) -> None:
        """Count the lanes of one load or store (those the mask keeps) against the argument each
        address falls in."""
        launch = self._current()
        if launch is None:
            return
        addresses = np.asarray(ptrs.data)
        if mask is not None:
            active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
            addresses = addresses[active]
        addresses = addresses.reshape(-1)
        size = _element_bytes(ptrs)
        for name, lanes in launch.attribute(addresses).items():
            self.counted._add(launch.kernel, name, loaded=lanes * size if load else 0,
                              stored=lanes * size if store else 0)

    def _memory_hooks(self, builder) -> list[tuple[type, str, object]]:
        """The interpreter's memory operations, each recorded before it runs."""
        record = self._record
        originals = {name: builder.__dict__[name] for name in _MEMORY_HOOKS}

        def masked_load(self, ptrs, mask, *args, **kwargs):
            record(ptrs, mask, load=True, store=False)
            return originals["create_masked_load"](self, ptrs, mask, *args, **kwargs)

        def masked_store(self, ptrs, value, mask, *args, **kwargs):
            record(ptrs, mask, load=False, store=True)
            return originals["create_masked_store"](self, ptrs, value, mask, *args, **kwargs)

        def atomic_rmw(self, rmw_op, ptr, val, mask, *args, **kwargs):
            record(ptr, mask, load=True, store=True)
            return originals["create_atomic_rmw"](self, rmw_op, ptr, val, mask, *args, **kwargs)

        def atomic_cas(self, ptr, cmp, val, *args, **kwargs):
            record(ptr, None, load=True, store=True)
            return originals["create_atomic_cas"](self, ptr, cmp, val, *args, **kwargs)

        return [
            (builder, "create_masked_load", masked_load),
            (builder, "create_masked_store", masked_store),
            (builder, "create_atomic_rmw", atomic_rmw),
            (builder, "create_atomic_cas", atomic_cas),
        ]

    def _launch_hooks(self, executor) -> list[tuple[type, str, object]]:
        """Each interpreted launch: which kernel runs, and the host tensors behind its arguments."""
        counter = self
        launch_call = executor.__dict__["__call__"]
        init_args = executor.__dict__["_init_args_hst"]

        def launched(self, *args, **kwargs):
            counter._launches.append(_Launch(getattr(self.fn, "__name__", "kernel"), self.arg_names))
            try:
                return launch_call(self, *args, **kwargs)
            finally:
                counter._launches.pop()
                counter.counted.launches += 1

        def host_arguments(self, *args, **kwargs):
            args_hst, kwargs_hst = init_args(self, *args, **kwargs)
            launch = counter._current()
            if launch is not None:
                launch.remember(args_hst, kwargs_hst)
            return args_hst, kwargs_hst

        return [(executor, "__call__", launched), (executor, "_init_args_hst", host_arguments)]

    def __exit__(self, *exc) -> bool:
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)
        self._patched.clear()
        count_bytes._active = False
        return False
