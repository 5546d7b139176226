"""check_arithmetic_intensity passes the reference and rejects each planted mistake."""

from __future__ import annotations

import pytest

from labsupport._answers import unguarded
from labsupport.checks import CheckFailed, check_arithmetic_intensity
from labsupport.roofline import matmul_intensity

# the answer itself, outside the guard (checks.roofline.reference_intensity delegates to it)
reference_intensity = unguarded(matmul_intensity)


def test_reference_passes(capsys):
    check_arithmetic_intensity(reference_intensity)
    assert "PASSED check_arithmetic_intensity" in capsys.readouterr().out


def test_an_equivalent_implementation_passes():
    def tidy(m, k, n, dtype_bytes):
        flops = 2.0 * m * k * n
        bytes_moved = (m * k + k * n + m * n) * dtype_bytes
        return flops / bytes_moved

    check_arithmetic_intensity(tidy)


def test_known_values():
    assert reference_intensity(1, 4096, 4096, 2) == pytest.approx(1.0, rel=1e-3)  # matvec: about 1
    assert reference_intensity(4096, 4096, 4096, 2) == pytest.approx(4096 / 3)  # square: n / (3 * bytes / 2)


MUTATIONS = {
    "forgot the factor 2": (lambda m, k, n, b: m * k * n / (b * (m * k + k * n + m * n)), "factor 2"),
    "forgot writing C": (lambda m, k, n, b: 2 * m * k * n / (b * (m * k + k * n)), "written for C"),
    "one dtype size for everything (fixed 2 bytes)": (
        lambda m, k, n, b: 2 * m * k * n / (2 * (m * k + k * n + m * n)),
        "fixed 2 bytes",
    ),
    "elements instead of bytes": (
        lambda m, k, n, b: 2 * m * k * n / (m * k + k * n + m * n),
        "elements are counted",
    ),
    "only the weights counted": (lambda m, k, n, b: 2 * m * k * n / (b * k * n), "only the bytes of B"),
    "C counted twice": (
        lambda m, k, n, b: 2 * m * k * n / (b * (m * k + k * n + 2 * m * n)),
        "counted twice",
    ),
    "multiplies by dtype_bytes": (
        lambda m, k, n, b: 2 * m * k * n * b / (m * k + k * n + m * n),
        "multiplies",
    ),
    "integer division": (
        lambda m, k, n, b: 2 * m * k * n // (b * (m * k + k * n + m * n)),
        "integer division",
    ),
    "wrong shape for C (k*n elements)": (
        lambda m, k, n, b: 2 * m * k * n / (b * (m * k + 2 * k * n)),
        "expected",
    ),
    "returns a string": (
        lambda m, k, n, b: f"{2 * m * k * n / (b * (m * k + k * n + m * n)):.3f}",
        "expected a number",
    ),
    "returns None": (lambda m, k, n, b: None, "expected a number"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_rejected(name):
    fn, message = MUTATIONS[name]
    with pytest.raises(CheckFailed, match=message):
        check_arithmetic_intensity(fn)


def test_stub_says_not_implemented():
    def stub(m, k, n, dtype_bytes):
        raise NotImplementedError("Exercise: compute the intensity")

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_arithmetic_intensity(stub)


def test_passing_a_value_instead_of_the_function():
    with pytest.raises(CheckFailed, match="takes your function itself"):
        check_arithmetic_intensity(3.0)


def test_a_float32_output_is_named_beside_c_counted_twice():
    """At dtype_bytes = 2 a float32 C (4 bytes) and C read and written (2 x 2 bytes) give the same count:
    the message names both (red team, issue 26)."""
    def fp32_output(m, k, n, dtype_bytes):
        return 2 * m * k * n / (dtype_bytes * (m * k + k * n) + 4 * m * n)

    with pytest.raises(CheckFailed, match="(?s)C is counted twice.*, or C is charged 4 bytes per element"):
        check_arithmetic_intensity(fp32_output)
