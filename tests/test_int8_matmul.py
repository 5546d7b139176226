"""The course's weight-only int8 kernel (interpreter on a CPU) and its byte counts."""

from __future__ import annotations

import pytest
import torch

from labsupport import int8_matmul as IM
from labsupport.quantize import quantize_groupwise

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.parametrize("m,n,k,group,dtype", [(1, 70, 256, 64, torch.float16), (5, 64, 128, 128, torch.float32),
                                               (20, 33, 512, 32, torch.float16)])
def test_kernel_matches_the_dequantised_reference(m, n, k, group, dtype):
    w_q, scales = quantize_groupwise(torch.randn(n, k), 8, group)
    x = torch.randn(m, k).to(dtype)
    got = IM.int8_matmul_reference(x, w_q, scales)
    want = IM.int8_matmul_spec(x, w_q, scales)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def test_bad_shapes_say_which():
    with pytest.raises(ValueError, match="K differ"):
        IM.int8_matmul_spec(torch.randn(1, 64), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 1))
    with pytest.raises(ValueError, match="int8"):
        IM.int8_matmul_spec(torch.randn(1, 64), torch.zeros(8, 64), torch.ones(8, 1))
    with pytest.raises(ValueError, match="G dividing K"):
        IM.int8_matmul_spec(torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 3))


def test_bytes_promise_nearly_two_at_batch_one():
    n, k = 14336, 4096
    assert IM.dense_matmul_bytes(1, n, k) == (k + n * k + n) * 2
    assert IM.int8_matmul_bytes(1, n, k, 1, 2, 4) == k * 2 + n * k + n * 4 + n * 2
    ratio_1, ratio_64 = IM.bytes_ratio(1, n, k), IM.bytes_ratio(64, n, k)
    assert 1.99 < ratio_1 < 2.0 and ratio_64 < ratio_1
    assert IM.bytes_ratio(1, n, k, groups=k // 128) < ratio_1  # more scales, slightly more bytes


def test_config_keeps_each_k_tile_inside_one_group():
    for group in (32, 64, 128, 4096):
        cfg = IM.int8_matmul_config(1, 4096, 4096, group, interpreter=False)
        assert group % cfg.block_k == 0 and cfg.block_m >= 16 and cfg.block_k >= 16
    with pytest.raises(ValueError, match="multiple of 16"):
        IM.int8_matmul_config(1, 64, 72, 24, interpreter=True)


def test_gpu_tiles_compile_for_tl_dot_and_fit_small_shared_memory():
    """tl.dot on NVIDIA needs every dimension >= 16; a stage of 16-bit x and int8 W tiles stays small."""
    for m in (1, 3, 16, 17, 64, 200):
        for group in (32, 128, 4096):
            cfg = IM.int8_matmul_config(m, 4096, 4096, group, interpreter=False)
            assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16
            stage = cfg.block_m * cfg.block_k * 2 + cfg.block_k * cfg.block_n  # bytes of one pipeline stage
            assert stage * cfg.num_stages <= 64 * 1024


H200, T4 = dict(shared_memory=227 * 1024, sms=132), dict(shared_memory=64 * 1024, sms=40)


@pytest.mark.parametrize("m,k,group,split,dtype", [(1, 512, 128, 1, torch.float16), (3, 512, 64, 2, torch.float32),
                                                   (7, 512, 32, 2, torch.float16)])
def test_the_tuned_path_matches_the_dequantised_reference(m, k, group, split, dtype):
    """The matrix-vector kernel (1-4 rows) and the split-K tiles (more rows), split or not."""
    n = 40  # not a multiple of any tile
    w_q, scales = quantize_groupwise(torch.randn(n, k, generator=torch.Generator().manual_seed(m)), 8, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    chosen = IM.int8_launch_plan(m, n, k, group, interpreter=True)
    assert chosen.kernel == ("gemv" if m <= IM.GEMV_ROWS else "tiles")
    got = IM.int8_linear(x, w_q, scales, plan=IM.LaunchPlan(chosen.kernel, chosen.config, split))
    want = IM.int8_matmul_spec(x, w_q, scales)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert got.dtype == dtype and got.shape == (m, n)
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def test_tiles_follow_the_devices_shared_memory():
    """The H200 sweep's best tiles at 64 rows where they fit (227 KiB), a T4's where they do not."""
    up, down = (14336, 4096), (4096, 14336)
    assert IM.int8_matmul_config(64, *up, 128, interpreter=False, shared_memory=H200["shared_memory"]) == \
        IM.MatmulConfig(64, 64, 128, 4, 4)
    assert IM.int8_matmul_config(64, *down, 128, interpreter=False, shared_memory=H200["shared_memory"]) == \
        IM.MatmulConfig(64, 32, 128, 4, 6)
    for shape in (up, down):
        t4 = IM.int8_matmul_config(64, *shape, 128, interpreter=False, shared_memory=T4["shared_memory"])
        assert t4 == IM.MatmulConfig(64, 64, 64, 4, 4)
        for limit in (T4["shared_memory"], H200["shared_memory"]):
            c = IM.int8_matmul_config(64, *shape, 128, interpreter=False, shared_memory=limit)
            assert (c.block_m * c.block_k * 2 + c.block_k * c.block_n) * c.num_stages <= limit


def test_the_plan_splits_k_only_when_a_layer_has_few_output_tiles():
    gemv = IM.int8_launch_plan(1, 14336, 4096, 128, interpreter=False, **H200)  # 896 programs of 16 columns
    assert (gemv.kernel, gemv.split_k, gemv.config.block_n) == ("gemv", 1, 16)
    down = IM.int8_launch_plan(1, 4096, 14336, 128, interpreter=False, **H200)  # 256 programs < 2 per SM
    assert (down.kernel, down.split_k) == ("gemv", 2)
    tiles = IM.int8_launch_plan(16, 4096, 14336, 128, interpreter=False, **H200)  # 128 programs of 32 columns
    assert (tiles.kernel, tiles.split_k) == ("tiles", 4)
    assert IM.int8_launch_plan(16, 4096, 14336, 128, interpreter=False, **T4).split_k == 1  # 128 >= 2 x 40
    short = IM.int8_launch_plan(16, 64, 1024, 128, interpreter=False, **H200)  # 8 K tiles: nothing to split
    assert short.split_k == 1
