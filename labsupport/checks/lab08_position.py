"""Checks for the position lab: RoPE in both layouts, Llama 3.1's scaled frequencies, and a fused
Triton kernel that rotates q and k in one launch.

The three functions a learner writes, and how the checks call them:

* ``apply_rope(x, positions, theta, layout) -> tensor``: ``x`` is ``(B, H, S, D)``, ``positions``
  ``(S,)`` int64, ``layout`` ``"halves"`` or ``"interleaved"``; returns ``x``'s shape and dtype.
* ``llama3_inv_freq(head_dim, theta, scaling) -> tensor``: ``scaling`` a Hugging Face
  ``rope_scaling`` dict of type ``"llama3"``; returns the ``(head_dim // 2,)`` inverse frequencies
  (float32: the fused kernel of exercise 4 reads them as float32; compute in float64 if you like and
  cast at the end).
* ``fused_rope(q, k, positions, inv_freq) -> (q_rot, k_rot)``: ``q`` ``(B, H, S, D)``, ``k``
  ``(B, Hkv, S, D)`` (grouped-query: fewer key heads), ``positions`` ``(S,)`` int64, ``inv_freq``
  ``(D/2,)`` float32; halves layout; one Triton launch writes both results (in place or not).

Cases are chosen to expose the usual mistakes: positions that do not start at 0 and are not in
order (decode, a shuffled batch), a position past Llama 3.1's original 8,192, lengths of 1 and
lengths that are not multiples of any block, head counts that are not powers of two, float32 and
float16 (bfloat16 too in the torch exercises, and on a GPU that has it in the kernel).
"""

from __future__ import annotations

import math

import torch

from ..device import cuda_available, device, gpu_has_bf16, interpreter_mode
from ..interpreter_bytes import OTHER, count_bytes
from ..position import (
    LLAMA3_THETA,
    LLAMA31_ROPE_SCALING,
    ROFORMER_THETA,
    apply_rope_reference,
    default_inv_freq,
    llama3_inv_freq,
    rope_cos_sin,
    rope_inv_freq,
    rotate,
)
from ..transformer import apply_rope as model_apply_rope
from ._guard import guarded_memory, touched_names
from .framework import Case, graded, torch_calls, triton_launches

# The course's RoPE, whole or in parts: a learner's rotation may not be, wrap or call any of them
ROPE_ANSWERS = (apply_rope_reference, rotate, model_apply_rope)
# torch functions that compute the rotation: the fused kernel's wrapper may allocate, reshape and
# make contiguous, but the kernel computes the angles and the rotation
COMPUTES = ("cos", "sin", "cos_", "sin_", "mul", "__mul__", "__rmul__", "mul_", "einsum", "outer", "polar",
            "view_as_complex", "addcmul", "matmul", "__matmul__")
ROPE_HINT = ("pair i turns by positions * theta ** (-2i / D); in the halves layout pair i is (x[i], x[i + D/2]), "
             "in the interleaved layout (x[2i], x[2i + 1]); rotate as (a cos - b sin, a sin + b cos).")
TRITON_HINT = ("this exercise is the Triton kernel: launch fused_rope_kernel[grid](...) once from your wrapper, "
               "let it write both results, and return them.")

# Llama 3.2 1B and 3B ship the same rule with factor 32 (config.json of meta-llama/Llama-3.2-1B)
LLAMA32_ROPE_SCALING = {**LLAMA31_ROPE_SCALING, "factor": 32.0}


# --- exercise 1: apply_rope ----------------------------------------------------------------------


def _rope_variant(x, positions, theta, layout, *, exponent="2i/D", shift=0, swap_layout=False, sign=1.0):
    """RoPE with one deliberate change, in float64 angles (what each mistake computes)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    power = {"2i/D": 2 * i / d, "i/D": i / d, "i/(D/2)/2": i / (d // 2), "2i/D, not inverted": -2 * i / d}[exponent]
    inv_freq = (1.0 / theta ** power).float()
    cos, sin = rope_cos_sin(positions + shift, inv_freq.to(x.device))
    other = {"halves": "interleaved", "interleaved": "halves"}[layout] if swap_layout else layout
    return rotate(x, cos, sign * sin, other)


def _rope_mistakes(x, positions, theta, layout):
    return {
        f"the pairs are taken in the {'interleaved' if layout == 'halves' else 'halves'} layout instead of "
        f"the {layout} one": _rope_variant(x, positions, theta, layout, swap_layout=True),
        "the exponent is i / D instead of 2i / D (theta applied per feature index, not per pair)":
            _rope_variant(x, positions, theta, layout, exponent="i/D"),
        "the frequencies are theta ** (2i / D), not its inverse": _rope_variant(
            x, positions, theta, layout, exponent="2i/D, not inverted"),
        "the positions are shifted by one (position + 1)": _rope_variant(x, positions, theta, layout, shift=1),
        "the positions are shifted by one (position - 1)": _rope_variant(x, positions, theta, layout, shift=-1),
        "the rotation turns the wrong way (the sign of sin is flipped)": _rope_variant(
            x, positions, theta, layout, sign=-1.0),
    }


def _rope_tolerance(dtype, max_position: int) -> tuple[float, float]:
    # float32 angles at position p are rounded by about p * 6e-8 radians: allow for a learner who
    # computes them in float64 (or the other way round)
    angle = max(1, max_position) * 1.2e-7
    if dtype == torch.float32:
        return 1e-5 + 4 * angle, 1e-5
    if dtype == torch.float16:
        return 4e-3 + 4 * angle, 4e-3
    return 3e-2 + 4 * angle, 1.6e-2  # bfloat16


def _positions(kind: str, s: int, gen) -> torch.Tensor:
    if kind == "from 0":
        return torch.arange(s)
    if kind == "decode":  # continuing a sequence of 1000 tokens
        return 1000 + torch.arange(s)
    if kind == "past 8192":  # odd, so a position rounded through float16 (spacing 8 there) shows
        return 9001 + torch.arange(s)
    return torch.randperm(4 * s, generator=gen)[:s]  # "shuffled": any positions, in any order


@graded(points=4, bans=ROPE_ANSWERS + (default_inv_freq,))
def check_apply_rope(fn, checker):
    """``fn(x, positions, theta, layout)`` must rotate ``x`` (B, H, S, D) like RoPE in that layout."""
    plan = [
        dict(B=1, H=1, S=1, D=2, theta=ROFORMER_THETA, positions="from 0", dtype=torch.float32),
        dict(B=1, H=2, S=5, D=8, theta=ROFORMER_THETA, positions="from 0", dtype=torch.float32),
        dict(B=2, H=3, S=17, D=64, theta=ROFORMER_THETA, positions="shuffled", dtype=torch.float32),
        dict(B=1, H=2, S=7, D=128, theta=LLAMA3_THETA, positions="decode", dtype=torch.float32),
        dict(B=1, H=2, S=3, D=128, theta=LLAMA3_THETA, positions="past 8192", dtype=torch.float32),
        dict(B=2, H=2, S=9, D=32, theta=ROFORMER_THETA, positions="shuffled", dtype=torch.float16),
        dict(B=2, H=2, S=9, D=64, theta=LLAMA3_THETA, positions="decode", dtype=torch.bfloat16),
    ]
    seed = 0
    for layout in ("halves", "interleaved"):
        for fields in plan:
            seed += 1
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(fields["B"], fields["H"], fields["S"], fields["D"], generator=gen).to(fields["dtype"])
            positions = _positions(fields["positions"], fields["S"], gen)
            case = Case(**{k: fields[k] for k in ("B", "H", "S", "D", "dtype")}, theta=fields["theta"],
                        layout=layout, positions=f"{fields['positions']} ({positions[:4].tolist()}...)")
            given = x.clone()
            got = checker.call(fn, given, positions.clone(), fields["theta"], layout, case=case)
            want = apply_rope_reference.__wrapped__(x, positions, fields["theta"], layout)
            if not torch.equal(given, x):
                checker.fail(case, "your function changed its input x in place.",
                             "return a new tensor; leave x as it was (the check reuses it).")
            atol, rtol = _rope_tolerance(fields["dtype"], int(positions.max()))
            mistakes = {d: w for d, w in _rope_mistakes(x, positions, fields["theta"], layout).items()
                        if not torch.allclose(w.double(), want.double(), atol=atol, rtol=rtol)}
            checker.expect_tensor(got, want, case=case, atol=atol, rtol=rtol, what="rotated x", hint=ROPE_HINT,
                                  mistakes=mistakes)


# --- exercise 3: llama3_inv_freq -----------------------------------------------------------------

LLAMA3_HINT = ("with L = original_max_position_embeddings and wavelength = 2 pi / inv_freq: keep pairs whose "
               "wavelength is below L / high_freq_factor, divide by factor those above L / low_freq_factor, and "
               "in between blend: s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor), "
               "inv_freq * ((1 - s) / factor + s).")


def _llama3_variant(head_dim, theta, scaling, *, mistake: str) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    inv_freq = default_inv_freq(head_dim, theta).double()
    wavelength = (1 if mistake == "no 2 pi" else 2 * math.pi) / inv_freq
    low_wl, high_wl = original / low, original / high
    long = wavelength > low_wl
    short = wavelength < high_wl
    if mistake == "inverted":  # the factor applied to the fast pairs instead of the slow ones
        long, short = short, long
    smooth = (original / wavelength - low) / (high - low)
    if mistake == "smooth reversed":
        smooth = 1 - smooth
    middle = inv_freq * ((1 - smooth) / factor + smooth)
    if mistake == "no blend":
        middle = inv_freq
    if mistake == "all divided":
        return inv_freq / factor
    return torch.where(long, inv_freq / factor, torch.where(short, inv_freq, middle))


LLAMA3_MISTAKES = {
    "every frequency is divided by factor (position interpolation, not Llama 3.1's rule)": "all divided",
    "the middle band is not blended (its frequencies are left unscaled)": "no blend",
    "the factor is applied to the fast (short-wavelength) pairs instead of the slow ones": "inverted",
    "the wavelength is 1 / inv_freq, without the 2 pi": "no 2 pi",
    "the blend runs the wrong way ((1 - s) and s swapped)": "smooth reversed",
}


@graded(points=3, bans=(llama3_inv_freq,))  # rope_inv_freq reaches it, so it is refused too
def check_llama3_inv_freq(fn, checker):
    """``fn(head_dim, theta, scaling)`` must return Llama 3.1's scaled inverse frequencies (D/2,)."""
    configs = [
        ("Llama 3.1 (config.json)", 128, LLAMA3_THETA, LLAMA31_ROPE_SCALING),
        ("Llama 3.2 1B/3B (factor 32)", 64, LLAMA3_THETA, LLAMA32_ROPE_SCALING),
        ("RoFormer base, head_dim 64", 64, ROFORMER_THETA, LLAMA31_ROPE_SCALING),
        ("made-up: factor 4, low 2, high 8, original 4096", 96, 250_000.0,
         {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 4096}),
        ("made-up: small head, original 512", 16, ROFORMER_THETA,
         {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
          "original_max_position_embeddings": 512}),
    ]
    for name, head_dim, theta, scaling in configs:
        case = Case(config=name, head_dim=head_dim, theta=theta, scaling=dict(scaling))
        got = checker.call(fn, head_dim, theta, dict(scaling), case=case)
        want = llama3_inv_freq.__wrapped__(head_dim, theta, scaling)
        if isinstance(got, torch.Tensor) and got.dtype == torch.float64:
            checker.fail(case, "the frequencies have dtype torch.float64, expected float32: the fused kernel of "
                               "exercise 4 takes inv_freq as a float32 pointer and would read these bytes as "
                               "other numbers.",
                         "computing in float64 is fine; return `.float()` of the result.")
        if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
            checker.fail(case, f"the frequencies have dtype {got.dtype}, expected float32.",
                         "compute in floating point: make the exponents floats before dividing by head_dim.")
        mistakes = {}
        for description, mistake in LLAMA3_MISTAKES.items():
            wrong = _llama3_variant(head_dim, theta, scaling, mistake=mistake)
            if not torch.allclose(wrong, want.double(), rtol=1e-5, atol=0):
                mistakes[description] = wrong
        got = got.double() if isinstance(got, torch.Tensor) and got.is_floating_point() else got
        checker.expect_tensor(got, want.double(), case=case, atol=0, rtol=1e-5, what="inverse frequencies",
                              hint=LLAMA3_HINT, mistakes=mistakes)


# --- exercise 4: the fused Triton kernel ---------------------------------------------------------


def _gpu_compiles() -> bool:
    return cuda_available() and not interpreter_mode()


def _kernel_dtypes():
    dtypes = [torch.float32, torch.float16]
    if _gpu_compiles() and gpu_has_bf16():  # bf16 arithmetic is broken in Triton's interpreter
        dtypes.append(torch.bfloat16)
    return dtypes


def _token_positions(kind: str, b: int, s: int, gen) -> torch.Tensor:
    """(B * S,) int64, one position per token, sequence after sequence (token ``s`` of sequence ``b``
    at ``b * S + s``). Every sequence of a batch has positions of its own, as the requests of a real
    batch do, so a kernel that rotates every sequence at the first one's positions fails whenever
    B > 1."""
    rows = []
    for i in range(b):
        if kind == "from 0":
            rows.append(torch.arange(s))
        elif kind == "resumed":  # chunks of prompts, each resuming where its own cache ends
            rows.append(5 + 35 * i + torch.arange(s))
        elif kind == "decode":  # continuing sequences of 1000, 1500, ... tokens
            rows.append(1000 + 500 * i + torch.arange(s))
        elif kind == "past 8192":  # odd, so a position rounded through float16 (spacing 8 there) shows
            rows.append(9001 + 1000 * i + torch.arange(s))
        else:  # "shuffled": any positions, in any order, different in each sequence
            rows.append(torch.randperm(4 * s, generator=gen)[:s])
    return torch.cat(rows)


def _kernel_cases() -> list[dict]:
    plan = [
        dict(B=1, H=1, Hkv=1, S=1, D=16, positions="from 0", freq="default"),
        dict(B=2, H=4, Hkv=2, S=17, D=32, positions="resumed", freq="default"),
        dict(B=1, H=6, Hkv=2, S=100, D=64, positions="decode", freq="default"),
        dict(B=2, H=3, Hkv=3, S=37, D=128, positions="shuffled", freq="llama3.1"),
        dict(B=3, H=5, Hkv=1, S=1, D=64, positions="past 8192", freq="llama3.1"),
    ]
    cases = []
    seed = 100
    for dtype in _kernel_dtypes():
        for fields in plan:
            seed += 1
            cases.append({**fields, "dtype": dtype, "seed": seed})
    return cases


def _diagnose_kernel(got_q, got_k, want_q, want_k, q_in, k_in, atol, rtol) -> str:
    """A plain-words guess at what went wrong, from where the errors are."""
    if isinstance(got_k, torch.Tensor) and got_k.shape == k_in.shape and torch.equal(got_k.cpu(), k_in.cpu()) \
            and not torch.equal(want_k.cpu(), k_in.cpu()):
        return "k came back unrotated: the kernel must rotate the keys as well as the queries (both in one launch)."
    hints = []
    for name, got, want, given in (("q", got_q, want_q, q_in), ("k", got_k, want_k, k_in)):
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape):
            continue
        bad = ~torch.isclose(got.double().cpu(), want.double().cpu(), atol=atol, rtol=rtol)  # (B, H, S, D)
        if not bool(bad.any()):
            continue
        g = got.detach().double().cpu()
        # never written: still 0 (zeros_like), NaN (empty_like, in the check) or the input (in place)
        unwritten = (g == 0) | g.isnan() | (g == given.detach().double().cpu())
        by_sequence = bad.any(dim=(1, 2, 3))  # (B,)
        if len(by_sequence) > 1 and not bool(by_sequence[0]) and bool(unwritten[bad].all()):
            hints.append(f"{name} is right for sequence 0 and never written for sequences "
                         f"{by_sequence.nonzero().flatten().tolist()}: the grid must cover every sequence of the "
                         f"batch (a grid axis of B programs, tl.program_id(1) = b, and b's data at b * H * S * D).")
            continue
        if len(by_sequence) > 1 and not bool(by_sequence[0]):
            hints.append(f"{name} is right for sequence 0 and wrong for sequences "
                         f"{by_sequence.nonzero().flatten().tolist()}: each sequence has its own positions; read "
                         f"sequence b's from positions[b * S:(b + 1) * S], not the first S for every sequence.")
            continue
        by_position = bad.any(dim=(0, 1, 3))  # (S,)
        by_head = bad.any(dim=(0, 2, 3))  # (H,)
        first = int(by_position.nonzero()[0])
        if bool(by_position[first:].all()) and bool(by_head.all()) and not bool(unwritten[bad].all()):
            if first == 0:
                hints.append(f"{name} is wrong at every position (and the kernel did write there, so the grid and "
                             f"the mask are not what is missing): check the angle positions * inv_freq (in "
                             f"float32, with each token's own position), the pairs (i, i + D/2) of the halves "
                             f"layout, the rotation's signs, and that the grid covers every sequence of the batch.")
                continue
        if bool(by_position[first:].all()) and bool(by_head.all()):
            hints.append(f"{name} is wrong at every position from index {first} on (the last {len(by_position) - first} "
                         f"of S = {len(by_position)}){' and right before it' if first else ''}: the grid or the mask drops the last positions "
                         f"(launch cdiv(S, BLOCK_S) programs and mask with offs < S, so a partial last block is "
                         f"processed too).")
        elif not bool(by_head.all()):
            heads = by_head.nonzero().flatten().tolist()
            hints.append(f"{name} is wrong only for heads {heads}: check the loop or mask over {name}'s heads "
                         f"(q has H heads, k has Hkv).")
    return " ".join(hints)


def _per_token_cos_sin(positions, inv_freq, b, s):
    """cos and sin of per-token positions (B * S,), shaped (B, 1, S, D/2) to broadcast over heads."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    return cos.view(b, 1, s, -1), sin.view(b, 1, s, -1)


def _kernel_mistakes(q, k, positions, inv_freq):
    b, s = q.shape[0], q.shape[2]
    mistakes = {}
    for description, kwargs in (
        ("the pairs are taken interleaved instead of in halves", dict(layout="interleaved")),
        ("the positions are shifted by one (position + 1)", dict(shift=1)),
        ("the index within the sequence is used instead of the positions tensor", dict(index=True)),
        ("every sequence is rotated at the first sequence's positions (positions shared by the batch): each "
         "sequence has its own, token s of sequence b at positions[b * S + s]", dict(shared=True)),
    ):
        if kwargs.get("index"):
            pos = torch.arange(s, device=positions.device).repeat(b)
        elif kwargs.get("shared"):
            pos = positions[:s].repeat(b)
        else:
            pos = positions + kwargs.get("shift", 0)
        cos, sin = _per_token_cos_sin(pos, inv_freq, b, s)
        layout = kwargs.get("layout", "halves")
        mistakes[description] = (rotate(q, cos, sin, layout), rotate(k, cos, sin, layout))
    return mistakes


BOUNDS_HINT = ("mask every load and store with the rows that exist (offs_s < S), loop over each tensor's own "
               "heads (q has H, k has Hkv: fewer), and compute each head's base from its own tensor's head count "
               "(k's (batch, head) base is (b * Hkv + h) * S * D).")


def _expect_within_bounds(checker, case, guard, counted) -> None:
    """Fail when the kernel wrote into the guard space around a tensor, or (counted in the interpreter)
    loaded or stored outside every tensor it was given."""
    touched = guard.touched()
    if touched:
        names = touched_names(touched)
        checker.fail(case, f"your kernel wrote outside {names}: past the end (or before the start) of the tensor. "
                           f"On a GPU that silently corrupts other tensors; in the interpreter it can crash Python.",
                     BOUNDS_HINT)
    outside = counted.by_argument.get(OTHER) if counted is not None else None
    if outside is not None and (outside.stored or outside.loaded):
        what = " and ".join(f"{verb} {n:,} bytes" for verb, n in (("stored", outside.stored),
                                                                   ("loaded", outside.loaded)) if n)
        checker.fail(case, f"your kernel {what} outside every tensor it was given (counted in the interpreter): "
                           f"past the end of q, k, positions, inv_freq or the outputs.", BOUNDS_HINT)


@graded(points=5, bans=ROPE_ANSWERS)
def check_fused_rope(fn, checker):
    """``fn(q, k, positions, inv_freq)`` must return (q, k) rotated (halves layout), written by one
    Triton launch; ``positions`` is (B * S,), one per token, sequence after sequence, and differs
    from one sequence of the batch to the next."""
    dev = device()
    for fields in _kernel_cases():
        gen = torch.Generator().manual_seed(fields["seed"])
        b, h, hkv, s, d, dtype = (fields[k] for k in ("B", "H", "Hkv", "S", "D", "dtype"))
        q = torch.randn(b, h, s, d, generator=gen).to(dtype=dtype, device=dev)
        k = torch.randn(b, hkv, s, d, generator=gen).to(dtype=dtype, device=dev)
        positions = _token_positions(fields["positions"], b, s, gen).to(dev)
        scaling = LLAMA31_ROPE_SCALING if fields["freq"] == "llama3.1" else None
        inv_freq = rope_inv_freq(d, LLAMA3_THETA, scaling).to(dev)
        starts = ", ".join(f"sequence {i}: {positions[i * s:i * s + min(s, 3)].tolist()}" for i in range(b))
        case = Case(B=b, H=h, Hkv=hkv, S=s, D=d, dtype=dtype, inv_freq=fields["freq"],
                    positions=f"{fields['positions']} ({starts}...)")
        cos, sin = _per_token_cos_sin(positions, inv_freq, b, s)
        want_q, want_k = rotate(q, cos, sin), rotate(k, cos, sin)
        # copies in guard space (see _guard): a kernel that reads or writes past a tensor fails with a
        # message instead of crashing Python
        guard = guarded_memory(nan_empty=True)
        q_in, k_in = guard.guard(q, "q"), guard.guard(k, "k")
        pos_in, freq_in = guard.guard(positions, "positions"), guard.guard(inv_freq, "inv_freq")
        launched = counted = None
        with triton_launches() as launches, torch_calls(COMPUTES) as calls, guard:
            if interpreter_mode():
                with count_bytes() as counted:
                    result = checker.call(fn, q_in, k_in, pos_in, freq_in, case=case)
                launched = counted.launches
            else:
                result = checker.call(fn, q_in, k_in, pos_in, freq_in, case=case)
        _expect_within_bounds(checker, case, guard, counted)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            checker.fail(case, f"your function returned a {type(result).__name__}, expected a pair (q_rot, k_rot).",
                         "return q_rot, k_rot.")
        got_q, got_k = result
        if dtype == torch.float32:
            atol, rtol = 2e-5, 2e-5
        elif dtype == torch.float16:
            atol, rtol = 4e-3, 4e-3
        else:
            atol, rtol = 3e-2, 1.6e-2
        mistakes = _kernel_mistakes(q, k, positions, inv_freq)
        for name, got, want, i in (("rotated q", got_q, want_q, 0), ("rotated k", got_k, want_k, 1)):
            if isinstance(got, torch.Tensor) and got.shape == want.shape and not torch.allclose(
                    got.double(), want.double(), atol=atol, rtol=rtol):
                hint = _diagnose_kernel(got_q, got_k, want_q, want_k, q, k, atol, rtol) or TRITON_HINT
            else:
                hint = TRITON_HINT
            checker.expect_tensor(got, want, case=case, atol=atol, rtol=rtol, what=name, hint=hint,
                                  mistakes={d: pair[i] for d, pair in mistakes.items()
                                            if not torch.allclose(pair[i].double(), want.double(), atol=atol,
                                                                  rtol=rtol)})
        checker.expect_kernel_work(case, launches, calls, {"q_rot": got_q, "k_rot": got_k}, TRITON_HINT)
        if launched is not None and launched != 1:
            checker.fail(case, f"your function launched {launched} Triton kernels; this exercise fuses q and k "
                               f"into one launch.", "rotate q and k in the same kernel: one grid, one launch.")
