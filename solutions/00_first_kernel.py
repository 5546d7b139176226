# Lab 00 source of truth. Edit this file, then run `python -m labsupport release` to regenerate
# labs/00_first_kernel.ipynb (learners) and solutions/00_first_kernel.ipynb (instructors).

# %% [markdown]
# # Lab 00: your environment and a first Triton kernel
#
# In this lab you will
#
# 1. check where your code runs (a GPU, or Triton's interpreter on the CPU);
# 2. take your device's first two measurements: how many FLOP/s a matrix multiply reaches, and
#    how many bytes per second a copy moves. Every later lab compares against these two numbers;
# 3. write a Triton kernel that adds two vectors of any length, and have it graded.
#
# Run the cells from top to bottom. Cells that say **Exercise** are yours to complete; the cell
# after each one checks your work and tells you precisely what is wrong if something is.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. This lab takes its
# measurements (section 1) before the exercise, so a first Run All already gives you your device's
# numbers.
#
# *Where to run it:* in the book, the rocket button at the top of the page opens this notebook in
# Colab (pick a GPU runtime). On your own Linux machine, run `make lab` in the course repository:
# it installs everything and opens JupyterLab on `my-labs/`, your own copy of the labs.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %% [markdown]
# The banner tells you three things. **device** is where tensors live. **kernels** says whether
# Triton compiles your kernels for a GPU or runs them in its *interpreter*, a Python emulation
# that needs no GPU: results are exact, but it is thousands of times slower, so any timing of a
# Triton kernel taken there says nothing about performance. **sizes** is the problem-size preset
# the labs use: small on a CPU, real on a GPU.

# %%
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from tqdm.auto import tqdm

from labsupport import ledger
from labsupport.checks import check_vector_add
from labsupport.costs import matmul_flops
from labsupport.device import device
from labsupport.hardware import match_device_name
from labsupport.phases import cpu_threads
from labsupport.timing import benchmark

DEVICE = device()
# On a CPU, time with one thread: on a small machine shared with other work, threads that wait for
# a busy core make timings erratic. On a GPU this does nothing.
THREADS = settings.pick(small=1, full=None)

# %% [markdown]
# ## 1. Your device's first two numbers
#
# Two measurements frame the whole course:
#
# * **Compute**: how many floating-point operations per second a large matrix multiply reaches.
#   Multiplying an $(n \times n)$ matrix by another costs $2n^3$ FLOPs (a multiply and an add
#   for each of $n$ terms of $n^2$ outputs).
# * **Bandwidth**: how many bytes per second a plain copy moves. Copying $b$ bytes reads $b$ and
#   writes $b$, so it moves $2b$.
#
# Prefill lives near the first number, decode near the second. The sweeps below use
# `labsupport.timing.benchmark`, which on a GPU warms up, synchronises and flushes the L2 cache
# between repetitions. On a CPU it uses a wall clock, calls the operation for at least 0.2 s, and
# compares five consecutive rounds of calls: when they disagree by more than half (another program
# took the cores for a while), the printed timing says **UNSTABLE**, and that point should be
# measured again on a quiet machine. Both report the median.

# %%
matmul_sizes = settings.pick(small=[64, 128, 256, 512], full=[512, 1024, 2048, 4096, 8192])
if DEVICE.type == "cpu":
    matmul_dtype = torch.float32
elif torch.cuda.get_device_capability()[0] >= 8:  # Ampere and newer have bf16 tensor cores
    matmul_dtype = torch.bfloat16
else:  # older GPUs such as the T4: fp16 is what their tensor cores (and datasheets) use
    matmul_dtype = torch.float16

matmul_tflops = []
unstable = 0
with cpu_threads(THREADS):
    for n in tqdm(matmul_sizes, desc="matmul sweep"):
        a = torch.randn(n, n, device=DEVICE, dtype=matmul_dtype)
        b = torch.randn(n, n, device=DEVICE, dtype=matmul_dtype)
        timing = benchmark(lambda: a @ b)
        unstable += timing.unstable
        matmul_tflops.append(matmul_flops(n, n, n) / timing.median_s / 1e12)
        print(f"n={n:5d}: {timing}  ->  {matmul_tflops[-1]:.3f} TFLOP/s")

# %%
# Buffers up to a quarter of the GPU's memory (src and dst together take half).
copy_mib = settings.pick(small=[4, 16, 64, 256], full=[16, 64, 256, 1024, 4096])
if settings.on_gpu:
    copy_mib = [m for m in copy_mib if m * 2**20 * 4 <= settings.memory_bytes] or copy_mib[:1]

copy_gbps = []
with cpu_threads(THREADS):
    for mib in tqdm(copy_mib, desc="copy sweep"):
        src = torch.empty(mib * 2**20, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        timing = benchmark(lambda: dst.copy_(src))
        unstable += timing.unstable
        copy_gbps.append(2 * src.numel() / timing.median_s / 1e9)  # read + write
        print(f"{mib:5d} MiB: {timing}  ->  {copy_gbps[-1]:.1f} GB/s")
        src = dst = None  # free this pair before allocating the next, larger one

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(matmul_sizes, matmul_tflops, "o-")
ax1.set(xscale="log", xlabel="matrix size n", ylabel="TFLOP/s", title=f"matmul ({str(matmul_dtype)[6:]})")
ax2.plot(copy_mib, copy_gbps, "o-", color="C1")
ax2.set(xscale="log", xlabel="buffer size (MiB)", ylabel="GB/s", title="copy (read + write)")
published = match_device_name(settings.device_name) if settings.on_gpu else None
if published:
    ax1.axhline(published.peak_flops / 1e12, ls="--", color="gray", label=f"{published.name} datasheet")
    ax2.axhline(published.hbm_bandwidth / 1e9, ls="--", color="gray", label=f"{published.name} datasheet")
    ax1.legend()
    ax2.legend()
fig.suptitle(f"Measured on {settings.device_name}")
fig.tight_layout()

# %%
# Only the largest buffer measures the memory the weights live in. On a CPU, small buffers can
# sit in its L2/L3 cache and copy faster than main memory allows. On a GPU, `benchmark` flushes
# the L2 cache before every call, so small copies are not cache hits there: they are too short to
# hide the fixed cost of launching a kernel, and read slower, not faster.
best_tflops, best_gbps = max(matmul_tflops), copy_gbps[-1]
print(f"best matmul: {best_tflops:.3f} TFLOP/s   copy of the largest buffer: {best_gbps:.1f} GB/s")
print(f"their ratio, the ridge point of your device: {best_tflops * 1e12 / (best_gbps * 1e9):.1f} FLOP per byte")
if unstable:
    print(f"WARNING: {unstable} of the points above were UNSTABLE (their rounds disagreed): these numbers are "
          f"not yet your device's. Close other programs and run the two sweeps again.")
if published:
    print(f"datasheet ({published.name}): {published.peak_flops / 1e12:.0f} TFLOP/s, "
          f"{published.hbm_bandwidth / 1e9:.0f} GB/s, ridge {published.ridge_point:.0f} FLOP/byte")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
ledger.record("00_first_kernel", [
    ledger.Figure("matmul_peak", best_tflops, "TFLOP/s",
                  f"best {str(matmul_dtype)[6:]} square matmul, n up to {matmul_sizes[-1]}; 2n^3 FLOPs over median time"),
    ledger.Figure("copy_bandwidth", best_gbps, "GB/s",
                  f"copy of a {copy_mib[-1]} MiB buffer; bytes read + written over median time"),
], timings_real=True)  # torch's own matmul and copy: real timings on a CPU too

# %% [markdown]
# ## What you measured
#
# The ratio of the two numbers, FLOPs per byte, is your device's *ridge point*. A computation
# that does fewer FLOPs per byte it reads than the ridge point waits on memory; one that does
# more waits on arithmetic. Chapter 04 turns this into a roofline, and chapter 05 shows that
# prefill lands well past the ridge and decode far below it.
#
# On a CPU the sweeps use one thread, so these numbers describe one core of your CPU, not a GPU:
# the shape of the argument is the same, the values are not. The UNSTABLE flag catches a machine
# that was busy for part of a point; one that was busy throughout looks stable but slow, so run
# the two sweeps twice and compare. Matmul timings here are real; a Triton kernel timed in the
# interpreter would not be.

# %% [markdown]
# ## 2. How a Triton kernel sees the data
#
# A Triton kernel is a function that many *programs* run at once. Each program handles one
# block of `BLOCK_SIZE` elements: it asks which program it is (`tl.program_id(0)`), works out
# the offsets of its block, loads those elements, computes, and stores the result.
#
# The last block is usually partial. If a vector has 1,000 elements and blocks hold 256, four
# programs cover 1,024 offsets, and the last 24 point past the end of the data. A *mask*
# (`offsets < n`) tells `tl.load` and `tl.store` which lanes are real; masked-off lanes are
# neither read nor written.
#
# What the kernel must compute, written in plain torch (the *spec*):

# %%
def vector_add_spec(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


# %% [markdown]
# ### Exercise 1: vector add
#
# Complete `add_kernel` and its host wrapper `vector_add`.
#
# * The kernel: compute this program's `offsets`, build the mask, load `x` and `y` with it, add,
#   and store into `out` with the same mask.
# * The wrapper: check the inputs, allocate the output, choose a grid of
#   `triton.cdiv(n, BLOCK_SIZE)` programs (rounding *up*, so the partial block gets a program),
#   and launch. Checking the inputs means refusing (with an `assert` or a `ValueError`) `x` and `y`
#   of different lengths, which the kernel would otherwise read past the end of, and handling
#   a strided view such as `x[::2]`: the kernel's `x_ptr + offsets` assumes adjacent elements, so
#   make the inputs contiguous (`x.contiguous()`) or refuse them.

# %%
@triton.jit
def add_kernel(
    x_ptr,  # pointer to the first input
    y_ptr,  # pointer to the second input
    out_ptr,  # pointer to the output
    n,  # number of elements
    BLOCK_SIZE: tl.constexpr,  # elements handled by one program
):
    # BEGIN SOLUTION: compute offsets and a mask, load x and y, store x + y
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)
    # END SOLUTION


def vector_add(x: torch.Tensor, y: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    # BEGIN SOLUTION: check shapes, allocate the output, launch cdiv(n, block_size) programs
    assert x.shape == y.shape and x.dim() == 1, "x and y must be 1-D and the same length"
    assert x.is_contiguous() and y.is_contiguous(), "x and y must be contiguous"
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, block_size),)
    add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size)
    return out
    # END SOLUTION


# %% [markdown]
# Check it. The check runs your function on lengths 1, 2, 17, 1000 and 4097 (and a million
# on a GPU), in float32 and float16, with signed random inputs; then on strided views `x[::2]`,
# `y[::2]` (the sum must be right, or your function must refuse them) and on `x` and `y` of
# different lengths (your function must refuse them).

# %%
check_vector_add(vector_add)
