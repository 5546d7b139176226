"""labsupport.roofline: small measurements on the CPU, the plot, and bad input."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labsupport.hardware import get_gpu  # noqa: E402
from labsupport.roofline import (  # noqa: E402
    RooflinePoint,
    attainable_flops,
    measure_copy,
    measure_matmul,
    plot_roofline,
    ridge_point,
)

FAST = dict(progress=False, repeats=2, warmup=1)


def test_ridge_point_of_h100_datasheet():
    h100 = get_gpu("H100 SXM")
    assert ridge_point(h100.peak_flops, h100.hbm_bandwidth) == pytest.approx(h100.ridge_point)
    assert ridge_point(1e12, 1e10) == pytest.approx(100.0)


def test_attainable_is_the_lower_roof():
    assert attainable_flops(10, peak_flops=1e12, bandwidth=1e10) == pytest.approx(1e11)  # bandwidth-bound
    assert attainable_flops(1000, peak_flops=1e12, bandwidth=1e10) == pytest.approx(1e12)  # compute-bound


@pytest.mark.parametrize("peak, bw", [(0, 1e9), (1e12, -1), ("fast", 1e9), (1e12, None)])
def test_ridge_point_rejects_bad_numbers(peak, bw):
    with pytest.raises(ValueError, match="peak_flops|bandwidth"):
        ridge_point(peak, bw)


def test_measure_matmul_small_sizes_square_and_rectangular():
    rates = measure_matmul([16, (1, 32, 24)], dtype=torch.float32, device="cpu", **FAST)
    assert len(rates) == 2
    assert all(isinstance(r, float) and r > 0 for r in rates)


def test_measure_matmul_fp16_on_cpu():
    (rate,) = measure_matmul([8], dtype=torch.float16, device="cpu", **FAST)
    assert rate > 0


def test_measure_copy_small_sizes():
    rates = measure_copy([1024, 4096], device="cpu", **FAST)
    assert len(rates) == 2 and all(r > 0 for r in rates)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ([], "at least one size"),
        ([0], "size must be 1 or more"),
        ([-4], "size must be 1 or more"),
        ([2.5], "int n"),
        ([(1, 2)], "int n"),
        ([(1, 0, 3)], "k must be 1 or more"),
        ("64", "list of sizes"),
        (64, "list of sizes"),
    ],
)
def test_measure_matmul_rejects_bad_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        measure_matmul(sizes, dtype=torch.float32, device="cpu", progress=False)


def test_measure_matmul_rejects_bad_dtype_and_device():
    with pytest.raises(ValueError, match="floating-point torch dtype"):
        measure_matmul([4], dtype=torch.int32, device="cpu", progress=False)
    with pytest.raises(ValueError, match="floating-point torch dtype"):
        measure_matmul([4], dtype="float32", device="cpu", progress=False)
    with pytest.raises(ValueError, match="device"):
        measure_matmul([4], dtype=torch.float32, device="tpu", progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when there is no GPU")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        measure_copy([1024], device="cuda", progress=False)


@pytest.mark.parametrize("sizes, match", [([], "at least one"), ([0], "1 or more"), ([1.5], "integer")])
def test_measure_copy_rejects_bad_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        measure_copy(sizes, device="cpu", progress=False)


def test_plot_roofline_smoke():
    fig, ax = plt.subplots()
    h100 = get_gpu("H100 SXM")
    points = [
        ("decode", 1.0),
        RooflinePoint("measured", 50.0, 2e13),
        ("prefill", 2000.0, 4e14),
    ]
    out = plot_roofline(ax, 7e14, 3e12, points=points, published=h100)
    assert out is ax
    assert len(ax.get_lines()) >= 2 + 2 + len(points)  # two roofs, two ridge lines, the points
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["decode", "measured", "prefill"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("H100 SXM datasheet" in t for t in legend) and any("measured" in t for t in legend)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    plt.close(fig)


def test_plot_roofline_dict_points_and_no_published():
    fig, ax = plt.subplots()
    plot_roofline(ax, 1e11, 2e10, points={"a": 1.0, "b": (100.0, 5e10)})
    assert [t.get_text() for t in ax.texts] == ["a", "b"]
    plt.close(fig)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(points=[("x",)]), "each point"),
        (dict(points=[("x", -1.0)]), "intensity of point 'x'"),
        (dict(points=[("x", 1.0, 0)]), "achieved FLOP/s"),
        (dict(published=42), "gpu must be a labsupport.hardware.GPU"),
        (dict(published="H1000"), "unknown GPU 'H1000'"),
        (dict(intensity_range=(10, 1)), "low < high"),
    ],
)
def test_plot_roofline_rejects_bad_input(kwargs, match):
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        plot_roofline(ax, 1e12, 1e10, **kwargs)
    plt.close(fig)


def test_plot_roofline_needs_axes():
    with pytest.raises(ValueError, match="matplotlib Axes"):
        plot_roofline(None, 1e12, 1e10)


def test_matmul_intensity_and_time():
    from labsupport.roofline import matmul_bytes, matmul_intensity, roofline_time

    assert matmul_bytes(2, 3, 4, 2) == 2 * (6 + 12 + 8)
    assert matmul_intensity(2, 3, 4, 2) == pytest.approx(2 * 24 / 52)
    assert roofline_time(1e12, 1e9, peak_flops=1e12, bandwidth=1e10) == pytest.approx(1.0)  # compute-bound
    assert roofline_time(1e9, 1e10, peak_flops=1e12, bandwidth=1e10) == pytest.approx(1.0)  # bandwidth-bound
    with pytest.raises(ValueError, match="dtype_bytes"):
        matmul_intensity(2, 3, 4, 0)
    with pytest.raises(ValueError, match="flops"):
        roofline_time(-1, 1, 1, 1)
