"""Checks for the first lab: a Triton vector add."""

from __future__ import annotations

from .framework import Case, graded


def _sizes() -> list[int]:
    from ..device import cuda_available, interpreter_mode

    sizes = [1, 2, 17, 1000, 4097]  # 17, 1000, 4097: not a multiple of any power-of-two block
    if cuda_available() and not interpreter_mode():
        sizes += [(1 << 20) + 3]
    return sizes


@graded(points=10)
def check_vector_add(fn, checker):
    """``fn(x, y)`` must return a new tensor equal to ``x + y`` for any length, fp32 and fp16."""
    import torch

    from ..device import device

    dev = device()
    for dtype in (torch.float32, torch.float16):
        for seed, n in enumerate(_sizes()):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(n, generator=gen).to(dtype=dtype, device=dev)  # signed values
            y = torch.randn(n, generator=gen).to(dtype=dtype, device=dev)
            x_before, y_before = x.clone(), y.clone()
            case = Case(n=n, dtype=dtype, seed=seed)
            out = checker.call(fn, x, y, case=case)
            if not (torch.equal(x, x_before) and torch.equal(y, y_before)):
                checker.fail(case, "your function changed its inputs x or y.",
                             "write the sum into a new tensor (torch.empty_like(x)), never into x or y.")
            expected = x_before + y_before
            hint = ""
            if isinstance(out, torch.Tensor) and out.shape == expected.shape:
                wrong = ((out.double() - expected.double()).abs() > 1e-3).cpu()
                first = int(wrong.nonzero()[0]) if bool(wrong.any()) else -1
                if first >= 0 and bool(wrong[first:].all()):
                    hint = (
                        f"elements 0..{first - 1} are right and every element from index {first} to the "
                        f"end is wrong: the last, partial block is probably missing. Launch "
                        f"triton.cdiv(n, BLOCK_SIZE) programs and mask loads and stores with `offsets < n`."
                        if first
                        else "every element is wrong. If n is smaller than your block, the only block is "
                        "partial: launch triton.cdiv(n, BLOCK_SIZE) programs (rounding up) and mask loads "
                        "and stores with `offsets < n`."
                    )
            atol = 1e-6 if dtype == torch.float32 else 1e-3
            checker.expect_tensor(out, expected, case=case, atol=atol, rtol=1e-3, hint=hint,
                                  mistakes={"x - y is computed instead of x + y": x_before - y_before,
                                            "x is returned instead of x + y": x_before})
