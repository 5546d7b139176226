"""count_bytes measures the bytes interpreted Triton kernels load and store, masked lanes excluded."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from labsupport.device import interpreter_mode
from labsupport.interpreter_bytes import OTHER, BytesNotCountable, count_bytes

pytestmark = [
    pytest.mark.skipif(not interpreter_mode(), reason="counting bytes needs Triton's interpreter"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def even_lanes_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Loads only even indices (a mask that is not a tail), stores every lane below n."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=(offs < n) & (offs % 2 == 0), other=0.0)
    tl.store(out_ptr + offs, x, mask=offs < n)


@triton.jit
def unmasked_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 2)


@triton.jit
def twice_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """Reads the same tile twice: lanes count twice (traffic asked for, not distinct bytes)."""
    offs = tl.arange(0, BLOCK)
    a = tl.load(x_ptr + offs)
    b = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, a + b)


@triton.jit
def atomic_kernel(x_ptr, total_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.atomic_add(total_ptr, tl.sum(x, axis=0))


def _add(x, y, block=64):
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vector_add_counts_three_n_elements(dtype):
    n = 1000  # not a multiple of the block of 64: the last program's tail lanes are masked off
    x, y = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
    with count_bytes() as counted:
        out = _add(x, y)
    torch.testing.assert_close(out, x + y)
    size = x.element_size()
    assert counted.loaded == 2 * n * size
    assert counted.stored == n * size
    assert counted.total == 3 * n * size
    assert counted.launches == 1
    assert counted.by_argument["x_ptr"].loaded == n * size
    assert counted.by_argument["y_ptr"].loaded == n * size
    assert counted.by_argument["out_ptr"].stored == n * size
    assert counted.by_argument["out_ptr"].loaded == 0
    assert OTHER not in counted.by_argument
    assert counted.by_kernel["add_kernel"].total == 3 * n * size


def test_masked_load_counts_only_unmasked_lanes():
    n = 11  # lanes 0..10 stored; of those, 0, 2, ..., 10 loaded
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty(16, dtype=torch.float32)
    with count_bytes() as counted:
        even_lanes_kernel[(1,)](x, out, n, BLOCK=16)
    assert counted.loaded == 6 * 4
    assert counted.stored == 11 * 4


def test_unmasked_and_repeated_loads_count_every_lane():
    x = torch.randn(32)
    out = torch.empty(32)
    with count_bytes() as counted:
        unmasked_kernel[(1,)](x, out, BLOCK=32)
        twice_kernel[(1,)](x, out, BLOCK=32)
    assert counted.launches == 2
    assert counted.by_kernel["unmasked_kernel"].loaded == 32 * 4
    assert counted.by_kernel["twice_kernel"].loaded == 2 * 32 * 4
    assert counted.by_argument["x_ptr"].loaded == 3 * 32 * 4
    assert counted.stored == 2 * 32 * 4


def test_views_are_attributed_to_their_own_argument():
    """Two arguments that are views of one buffer (q and k halves of a fused qkv) stay apart."""
    buf = torch.randn(2, 100)
    out = torch.empty(100)
    with count_bytes() as counted:
        add_kernel[(2,)](buf[0], buf[1], out, 100, BLOCK=64)
    assert counted.by_argument["x_ptr"].loaded == 400
    assert counted.by_argument["y_ptr"].loaded == 400


def test_atomics_count_a_load_and_a_store_per_lane():
    x = torch.ones(100)
    total = torch.zeros(1)
    with count_bytes() as counted:
        atomic_kernel[(2,)](x, total, 100, BLOCK=64)
    assert total.item() == 100
    assert counted.by_argument["total_ptr"].loaded == 2 * 4  # one lane per program
    assert counted.by_argument["total_ptr"].stored == 2 * 4
    assert counted.by_argument["x_ptr"].loaded == 400


def test_nothing_is_counted_outside_the_block_and_patches_are_undone():
    x, y = torch.randn(100), torch.randn(100)
    with count_bytes() as counted:
        pass
    _add(x, y)  # after the block: nothing counted, nothing patched
    assert counted.total == 0 and counted.launches == 0
    from triton.runtime import interpreter

    assert interpreter.InterpreterBuilder.create_masked_load.__module__ == "triton.runtime.interpreter"


def test_refuses_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BytesNotCountable, match="only in Triton's interpreter.*formula"):
        with count_bytes():
            pass


def test_blocks_do_not_nest():
    with count_bytes():
        with pytest.raises(BytesNotCountable, match="do not nest"):
            with count_bytes():
                pass


def test_an_unknown_interpreter_layout_is_refused(monkeypatch):
    from triton.runtime import interpreter

    def create_masked_load(self, pointers, mask, other):  # a renamed parameter: refuse, do not guess
        raise AssertionError("never called")

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", create_masked_load)
    with pytest.raises(BytesNotCountable, match="cannot count bytes with Triton .*create_masked_load"):
        with count_bytes():
            pass


def test_exceptions_inside_the_block_undo_the_patches():
    from triton.runtime import interpreter

    before = interpreter.GridExecutor.__call__
    with pytest.raises(ValueError):
        with count_bytes():
            raise ValueError("boom")
    assert interpreter.GridExecutor.__call__ is before
