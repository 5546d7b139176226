"""check_vector_add (lab 00): right kernels pass, planted wrong ones fail with the message that names
the mistake."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from labsupport.checks import CheckFailed, check_vector_add


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


def _checked(x, y):
    """The wrapper's input check, as the exercise asks: same length, contiguous."""
    assert x.shape == y.shape and x.dim() == 1, "x and y must be 1-D and the same length"
    return x.contiguous(), y.contiguous()


def triton_add(x, y, block=128):
    x, y = _checked(x, y)
    out = torch.empty_like(x)
    _add_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
    return out


@triton.jit
def _add_kernel_unmasked_store(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask, other=0.0) + tl.load(y_ptr + offsets, mask=mask,
                                                                                       other=0.0))


@triton.jit
def _add_kernel_mask_off_by_one(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n - 1
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def _add_kernel_pid_offsets(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) + tl.arange(0, BLOCK)  # forgot to multiply by BLOCK
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


def _launch_new_empty(kernel, block=128):
    def add(x, y):
        x, y = _checked(x, y)
        out = x.new_empty(x.shape)
        kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
        return out

    return add


def _launch(kernel, block=128):
    def add(x, y):
        x, y = _checked(x, y)
        out = torch.zeros_like(x)
        kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
        return out

    return add


def triton_add_floor_grid(x, y, block=128):
    """Mutation: the grid rounds down, so the last partial block is never computed."""
    x, y = _checked(x, y)
    out = torch.zeros_like(x)
    if x.numel() // block:
        _add_kernel[(x.numel() // block,)](x, y, out, x.numel(), BLOCK=block)
    return out


def test_reference_triton_kernel_passes(capsys):
    check_vector_add(triton_add)
    assert "PASSED check_vector_add" in capsys.readouterr().out


def test_any_correct_kernel_passes():
    check_vector_add(lambda x, y: triton_add(x, y, block=1024))
    check_vector_add(lambda x, y: triton_add(x, y, block=16))


def _stub(x, y):
    raise NotImplementedError("Exercise: write it")


MUTANTS = {
    "floor_grid_drops_tail": (triton_add_floor_grid, "(?s)n=1000.*elements 0..895 are right.*partial block.*cdiv"),
    "adds_x_twice": (lambda x, y: x + x, "(?s)every element is wrong: check that you store x \\+ y"),
    "skips_every_other_element": (lambda x, y: (x + y).index_fill(0, torch.arange(0, x.numel(), 2), 0),
                                  "some elements are right and others wrong"),
    "subtracts": (lambda x, y: x - y, "x - y is computed"),
    "returns_x": (lambda x, y: x.clone(), "x is returned"),
    "in_place": (lambda x, y: x.add_(y), "changed its inputs"),
    "wrong_dtype": (lambda x, y: triton_add(x.float(), y.float()), "dtype float32, expected float16"),
    "torch_not_triton": (lambda x, y: x + y, "no Triton kernel was launched"),
    "unmasked_store": (_launch(_add_kernel_unmasked_store), "(?s)wrote past the end of the output.*mask the store"),
    "unmasked_store_new_empty": (_launch_new_empty(_add_kernel_unmasked_store),
                                 "(?s)wrote past the end of the output.*mask the store"),
    "mask_off_by_one": (_launch(_add_kernel_mask_off_by_one), "mask is off by one"),
    "offsets_not_scaled_by_block": (_launch(_add_kernel_pid_offsets), "check the offsets"),
    "returns_list": (lambda x, y: (x + y).tolist(), "expected a torch.Tensor"),
    "drops_last_element": (lambda x, y: (x + y)[:-1] if x.numel() > 1 else x + y, "shape"),
    "nan_output": (lambda x, y: (x + y) * float("nan"), "non-finite"),
    "stub": (_stub, "still raises NotImplementedError"),
    "crashes": (lambda x, y: x + y[:2] if x.numel() > 2 else x + y, "raised RuntimeError.*n=1000"),
    "fp16_precision_loss": (lambda x, y: (x + y).to(torch.bfloat16).to(x.dtype), "wrong at"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_check_vector_add_rejects(name):
    fn, message = MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_vector_add(fn)


def test_tail_hint_names_the_first_wrong_element():
    def tail_dropped(x, y):
        out = triton_add(x, y)
        if x.numel() >= 8:
            out[(x.numel() // 8) * 8 :] = 0  # blocks of 8; the partial last block is skipped
        return out

    with pytest.raises(CheckFailed, match="(?s)n=17.*every element from index 16.*partial block"):
        check_vector_add(tail_dropped)


def test_a_tiny_length_gets_the_only_block_is_partial_hint():
    def nothing_below_8(x, y):
        return triton_add(x, y) if x.numel() >= 8 else torch.zeros_like(x)

    with pytest.raises(CheckFailed, match="(?s)n=2.*smaller than any block.*cdiv"):
        check_vector_add(nothing_below_8)


def test_a_named_mistake_gets_no_misleading_block_hint():
    with pytest.raises(CheckFailed) as info:
        check_vector_add(lambda x, y: x - y)
    assert "x - y is computed" in str(info.value) and "Hint" not in str(info.value)


def test_kernels_launched_any_way_count():
    """kernel.run(...), a helper, new_empty: a right answer from a Triton kernel passes."""
    def via_run(x, y):
        x, y = _checked(x, y)
        out = x.new_empty(x.shape)
        _add_kernel.run(x, y, out, x.numel(), grid=(triton.cdiv(x.numel(), 64),), warmup=False, BLOCK=64)
        return out

    check_vector_add(via_run)
    check_vector_add(_launch_new_empty(_add_kernel))



# --- the sum must come from the learner's kernel (issue 9) ---------------------------------------


@triton.jit
def _does_nothing(x_ptr, n, BLOCK: tl.constexpr):
    tl.load(x_ptr + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < n)  # reads, stores nothing


def torch_sum_then_idle_kernel(x, y):
    out = x + y  # computed in torch ...
    _does_nothing[(1,)](x, x.numel(), BLOCK=16)  # ... then any launch, to be counted
    return out


def torch_sum_into_a_launched_tensor(x, y):
    out = torch.empty_like(x)
    torch.add(x, y, out=out)  # out is passed to a launch below, but that kernel writes nothing
    _does_nothing[(1,)](out, x.numel(), BLOCK=16)
    return out


def test_a_torch_sum_beside_an_idle_kernel_fails():
    with pytest.raises(CheckFailed, match="returned a tensor that no Triton kernel you launched wrote to: out"):
        check_vector_add(torch_sum_then_idle_kernel)


def test_a_torch_sum_written_into_a_launched_tensor_fails():
    with pytest.raises(CheckFailed, match="(?s)the result is right, but your function called `add` in torch"):
        check_vector_add(torch_sum_into_a_launched_tensor)


def test_a_kernel_writing_a_view_of_its_output_passes(capsys):
    def through_views(x, y):
        x, y = _checked(x, y)
        out = torch.empty(x.numel() + 8, dtype=x.dtype)[: x.numel()]  # a view; the kernel writes its storage
        _add_kernel[(triton.cdiv(x.numel(), 64),)](x, y, out, x.numel(), BLOCK=64)
        return out.view(x.shape)

    check_vector_add(through_views)
    assert "PASSED check_vector_add" in capsys.readouterr().out


# --- the inputs: strided views and different lengths (issue 26, red team) ------------------------


def triton_add_assumes_contiguous(x, y, block=256):
    """Mutation: checks the shapes but not the layout; a strided view is read as if it were adjacent."""
    assert x.shape == y.shape
    out = torch.empty_like(x)
    _add_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
    return out


def triton_add_no_input_check(x, y, block=256):
    """Mutation: no input check at all; a shorter y is read past its end."""
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    _add_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
    return out


def triton_add_grid_of_fixed_block(x, y, block=256):
    """Mutation: the grid is cdiv(n, 1024) while the kernel runs 256 lanes per program."""
    x, y = _checked(x, y)
    out = torch.empty_like(x)
    _add_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=block)
    return out


def test_a_kernel_that_assumes_contiguous_inputs_fails():
    with pytest.raises(CheckFailed, match=r"(?s)x\[::2\].*not contiguous.*as if their elements were adjacent"):
        check_vector_add(triton_add_assumes_contiguous)


def test_a_function_without_an_input_check_fails_on_different_lengths():
    with pytest.raises(CheckFailed, match="(?s)x of 1000 elements and y of 10.*must refuse"):
        check_vector_add(triton_add_no_input_check)


def test_a_function_that_makes_strided_inputs_contiguous_or_refuses_them_passes(capsys):
    def refuses_strided(x, y):
        assert x.is_contiguous() and y.is_contiguous(), "x and y must be contiguous"
        return triton_add(x, y)

    check_vector_add(triton_add)  # .contiguous()
    check_vector_add(refuses_strided)
    assert capsys.readouterr().out.count("PASSED") == 2


def test_a_grid_too_small_is_named_as_the_grid():
    with pytest.raises(CheckFailed) as info:
        check_vector_add(triton_add_grid_of_fixed_block)
    message = str(info.value)
    assert "elements 0..255 are right" in message and "The grid is too small" in message
    assert "not the start of a block" not in message
