"""Checks for the precision lab: group-wise quantisation, its inverse, and a weight-only int8 matmul in Triton.

The functions a learner writes, and how the checks call them (conventions in
:mod:`labsupport.quantize` and :mod:`labsupport.int8_matmul`):

* ``quantize_groupwise(w, bits=8, group_size=128) -> (codes, scales)``: ``w`` is ``(N, K)``;
  ``codes`` int8 ``(N, K)`` for 8 bits, packed uint8 ``(N, K // 2)`` for 4 bits (element ``2j``
  in the low nibble); ``scales`` float32 ``(N, K // group_size)``. Cases: int8 and int4, per
  channel and groups of 32, 64 and 128, float32, float16 and bfloat16 weights, a group whose
  largest magnitude is negative, a group holding exactly ``+-max``, an outlier column and an
  all-zero group. The codes are compared with the course's (a difference is allowed only within
  1e-4 of a rounding tie), the scales to 1e-5, and every dequantised element must lie within half
  a step (``scale / 2``) of ``w``.
* ``dequantize_groupwise(codes, scales, bits=8, group_size=128) -> w``: float32 ``(N, K)``; int4
  cases hold every nibble from ``0x0`` to ``0xF`` (so ``-8`` and ``-1`` must be sign-extended).
* ``int8_matmul(x, w_q, scales) -> y``: ``x`` ``(M, K)``, ``w_q`` int8 ``(N, K)``, ``scales``
  ``(N, G)``; ``y = x @ dequantised(W).T`` ``(M, N)`` in x's dtype. Decode shapes (M from 1 to 64),
  N not a multiple of any tile, per channel and per group, float32 and float16 (bfloat16 as well
  on a GPU with compute capability 8.0), one square case (so a scale applied along K is named),
  and one case whose partial sums grow large and cancel (an fp16 accumulator loses the answer).
  A Triton kernel launched by the function must write the result and receive ``w_q``; torch's
  matmuls are refused, and so are a float tensor as large as ``W`` and any torch call that makes
  floats from the codes, whole or a slice at a time (the weights are dequantised in registers).
"""

from __future__ import annotations

import functools

import torch

from ..attention import peak_tensor_memory
from ..device import cuda_available, device, gpu_has_bf16, interpreter_mode
from ..gguf_blocks import BLOCK_BYTES, dequantize_q4_1, dequantize_q8_0
from ..int8_matmul import int8_matmul_reference, int8_matmul_spec
from ..quantize import dequantize_groupwise, pack_int4, qmax, quantize_groupwise, unpack_int4
from .framework import Case, graded, torch_calls, triton_launches

QUANT_ANSWERS = (quantize_groupwise, dequantize_groupwise)
MATMUL_ANSWERS = (int8_matmul_spec, int8_matmul_reference, dequantize_groupwise, quantize_groupwise)
MATMULS = ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "einsum", "linear", "tensordot",
           "dot", "mv", "_int_mm")
TRITON_HINT = ("this exercise is the Triton kernel: launch int8_matmul_kernel[grid](...) from your wrapper and "
               "let it load the int8 weights, dequantise them in registers and write y.")
TIE = 1e-4  # codes may differ from the course's only this close to a rounding tie


# --- inputs ------------------------------------------------------------------------------------


def _weights(n: int, k: int, group: int, dtype, seed: int, special: bool) -> torch.Tensor:
    """Signed N(0, 1) weights; with ``special``: an outlier column, an all-zero group, a group whose
    largest magnitude is negative, and a group holding exactly +-max."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    if special:
        w[:, 1] *= 30.0  # an outlier input channel
        w[0, :group] = 0.0  # an all-zero group
        if n > 1:
            w[1, :group] = w[1, :group].clamp(-1.5, 1.5)
            w[1, 3] = -4.0  # the largest magnitude is negative: it must map to -qmax
        if n > 2:
            w[2, :group] = w[2, :group].clamp(-2.0, 2.0)
            w[2, 0], w[2, group - 1] = 3.0, -3.0  # exactly +-max: codes +-qmax, nothing beyond
    return w.to(dtype)


QUANT_CASES = [  # (N, K, group_size, dtype, special)
    (4, 64, 64, torch.float32, True),  # per channel
    (6, 256, 32, torch.float32, True),
    (8, 512, 128, torch.float16, True),
    (3, 256, 64, torch.bfloat16, False),
    (5, 384, 128, torch.float32, False),
]


def _quant_case(n, k, group, dtype, bits, seed) -> Case:
    return Case(N=n, K=k, bits=bits, group_size=group, dtype=dtype, seed=seed)


def _codes_of(fields_bits: int, codes: torch.Tensor) -> torch.Tensor:
    return unpack_int4(codes) if fields_bits == 4 else codes


# --- what the usual mistakes produce ----------------------------------------------------------


def _scale_mistakes(w: torch.Tensor, bits: int, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    amax, top = g.abs().amax(-1), qmax(bits)
    return {
        "the scale comes from the mean of |w| instead of its maximum (mean / qmax): large weights saturate":
            g.abs().mean(-1) / top,
        f"the scale divides by 2**(bits-1) = {top + 1} instead of qmax = {top}: the maximum maps to {top + 1}, "
        f"which does not fit":
            amax / (top + 1),
        f"the scale divides by 2**bits - 1 = {2**bits - 1}, the asymmetric range, instead of qmax = {top}":
            amax / (2**bits - 1),
        "the scale is inverted (qmax / max instead of max / qmax)":
            top / amax.clamp(min=1e-30),
    }


def _code_mistakes(w: torch.Tensor, bits: int, group: int, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Description -> the unpacked codes (N, K) that mistake returns."""
    n, k = w.shape
    top = qmax(bits)
    g = w.float().reshape(n, k // group, group)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]
    ratio = g / safe
    out = {
        "w / scale is rounded toward zero (a cast with .to(torch.int8) or int() truncates) instead of to the "
        "nearest integer": torch.trunc(ratio).clamp(-top, top),
        "w / scale is rounded down (floor) instead of to the nearest integer": torch.floor(ratio).clamp(-top, top),
    }
    if bits == 4:
        ref = torch.round(ratio).clamp(-top, top).reshape(n, k)
        swapped = ref.reshape(n, k // 2, 2).flip(-1).reshape(n, k)
        out["the nibbles are swapped: element 2j must go in the low nibble (bits 0-3), element 2j+1 in the "
            "high nibble (bits 4-7)"] = swapped
    return {d: c.reshape(n, k) for d, c in out.items()}


# --- the checks: quantisation -------------------------------------------------------------------


def _expect_pair(checker, result, case):
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        checker.fail(case, f"your function returned a {type(result).__name__}, expected a pair (codes, scales).",
                     "return codes, scales.")
    return result


@graded(points=15, bans=QUANT_ANSWERS)
def check_quantize_groupwise(fn, checker):
    """``fn(w, bits=8, group_size=128)`` must return ``(codes, scales)`` as the lab states."""
    seed = 0
    for bits in (8, 4):
        for n, k, group, dtype, special in QUANT_CASES:
            seed += 1
            case = _quant_case(n, k, group, dtype, bits, seed)
            w = _weights(n, k, group, dtype, seed, special)
            before = w.clone()
            result = checker.call(fn, w, bits=bits, group_size=group, case=case)
            if not torch.equal(w, before):
                checker.fail(case, "your function changed w.", "never write into the input; work on a copy.")
            codes, scales = _expect_pair(checker, result, case)
            want_codes, want_scales = quantize_groupwise(w, bits, group)
            _check_scales(checker, case, w, bits, group, scales, want_scales)
            _check_codes(checker, case, w, bits, group, codes, want_codes, want_scales)


def _check_scales(checker, case, w, bits, group, scales, want):
    n, k = w.shape
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (n, k // group):
        shape = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
        checker.fail(case, f"the scales have shape {shape}, expected (N, K // group_size) = {(n, k // group)}.",
                     "one scale per group of group_size consecutive elements of each row.")
    if scales.dtype != torch.float32:
        checker.fail(case, f"the scales are {str(scales.dtype).replace('torch.', '')}, expected float32.",
                     "compute the scales in float32 (w.float()) and return them as float32.")
    zero = want == 0  # all-zero groups: any finite scale is fine, the codes must be 0
    if bool((~torch.isfinite(scales)).any()):
        idx = tuple(int(i) for i in (~torch.isfinite(scales)).nonzero()[0])
        checker.fail(case, f"scale {idx} is {scales[idx].item()}" + (" (an all-zero group)" if bool(zero[idx]) else "")
                     + ".", "a group of zeros has max 0: guard the division (give it scale 0 or 1, codes 0).")
    got = torch.where(zero, want, scales.detach().float())
    mistakes = {d: torch.where(zero, want, v.float()) for d, v in _scale_mistakes(w, bits, group).items()}
    checker.expect_tensor(got, want, case=case, atol=0.0, rtol=1e-5, what="scales", mistakes=mistakes,
                          hint=f"scale = max(|w|) over the group / qmax, qmax = 2**(bits-1) - 1 = {qmax(bits)}.")


def _check_codes(checker, case, w, bits, group, codes, want_packed, scales):
    n, k = w.shape
    shape, dtype = ((n, k // 2), torch.uint8) if bits == 4 else ((n, k), torch.int8)
    if not isinstance(codes, torch.Tensor) or tuple(codes.shape) != shape or codes.dtype != dtype:
        got = (f"{str(codes.dtype).replace('torch.', '')} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor)
               else type(codes).__name__)
        checker.fail(case, f"the codes are {got}, expected {str(dtype).replace('torch.', '')} {shape}.",
                     "int8: one int8 per weight. int4: two codes per uint8 byte, element 2j in the low nibble "
                     "(bits 0-3) and element 2j+1 in the high nibble (bits 4-7).")
    got = _codes_of(bits, codes).float()
    want = _codes_of(bits, want_packed).float()
    if bool((got.abs() > qmax(bits)).any()):
        idx = tuple(int(i) for i in (got.abs() > qmax(bits)).nonzero()[0])
        problem = f"code {idx} is {got[idx].item():.0f}, outside the symmetric range +-{qmax(bits)}."
        offset = (unpack_int4(codes).to(torch.int16) & 0xF) - 8 if bits == 4 else None
        if offset is not None and torch.equal(offset.float(), want):
            problem += ("\nYour bytes hold code + 8 (unsigned, as llama.cpp's Q4_0 stores them); this lab stores "
                        "each code as a 4-bit two's complement (-1 is 0xF, -7 is 0x9).")
        checker.fail(case, problem, f"clamp the rounded codes to [-{qmax(bits)}, {qmax(bits)}].")
    ratio = (w.float().reshape(n, k // group, group)
             / torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]).reshape(n, k)
    near_tie = ((ratio - ratio.floor()) - 0.5).abs() < TIE
    wrong = (got != want) & ~near_tie
    if bool(wrong.any()):
        idx = tuple(int(i) for i in wrong.nonzero()[0])
        problem = (f"{int(wrong.sum())} of {got.numel()} codes differ from round(w / scale); first at {idx}: got "
                   f"{got[idx].item():.0f}, expected {want[idx].item():.0f} (w = {w[idx].item():.6g}, w / scale = "
                   f"{ratio[idx].item():.4f}).")
        for description, mistake in _code_mistakes(w, bits, group, scales).items():
            if torch.equal(torch.where(near_tie, want, mistake), torch.where(near_tie, want, got)):
                problem += f"\nYour codes match what we get when {description}."
                break
        deq = got * scales.repeat_interleave(group, dim=1)
        err = (deq - w.float()).abs() / scales.repeat_interleave(group, dim=1).clamp(min=1e-30)
        problem += f"\nThe largest error is {err.max().item():.2f} steps; round to nearest keeps it at 0.5."
        checker.fail(case, problem, "round each weight over its group's scale to the NEAREST integer "
                                    "(torch.round), clamp it to -qmax .. qmax, then pack.")
    # the bound the exercise promises, on the learner's own codes and scales
    deq = got * scales.repeat_interleave(group, dim=1)
    bound = scales.repeat_interleave(group, dim=1) / 2 * (1 + 1e-5) + 1e-30
    if bool(((deq - w.float()).abs() > bound).any()):
        checker.fail(case, "a dequantised weight is more than half a step from w.", "round to the nearest code.")


# --- the checks: dequantisation -------------------------------------------------------------------


def _dequant_mistakes(codes, scales, bits, group) -> dict[str, torch.Tensor]:
    q = unpack_int4(codes).float() if bits == 4 else codes.float()
    n, k = q.shape
    s = scales.float()
    out = {
        "each group's scale is taken from the wrong place (scale index k % G instead of k // group_size)":
            q * s.repeat(1, group),
        "the scale is not applied": q,
    }
    if bits == 4:
        p = codes.to(torch.int16)
        low, high = p & 0xF, (p >> 4) & 0xF
        swapped = torch.stack([high, low], -1).reshape(n, k)
        swapped = torch.where(swapped >= 8, swapped - 16, swapped).float()
        unsigned = torch.stack([low, high], -1).reshape(n, k).float()
        out["the nibbles are swapped: element 2j is in the low nibble (bits 0-3), element 2j+1 in the high "
            "nibble (bits 4-7)"] = swapped * s.repeat_interleave(group, 1)
        out["the nibbles are not sign-extended (0x8..0xF read as 8..15 instead of -8..-1)"] = (
            unsigned * s.repeat_interleave(group, 1))
    return out


@graded(points=10, bans=QUANT_ANSWERS)
def check_dequantize_groupwise(fn, checker):
    """``fn(codes, scales, bits=8, group_size=128)`` must return the float32 (N, K) weights."""
    seed = 100
    for bits in (8, 4):
        for n, k, group, dtype, special in QUANT_CASES:
            seed += 1
            case = _quant_case(n, k, group, dtype, bits, seed)
            w = _weights(n, k, group, dtype, seed, special)
            codes, scales = quantize_groupwise(w, bits, group)
            if bits == 4:  # every nibble value, -8 (0x8) included, in the first row
                row = unpack_int4(codes)
                row[0, :16] = torch.arange(-8, 8, dtype=torch.int8)
                codes = pack_int4(row)
                scales = scales.clone()
                scales[0, 0] = 0.25
            want = dequantize_groupwise(codes, scales, bits, group)
            result = checker.call(fn, codes.clone(), scales.clone(), bits=bits, group_size=group, case=case)
            if isinstance(result, torch.Tensor) and result.dtype != torch.float32:
                checker.fail(case, f"the dequantised weights are {str(result.dtype).replace('torch.', '')}, "
                                   f"expected float32 (the lab's convention, whatever dtype w had).",
                             "return codes.float() * the scales, as float32.")
            checker.expect_tensor(result, want, case=case, atol=0.0, rtol=1e-6, what="dequantised weights",
                                  mistakes=_dequant_mistakes(codes, scales, bits, group),
                                  hint="w[n, k] = code[n, k] * scales[n, k // group_size]; int4: unpack both "
                                       "nibbles of each byte (low first) and sign-extend them.")


# --- the checks: the int8 matmul kernel -------------------------------------------------------------


class _weights_in_torch:
    """Context manager watching torch while the learner's function runs: it records the first torch
    call that makes floats out of the int8 codes ``w_q``, or out of an integer tensor derived from
    them (a slice, a copy, a view), and any call that hands the codes to Python or NumPy
    (``.tolist()``, ``.numpy()``, ``.item()``). Dequantising ``W`` in torch, whole or a chunk at a
    time, and computing ``y`` in torch for a kernel to copy all go through such a call.
    ``used`` is None or ``(function name, dtype, shape)``; ``received`` says whether a tensor
    holding the codes was passed to a Triton launch (checked with :class:`triton_launches`)."""

    LEAKS = ("tolist", "numpy", "item", "__array__", "__int__", "__float__", "__index__")

    def __init__(self, w_q: torch.Tensor):
        from torch.overrides import TorchFunctionMode

        self.codes = {_storage_of(w_q)}
        self.used: tuple[str, str, tuple] | None = None
        watch = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                result = func(*args, **kwargs)
                if watch.used is None and any(_storage_of(t) in watch.codes for t in _tensors_in((args, kwargs))):
                    name = getattr(func, "__name__", str(func))
                    outputs = list(_tensors_in(result))
                    if name in watch.LEAKS:
                        watch.used = (name, "Python or NumPy values", ())
                    for t in outputs:
                        if t.is_floating_point() or t.is_complex():
                            watch.used = (name, str(t.dtype).replace("torch.", ""), tuple(t.shape))
                            break
                        watch.codes.add(_storage_of(t))
                return result

        self.mode = Mode()

    def received(self, launches: triton_launches) -> bool:
        return launches.count is None or bool(self.codes & launches.storages)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _storage_of(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return None


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def _gpu_compiles() -> bool:
    return cuda_available() and not interpreter_mode()


def _matmul_cases() -> list[dict]:
    """Decode shapes, smallest first: (M, N, K, group_size or None for per channel, dtype)."""
    plan = [
        dict(M=1, N=128, K=128, group=None, dtype=torch.float32),  # square, per channel
        dict(M=1, N=200, K=256, group=64, dtype=torch.float16),
        dict(M=3, N=96, K=512, group=128, dtype=torch.float32),
        dict(M=16, N=64, K=256, group=32, dtype=torch.float16),
        dict(M=33, N=130, K=128, group=None, dtype=torch.float16),
        dict(M=64, N=72, K=256, group=128, dtype=torch.float16),
        dict(M=2, N=64, K=2048, group=128, dtype=torch.float16, cancel=True),
        # cases that each change one thing the decode shapes above share, with the hint that names it
        dict(M=80, N=64, K=256, group=64, dtype=torch.float16, hint=(
            "this case has M = 80 rows, more than one BLOCK_M tile (at most 64): launch a grid of "
            "(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)) programs, each taking its own rows, and mask the rows past M.")),
        dict(M=2, N=64, K=512, group=256, dtype=torch.float32, hint=(
            "this case's groups (256) are longer than a K tile (BLOCK_K is at most 128): the tile starting at k0 "
            "takes scales[n, k0 // group_size], the group it lies in, not the tile number k0 // BLOCK_K.")),
        dict(M=5, N=64, K=128, group=64, dtype=torch.float16, x_view=True, hint=(
            "this case's x is a column slice of a wider tensor, so its row stride (x.stride(0)) is not K: make x "
            "contiguous in the wrapper, or pass x.stride(0) to the kernel.")),
    ]
    if _gpu_compiles():
        plan += [dict(M=m, N=1000, K=1024, group=128, dtype=torch.float16) for m in (1, 64)]
        if gpu_has_bf16():
            plan += [dict(M=1, N=200, K=256, group=64, dtype=torch.bfloat16),
                     dict(M=8, N=4096, K=4096, group=128, dtype=torch.bfloat16),
                     dict(M=64, N=1000, K=1024, group=None, dtype=torch.bfloat16)]
    for seed, fields in enumerate(plan):
        fields["seed"] = seed
    return plan


def _matmul_inputs(f: dict, dev):
    gen = torch.Generator().manual_seed(1000 + f["seed"])
    m, n, k = f["M"], f["N"], f["K"]
    group = f["group"] or k
    if f.get("cancel"):
        # Half the inputs add about +1 each, the other half -1: the partial sums climb past 1,000
        # and fall back to a small result, which an fp16 accumulator (spacing 1 there) cannot keep.
        w = torch.ones(n, k)
        w[:, k // 2:] = -1.0
        w += 0.01 * torch.randn(n, k, generator=gen)
        x = 0.5 + torch.rand(m, k, generator=gen)
    else:
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(m, k, generator=gen)
    w_q, scales = quantize_groupwise(w, 8, group)
    x = x.to(device=dev, dtype=f["dtype"])
    if f.get("x_view"):  # the same values as a view into a wider buffer: row stride K + 16
        wide = torch.zeros(m, k + 16, device=dev, dtype=f["dtype"])
        wide[:, :k] = x
        x = wide[:, :k]
    return x, w_q.to(dev), scales.to(dev)


def _matmul_tolerance(x, w_q, scales, want) -> tuple[float, float]:
    """(atol, rtol): rounding of the output in x's dtype, plus what rounding the dequantised weights to
    x's dtype in registers moves the result (a kernel may keep them in float32 or round them)."""
    top = float(want.float().abs().max()) if want.numel() else 1.0
    if x.dtype == torch.float32:
        return 1e-5 * top, 1e-5
    n, k = w_q.shape
    deq = w_q.float() * scales.float().repeat_interleave(k // scales.shape[1], 1)  # (N, K)
    rounded = x.float() @ deq.to(x.dtype).float().T
    spread = float((rounded - x.float() @ deq.T).abs().max())
    rel = 2e-3 if x.dtype == torch.float16 else 1.6e-2  # two steps of the output's dtype
    return rel * top + spread, rel


def _matmul_mistakes(x, w_q, scales, f, got=None) -> dict[str, torch.Tensor]:
    n, k = w_q.shape
    group = k // scales.shape[1]
    out = {}
    if n == k and scales.shape[1] == 1:
        wrong = w_q.float() * scales.float().reshape(1, -1)  # the scale of input channel k, not output n
        out["each scale is applied along K (to input channel k) instead of to its output channel n (row of W)"] = (
            (x.float() @ wrong.T).to(x.dtype))
    deq = (w_q.float().reshape(n, k // group, group) * scales.float()[..., None]).reshape(n, k)
    out["the scales are not applied (raw codes multiplied)"] = (x.float() @ w_q.float().T).to(x.dtype)
    if scales.shape[1] > 1:
        wrong = w_q.float() * scales.float().repeat(1, group)
        out["the group index is wrong (scale k % G instead of k // group_size)"] = (x.float() @ wrong.T).to(x.dtype)
    if f.get("cancel") and x.dtype == torch.float16:
        out["the accumulator is float16: keep it float32 (tl.zeros(..., dtype=tl.float32)) and cast only the "
            "final result"] = _closest(got, [_fp16_accumulated(x, deq, b) for b in (16, 32, 64, 128, 256)])
    return out


def _closest(got, candidates: list[torch.Tensor]) -> torch.Tensor:
    """The candidate nearest to ``got`` (a mistake's result depends on the learner's BLOCK_K)."""
    if not isinstance(got, torch.Tensor) or got.shape != candidates[0].shape:
        return candidates[0]
    return min(candidates, key=lambda c: float((c.double() - got.detach().double().to(c.device)).abs().max()))


def _fp16_accumulated(x, deq, block_k: int = 64) -> torch.Tensor:
    """What a kernel accumulating in fp16 returns (rounded after every K tile of ``block_k``)."""
    acc = torch.zeros(x.shape[0], deq.shape[0], dtype=torch.float16)
    for k0 in range(0, x.shape[1], block_k):
        part = x[:, k0:k0 + block_k].float().cpu() @ deq[:, k0:k0 + block_k].half().float().T.cpu()
        acc = (acc.float() + part).half()
    return acc.to(x.device)


def _poison_freed_memory(shape, dtype, dev) -> None:
    """Free an output-sized tensor of NaN just before the learner's call. A kernel that leaves part of
    its ``torch.empty`` output unwritten (rows past one tile) reads stale memory there, and stale memory
    can hold the right numbers (a correct run of the same case freed earlier in the process, as in a
    test run): the allocator most likely hands these NaN bytes to the next output of this size instead."""
    poison = [torch.full(shape, float("nan"), dtype=dtype, device=dev) for _ in range(8)]  # freed chunks may merge
    del poison


@graded(points=25, bans=MATMUL_ANSWERS)
def check_int8_matmul(fn, checker):
    """``fn(x, w_q, scales)`` must return ``x @ dequantised(W).T`` from a Triton kernel."""
    dev = device()
    for f in _matmul_cases():
        group = f["group"] or f["K"]
        case = Case(M=f["M"], N=f["N"], K=f["K"], group_size=group if f["group"] else f"{group} (per channel)",
                    dtype=f["dtype"], seed=f["seed"], **({"partial_sums": "large, cancelling"} if f.get("cancel") else {}),
                    **({"x": "a column slice, row stride K + 16"} if f.get("x_view") else {}))
        x, w_q, scales = _matmul_inputs(f, dev)
        before = [t.clone() for t in (x, w_q, scales)]

        @functools.wraps(fn)  # failure messages name the learner's function
        def watched(*args):
            return peak_tensor_memory(fn, *args)

        _poison_freed_memory((f["M"], f["N"]), f["dtype"], dev)
        with triton_launches() as launches, torch_calls(MATMULS) as calls, _weights_in_torch(w_q) as codes:
            y, report = checker.call(watched, x, w_q, scales, case=case)
        if not all(torch.equal(t, b) for t, b in zip((x, w_q, scales), before)):
            checker.fail(case, "your function changed x, w_q or scales.", "never write into the inputs.")
        want = int8_matmul_spec(x, w_q, scales)
        atol, rtol = _matmul_tolerance(x, w_q, scales, want)
        hint = ("y[m, n] = sum over k of x[m, k] * w_q[n, k] * scales[n, k // group_size]; load each W tile as "
                "(BLOCK_K, BLOCK_N), scale it by its columns' scales, accumulate tl.dot in float32.")
        if f.get("cancel"):
            hint = ("this case's partial sums climb past 1,000 and cancel: accumulate in float32 "
                    "(tl.zeros(..., dtype=tl.float32)) and cast to x's dtype only when storing.")
        hint = f.get("hint", hint)
        checker.expect_tensor(y, want, case=case, atol=atol, rtol=rtol, what="output",
                              mistakes=_matmul_mistakes(x, w_q, scales, f, y), hint=hint)
        if launches.count == 0:
            checker.fail(case, "the result is right, but no Triton kernel was launched.", TRITON_HINT)
        checker.expect_kernel_work(case, launches, calls, {"y": y}, TRITON_HINT)
        n, k = w_q.shape
        if report.largest_numel >= n * k:
            checker.fail(case, f"your function created a float tensor of shape {report.largest_shape} "
                               f"({report.largest_numel:,} numbers, as many as W has weights).",
                         "the weights stay int8 in memory: the kernel loads int8 tiles and dequantises them in "
                         "registers. Dequantising W in torch first moves four times the bytes.")
        if codes.used is not None:
            name, dtype, shape = codes.used
            made = f"a {dtype} tensor of shape {shape}" if shape or dtype != "Python or NumPy values" else dtype
            checker.fail(case, f"your function computed with the int8 weights in torch: `{name}` made {made} "
                               f"from w_q (dequantising W in torch, even a slice at a time, or computing y in "
                               f"torch for a kernel to copy).",
                         "pass w_q to your kernel as it is; the kernel loads int8 tiles, converts and scales them "
                         "in registers, and multiplies them there.")
        if not codes.received(launches):
            checker.fail(case, "no Triton kernel you launched received w_q (or a tensor holding its codes).",
                         TRITON_HINT)


# --- the checks: GGUF's Q8_0 and Q4_1 blocks ------------------------------------------------------
#
# ``dequantize_q8_0(raw)`` and ``dequantize_q4_1(raw)`` (labsupport.gguf_blocks states the formats):
# ``raw`` is a tensor's bytes as gguf.GGUFReader maps them, uint8 (rows, bytes per row); the result is
# float32 (rows, weights per row). The reference is the gguf package's own reading of the same bytes,
# on real rows of the shipped SmolLM2 file (its Q8_0 token embedding, Q4_1 projections of the first
# and last layers) and on blocks written here: negative scales, a zero and a subnormal scale, every
# code from the smallest to the largest, several rows of several blocks whose last block differs.

GGUF_ANSWERS = (dequantize_q8_0, dequantize_q4_1)
GGUF_REAL_ROWS = {  # tensor -> rows read from the shipped file
    "Q8_0": (("token_embd.weight", (0, 1, 2, 1000, 49151)),),
    "Q4_1": (("blk.0.attn_q.weight", (0, 1, 575)), ("blk.29.ffn_down.weight", (0, 288, 575))),
}
GGUF_HINTS = {
    "Q8_0": "a Q8_0 block is 34 bytes: a little-endian float16 scale d (bytes 0-1, read with .view(torch.float16)), "
            "then 32 signed int8 codes q (.view(torch.int8)); weight i = d * q[i]. A row is several blocks.",
    "Q4_1": "a Q4_1 block is 20 bytes: float16 d, float16 m, then 16 bytes of 4-bit codes; byte j holds weight j "
            "in its low nibble (& 0xF) and weight j + 16 in its high nibble (>> 4); weight i = d * q[i] + m.",
}


def _f16_bytes(values) -> torch.Tensor:
    """float16 numbers -> their little-endian bytes, (n, 2) uint8."""
    return torch.tensor(values, dtype=torch.float16).view(torch.uint8).reshape(-1, 2)


def _made_q8_0() -> torch.Tensor:
    """3 rows of 4 blocks: negative, zero, subnormal and large scales; codes -128 .. 127."""
    gen = torch.Generator().manual_seed(9)
    scales = [[-0.5, 0.0078125, 2.0 ** -20, 3.25], [1.0, -1.5, 0.0, 0.001], [0.125, 0.25, -0.0625, 7.0]]
    rows = []
    for r, row_scales in enumerate(scales):
        blocks = []
        for b, d in enumerate(row_scales):
            codes = torch.randint(-128, 128, (32,), generator=gen, dtype=torch.int16).to(torch.int8)
            if r == 0 and b == 0:
                codes = torch.arange(-128, 128, 8, dtype=torch.int16).to(torch.int8)  # the extremes included
            blocks.append(torch.cat([_f16_bytes([d])[0], codes.view(torch.uint8)]))
        rows.append(torch.cat(blocks))
    return torch.stack(rows)  # (3, 4 * 34)


def _made_q4_1() -> torch.Tensor:
    """3 rows of 5 blocks: negative minima, a negative scale, every nibble 0x0 .. 0xF in both halves."""
    gen = torch.Generator().manual_seed(4)
    params = [[(0.1, -0.75), (0.02, -0.15), (-0.05, 0.4), (0.5, 0.0), (0.003, 1.5)],
              [(0.25, -2.0), (0.0, 0.3), (1.0, -7.5), (0.125, -1.0), (0.07, -0.5)],
              [(0.01, 0.0), (0.3, -2.2), (0.2, 1.0), (-0.4, 3.0), (0.0625, -0.5)]]
    rows = []
    for r, row in enumerate(params):
        blocks = []
        for b, (d, m) in enumerate(row):
            qs = torch.randint(0, 256, (16,), generator=gen, dtype=torch.int16).to(torch.uint8)
            if r == 0 and b == 0:  # low nibbles 0..15, high nibbles 15..0: weights 0..15 and 16..31 differ
                qs = (torch.arange(16, dtype=torch.int16) | ((15 - torch.arange(16, dtype=torch.int16)) << 4))
                qs = qs.to(torch.uint8)
            blocks.append(torch.cat([_f16_bytes([d, m]).reshape(-1), qs]))
        rows.append(torch.cat(blocks))
    return torch.stack(rows)  # (3, 5 * 20)


@functools.lru_cache(maxsize=1)
def _real_rows() -> dict:
    """Raw rows of the shipped model file, by type: ``{kind: [(label, raw)]}`` (read once per process)."""
    from ..checkpoints import CheckpointError, registered_path
    from ..gguf_blocks import gguf_rows

    try:
        path = registered_path("smollm2-135m-instruct")
    except CheckpointError as exc:
        return {"missing": str(exc)}
    out: dict = {}
    for kind, tensors in GGUF_REAL_ROWS.items():
        for name, rows in tensors:
            raw, stored = gguf_rows(path, name, rows)
            if stored != kind:
                raise RuntimeError(f"{path.name}: {name} is stored as {stored}, the check expected {kind}")
            out.setdefault(kind, []).append((f"{path.name}: {name}, rows {list(rows)}", raw))
    return out


def _gguf_mistakes(raw: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """What the usual mistakes make of ``raw``: description -> float32 (rows, weights)."""
    b = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[kind])
    f16 = lambda two: two.contiguous().view(torch.float16)[..., 0].float()  # noqa: E731
    swapped = lambda two: f16(two.flip(-1))  # noqa: E731  (the two bytes in the other order)
    flat = lambda t: t.reshape(raw.shape[0], -1)  # noqa: E731
    if kind == "Q8_0":
        d, q = f16(b[..., 0:2]), b[..., 2:].contiguous().view(torch.int8).float()
        return {
            "the codes are read as unsigned bytes (0 .. 255) instead of signed int8 (-128 .. 127): "
            "use .view(torch.int8)": flat(d[..., None] * b[..., 2:].float()),
            "the float16 scale is read with its two bytes swapped (big-endian); GGUF is little-endian":
                flat(swapped(b[..., 0:2])[..., None] * q),
            "the scale's sign is lost (|d| instead of d)": flat(d.abs()[..., None] * q),
            "every block uses the first block's scale instead of its own": flat(d[:, :1, None] * q),
        }
    d, m = f16(b[..., 0:2]), f16(b[..., 2:4])
    qs = b[..., 4:].to(torch.int16)
    blocked = torch.cat([qs & 0xF, qs >> 4], -1).float()  # (rows, blocks, 32): the right order
    interleaved = torch.stack([qs & 0xF, qs >> 4], -1).reshape(*qs.shape[:-1], 32).float()
    high_first = torch.cat([qs >> 4, qs & 0xF], -1).float()
    return {
        "the nibbles are interleaved (weight 2j in the low nibble of byte j, 2j + 1 in its high nibble, as in "
        "exercise 1's int4 packing); in Q4_1 byte j holds weight j (low nibble) and weight j + 16 (high nibble)":
            flat(d[..., None] * interleaved + m[..., None]),
        "the high nibbles are taken first (weights 0-15 from bits 4-7); the low nibbles are weights 0-15":
            flat(d[..., None] * high_first + m[..., None]),
        "the minimum m is not added (Q4_1's grid starts at m, not at 0)": flat(d[..., None] * blocked),
        "the codes are centred as in Q4_0 (q - 8); Q4_1's codes are unsigned and the minimum m does the shifting":
            flat(d[..., None] * (blocked - 8) + m[..., None]),
        "d and m are swapped: the scale d is the block's first float16, the minimum m its second":
            flat(m[..., None] * blocked + d[..., None]),
        "m is subtracted instead of added": flat(d[..., None] * blocked - m[..., None]),
        "the float16 numbers are read with their two bytes swapped (big-endian); GGUF is little-endian":
            flat(swapped(b[..., 0:2])[..., None] * blocked + swapped(b[..., 2:4])[..., None]),
    }


def _check_gguf(fn, checker, kind: str) -> None:
    from ..gguf_blocks import reference_dequantize

    real = _real_rows()
    if "missing" in real:
        checker.fail(Case(model_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
                     f"this check reads real blocks from the course's model file, which is not installed "
                     f"({real['missing']}).",
                     "run `from labsupport.checkpoints import install_model; install_model()` (the lab's cell "
                     "after the setup does), then this check again.")
    made = _made_q8_0() if kind == "Q8_0" else _made_q4_1()
    cases = [*real[kind], (f"blocks written here: {made.shape[0]} rows of {made.shape[1] // BLOCK_BYTES[kind]} "
                           f"blocks, negative and zero scales{', negative minima' if kind == 'Q4_1' else ''}", made)]
    for label, raw in cases:
        case = Case(type=kind, raw=f"uint8 {tuple(raw.shape)}", source=label)
        before = raw.clone()
        got = checker.call(fn, raw, case=case)
        if not torch.equal(raw, before):
            checker.fail(case, "your function changed raw.", "never write into the input; work on a copy.")
        want = reference_dequantize(raw, kind)
        if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
            checker.fail(case, f"the weights are {str(got.dtype).replace('torch.', '')}, expected float32.",
                         "compute in float32: convert d, m and the codes with .float() before multiplying.")
        atol = 1e-6 * float(want.abs().max().clamp(min=1e-30))
        mistakes = _gguf_mistakes(raw, kind)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and not bool(torch.isfinite(got).all()):
            # bytes read in the wrong order can spell NaN or inf: name the mistake before the NaN
            for description, wrong in mistakes.items():
                if torch.allclose(got.double(), wrong.double(), atol=atol, rtol=1e-6, equal_nan=True):
                    checker.fail(case, f"the dequantised {kind} weights hold NaN or inf where the gguf package "
                                       f"reads finite numbers: they match what we get when {description}.",
                                 GGUF_HINTS[kind])
        checker.expect_tensor(got, want, case=case, atol=atol, rtol=1e-6, what=f"dequantised {kind} weights",
                              mistakes=mistakes, hint=GGUF_HINTS[kind])



@graded(points=5, bans=GGUF_ANSWERS)
def check_dequantize_q8_0(fn, checker):
    """``fn(raw)`` must read Q8_0 blocks as the gguf package does: raw uint8 (rows, 34 * blocks) ->
    float32 (rows, 32 * blocks), weight i of a block = d * q[i]."""
    _check_gguf(fn, checker, "Q8_0")


@graded(points=5, bans=GGUF_ANSWERS)
def check_dequantize_q4_1(fn, checker):
    """``fn(raw)`` must read Q4_1 blocks as the gguf package does: raw uint8 (rows, 20 * blocks) ->
    float32 (rows, 32 * blocks), weight i = d * q[i] + m, byte j holding weights j and j + 16."""
    _check_gguf(fn, checker, "Q4_1")
