"""Checks for the roofline lab: the arithmetic intensity of a matmul."""

from __future__ import annotations

from .._answers import answer
from ..roofline import matmul_intensity
from .framework import Case, graded

# (m, k, n, dtype_bytes, what the shape stands for). Decode multiplies one token (or a small
# batch) by a weight matrix; prefill multiplies a whole prompt by it.
_CASES = [
    (1, 4096, 4096, 2, "matrix-vector, decode-like"),
    (8, 4096, 14336, 2, "batch-8 decode step, feed-forward up projection"),
    (2000, 4096, 4096, 2, "2,000-token prefill, attention projection"),
    (4096, 4096, 4096, 2, "square, prefill-like"),
    (512, 512, 512, 4, "square, 4-byte (fp32) elements"),
    (1, 8192, 1024, 1, "matrix-vector, 1-byte (fp8/int8) elements"),
    (3, 5, 7, 4, "small and rectangular"),
    (1, 1, 1, 2, "one element each"),
]

CONVENTION = (
    "the convention: FLOPs = 2*m*k*n (a multiply and an add per term); bytes = dtype_bytes * "
    "(m*k + k*n + m*n), reading A and B once and writing C once."
)


@answer
def reference_intensity(m: int, k: int, n: int, dtype_bytes: float) -> float:
    """FLOP per byte of ``C = A @ B``, A ``(m, k)``, B ``(k, n)``: A and B read once, C written once."""
    return matmul_intensity(m, k, n, dtype_bytes)


def _mistakes(m, k, n, b) -> dict[str, float]:
    mistakes = {
        "the factor 2 is missing from the FLOPs (a multiply-add is two operations)": m
        * k
        * n
        / (b * (m * k + k * n + m * n)),
        "the bytes written for C (m*n elements) are left out": 2 * m * k * n / (b * (m * k + k * n)),
        "only the bytes of B (the weights) are counted": 2 * m * k * n / (b * k * n),
        "C is counted twice (read and written)": 2 * m * k * n / (b * (m * k + k * n + 2 * m * n)),
        "C is charged 4 bytes per element (a float32 output, the accumulator's width) whatever dtype_bytes: "
        "the matmul writes C in the inputs' dtype": 2 * m * k * n / (b * (m * k + k * n) + 4 * m * n),
        "elements are counted instead of bytes (dtype_bytes is ignored)": 2
        * m
        * k
        * n
        / (m * k + k * n + m * n),
        "a fixed 2 bytes per element is used instead of dtype_bytes": 2
        * m
        * k
        * n
        / (2 * (m * k + k * n + m * n)),
        "dtype_bytes multiplies the intensity instead of dividing it": 2
        * m
        * k
        * n
        * b
        / (m * k + k * n + m * n),
        "integer division (//) truncates the result": float(2 * m * k * n // (b * (m * k + k * n + m * n))),
    }
    if b == 2:  # a float32 C (4 bytes) and a C read and written (2 x 2 bytes) give the same count
        twice = mistakes.pop("C is counted twice (read and written)")
        del mistakes["C is charged 4 bytes per element (a float32 output, the accumulator's width) whatever "
                     "dtype_bytes: the matmul writes C in the inputs' dtype"]
        mistakes["C is counted twice (read and written), or C is charged 4 bytes per element (a float32 output, "
                 "the accumulator's width) although the matmul writes C in the inputs' dtype"] = twice
    return mistakes


@graded(points=5, bans=(reference_intensity, matmul_intensity))
def check_arithmetic_intensity(fn, checker):
    """``fn(m, k, n, dtype_bytes)`` must return the FLOP per byte of an ``(m, k) @ (k, n)`` matmul."""
    for m, k, n, b, what in _CASES:
        case = Case(m=m, k=k, n=n, dtype_bytes=b, shape=what)
        got = checker.call(fn, m, k, n, b, case=case)
        expected = reference_intensity(m, k, n, b)
        mistakes = {d: v for d, v in _mistakes(m, k, n, b).items() if abs(v - expected) > 1e-9 * expected}
        checker.expect_number(
            got,
            expected,
            case=case,
            rel=1e-6,
            what="arithmetic intensity",
            hint=CONVENTION,
            mistakes=mistakes,
        )
