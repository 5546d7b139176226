"""Guard space around the tensors a learner's kernel touches (the Triton checks of labs 00, 07, 08).

A kernel that loads or stores past the end of a tensor touches memory the tensor does not own.
In Triton's interpreter that corrupts the heap and kills the whole Python process (a Jupyter
kernel dies, the notebook's state is lost, and nothing says why); on a GPU it silently
overwrites other tensors, or faults. While :class:`guarded_memory` is active:

* every tensor the learner's function allocates (``torch.empty_like``, ``torch.zeros``,
  ``x.clone()``, ``x.contiguous()`` of a strided view, ...) is a view into the middle of a larger
  buffer, with guard space before and after it filled with a fixed byte pattern;
* :meth:`guarded_memory.guard` puts a copy of an input into such a buffer, its guard space
  filled with ``0xFF`` bytes: NaN in every float dtype, so a kernel that reads past an input's
  end gets NaN and its result shows it, instead of reading whatever lies there.

Afterwards :meth:`guarded_memory.touched` names every tensor whose guard space was written, so
the check can say "your kernel wrote past the end of ..." instead of crashing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

PAD = 1 << 16  # guard elements on each side, at least
MAX_PAD = 1 << 22  # and at most four times the tensor's elements, up to this
INPUT_FILL = 0xFF  # every byte of an input's guard space: NaN in float16, bfloat16, float32, float64
ALLOCATION_FILL = 0xA5  # every byte of an allocation's guard space: a pattern no kernel writes by chance

# the torch functions and tensor methods whose result, when it has storage of its own, is padded
ALLOCATORS = frozenset({
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "empty", "zeros", "ones",
    "full", "clone", "new_empty", "new_zeros", "new_ones", "new_full", "empty_strided", "contiguous", "to",
    "float", "half", "bfloat16", "double",
})
EMPTY = frozenset({"empty_like", "empty", "new_empty", "empty_strided"})  # uninitialised: NaN with nan_empty=True


@dataclass
class Guarded:
    """One padded tensor: its ``buffer`` (uint8 view of the whole storage), where its own bytes start
    and stop in it, the fill byte of the guard space, and what to call it in a message."""

    buffer: torch.Tensor
    start: int
    stop: int
    fill: int
    label: str
    shape: tuple
    dtype: torch.dtype

    def touched(self) -> bool:
        before, after = self.buffer[: self.start], self.buffer[self.stop:]
        return not (bool((before == self.fill).all()) and bool((after == self.fill).all()))


def _pad_elements(numel: int) -> int:
    pad = max(PAD, min(4 * numel, MAX_PAD))
    return -(-pad // 64) * 64  # a multiple of 64 elements: the tensor stays 16-byte aligned, as Triton likes


def padded_copy(t: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A copy of ``t`` in the middle of a buffer whose guard bytes are ``fill``, laid out as ``t`` is (a
    transposed view stays a transposed view): ``(copy, buffer as uint8, first byte, one past the last)``."""
    pad = _pad_elements(t.numel())
    item = t.element_size()
    raw = torch.full(((t.numel() + 2 * pad) * item,), fill, dtype=torch.uint8, device=t.device)
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))  # outermost dimension in memory first
    dense = t.permute(order)  # the same elements, in the order they are laid out in memory
    flat = raw.view(t.dtype)[pad: pad + t.numel()]
    flat.copy_(dense.reshape(-1))
    copy = flat.view(dense.shape).permute([order.index(i) for i in range(t.dim())])
    return copy, raw, pad * item, (pad + t.numel()) * item


class guarded_memory:
    """Context manager: while active, what the learner's function allocates is padded (see the module
    docstring). ``guard(t, label)`` pads an input; ``touched()`` lists the guarded tensors written
    outside their bounds. With ``nan_empty=True`` a float tensor from ``torch.empty``-like calls starts
    as NaN, so elements a kernel never writes show as NaN instead of whatever memory held before."""

    def __init__(self, *, nan_empty: bool = False):
        self.guarded: list[Guarded] = []
        self.nan_empty = nan_empty
        guard = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                name = getattr(func, "__name__", "")
                if name in ALLOCATORS:
                    return guard._allocated(result, args, empty=name in EMPTY)
                return result

        self.mode = Mode()

    def guard(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """A copy of input ``t`` with guard space (NaN for floats) before and after it."""
        view, raw, start, stop = padded_copy(t, INPUT_FILL)
        self.guarded.append(Guarded(raw, start, stop, INPUT_FILL, label, tuple(t.shape), t.dtype))
        return view

    def _allocated(self, t, args, empty=False):
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or not t.is_contiguous() or t.is_sparse:
            return t  # Triton's interpreter itself makes empty placeholders
        if t.device.type == "meta" or t.dtype == torch.bool or t.is_complex():
            return t
        storage = t.untyped_storage()
        if t.storage_offset() or storage.nbytes() != t.numel() * t.element_size():
            return t  # a view into something else
        if any(isinstance(a, torch.Tensor) and a.numel() and a.untyped_storage().data_ptr() == storage.data_ptr()
               for a in args):
            return t  # x.contiguous() or x.to(x.dtype) returned x itself
        view, raw, start, stop = padded_copy(t, ALLOCATION_FILL)
        if empty and self.nan_empty and t.is_floating_point():
            raw[start:stop] = INPUT_FILL  # uninitialised memory reads as NaN, as torch's fill_uninitialized_memory
        label = f"the {'x'.join(map(str, t.shape)) or 'scalar'} {str(t.dtype).replace('torch.', '')} tensor your function allocated"
        self.guarded.append(Guarded(raw, start, stop, ALLOCATION_FILL, label, tuple(t.shape), t.dtype))
        return view

    def touched(self) -> list[Guarded]:
        """The guarded tensors whose guard space was written (their bounds were overstepped)."""
        return [g for g in self.guarded if g.touched()]

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def touched_names(touched: list[Guarded]) -> str:
    """The guarded tensors written outside their bounds, in words, each named once ("the input q, the
    1x4 float32 tensor your function allocated (2 of them)")."""
    counts: dict[str, int] = {}
    for g in touched:
        name = g.label if " " in g.label else f"the input {g.label}"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(name if n == 1 else f"{name} ({n} of them)" for name, n in counts.items())
