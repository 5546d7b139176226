"""Checks for the first lab: a Triton vector add."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..device import cuda_available, device, interpreter_mode
from .framework import Case, graded, torch_calls, triton_launches

PAD = 1 << 16  # elements of guard space after every output tensor the learner's function allocates
# torch functions that compute the sum: the learner's function may allocate and reshape, not add
ADDS = ("add", "add_", "__add__", "__radd__", "__iadd__")
NO_KERNEL_HINT = ("compute the sum with your Triton kernel: allocate `out`, launch "
                  "`add_kernel[grid](x, y, out, n, BLOCK_SIZE=...)` and return `out`.")


class _guarded_allocations:
    """While active, ``torch.empty_like``, ``torch.zeros``, ``x.clone()`` and friends return views
    into buffers with ``PAD`` NaN-filled elements after the end, so a kernel that stores past the
    end of its output writes there (detectably) instead of into memory it does not own, which in
    the interpreter aborts the whole Python process."""

    ALLOCATORS = ("empty_like", "zeros_like", "ones_like", "full_like", "empty", "zeros", "ones", "full", "clone",
                  "new_empty", "new_zeros", "new_ones", "new_full", "empty_strided")

    def __init__(self):
        guard = self
        self.buffers: list[tuple[object, int]] = []  # (padded buffer, elements in use)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                if getattr(func, "__name__", "") in guard.ALLOCATORS:
                    return guard._padded(result)
                return result

        self.mode = Mode()

    def _padded(self, t):
        if (not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.is_contiguous()
                or t.numel() == 0):  # Triton's interpreter itself makes empty placeholders
            return t
        buffer = torch.full((t.numel() + PAD,), float("nan"), dtype=t.dtype, device=t.device)
        buffer[: t.numel()].copy_(t.reshape(-1))
        self.buffers.append((buffer, t.numel()))
        return buffer[: t.numel()].view(t.shape)

    def wrote_past_the_end(self) -> bool:
        return any(not bool(torch.isnan(buf[used:]).all()) for buf, used in self.buffers)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _sizes() -> list[int]:
    # 1000, 17, 4097: not a multiple of any power-of-two block. A mid-sized length comes first, so a
    # first failure shows where the wrong elements are (a wrong tail means a missing last block).
    sizes = [1000, 17, 4097, 2, 1]
    if cuda_available() and not interpreter_mode():
        sizes += [(1 << 20) + 3]
    return sizes


@graded(points=10)
def check_vector_add(fn, checker):
    """``fn(x, y)`` must return a new tensor equal to ``x + y`` for any length, fp32 and fp16."""
    dev = device()
    for dtype in (torch.float32, torch.float16):
        for seed, n in enumerate(_sizes()):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(n, generator=gen).to(dtype=dtype, device=dev)  # signed values
            y = torch.randn(n, generator=gen).to(dtype=dtype, device=dev)
            x_before, y_before = x.clone(), y.clone()
            case = Case(n=n, dtype=dtype, seed=seed)
            with triton_launches() as launches, torch_calls(ADDS) as calls, _guarded_allocations() as guard:
                out = checker.call(fn, x, y, case=case)
            if guard.wrote_past_the_end():
                checker.fail(case, f"your kernel wrote past the end of the output (n={n}): the last block's "
                                   f"lanes beyond n stored values into memory the tensor does not own.",
                             "mask the store as well as the loads: `tl.store(out_ptr + offsets, ..., "
                             "mask=offsets < n)`. On a GPU this corrupts other tensors silently; in the "
                             "interpreter it can crash Python.")
            if not (torch.equal(x, x_before) and torch.equal(y, y_before)):
                checker.fail(case, "your function changed its inputs x or y.",
                             "write the sum into a new tensor (torch.empty_like(x)), never into x or y.")
            expected = x_before + y_before
            mistakes = {"x - y is computed instead of x + y": x_before - y_before,
                        "x is returned instead of x + y": x_before}
            atol = 1e-6 if dtype == torch.float32 else 1e-3
            checker.expect_tensor(out, expected, case=case, atol=atol, rtol=1e-3,
                                  hint=_block_hint(out, expected, mistakes, atol), mistakes=mistakes)
            if launches.count == 0:
                checker.fail(case, "the result is right, but no Triton kernel was launched: the sum was "
                                   "computed some other way (in torch?).", NO_KERNEL_HINT)
            checker.expect_kernel_work(case, launches, calls, {"out": out}, NO_KERNEL_HINT)


def _block_hint(out, expected, mistakes, atol) -> str:
    """A hint from where the wrong elements are: a missing last block shows as a wrong tail."""
    if not isinstance(out, torch.Tensor) or (out.shape, out.dtype, out.device) != (
        expected.shape, expected.dtype, expected.device
    ):
        return ""
    if any(torch.allclose(out.double(), m.double(), atol=atol, rtol=1e-3) for m in mistakes.values()):
        return ""  # the message already names the mistake
    wrong = ((out.double() - expected.double()).abs() > atol + 1e-3 * expected.double().abs()).cpu()
    if not bool(wrong.any()):
        return ""
    first, n = int(wrong.nonzero()[0]), wrong.numel()
    if first and bool(wrong[first:].all()):
        if first % 16 == 0 and n - first < first:
            also = " (or, if only the very last element is wrong, the mask may be off by one)" if n - first <= 2 else ""
            return (f"elements 0..{first - 1} are right and every element from index {first} to the end is "
                    f"wrong: the last, partial block is probably missing{also}. Launch triton.cdiv(n, BLOCK_SIZE) "
                    f"programs and mask loads and stores with `offsets < n`.")
        if n - first <= 2:
            return (f"only the last {n - first} element(s) are wrong: the mask is off by one. Keep every "
                    f"offset below n: `mask = offsets < n`.")
        return (f"elements 0..{first - 1} are right and the rest are wrong, from an index that is not the "
                f"start of a block: check the offsets (`pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)`).")
    if n < 16 and bool(wrong.all()):
        return (f"every element is wrong. With n={n}, smaller than any block, the only block is partial: "
                f"launch triton.cdiv(n, BLOCK_SIZE) programs (rounding up, so at least one) and mask loads "
                f"and stores with `offsets < n`.")
    if float(wrong.double().mean()) >= 0.9:
        amount = "every" if bool(wrong.all()) else "nearly every"
        return f"{amount} element is wrong: check that you store x + y, loaded from x_ptr and y_ptr, into out_ptr."
    return ("some elements are right and others wrong: check the offsets "
            "(`pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)`) and that loads and stores use the same ones.")
