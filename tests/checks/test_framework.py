"""The check framework (recording, messages, guards, launch counting), driven through check_vector_add;
the vector add's own planted mistakes are in test_lab00_first_kernel.py."""

from __future__ import annotations

import json

import pytest
import torch
import triton
import triton.language as tl

from labsupport.checks import REGISTRY, RESULTS, CheckFailed, check_vector_add
from labsupport.checks.framework import RESULTS_ENV, Case, Checker, graded


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


def _stub(x, y):
    raise NotImplementedError("Exercise: write it")


def triton_add(x, y, block=128):
    out = torch.empty_like(x)
    _add_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
    return out


def test_failure_names_the_case():
    with pytest.raises(CheckFailed, match=r"case \[n=1000, dtype=float32, seed=0\].*Largest error"):
        check_vector_add(lambda x, y: x - y)


def test_passing_something_that_is_not_a_function():
    with pytest.raises(CheckFailed, match="Pass the function without calling it"):
        check_vector_add(torch.ones(3))


def test_results_are_recorded_and_written_for_the_grader(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    monkeypatch.setenv(RESULTS_ENV, str(path))
    before = len(RESULTS)
    check_vector_add(triton_add)
    with pytest.raises(CheckFailed):
        check_vector_add(lambda x, y: x - y)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["check"], r["passed"], r["points"]) for r in lines] == [
        ("check_vector_add", True, 10),
        ("check_vector_add", False, 0),
    ]
    assert len(RESULTS) == before + 2 and REGISTRY["check_vector_add"].points == 10


def test_forbidden_function_is_caught_however_it_was_imported():
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    @graded(points=1, name="check_demo_forbid")
    def check_demo(fn, checker):
        q = torch.randn(1, 1, 4, 8)
        checker.call(fn, q, case=Case(S=4), forbid=["scaled_dot_product_attention"])

    with pytest.raises(CheckFailed, match="S=4.*called `scaled_dot_product_attention`"):
        check_demo(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    with pytest.raises(CheckFailed, match="called `scaled_dot_product_attention`"):
        check_demo(lambda q: sdpa(q, q, q))
    check_demo(lambda q: (q @ q.transpose(-1, -2)).softmax(-1) @ q)  # plain ops are allowed
    REGISTRY.pop("check_demo_forbid")


def test_expect_number_reports_ratio_and_mistake():
    checker = Checker("check_demo")
    with pytest.raises(CheckFailed, match=r"(?s)ratio 2.*forgot to divide"):
        checker.expect_number(20.0, 10.0, case=Case(a=1), mistakes={"you forgot to divide by 2": 20.0})
    with pytest.raises(CheckFailed, match="expected a number"):
        checker.expect_number("10", 10.0, case=Case(a=1))
    checker.expect_number(10.0 + 1e-9, 10.0, case=Case(a=1))


def test_a_launch_without_driver_gets_advice():
    def no_driver(x, y):
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    with pytest.raises(CheckFailed, match="TRITON_INTERPRET=1"):
        check_vector_add(no_driver)


def test_failures_record_why_for_the_grader(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    monkeypatch.setenv(RESULTS_ENV, str(path))
    with pytest.raises(CheckFailed) as stub:
        check_vector_add(_stub)
    with pytest.raises(CheckFailed) as wrong:
        check_vector_add(lambda x, y: x - y)
    assert (stub.value.reason, wrong.value.reason) == ("not done", "failed")
    assert [json.loads(line)["reason"] for line in path.read_text().splitlines()] == ["not done", "failed"]


def test_a_stub_called_outside_checker_call_still_reads_as_not_done():
    @graded(points=1, name="check_demo_direct")
    def check_demo(fn, checker):
        fn(1)

    def stub(x):
        raise NotImplementedError("Exercise: write it")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError") as info:
        check_demo(stub)
    assert info.value.reason == "not done"
    REGISTRY.pop("check_demo_direct")


def test_an_output_must_match_inf_and_nan_where_the_reference_has_them():
    checker = Checker("check_demo")
    want = torch.tensor([1.0, float("-inf"), float("nan")])
    checker.expect_tensor(want.clone(), want, case=Case(a=1), atol=1e-6, rtol=0)
    with pytest.raises(CheckFailed, match=r"reference is inf or NaN, first at index \(1,\)"):
        checker.expect_tensor(torch.tensor([1.0, 0.0, float("nan")]), want, case=Case(a=1), atol=1e-6, rtol=0)
    with pytest.raises(CheckFailed, match=r"index \(2,\): got 5.0"):
        checker.expect_tensor(torch.tensor([1.0, float("-inf"), 5.0]), want, case=Case(a=1), atol=1e-6, rtol=0)


def test_a_crash_is_located_in_the_learners_code_not_in_torch():
    def uses_torch_wrongly(x, y):
        return torch.cat([x, y]).view(x.numel(), 3)

    with pytest.raises(CheckFailed) as info:
        check_vector_add(uses_torch_wrongly)
    message = str(info.value)
    assert "raised RuntimeError" in message and "uses_torch_wrongly" in message and ".view(x.numel(), 3)" in message
    assert "site-packages" not in message


def test_launch_counting_is_undone_even_after_an_exception():
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    from labsupport.checks.framework import triton_launches

    before = (jit.JITFunction.__dict__["run"], interpreter.GridExecutor.__dict__["__call__"])
    with pytest.raises(RuntimeError):
        with triton_launches() as launches:
            triton_add(torch.ones(10), torch.ones(10))
            assert launches.count > 0
            raise RuntimeError("a learner's exception")
    assert (jit.JITFunction.__dict__["run"], interpreter.GridExecutor.__dict__["__call__"]) == before

