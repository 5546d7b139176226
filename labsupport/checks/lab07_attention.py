"""Checks for the attention lab: naive attention, the online softmax, and FlashAttention in Triton.

The three functions a learner writes, and how the checks call them:

* ``naive_attention(q, k, v, causal=False) -> out``
* ``online_softmax_attention(q, k, v, causal=False, block_n=...) -> (out, lse)``: plain torch,
  one block of ``block_n`` keys at a time. The check always passes ``block_n`` itself (small
  blocks, some not dividing S) so that every case crosses several blocks.
* ``flash_attention(q, k, v, causal=False) -> (out, lse)``: the Triton kernel's host wrapper.

``q``, ``k``, ``v`` are ``(B, H, S, D)``; ``out`` has their shape and dtype; ``lse`` is the
natural-log log-sum-exp of each row's scaled scores, shape ``(B, H, S)``, float32 (or any float
dtype at least as precise as the inputs; compared in fp32). Cases: S of 1, 2, 17, 100, 257 (not
multiples of any block), causal and not, signed inputs, large logits that overflow a softmax
without the max subtraction (float32 and float16), float16 logits in the hundreds (scores rounded
to float16 fail there: they must be float32), a causal row whose only visible score is far below
-1e4 (a finite mask value or a running maximum started at 0 fails there), several seeds, B and H
above 1, a non-contiguous layout, float32 and float16 (bfloat16 too on a GPU that computes in it,
compute capability 8.0 and above). ``scaled_dot_product_attention`` is forbidden while the
learner's function runs.

The Triton exercise runs with guard space around q, k, v and whatever the wrapper allocates
(:mod:`labsupport.checks._guard`), so a kernel that loads or stores past a tensor fails with a
message instead of crashing Python; in the interpreter it also counts the bytes the kernel moves
(:mod:`labsupport.interpreter_bytes`): any outside the tensors it was given fail, and a causal
kernel must load less than the same shape without the mask (it skips the future key blocks).

Behaviour only: any correct implementation passes whatever its blocks or loop order. Two
behavioural limits apply as well: the online softmax must never create an S x S float tensor
(watched with :func:`labsupport.attention.peak_tensor_memory`), and on a GPU FlashAttention
runs S = 4096 and must not allocate an S x S score matrix (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..attention import (
    attention_spec,
    flash_attention_reference,
    naive_attention_reference,
    online_softmax_reference,
    peak_tensor_memory,
)
from ..device import cuda_available, device, gpu_has_bf16, interpreter_mode
from ..interpreter_bytes import OTHER, BytesNotCountable, count_bytes
from ._guard import guarded_memory, touched_names
from .framework import Case, graded, torch_calls, triton_launches

FORBID = ["scaled_dot_product_attention"]
ANSWERS = (  # the course's own implementations: a learner's function may not be or call them
    attention_spec,
    naive_attention_reference,
    online_softmax_reference,
    flash_attention_reference,
)
# torch functions that compute attention: FlashAttention's wrapper may allocate, reshape and make
# contiguous, but the kernel computes the scores, the softmax and the output
COMPUTES = ("matmul", "__matmul__", "__rmatmul__", "__imatmul__", "mm", "bmm", "baddbmm", "einsum", "tensordot",
            "softmax", "log_softmax", "_softmax", "exp", "exp_", "exp2", "logsumexp")
TRITON_HINT = ("this exercise is the Triton kernel: launch flash_attention_kernel[grid](...) from your wrapper, "
               "let it write out and lse, and return those tensors.")
SEQ_LENS = (1, 2, 17, 100, 257)
ROW0 = "query 0's only visible score far below -1e4"  # a case pattern (see _make_inputs)
ROW0_SCORE = 30000.0  # how far below 0 query 0's score with key 0 is, in that case
FP16_SCORES_SIGMA = 8.0  # logits up to about 300 in float16: scores rounded to float16 are off by up to 0.125
PRECISE_ATOL = 3.5e-2  # that case's output atol: float16 scores miss it by 0.063, q pre-scaled in float16 keeps 0.03
LONG_SEQ = 4096  # GPU-only memory case

_NOT_FINITE = "NaN or inf"


# --- inputs and tolerances ---------------------------------------------------------------------


def _make_inputs(case_fields: dict, device):
    """Signed random q, k, v for one case, on ``device``; ``sigma`` scales q and k (logits)."""
    f = case_fields
    gen = torch.Generator().manual_seed(f["seed"])
    b, h, s, d = f["B"], f["H"], f["S"], f["D"]
    shape = (b, s, h, d) if f.get("layout") == "BSHD" else (b, h, s, d)
    q = torch.randn(shape, generator=gen) * f.get("sigma", 1.0)
    k = torch.randn(shape, generator=gen) * f.get("sigma", 1.0)
    v = torch.randn(shape, generator=gen)
    if f.get("pattern") == ROW0:
        # Query 0 and key 0 point in opposite directions along feature 0, which no other query or key
        # uses: s_00 = -ROW0_SCORE, every other score is ordinary. Causal, query 0 sees only key 0, so
        # its output is v_0 exactly (its weight is 1, whatever its score): a mask of -1e4 instead of
        # -inf, or a running maximum started at 0, is wrong there and nowhere else.
        a = math.sqrt(ROW0_SCORE * math.sqrt(d))
        q[..., 0] = 0.0
        k[..., 0] = 0.0
        q[:, :, 0, 0] = a
        k[:, :, 0, 0] = -a
    out = []
    for t in (q, k, v):
        t = t.to(dtype=f["dtype"], device=device)
        if f.get("layout") == "BSHD":
            t = t.transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) buffer: not contiguous
        out.append(t)
    return out


def _tolerances(dtype, large: bool, precise: bool = False) -> tuple[float, float, float, float]:
    """(out atol, out rtol, lse atol, lse rtol) for inputs of ``dtype``.

    fp16 and bf16 allow for scores rounded to the input dtype (what torch matmuls in fp16 do) at
    ordinary logits; large logits magnify that rounding. The ``precise`` case (float16 logits in
    the hundreds) allows for q scaled by 1/sqrt(D) and rounded to float16 before a float32 q.k
    (older Triton tutorials do that: about a third of the error) but not for the scores
    themselves rounded to float16. fp32 allows plain fp32 rounding only: on a GPU that means
    ``tl.dot(..., input_precision="ieee")``, not the default tf32.
    """
    if dtype == torch.float32:
        return 1e-4, 1e-4, 1e-4, 1e-5
    if dtype == torch.float16:
        if precise:
            return PRECISE_ATOL, 1e-2, 3e-2, 2e-3
        return (2.5e-2 if large else 1e-2), 1e-2, 3e-2, 2e-3
    return 4e-2, 2e-2, 0.1, 1e-2  # bfloat16 (GPU only)


def _gpu_compiles() -> bool:
    """True when Triton compiles for a CUDA GPU (not the interpreter): the GPU-only cases run."""
    return cuda_available() and not interpreter_mode()


def _dtypes():
    dtypes = [torch.float32, torch.float16]
    # bf16 is broken in the Triton interpreter; on GPUs it needs compute capability 8.0 (Ampere).
    if _gpu_compiles() and gpu_has_bf16():
        dtypes.append(torch.bfloat16)
    return dtypes


def _cases(d_small: int = 32, d_large: int = 64) -> list[dict]:
    """The case list shared by the three checks, smallest first (failures then name the simplest)."""
    cases = []
    seed = 0
    for dtype in _dtypes():
        # Large logits: row maxima near 100 in float32 and 13 in float16, where exp overflows
        # unless the maximum is subtracted. bfloat16 has float32's range, so overflowing it needs
        # logits near 100, where bf16 rounding of the scores (what a correct naive attention in
        # bf16 does) already moves the output by more than any tolerance that still catches bugs:
        # its large-logit cases are left out (float32 and float16 catch a missing max subtraction).
        sigma_large = {torch.float32: 7.0, torch.float16: 2.3}.get(dtype)
        plan = [
            dict(S=1, causal=False, B=2, H=3, D=d_small),
            dict(S=2, causal=True, B=2, H=3, D=d_small),
            dict(S=17, causal=False, B=2, H=3, D=d_small),
            dict(S=17, causal=True, B=2, H=3, D=d_small),
            dict(S=100, causal=False, B=2, H=3, D=d_large),
            dict(S=100, causal=True, B=2, H=3, D=d_large),
            dict(S=257, causal=False, B=1, H=2, D=d_small),
            dict(S=257, causal=True, B=1, H=2, D=d_small),
        ]
        if sigma_large:
            plan += [
                dict(S=100, causal=False, B=1, H=2, D=d_small, sigma=sigma_large),
                dict(S=100, causal=True, B=1, H=2, D=d_small, sigma=sigma_large),
            ]
        if dtype == torch.float16:
            plan.append(dict(S=100, causal=True, B=2, H=2, D=d_small, layout="BSHD"))
            # logits so large that scores computed in float16 move the output well past the tolerance,
            # while scores in float32 (as the spec says, and as tl.dot accumulates) stay far inside it
            plan.append(dict(S=100, causal=False, B=1, H=2, D=d_small, sigma=FP16_SCORES_SIGMA, precise=True))
        if dtype == torch.float32:
            plan.append(dict(S=17, causal=True, B=1, H=2, D=d_small, pattern=ROW0))
        for fields in plan:
            fields.update(dtype=dtype, seed=seed)
            seed += 1
            cases.append(fields)
    return cases


def _case(fields: dict, **extra) -> Case:
    shown = {key: fields[key] for key in ("B", "H", "S", "D", "dtype", "causal", "seed")}
    if fields.get("sigma"):
        shown["large_logits"] = True
    if fields.get("layout"):
        shown["layout"] = "(B,S,H,D) transposed to (B,H,S,D), not contiguous"
    if fields.get("precise"):
        shown["large_logits"] = "in the hundreds, in float16"
    if fields.get("pattern"):
        shown["inputs"] = f"{fields['pattern']} (about -{ROW0_SCORE:,.0f})"
    shown.update(extra)
    return Case(**shown)


# --- what the usual mistakes produce ----------------------------------------------------------


def _variant(q, k, v, causal, *, scale=None, axis=-1, mask_offset=0, transpose_mask=False,
             normalise=True, mask_when=None, local_block=None, fill=float("-inf")):
    """Attention with one deliberate change; returns (out in q.dtype, lse in fp32).

    ``mask_offset`` shifts the causal diagonal (``-1`` hides the diagonal, ``+1`` shows one future
    key); ``mask_when`` overrides whether a causal mask is applied at all.
    """
    s_q, s_k, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale  # (B, H, S, S)
    apply_mask = causal if mask_when is None else mask_when
    if apply_mask:
        rows = torch.arange(s_q, device=q.device)[:, None]
        cols = torch.arange(s_k, device=q.device)[None, :]
        if local_block:  # each key's index within its block of local_block keys, not in the sequence
            cols = cols % local_block
        visible = (cols >= rows - mask_offset) if transpose_mask else (cols <= rows + mask_offset)
        scores = scores.masked_fill(~visible, fill)
    lse = torch.logsumexp(scores, dim=-1)
    if normalise:
        weights = torch.softmax(scores, dim=axis)
    else:
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    out = weights @ v.double()
    return out.to(q.dtype), lse.float()


def _in_input_dtype(q, k, v, causal):
    """Attention with the scores and the softmax in the inputs' dtype (float16 scores are rounded)."""
    s_q, d = q.shape[2], q.shape[3]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(s_q, s_q, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _output_mistakes(q, k, v, causal, fields=None, block_n=None) -> dict[str, tuple[object, str]]:
    """Description -> (what that mistake returns, how to fix it)."""
    d = q.shape[3]
    fields = fields or {}
    mistakes = {
        "the scores are not scaled by 1/sqrt(D)": (
            _variant(q, k, v, causal, scale=1.0)[0],
            "multiply q @ k^T by 1/sqrt(D), where D = q.shape[-1] is the head dim."),
        "the scores are divided by D instead of sqrt(D)": (
            _variant(q, k, v, causal, scale=1.0 / d)[0],
            "the scale is 1/sqrt(D) (math.sqrt), not 1/D."),
        "the softmax normalises over the queries (dim=-2) instead of over the keys (dim=-1)": (
            _variant(q, k, v, causal, axis=-2)[0],
            "each query's weights over the keys must sum to 1: softmax over the last dimension (dim=-1)."),
        "the output is not divided by the softmax denominator (unnormalised)": (
            _variant(q, k, v, causal, normalise=False)[0],
            "divide the accumulated sum of p * v by the running sum l at the end (out = acc / l)."),
    }
    if causal:
        mistakes.update({
            "the causal mask also hides the diagonal (a query cannot see its own key: off by one)": (
                _variant(q, k, v, causal, mask_offset=-1)[0],
                "query i may see keys j <= i, its own position included: keep j <= i, mask j > i."),
            "the causal mask lets each query see one key in its future (off by one)": (
                _variant(q, k, v, causal, mask_offset=1)[0],
                "query i may see keys j <= i only: mask j > i (not j > i + 1)."),
            "the causal mask is transposed (queries see later keys, not earlier ones)": (
                _variant(q, k, v, causal, transpose_mask=True)[0],
                "keep scores where the key index j is at most the query index i (j <= i)."),
            "no causal mask is applied although causal=True": (
                _variant(q, k, v, causal, mask_when=False)[0],
                "when causal is True, set scores of keys j > i to -inf before the softmax."),
        })
    else:
        mistakes["a causal mask is applied although causal=False"] = (
            _variant(q, k, v, causal, mask_when=True)[0],
            "apply the mask only when causal is True.")
    if causal and block_n:
        mistakes["the causal mask compares each key's index within its block (0 .. block_n - 1) with the query's "
                 "index in the whole sequence"] = (
            _variant(q, k, v, causal, local_block=block_n)[0],
            "compare positions in the whole sequence: the key at index j of the block starting at `start` is key "
            "start + j (torch.arange(start, start + n)), visible to query i when start + j <= i.")
    if fields.get("precise"):
        mistakes["the scores (or the softmax) are computed in float16, the inputs' dtype: at logits in the "
                 "hundreds float16 keeps a score only to within about 0.1, and the softmax weights move by as "
                 "much"] = (
            _in_input_dtype(q, k, v, causal),
            "compute q @ k^T and the softmax in float32 (q.float() @ k.float().transpose(-2, -1), then "
            "torch.softmax) and cast the output back to the inputs' dtype at the end.")
    if fields.get("pattern") == ROW0:
        out = attention_spec(q, k, v, causal)[0].clone()
        out[:, :, 0] = float("nan")
        mistakes[f"the running maximum starts at 0 instead of -inf (or exp is taken without subtracting the "
                 f"maximum): query 0's only visible score is about -{ROW0_SCORE:,.0f}, so exp(s - 0) underflows "
                 f"to 0, the sum l is 0 and 0 / 0 is NaN"] = (
            out, "start the running maximum at -inf (float('-inf'); in Triton tl.full((BLOCK_M,), float('-inf'), "
                 "tl.float32)), so m becomes the largest score seen and exp(s - m) <= 1 with at least one 1; "
                 "in one pass, subtract each row's maximum before exponentiating.")
        mistakes[f"masked scores are set to -1e4 (a large but finite number) instead of -inf: query 0's own score "
                 f"here is about -{ROW0_SCORE:,.0f}, below the mask value, so the masked future keys outweigh "
                 f"the one key it may see"] = (
            _variant(q, k, v, causal, fill=-1e4)[0],
            "mask with float('-inf'): exp(-inf - m) is exactly 0, whatever the visible scores are.")
    return mistakes


def _lse_mistakes(q, k, v, causal, lse_true) -> dict[str, tuple[object, str]]:
    s_q, s_k = q.shape[2], k.shape[2]
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[3])
    if causal:
        rows = torch.arange(s_q, device=q.device)[:, None]
        cols = torch.arange(s_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    row_max = scores.amax(dim=-1).float()
    return {
        "the log-sum-exp leaves out the running maximum (log(l) instead of m + log(l))": (
            lse_true - row_max,
            "l is a sum of exp(s - m), so log(sum exp(s)) = m + log(l)."),
        "the log-sum-exp is the running maximum alone": (
            row_max, "add log(l): lse = m + log(l)."),
        "the log-sum-exp is in base 2 (computed with exp2/log2 and not converted back)": (
            lse_true / math.log(2),
            "if you work in base 2 (exp2, log2), multiply the result by ln(2) to return the natural log."),
        "the log-sum-exp is of scores not scaled by 1/sqrt(D)": (
            _variant(q, k, v, causal, scale=1.0)[1], "the lse is of the scaled scores s = q.k / sqrt(D)."),
    }


# --- comparing -------------------------------------------------------------------------------


def _compare(checker, got, want, *, case, atol, rtol, what, mistakes, hint="", diagnose=None, large=False,
             first_diagnose=None):
    """Fail with a named mistake when ``got`` matches one; otherwise the framework's comparison.

    ``mistakes`` is a function returning them: they are computed only when ``got`` is wrong.
    ``diagnose``, if given, is called only when no mistake matched (it may run the learner's
    function on probes); a non-empty answer replaces the generic ``hint``. ``first_diagnose`` is
    asked before the (batch, head) diagnosis (of the output only), ``diagnose`` after it.
    """
    if (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape)
            and got.device == want.device):
        g, w = got.detach().double(), want.detach().double()
        if not torch.allclose(g, w, atol=atol, rtol=rtol):
            matched = [(description, fix) for description, (wrong, fix) in mistakes().items()
                       if wrong.shape == g.shape
                       and torch.allclose(g, wrong.detach().double(), atol=atol, rtol=rtol, equal_nan=True)]
            if matched:  # several can coincide on short sequences (S = 2: "one future key" = "no mask")
                err = (g - w).abs().nan_to_num(float("inf"))
                idx = tuple(int(i) for i in torch.unravel_index(torch.argmax(err), err.shape))
                checker.fail(case, f"the {what} is wrong (largest error at index {idx}: got {g[idx].item():.6g}, "
                                   f"expected {w[idx].item():.6g}).\nYour {what} matches what we get when "
                                   + ", or when ".join(d for d, _ in matched) + ".",
                             " / ".join(fix for _, fix in matched))
            bad = ~torch.isfinite(g) & torch.isfinite(w)
            if bool(bad.any()):
                idx = tuple(int(i) for i in bad.nonzero()[0])
                if large:
                    reason = ("This case has large logits: exp(score) overflows unless you subtract the "
                              "(running) maximum of each row before exponentiating, the maximum of the very "
                              "scores you exponentiate (the scaled q.k / sqrt(D), not the raw q.k).")
                else:
                    reason = ((_where_wrong(got, want, atol, rtol) if what == "output" else "")
                              or (diagnose() if diagnose else "") or (
                        "NaN or inf usually means exp of a large number (subtract the maximum first), "
                        "a row whose keys are all masked or never visited (0/0), memory read outside "
                        "the tensor (a missing mask), or elements your kernel never wrote (in the Triton "
                        "check, what torch.empty allocates starts as NaN)."))
                checker.fail(case, f"the {what} has {int(bad.sum())} {_NOT_FINITE} value(s) where the "
                                   f"reference is finite, first at index {idx}.", reason)
    if not _close(got, want, atol, rtol):
        hint = ((first_diagnose() if first_diagnose else "")
                or (_where_wrong(got, want, atol, rtol) if what == "output" else "")
                or (diagnose() if diagnose else "") or hint)
    checker.expect_tensor(got, want, case=case, atol=atol, rtol=rtol, what=what, hint=hint)


def _where_wrong(got, want, atol, rtol) -> str:
    """A diagnosis from which (batch, head) pairs are wrong, when only some are: "" otherwise."""
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dim() >= 3):
        return ""
    bad = ~torch.isclose(got.detach().double().cpu(), want.detach().double().cpu(), atol=atol, rtol=rtol,
                         equal_nan=False)
    share = bad.flatten(2).double().mean(dim=2)  # (B, H): the share of wrong elements in that (batch, head)
    pairs = share > 0
    if bool(pairs.all()) or not bool(pairs.any()) or bool((share[pairs] < 0.5).any()):
        return ""  # all wrong, none, or a few elements here and there (rounding, not an offset)
    b, h = pairs.shape
    if b > 1 and not bool(pairs[0].any()) and bool(pairs[1:].all()):
        others = "batch item 1" if b == 2 else f"batch items 1 to {b - 1}"
        return (f"every head of batch item 0 is right and every head of {others} is wrong: the "
                f"(batch, head) offset covers the heads but not the batch. The grid's second axis must be B * H "
                f"(tl.program_id(1) = b * H + h), and each program's data starts at pid_bh * S * D.")
    wrong = [(int(i), int(j)) for i, j in pairs.nonzero()]
    return (f"some (batch, head) pairs are right and others wrong (wrong: {wrong[:6]}"
            f"{' ...' if len(wrong) > 6 else ''} of B={b}, H={h}): check the offset of each (batch, head) pair "
            f"and that the grid covers all B * H of them.")


def _expect_pair(checker, result, case) -> tuple[object, object]:
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        kind = type(result).__name__
        checker.fail(case, f"your function returned a {kind}{'' if kind != 'tuple' else f' of {len(result)}'}"
                           f", expected a pair (out, lse).",
                     "return out, lse: the attention output and the log-sum-exp of each row.")
    return result[0], result[1]


def _run_cases(fn, checker, *, returns_lse: bool, extra_kwargs=None, diagnose=None, limit_memory=False,
               require_triton=False):
    dev = device()
    passed_noncausal = set()  # shapes whose causal=False case passed: a causal failure there is the causal part's
    loaded = {}  # interpreter, Triton exercise: bytes loaded per (shape, causal), for the causal skip
    for fields in _cases():
        kwargs = dict(extra_kwargs(fields)) if extra_kwargs else {}
        case = _case(fields, **kwargs)
        q, k, v = _make_inputs(fields, dev)
        before = [t.clone() for t in (q, k, v)]
        watch = limit_memory and fields["S"] == max(SEQ_LENS)
        shape = tuple(fields.get(key) for key in ("B", "H", "S", "D", "dtype", "layout", "sigma", "pattern"))

        @functools.wraps(fn)
        def watched(*args, **kw):
            return peak_tensor_memory(fn, *args, **kw)

        with contextlib.ExitStack() as stack:
            launches = stack.enter_context(triton_launches())
            calls = stack.enter_context(torch_calls(COMPUTES)) if require_triton else None
            guard = counted = None
            if require_triton:  # a kernel may read or write past a tensor: give it guard space (see _guard)
                guard = guarded_memory(nan_empty=True)
                q, k, v = (guard.guard(t, name) for t, name in zip((q, k, v), "qkv"))
                stack.enter_context(guard)
                if interpreter_mode() and not count_bytes._active:
                    try:
                        counted = stack.enter_context(count_bytes())
                    except BytesNotCountable:
                        counted = None
            if watch:
                result, report = checker.call(watched, q, k, v, causal=fields["causal"], case=case,
                                              forbid=FORBID, **kwargs)
            else:
                result = checker.call(fn, q, k, v, causal=fields["causal"], case=case, forbid=FORBID, **kwargs)
        if guard is not None:
            _expect_within_bounds(checker, case, guard, counted)
        if not all(torch.equal(t, b) for t, b in zip((q, k, v), before)):
            checker.fail(case, "your function changed q, k or v.", "never write into the inputs; allocate new tensors.")
        want_out, want_lse = attention_spec(q, k, v, fields["causal"])
        large = bool(fields.get("sigma"))
        atol, rtol, lse_atol, lse_rtol = _tolerances(fields["dtype"], large, bool(fields.get("precise")))
        out, lse = _expect_pair(checker, result, case) if returns_lse else (result, None)
        returned_lse = lse  # before any conversion below: the tensor the function returned
        causal_at_fault = fields["causal"] and shape in passed_noncausal
        hint = (CAUSAL_HINT_KERNEL if require_triton else CAUSAL_HINT_TORCH) if causal_at_fault else (
            FP16_SCORES_HINT if fields.get("precise") else BLOCKWISE_HINT if diagnose else "")
        if fields.get("precise"):  # float16 logits in the hundreds: the same numbers in float32 tell
            first = functools.partial(_float32_diagnosis, functools.partial(fn, **kwargs), q, k, v, fields["causal"],
                                      want_out, atol, rtol, guarded=require_triton)
        else:
            first = None
        _compare(checker, out, want_out, case=case, atol=atol, rtol=rtol, what="output",
                 mistakes=functools.partial(_output_mistakes, q, k, v, fields["causal"], fields,
                                            kwargs.get("block_n")),
                 hint=hint, first_diagnose=first,
                 diagnose=(lambda f=fields, kw=kwargs: diagnose(f, kw)) if diagnose and not causal_at_fault
                 else None, large=large)
        if returns_lse:
            lse_hint = ("lse[b, h, i] = log(sum_j exp(s_ij)) over the keys query i sees, with "
                        "s = q.k / sqrt(D): in a blockwise loop, m + log(l) at the end.")
            if isinstance(lse, torch.Tensor) and lse.is_floating_point():
                if torch.finfo(lse.dtype).eps > torch.finfo(fields["dtype"]).eps:
                    lse_hint += (f" Your lse is {str(lse.dtype).replace('torch.', '')}, less precise than "
                                 f"the inputs: return it in float32.")
                lse = lse.float()
            _compare(checker, lse, want_lse, case=case, atol=lse_atol, rtol=lse_rtol, what="log-sum-exp",
                     mistakes=functools.partial(_lse_mistakes, q, k, v, fields["causal"], want_lse), hint=lse_hint)
        if require_triton and launches.count == 0:
            checker.fail(case, "the result is right, but no Triton kernel was launched: it was computed some "
                               "other way (in torch?).", TRITON_HINT)
        if require_triton:
            checker.expect_kernel_work(case, launches, calls, {"out": out, "lse": returned_lse}, TRITON_HINT)
        if watch:
            limit = fields["S"] * fields["S"]
            if report.largest_numel >= limit:
                checker.fail(case, f"your function created a float tensor of shape {report.largest_shape} "
                                   f"({report.largest_numel:,} numbers, at least S x S = {limit:,}).",
                             "the point of the online softmax is never to hold the S x S score matrix: "
                             "compute scores for one block of block_n keys at a time, (B, H, S, block_n).")
        if not fields["causal"]:
            passed_noncausal.add(shape)
        if counted is not None:
            loaded[shape, fields["causal"]] = counted.loaded
            if fields["causal"] and fields["S"] == max(SEQ_LENS) and (shape, False) in loaded:
                _expect_causal_skip(checker, case, loaded[shape, True], loaded[shape, False])


def _expect_within_bounds(checker, case, guard, counted) -> None:
    """Fail when the kernel wrote into the guard space around a tensor, or (counted in the interpreter)
    loaded or stored outside every tensor it was given."""
    touched = guard.touched()
    if touched:
        names = touched_names(touched)
        checker.fail(case, f"your kernel wrote outside {names}: some lanes of a partial block stored past the end "
                           f"(or before the start) of the tensor. On a GPU that silently corrupts other tensors; in "
                           f"the interpreter it can crash Python.", BOUNDS_HINT)
    outside = counted.by_argument.get(OTHER) if counted is not None else None
    if outside is not None and (outside.stored or outside.loaded):
        what = " and ".join(f"{verb} {n:,} bytes" for verb, n in (("stored", outside.stored),
                                                                   ("loaded", outside.loaded)) if n)
        checker.fail(case, f"your kernel {what} outside every tensor it was given (counted in the interpreter): "
                           f"past the end of q, k, v, out or lse.", BOUNDS_HINT)


def _expect_causal_skip(checker, case, causal_bytes: int, full_bytes: int) -> None:
    """Interpreter only: a causal kernel must load less than the same kernel without the mask does."""
    if causal_bytes < full_bytes:
        return
    checker.fail(case, f"the values are right, but your causal kernel loaded {causal_bytes:,} bytes, as many as "
                       f"for the same shape with causal=False ({full_bytes:,}; counted in the interpreter): it visits "
                       f"key blocks that lie entirely in the future of every query of the program, and masks them "
                       f"away. Skipping them is the point of the causal loop (almost half the work).",
                 "stop the loop over key blocks at the end of this program's query tile: "
                 "`stop = tl.minimum((pid_m + 1) * BLOCK_M, S)` and `for start_n in range(0, stop, BLOCK_N)`. "
                 "(Tiles from kernel_config are smaller than S here; a tile covering the whole sequence skips "
                 "nothing.)")


def _close(got, want, atol, rtol) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape and got.device == want.device
            and torch.allclose(got.detach().double(), want.detach().double(), atol=atol, rtol=rtol))


TAIL_HINT_KERNEL = ("keys at or past S must get score -inf (mask offs_n < S), and loads and stores of the "
                    "partial query and key blocks need masks.")
TAIL_HINT_TORCH = ("the last block of keys is shorter than block_n: make sure your loop visits it "
                   "(range(0, S, block_n)) and slices it to its real length.")


def _probe_diagnosis(call, fields, probe_len: int = 256, tail_hint: str = TAIL_HINT_KERNEL) -> str:
    """Run up to two extra probes to name a blockwise bug: a missing tail mask, or a missing rescale.

    Returns the diagnosis, or "" when the probes do not single one out.

    P1: random inputs of length ``probe_len``, a multiple of every block the function may use
    (256 for power-of-two blocks up to 256). If that is right while the failing case (a length
    that is not a multiple) is wrong, the partial last block is at fault.
    P2: the same length with key 0 dominating every row, so the running maximum is final after
    the first key block and never changes. If P1 is wrong and P2 right, the rescale is missing.
    """
    atol, rtol, _, _ = _tolerances(fields["dtype"], False)
    probe = dict(fields, S=probe_len, seed=fields["seed"] + 1000)  # same B, H, dtype, layout
    for special in ("sigma", "precise", "pattern"):
        probe.pop(special, None)

    def right(q, k, v) -> bool:
        try:
            result = _guarded_call(call, q, k, v, fields["causal"])
        except Exception:
            return False
        out = result[0] if isinstance(result, (tuple, list)) else result
        return _close(out, attention_spec(q, k, v, fields["causal"])[0], atol, rtol)

    q, k, v = _make_inputs(probe, _device())
    p1 = right(q, k, v)
    if p1 and fields["S"] % probe_len:
        return (f"this length is wrong but S = {probe_len} (a multiple of the block) is right: the last, partial "
                f"block is mishandled; {tail_hint}")
    if not p1:
        q, k = q.clone(), k.clone()
        q[..., 0] = 4.0  # every query has a large first feature ...
        k[..., 0] = 0.0
        k[:, :, 0, 0] = 4.0 * math.sqrt(q.shape[-1])  # ... and key 0 matches it: logit +16 over the rest
        if right(q, k, v):
            return ("right when every row's maximum is in the first key block, wrong otherwise: when a new "
                    "block raises the running maximum from m_old to m_new, both the running sum l and the "
                    "accumulator must be rescaled by exp(m_old - m_new) before adding the new block.")
    return ""


def _float32_diagnosis(fn, q, k, v, causal, want, atol, rtol, *, guarded=False) -> str:
    """The learner's function on float32 copies of the same float16 inputs: right there and wrong in
    float16 means it computes in the inputs' dtype. "" when the float32 run is wrong too (or raises)."""
    q32, k32, v32 = (t.float() for t in (q, k, v))
    try:
        result = (_guarded_call(lambda a, b, c, causal: fn(a, b, c, causal=causal), q32, k32, v32, causal)
                  if guarded else fn(q32, k32, v32, causal=causal))
    except Exception:
        return ""
    out = result[0] if isinstance(result, (tuple, list)) else result
    if not (isinstance(out, torch.Tensor) and out.shape == want.shape and _close(out, want, atol, rtol)):
        return ""
    return ("the same inputs converted to float32 give the right output, so the scores (or the softmax) are "
            "computed in float16, the inputs' dtype: at logits in the hundreds float16 keeps a score only to "
            "within about 0.1, and the softmax weights move by as much. Compute q @ k^T and the softmax in float32 "
            "(q.float() @ k.float().transpose(-2, -1)) and cast only the output back to the inputs' dtype.")


def _guarded_call(call, q, k, v, causal):
    """A probe run of the learner's function, its tensors in guard space (see :mod:`._guard`)."""
    guard = guarded_memory(nan_empty=True)
    q, k, v = (guard.guard(t, name) for t, name in zip((q, k, v), "qkv"))
    with guard:
        return call(q, k, v, causal)


TF32_TOLERANCE = 2e-2  # float32 through tf32 tensor cores (10-bit mantissas) lands within this


def _tf32_diagnosis(call, fields) -> str:
    """On a GPU, name tf32 rounding when a float32 result is off by about what tf32 gives.

    ``tl.dot`` multiplies float32 inputs in tf32 on NVIDIA GPUs unless ``input_precision="ieee"``
    is passed: errors near 1e-3, too large for the float32 tolerance yet far smaller than any
    logic mistake makes (at S = 1, where every mistake gives the right answer, it is the only
    way to fail). Returns "" when this does not apply.
    """
    if fields["dtype"] != torch.float32 or not _gpu_compiles():
        return ""
    q, k, v = _make_inputs(fields, _device())
    try:
        result = _guarded_call(call, q, k, v, fields["causal"])
    except Exception:
        return ""
    out = result[0] if isinstance(result, (tuple, list)) else result
    if not _close(out, attention_spec(q, k, v, fields["causal"])[0], TF32_TOLERANCE, TF32_TOLERANCE):
        return ""
    return ("the float32 output is off by about what tf32 rounding gives: on NVIDIA GPUs tl.dot multiplies "
            "float32 inputs in tf32 (10-bit mantissas) by default. Pass input_precision=\"ieee\" to every "
            "tl.dot (both q @ k^T and p @ v) for full float32 products.")


BOUNDS_HINT = ("mask every load and store of a partial block: rows at or past S (offs_m < S for q, out and lse; "
               "offs_n < S for k and v), with `other=0.0` on the loads, and keep the (batch, head) offset within "
               "the tensor.")
CAUSAL_HINT_KERNEL = ("the same shape passes with causal=False, so the causal part is at fault: query i may see key "
                      "j when j <= i (offs_n[None, :] <= offs_m[:, None]), and the loop over key blocks must run up "
                      "to (pid_m + 1) * BLOCK_M, the end of this program's query tile: BLOCK_M, not the key tile "
                      "BLOCK_N (the two differ, here as on a GPU).")
CAUSAL_HINT_TORCH = ("the same shape passes with causal=False, so the causal mask is at fault: key j is visible to "
                     "query i when j <= i, with j the key's position in the whole sequence (start + its index in "
                     "the block), and a loop that stops early must still visit every key up to the last query.")
FP16_SCORES_HINT = ("this case has float16 inputs with logits in the hundreds: compute the scores and the softmax "
                    "in float32 (q.float() @ k.float().transpose(-2, -1)) and cast only the output back; float16 "
                    "rounds a score of 200 to a multiple of 0.125.")
BLOCKWISE_HINT = (
    "common causes: the accumulator or running sum not rescaled by exp(m_old - m_new) when the maximum "
    "grows; keys past the end of the sequence not masked to -inf; a stride or batch/head offset wrong "
    "(B and H are above 1, and one case is not contiguous).")


def _device():
    return device()


# --- the checks --------------------------------------------------------------------------------


@graded(points=10, bans=ANSWERS)
def check_naive_attention(fn, checker):
    """``fn(q, k, v, causal=False)`` must return attention of q, k, v (B, H, S, D), in q's dtype."""
    _run_cases(fn, checker, returns_lse=False)


ONLINE_BLOCKS = (16, 10, 32)  # block_n the check passes; 10 and 16 do not divide 17, 100 or 257


@graded(points=15, bans=ANSWERS)
def check_online_softmax(fn, checker):
    """``fn(q, k, v, causal=False, block_n=...)`` must return ``(out, lse)``, visiting keys in blocks.

    It must never create an S x S float tensor (watched on the S = 257 cases).
    """

    def kwargs(fields):
        return {"block_n": ONLINE_BLOCKS[fields["seed"] % len(ONLINE_BLOCKS)]}

    def diagnose(fields, kw):
        block_n = kw["block_n"]
        return _probe_diagnosis(lambda q, k, v, c: fn(q, k, v, causal=c, **kw), fields,
                                probe_len=block_n * max(1, 256 // block_n), tail_hint=TAIL_HINT_TORCH)

    _run_cases(fn, checker, returns_lse=True, extra_kwargs=kwargs, diagnose=diagnose, limit_memory=True)


@graded(points=25, bans=ANSWERS)
def check_flash_attention(fn, checker):
    """``fn(q, k, v, causal=False)`` must return ``(out, lse)``; on a GPU, also S = 4096 in O(S) memory."""
    def diagnose(fields, _):
        def call(q, k, v, c):
            return fn(q, k, v, causal=c)

        return _tf32_diagnosis(call, fields) or _probe_diagnosis(call, fields)

    _run_cases(fn, checker, returns_lse=True, diagnose=diagnose, require_triton=True)
    if cuda_available() and not interpreter_mode():
        _check_long_sequence(fn, checker)


def _check_long_sequence(fn, checker, seq_len: int = LONG_SEQ):
    """GPU only: S = seq_len is right, and peak memory shows no S x S tensor was allocated."""
    for causal in (False, True):
        fields = dict(B=1, H=4, S=seq_len, D=64, dtype=torch.float16, causal=causal, seed=99)
        case = _case(fields)
        q, k, v = _make_inputs(fields, torch.device("cuda"))
        want_out, want_lse = attention_spec(q, k, v, causal)
        del want_lse
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with triton_launches() as launches, torch_calls(COMPUTES) as calls:
            result = checker.call(fn, q, k, v, causal=causal, case=case, forbid=FORBID)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        out, lse = _expect_pair(checker, result, case)
        score_bytes = seq_len * seq_len * 2  # one head's score matrix in 16-bit
        if extra >= score_bytes:
            checker.fail(case, f"the call allocated {extra / 2**20:,.1f} MiB at its peak, at least one "
                               f"head's S x S score matrix in 16 bits ({score_bytes / 2**20:,.0f} MiB).",
                         "FlashAttention never materialises the score matrix: the kernel keeps each "
                         "BLOCK_M x BLOCK_N tile on chip; the wrapper should allocate only out and lse.")
        atol, rtol, _, _ = _tolerances(torch.float16, False)
        checker.expect_tensor(out, want_out, case=case, atol=atol, rtol=rtol,
                              hint="short sequences pass but this one does not: check that the grid covers "
                                   "every query block (cdiv(S, BLOCK_M) of them) and that the key loop "
                                   "runs to the last key.")
        checker.expect_kernel_work(case, launches, calls, {"out": out, "lse": lse}, TRITON_HINT)
