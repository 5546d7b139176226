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
