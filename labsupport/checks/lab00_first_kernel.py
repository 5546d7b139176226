"""Checks for the first lab: a Triton vector add."""

from __future__ import annotations

import torch

from ..device import cuda_available, device, interpreter_mode
from ._guard import guarded_memory
from .framework import Case, CheckFailed, graded, torch_calls, triton_launches

# torch functions that compute the sum: the learner's function may allocate and reshape, not add
ADDS = ("add", "add_", "__add__", "__radd__", "__iadd__")
NO_KERNEL_HINT = ("compute the sum with your Triton kernel: allocate `out`, launch "
                  "`add_kernel[grid](x, y, out, n, BLOCK_SIZE=...)` and return `out`.")
INPUTS_HINT = ("check the inputs before launching: x and y must be 1-D tensors of the same length "
               "(`assert x.shape == y.shape`), and the kernel's `x_ptr + offsets` assumes adjacent elements, "
               "so make them contiguous (`x = x.contiguous()`) or refuse a strided view "
               "(`assert x.is_contiguous()`).")


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
            with triton_launches() as launches, torch_calls(ADDS) as calls, guarded_memory(nan_empty=True) as guard:
                out = checker.call(fn, x, y, case=case)
            if guard.touched():
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
    _check_strided_inputs(fn, checker, dev)
    _check_mismatched_lengths(fn, checker, dev)


def _refused(checker, fn, *args, case) -> tuple[bool, object]:
    """Run ``fn`` on inputs it may refuse: (True, None) when it raised (an assert, ValueError, ...),
    (False, result) when it returned."""
    try:
        return False, checker.call(fn, *args, case=case)
    except CheckFailed as exc:
        if exc.reason == "not done" or not isinstance(exc.__cause__, (AssertionError, ValueError, TypeError,
                                                                      RuntimeError, IndexError)):
            raise
        return True, None


def _check_strided_inputs(fn, checker, dev) -> None:
    """Every second element of longer tensors: the sum must be right, or the function must refuse."""
    n = 1000
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2 * n, generator=gen).to(device=dev)[::2]  # a view: stride 2, not contiguous
    y = torch.randn(2 * n, generator=gen).to(device=dev)[::2]
    case = Case(n=n, dtype=torch.float32, inputs="x[::2] and y[::2], views of tensors twice as long (stride 2)")
    expected = x + y
    with guarded_memory() as guard:
        refused, out = _refused(checker, fn, x, y, case=case)
    if guard.touched():
        checker.fail(case, "your kernel wrote outside the output it allocated.", INPUTS_HINT)
    if refused:
        return
    if isinstance(out, torch.Tensor) and out.shape == expected.shape and out.dtype == expected.dtype:
        contiguous_read = torch.as_strided(x, (n,), (1,)) + torch.as_strided(y, (n,), (1,))  # x's first n slots
        if not torch.allclose(out, expected, atol=1e-6, rtol=1e-3) and torch.allclose(
                out, contiguous_read, atol=1e-6, rtol=1e-3):
            checker.fail(case, "the sum is wrong for inputs that are not contiguous: your kernel read the first n "
                               "elements of the memory x and y start at, as if their elements were adjacent, but "
                               "x[::2] has a stride of 2 (x.stride() == (2,)).", INPUTS_HINT)
    checker.expect_tensor(out, expected, case=case, atol=1e-6, rtol=1e-3, hint=INPUTS_HINT)


def _check_mismatched_lengths(fn, checker, dev) -> None:
    """x of 1000 elements and y of 10: the function must refuse them, not read past the end of y."""
    gen = torch.Generator().manual_seed(12)
    case = Case(x="1000 elements", y="10 elements", dtype=torch.float32)
    with guarded_memory() as guard:
        x = guard.guard(torch.randn(1000, generator=gen).to(device=dev), "x")
        y = guard.guard(torch.randn(10, generator=gen).to(device=dev), "y")
        refused, out = _refused(checker, fn, x, y, case=case)
    if refused:
        return
    what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
    checker.fail(case, f"your function returned {what} for x of 1000 elements and y of 10; it must "
                       f"refuse inputs of different lengths (raise, e.g. `assert x.shape == y.shape`) instead of "
                       f"reading 990 elements past the end of y, memory y does not own.", INPUTS_HINT)


def _block_hint(out, expected, mistakes, atol) -> str:
    """A hint from where the wrong elements are: a missing last block shows as a wrong tail."""
    if not isinstance(out, torch.Tensor) or (out.shape, out.dtype, out.device) != (
        expected.shape, expected.dtype, expected.device
    ):
        return ""
    if any(torch.allclose(out.double(), m.double(), atol=atol, rtol=1e-3) for m in mistakes.values()):
        return ""  # the message already names the mistake
    diff = (out.double() - expected.double()).abs()
    wrong = (diff.isnan() | (diff > atol + 1e-3 * expected.double().abs())).cpu()  # NaN: never written
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
        if first % 16 == 0:
            return (f"elements 0..{first - 1} are right and every element from index {first} to the end is "
                    f"wrong: {first} is a whole number of blocks, so the programs that should have covered the "
                    f"rest never ran. The grid is too small: launch triton.cdiv(n, BLOCK_SIZE) programs, with "
                    f"the same BLOCK_SIZE the kernel is launched with.")
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
