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
without the max subtraction (float32 and float16), several seeds, B and H above 1, a
non-contiguous layout, float32 and float16 (bfloat16 too on a GPU that computes in it, compute
capability 8.0 and above). ``scaled_dot_product_attention`` is forbidden while the learner's
function runs.

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
    out = []
    for t in (q, k, v):
        t = t.to(dtype=f["dtype"], device=device)
        if f.get("layout") == "BSHD":
            t = t.transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) buffer: not contiguous
        out.append(t)
    return out


def _tolerances(dtype, large: bool) -> tuple[float, float, float, float]:
    """(out atol, out rtol, lse atol, lse rtol) for inputs of ``dtype``.

    fp16 and bf16 allow for scores rounded to the input dtype (what torch matmuls in fp16 do);
    large logits magnify that rounding. fp32 allows plain fp32 rounding only: on a GPU that
    means ``tl.dot(..., input_precision="ieee")``, not the default tf32.
    """
    if dtype == torch.float32:
        return 1e-4, 1e-4, 1e-4, 1e-5
    if dtype == torch.float16:
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
    shown.update(extra)
    return Case(**shown)


# --- what the usual mistakes produce ----------------------------------------------------------


def _variant(q, k, v, causal, *, scale=None, axis=-1, mask_offset=0, transpose_mask=False,
             normalise=True, mask_when=None):
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
        visible = (cols >= rows - mask_offset) if transpose_mask else (cols <= rows + mask_offset)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if normalise:
        weights = torch.softmax(scores, dim=axis)
    else:
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    out = weights @ v.double()
    return out.to(q.dtype), lse.float()


def _output_mistakes(q, k, v, causal) -> dict[str, tuple[object, str]]:
    """Description -> (what that mistake returns, how to fix it)."""
    d = q.shape[3]
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


def _compare(checker, got, want, *, case, atol, rtol, what, mistakes, hint="", diagnose=None, large=False):
    """Fail with a named mistake when ``got`` matches one; otherwise the framework's comparison.

    ``diagnose``, if given, is called only when no mistake matched (it may run the learner's
    function on probes); a non-empty answer replaces the generic ``hint``.
    """
    if (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape)
            and got.device == want.device):
        g, w = got.detach().double(), want.detach().double()
        if not torch.allclose(g, w, atol=atol, rtol=rtol):
            matched = [(description, fix) for description, (wrong, fix) in mistakes.items()
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
                              "(running) maximum of each row before exponentiating.")
                else:
                    reason = (diagnose() if diagnose else "") or (
                        "NaN or inf usually means exp of a large number (subtract the maximum first), "
                        "a row whose keys are all masked or never visited (0/0), or memory read outside "
                        "the tensor (a missing mask).")
                checker.fail(case, f"the {what} has {int(bad.sum())} {_NOT_FINITE} value(s) where the "
                                   f"reference is finite, first at index {idx}.", reason)
    if diagnose and not _close(got, want, atol, rtol):
        hint = diagnose() or hint
    checker.expect_tensor(got, want, case=case, atol=atol, rtol=rtol, what=what, hint=hint)


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
    for fields in _cases():
        kwargs = dict(extra_kwargs(fields)) if extra_kwargs else {}
        case = _case(fields, **kwargs)
        q, k, v = _make_inputs(fields, dev)
        before = [t.clone() for t in (q, k, v)]
        watch = limit_memory and fields["S"] == max(SEQ_LENS)

        @functools.wraps(fn)
        def watched(*args, **kw):
            return peak_tensor_memory(fn, *args, **kw)

        with triton_launches() as launches, (torch_calls(COMPUTES) if require_triton else contextlib.nullcontext()) as calls:
            if watch:
                result, report = checker.call(watched, q, k, v, causal=fields["causal"], case=case,
                                              forbid=FORBID, **kwargs)
            else:
                result = checker.call(fn, q, k, v, causal=fields["causal"], case=case, forbid=FORBID, **kwargs)
        if not all(torch.equal(t, b) for t, b in zip((q, k, v), before)):
            checker.fail(case, "your function changed q, k or v.", "never write into the inputs; allocate new tensors.")
        want_out, want_lse = attention_spec(q, k, v, fields["causal"])
        large = bool(fields.get("sigma"))
        atol, rtol, lse_atol, lse_rtol = _tolerances(fields["dtype"], large)
        out, lse = _expect_pair(checker, result, case) if returns_lse else (result, None)
        returned_lse = lse  # before any conversion below: the tensor the function returned
        _compare(checker, out, want_out, case=case, atol=atol, rtol=rtol, what="output",
                 mistakes=_output_mistakes(q, k, v, fields["causal"]), hint=BLOCKWISE_HINT if diagnose else "",
                 diagnose=(lambda f=fields, kw=kwargs: diagnose(f, kw)) if diagnose else None, large=large)
        if returns_lse:
            lse_hint = ("lse[b, h, i] = log(sum_j exp(s_ij)) over the keys query i sees, with "
                        "s = q.k / sqrt(D): in a blockwise loop, m + log(l) at the end.")
            if isinstance(lse, torch.Tensor) and lse.is_floating_point():
                if torch.finfo(lse.dtype).eps > torch.finfo(fields["dtype"]).eps:
                    lse_hint += (f" Your lse is {str(lse.dtype).replace('torch.', '')}, less precise than "
                                 f"the inputs: return it in float32.")
                lse = lse.float()
            _compare(checker, lse, want_lse, case=case, atol=lse_atol, rtol=lse_rtol, what="log-sum-exp",
                     mistakes=_lse_mistakes(q, k, v, fields["causal"], want_lse), hint=lse_hint)
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
    probe.pop("sigma", None)

    def right(q, k, v) -> bool:
        try:
            result = call(q, k, v, fields["causal"])
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
        result = call(q, k, v, fields["causal"])
    except Exception:
        return ""
    out = result[0] if isinstance(result, (tuple, list)) else result
    if not _close(out, attention_spec(q, k, v, fields["causal"])[0], TF32_TOLERANCE, TF32_TOLERANCE):
        return ""
    return ("the float32 output is off by about what tf32 rounding gives: on NVIDIA GPUs tl.dot multiplies "
            "float32 inputs in tf32 (10-bit mantissas) by default. Pass input_precision=\"ieee\" to every "
            "tl.dot (both q @ k^T and p @ v) for full float32 products.")


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
