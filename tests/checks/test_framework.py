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
    assert x.shape == y.shape, "x and y must have the same length"
    x, y = x.contiguous(), y.contiguous()
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



# --- the learner's own work (issue 9) ---------------------------------------------------------------


def _answer_reached(through):
    """The naive attention answer, reached through one of the ways a callable can hold another."""
    import functools

    from labsupport import attention as A

    raw = A.naive_attention_reference.__wrapped__  # the function under the guard

    def closing_over(q, k, v, causal=False):
        return raw(q, k, v, causal)

    def by_default(q, k, v, causal=False, _impl=raw):
        return _impl(q, k, v, causal)

    class Holder:
        def __init__(self):
            self.impl = raw

        def __call__(self, q, k, v, causal=False):
            return self.impl(q, k, v, causal)

    @functools.wraps(raw)
    def wrapped(q, k, v, causal=False):
        return q  # wrong, but its __wrapped__ is the answer

    return {
        "guarded": A.naive_attention_reference,
        "__wrapped__": raw,
        "partial": functools.partial(raw),
        "closure": closing_over,
        "default": by_default,
        "callable object": Holder(),
        "wraps": wrapped,
        "partial of a closure": functools.partial(closing_over),
    }[through]


@pytest.mark.parametrize("through", ["guarded", "__wrapped__", "partial", "closure", "default", "callable object",
                                     "wraps", "partial of a closure"])
def test_an_answer_reached_through_any_attribute_chain_is_refused(through):
    from labsupport._answers import course_checks_its_answers
    from labsupport.checks import check_naive_attention

    with course_checks_its_answers(False), pytest.raises(
            CheckFailed, match="is, wraps or holds `labsupport.attention.naive_attention_reference`"):
        check_naive_attention(_answer_reached(through))


def test_the_course_may_check_its_own_answer_in_the_sanctioned_context(capsys):
    from labsupport import attention as A
    from labsupport._answers import course_checks_its_answers, unguarded
    from labsupport.checks import check_naive_attention

    def spec_out(q, k, v, causal=False):  # the definition's output, in fp32 (the eager baseline rounds to fp16)
        return unguarded(A.attention_spec)(q, k, v, causal)[0]

    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="the course's own answer"):
            check_naive_attention(spec_out)
        with course_checks_its_answers():
            check_naive_attention(spec_out)
    assert "PASSED check_naive_attention" in capsys.readouterr().out


def test_the_gpu_bench_checks_the_answers_in_the_sanctioned_context(monkeypatch):
    """bench_attention.run_checks hands the unguarded answers in; the checks must see them allowed."""
    from labsupport import bench_attention, checks
    from labsupport._answers import ANSWERS, course_checks_its_answers, reached_answer

    seen = []
    for name in ("check_naive_attention", "check_online_softmax", "check_flash_attention"):
        monkeypatch.setattr(checks, name, lambda fn, name=name: seen.append((name, reached_answer(fn, ANSWERS))))
    monkeypatch.setattr(bench_attention, "check_launch_ladder", lambda: True)
    with course_checks_its_answers(False):
        assert bench_attention.run_checks()
        assert [held for _, held in seen] == [None, None, None]
        # outside it, the same function is refused
        from labsupport._answers import unguarded
        from labsupport.attention import flash_attention_reference

        assert reached_answer(unguarded(flash_attention_reference), ANSWERS) == \
            "labsupport.attention.flash_attention_reference"
    assert len(seen) == 3


@triton.jit
def _writes_nothing(x_ptr):
    tl.load(x_ptr)


class _Agreeable(torch.Tensor):
    """A tensor whose comparisons always succeed: any() is False, allclose and equal are True."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("allclose", "equal"):
            return True
        if name == "any":
            return torch.tensor(False)
        return super().__torch_function__(func, types, args, kwargs)


def test_a_tensor_subclass_whose_comparisons_always_succeed_is_refused():
    def zeros_that_agree(x, y):
        out = torch.zeros_like(x)
        _writes_nothing[(1,)](out)
        return out.as_subclass(_Agreeable)

    with pytest.raises(CheckFailed, match="returned a _Agreeable, a subclass of torch.Tensor"):
        check_vector_add(zeros_that_agree)
    from labsupport.checks import check_naive_attention

    with pytest.raises(CheckFailed, match="subclass of torch.Tensor"):
        check_naive_attention(lambda q, k, v, causal=False: torch.zeros_like(q).as_subclass(_Agreeable))


def test_an_object_posing_as_a_tensor_is_refused():
    class Posing:
        __class__ = property(lambda self: torch.Tensor)  # isinstance(obj, torch.Tensor) is True

    assert isinstance(Posing(), torch.Tensor)
    with pytest.raises(CheckFailed, match="posing as one"):
        check_vector_add(lambda x, y: Posing())


def test_an_answer_called_unguarded_inside_the_function_is_refused():
    """The function under the guard (``__wrapped__``) is banned too when the learner's code calls it."""
    from labsupport import attention as A
    from labsupport._answers import course_checks_its_answers
    from labsupport.checks import check_naive_attention

    def calls_it_unguarded(q, k, v, causal=False):
        return A.naive_attention_reference.__wrapped__(q, k, v, causal)  # reached at run time

    with course_checks_its_answers(False), pytest.raises(CheckFailed, match="unguarded \\(through `__wrapped__`\\)"):
        check_naive_attention(calls_it_unguarded)
    q = k = v = torch.randn(1, 1, 4, 16)  # outside a check it runs normally
    assert A.naive_attention_reference.__wrapped__(q, k, v).shape == (1, 1, 4, 16)
