# Lab 04 source of truth. Edit this file, then run `python -m labsupport release 04_roofline` to
# regenerate labs/04_roofline.ipynb (learners) and solutions/04_roofline.ipynb (instructors).

# %% [markdown]
# # Lab 04: your device's roofline
#
# Every kernel is limited either by arithmetic or by memory traffic. In this lab you will
#
# 1. measure the two ceilings of the device you are on: the FLOP/s a matrix multiply reaches, and
#    the bytes per second a copy moves;
# 2. compute your device's *ridge point* and draw its roofline next to the published one;
# 3. time a few matmul shapes, from decode-like to prefill-like;
# 4. write `arithmetic_intensity` for a matmul, have it checked, and use it to place those shapes
#    on your roofline and see how close each one gets to its roof.
#
# Run the cells from top to bottom. On a CPU everything runs in seconds with small sizes; the
# numbers then describe your CPU, not a GPU, but the shape of the argument is the same.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written the exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. Every measurement in
# this lab comes before the exercise, so a first Run All already measures your device; only the
# last section waits for your function.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import matplotlib.pyplot as plt
import torch

from labsupport import ledger
from labsupport.checks import check_arithmetic_intensity
from labsupport.device import device, lab_dtype
from labsupport.hardware import match_device_name
from labsupport.phases import cpu_threads
from labsupport.roofline import attainable_flops, measure_copy, measure_matmul, plot_roofline, ridge_point

DEVICE = device()
DTYPE = lab_dtype()  # what each device is fast at: bf16 (fp16 before Ampere) on a GPU, fp32 on a CPU
DTYPE_BYTES = torch.empty((), dtype=DTYPE).element_size()
PUBLISHED = match_device_name(settings.device_name) if settings.on_gpu else None
# On a CPU, time with one thread: on a small machine shared with other work, threads that wait for
# a busy core make timings erratic. On a GPU this does nothing.
THREADS = settings.pick(small=1, full=None)
print(f"measuring on {settings.device_name} in {str(DTYPE)[6:]} ({DTYPE_BYTES} bytes per element)")
print(f"published numbers for this device: {PUBLISHED.name if PUBLISHED else 'none in labsupport.hardware'}")

# %% [markdown]
# ## 1. The roofline in one equation
#
# A kernel that performs $F$ floating-point operations and moves $B$ bytes between memory and
# the compute units cannot finish faster than
#
# $$t \ge \max\left(\frac{F}{\text{peak FLOP/s}}, \frac{B}{\text{bandwidth}}\right).$$
#
# Divide by $B$: the best FLOP/s a kernel of *arithmetic intensity* $I = F/B$ can reach is
# $\min(\text{peak}, I \times \text{bandwidth})$. That is the roof. The two pieces meet at the
# **ridge point**, peak / bandwidth, in FLOP per byte.
#
# The datasheet gives both ceilings; this lab measures them. Two conventions:
#
# * a matmul of an $(m \times k)$ by a $(k \times n)$ matrix does $2mkn$ FLOPs (a multiply and an
#   add for each of the $k$ terms of each of the $mn$ outputs);
# * a copy of $b$ bytes moves $2b$ bytes: it reads $b$ and writes $b$.

# %% [markdown]
# ## 2. The compute ceiling: matmul FLOP/s over sizes
#
# Small matrices cannot keep every core busy, and fixed overheads (a kernel launch on a GPU, a
# thread wake-up on a CPU) dominate them. As the size grows, FLOP/s climbs towards a plateau:
# that plateau is your practical peak. `measure_matmul` times each size with
# `labsupport.timing.benchmark` and returns FLOP/s. On a CPU each point is timed for at least
# 0.2 s in five rounds; a point whose rounds disagree prints a warning that it is too unstable to
# trust (close other programs and run the cell again).

# %%
matmul_sizes = settings.pick(small=[64, 128, 256, 512, 1024], full=[512, 1024, 2048, 4096, 8192, 16384])
with cpu_threads(THREADS):
    matmul_rates = measure_matmul(matmul_sizes, dtype=DTYPE, device=DEVICE)  # FLOP/s, one per size
for n, rate in zip(matmul_sizes, matmul_rates):
    print(f"n = {n:6,d}: {rate / 1e12:8.3f} TFLOP/s")

# %% [markdown]
# ## 3. The bandwidth ceiling: copy bytes/s over sizes
#
# A copy does no arithmetic at all, so its speed is pure memory traffic. Small buffers can fit in
# a cache (the L2 of a GPU, the L2/L3 of a CPU) and look faster than the main memory really is,
# so we take the bandwidth of the **largest** buffer as the device's memory bandwidth.

# %%
copy_mib = settings.pick(small=[4, 16, 64, 256], full=[16, 64, 256, 1024, 4096])
if settings.on_gpu:  # buffers up to a quarter of the GPU's memory (src and dst together take half)
    copy_mib = [m for m in copy_mib if m * 2**20 * 4 <= settings.memory_bytes] or copy_mib[:1]
with cpu_threads(THREADS):
    copy_rates = measure_copy([mib * 2**20 for mib in copy_mib], device=DEVICE)  # bytes/s, one per size
for mib, rate in zip(copy_mib, copy_rates):
    print(f"{mib:5d} MiB: {rate / 1e9:8.1f} GB/s (read + write)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(matmul_sizes, [r / 1e12 for r in matmul_rates], "o-")
ax1.set(xscale="log", xlabel="matrix size n", ylabel="TFLOP/s", title=f"matmul, {str(DTYPE)[6:]}")
ax2.plot(copy_mib, [r / 1e9 for r in copy_rates], "o-", color="C1")
ax2.set(xscale="log", xlabel="buffer size (MiB)", ylabel="GB/s", title="copy (read + write)")
if PUBLISHED:
    ax1.axhline(PUBLISHED.peak_flops / 1e12, ls="--", color="gray", label=f"{PUBLISHED.name} datasheet")
    ax2.axhline(PUBLISHED.hbm_bandwidth / 1e9, ls="--", color="gray", label=f"{PUBLISHED.name} datasheet")
    ax1.legend()
    ax2.legend()
fig.suptitle(f"Measured on {settings.device_name}")
fig.tight_layout()

# %% [markdown]
# ## 4. Your ridge point and your roofline
#
# The measured peak is the best matmul rate; the measured bandwidth is the copy rate of the
# largest buffer. Their ratio is your device's ridge point. On a GPU the published roof is drawn
# dashed beside the measured one: the gap is what real kernels lose to clocks, power limits and
# the memory system.

# %%
peak = max(matmul_rates)  # FLOP/s
bandwidth = copy_rates[-1]  # bytes/s, largest buffer
ridge = ridge_point(peak, bandwidth)  # FLOP per byte
print(f"measured : {peak / 1e12:.3f} TFLOP/s, {bandwidth / 1e9:.1f} GB/s, ridge {ridge:.1f} FLOP/byte")
if PUBLISHED:
    print(f"published: {PUBLISHED.peak_flops / 1e12:.0f} TFLOP/s, {PUBLISHED.hbm_bandwidth / 1e9:.0f} GB/s, "
          f"ridge {PUBLISHED.ridge_point:.0f} FLOP/byte ({PUBLISHED.source})")
    print(f"you reached {peak / PUBLISHED.peak_flops:.0%} of the peak and "
          f"{bandwidth / PUBLISHED.hbm_bandwidth:.0%} of the bandwidth on the datasheet")
else:
    print("no published numbers to compare with: these are your CPU's own ceilings "
          "(small preset; a GPU's are thousands of times higher)")

# %%
fig, ax = plt.subplots(figsize=(8, 4.5))
plot_roofline(ax, peak, bandwidth, published=PUBLISHED, label=f"measured ({settings.device_name})")
ax.set_title("Your roofline" + (" beside the datasheet's" if PUBLISHED else ""))
fig.tight_layout()

# %% [markdown]
# ## 5. Matmuls from decode-like to prefill-like, timed
#
# A decode step multiplies a few token vectors by each weight matrix; prefill multiplies a whole
# prompt by it. Both are $(m, d) \times (d, d)$ matmuls that differ only in the number of rows
# $m$. `measure_matmul` (which accepts `(m, k, n)` shapes) times each; section 7 places them on
# your roofline once your `arithmetic_intensity` says where each should land.

# %%
d = settings.pick(small=1024, full=4096)  # hidden size: 4096 is Llama 3.1 8B's
rows = settings.pick(small=[1, 8, 64, 512, 1024], full=[1, 8, 64, 512, 4096])
shapes = [(m, d, d) for m in rows]
with cpu_threads(THREADS):
    achieved = measure_matmul(shapes, dtype=DTYPE, device=DEVICE)  # FLOP/s
for shape, rate in zip(shapes, achieved):
    print(f"{str(shape):>20}: {rate / 1e12:8.3f} TFLOP/s")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
dtype_name = str(DTYPE)[6:]
ledger.record("04_roofline", [
    ledger.Figure("matmul_peak", peak / 1e12, "TFLOP/s", f"best {dtype_name} square matmul of the sweep; 2n^3 FLOPs over median time"),
    ledger.Figure("copy_bandwidth", bandwidth / 1e9, "GB/s", "copy of the largest buffer; bytes read + written over median time"),
    ledger.Figure("ridge_point", ridge, "FLOP/byte", "measured peak over measured copy bandwidth"),
    *(ledger.Figure(f"matmul_m{m}_d{d}", rate / 1e12, "TFLOP/s", f"{dtype_name} (m, d) x (d, d) matmul; 2m*d^2 FLOPs over median time")
      for (m, _, _), rate in zip(shapes, achieved)),
], timings_real=True)  # torch's own matmul and copy: real timings on a CPU too

# %% [markdown]
# ## 6. Exercise: the arithmetic intensity of a matmul
#
# Where does a given kernel sit on that roof? For $C = A B$ with $A$ of shape $(m, k)$, $B$ of
# shape $(k, n)$ and every element taking `dtype_bytes` bytes, use this convention:
#
# * FLOPs: $2mkn$;
# * bytes: $A$ and $B$ are each **read once** and $C$ is **written once**, so
#   $\text{bytes} = \text{dtype\_bytes} \times (mk + kn + mn)$.
#
# $$I = \frac{2mkn}{\text{dtype\_bytes}\,(mk + kn + mn)} \quad \text{FLOP per byte}$$
#
# It is the least traffic the matmul can possibly cause; a real kernel that re-reads tiles moves
# more. In plain torch, here is the computation being counted:

# %%
def matmul_spec(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a: (m, k), b: (k, n) -> c: (m, n). Reads a and b, writes c.
    return a @ b


# %% [markdown]
# ### Exercise 1
#
# Complete `arithmetic_intensity(m, k, n, dtype_bytes)`: return the FLOPs per byte of the
# matmul above, as a float. The check tries decode-like shapes (one row), prefill-like ones
# (thousands of rows), and 1-, 2- and 4-byte elements.

# %%
def arithmetic_intensity(m: int, k: int, n: int, dtype_bytes: float) -> float:
    # BEGIN SOLUTION: return the FLOPs of the product divided by the bytes it must move to and from memory
    flops = 2 * m * k * n
    bytes_moved = dtype_bytes * (m * k + k * n + m * n)
    return flops / bytes_moved
    # END SOLUTION


# %%
check_arithmetic_intensity(arithmetic_intensity)

# %% [markdown]
# ## 7. Placing matmuls on your roofline
#
# Your function predicts where each shape of section 5 lands; the timing says where it really
# landed.

# %%
intensities = [arithmetic_intensity(m, k, n, DTYPE_BYTES) for m, k, n in shapes]

print(f"{'shape (m, k, n)':>20} {'FLOP/byte':>10} {'roof TFLOP/s':>13} {'measured':>10} {'of roof':>8}")
for shape, ai, rate in zip(shapes, intensities, achieved):
    roof = attainable_flops(ai, peak, bandwidth)
    bound = "bandwidth" if ai < ridge else "compute"
    print(f"{str(shape):>20} {ai:10.1f} {roof / 1e12:13.3f} {rate / 1e12:10.3f} {rate / roof:8.0%}  {bound}-bound")

# %%
fig, ax = plt.subplots(figsize=(8, 4.5))
points = [(f"m={m}", ai, rate) for (m, _, _), ai, rate in zip(shapes, intensities, achieved)]
plot_roofline(ax, peak, bandwidth, points=points, published=PUBLISHED, label="measured roof")
ax.set_title(f"(m, {d}) @ ({d}, {d}) matmuls in {str(DTYPE)[6:]}, measured")
fig.tight_layout()

# %% [markdown]
# ## What you measured
#
# * The one-row matmul (decode at batch 1) has an intensity of about $2 / \text{dtype\_bytes}$ and
#   sits on the sloped part of the roof: its time is bytes over bandwidth, and faster arithmetic
#   would not help it at all.
# * Adding rows moves a matmul to the right along the slope, almost for free: the weights are
#   read once whatever $m$ is. That is why serving systems batch decode.
# * Past the ridge, more rows cost proportionally more time: prefill-like shapes are limited by
#   arithmetic.
#
# Some points land above the measured roof. A small matrix can stay in a cache between
# repetitions, so it is read faster than main memory allows; on a GPU, `do_bench` flushes the L2
# between runs to limit this. On a CPU the timings are also noisier, especially on a shared
# machine. Chapter 05 puts real prefill and decode steps of a transformer on this same roof.
