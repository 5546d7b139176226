# Lab 07 source of truth. Edit this file, then run `python -m labsupport release 07_attention` to
# regenerate labs/07_attention.ipynb (learners) and solutions/07_attention.ipynb (instructors).

# %% [markdown]
# # Lab 07: attention, from the textbook formula to FlashAttention in Triton
#
# In this lab you will
#
# 1. measure what attention by its formula costs as the sequence grows: the memory wall of the
#    $S \times S$ score matrix;
# 2. write attention the way the formula reads it, and have it graded;
# 3. compute the same attention one block of keys at a time with an *online softmax*, in plain torch;
# 4. turn that loop into a Triton kernel, FlashAttention's forward pass, which never writes the
#    score matrix anywhere;
# 5. compare your kernel with naive attention and with PyTorch's own fused attention.
#
# Chapter 07 of the book explains the ideas in more depth. Run the cells from top to bottom; cells
# marked **Exercise** are yours, and the check after each one says precisely what is wrong.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. The memory-wall
# measurement (section 2) needs none of your code and comes before the first exercise. The later
# measurements time *your* kernels, so they wait for them: each exercise's check must pass before
# the sections after it run.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import functools
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tqdm.auto import tqdm

from labsupport import ledger
from labsupport.attention import (
    attention_spec,
    flash_attention_hbm_bytes,
    is_out_of_resources,
    kernel_config,
    naive_attention_hbm_bytes,
    naive_attention_reference,
    online_softmax_reference,
    peak_tensor_memory,
    score_matrix_elements,
)
from labsupport.checks import check_flash_attention, check_naive_attention, check_online_softmax
from labsupport.costs import attention_flops
from labsupport.device import device, gpu_has_bf16
from labsupport.interpreter_bytes import count_bytes
from labsupport.timing import benchmark

DEVICE = device()
# bfloat16 and SDPA's FlashAttention backend need an Ampere-or-newer GPU (compute capability 8.0);
# on older GPUs (a Colab T4) the full preset uses float16 and SDPA picks its own backend.
AMPERE = gpu_has_bf16()

# %% [markdown]
# ## 1. What attention computes
#
# Every head of every layer gets three tensors of shape `(B, H, S, D)`: batch, heads, sequence
# length, head dim. Query row $i$ is compared with every key row $j$, the similarities become
# weights with a softmax, and the output row is the weighted average of the value rows:
#
# $$s_{ij} = \frac{q_i \cdot k_j}{\sqrt{D}}, \qquad
#   p_{ij} = \frac{e^{s_{ij}}}{\sum_{j'} e^{s_{ij'}}}, \qquad
#   o_i = \sum_j p_{ij}\, v_j .$$
#
# The $1/\sqrt{D}$ keeps the scores near unit size whatever the head dim. In a decoder the
# attention is **causal**: token $i$ may only look at tokens $j \le i$, so the scores of later
# keys are set to $-\infty$ before the softmax (their weight becomes exactly 0). Each row of $p$
# sums to 1 over the keys, which is why the softmax runs over the last dimension.
#
# Here is the causal mask for a sequence of five tokens (`True` = may look):

# %% tags=["nbval-check-output"]
S_demo = 5
rows = torch.arange(S_demo)[:, None]  # (S, 1): query positions
cols = torch.arange(S_demo)[None, :]  # (1, S): key positions
print(cols <= rows)

# Why softmax implementations subtract the maximum: exp of a large score overflows.
print("exp in float32:", torch.exp(torch.tensor([88.0, 89.0])))
print("exp in float16:", torch.exp(torch.tensor([11.0, 12.0], dtype=torch.float16)))

# %% [markdown]
# ## 2. The $S^2$ wall
#
# The score matrix has $S \times S$ entries for every head of every layer, and attention computed
# the way the formula reads holds at least that (the scores, then the softmax weights) at once.
# Below we measure, for growing $S$, the peak memory and the run time of the course's plain-torch
# spec, `attention_spec` (the formula, in float32), with the bytes of one `(B, H, S, S)` score
# matrix in float32 beside them. The naive attention you write in section 3 holds the same
# matrices: once its check passes, set `wall_fn = naive_attention` and run these cells again to
# measure yours.
#
# How the peak is measured: on a GPU, `torch.cuda.max_memory_allocated` (after resetting it) minus
# what was allocated before the call. On a CPU, `labsupport.attention.peak_tensor_memory` watches
# every torch operation during the call and records the most bytes of new tensors alive at once.

# %%
def peak_bytes(fn, *args, **kwargs) -> int:
    """Peak bytes of new tensors while ``fn`` runs (GPU allocator stats, or a torch op watcher)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    _, report = peak_tensor_memory(fn, *args, **kwargs)
    return report.peak_bytes


mem_batch, mem_heads, mem_dim = settings.pick(small=(1, 4, 64), full=(1, 16, 128))
mem_dtype = settings.pick(small=torch.float32, full=torch.bfloat16 if AMPERE else torch.float16)
mem_lens = settings.pick(small=[128, 256, 512, 1024, 2048], full=[1024, 2048, 4096, 8192, 16384])

wall_fn = attention_spec  # the formula in plain torch; after Exercise 1, try your naive_attention
measured = []  # (S, peak bytes or None if out of memory, seconds or None)
for s in tqdm(mem_lens, desc=f"{wall_fn.__name__} vs S"):
    q, k, v = (torch.randn(mem_batch, mem_heads, s, mem_dim, device=DEVICE, dtype=mem_dtype) for _ in range(3))
    try:
        peak = peak_bytes(wall_fn, q, k, v, causal=True)
        seconds = benchmark(functools.partial(wall_fn, q, k, v, causal=True), max_time_s=1.0).median_s
    except torch.cuda.OutOfMemoryError:  # a real outcome of naive attention at long context
        peak, seconds = None, None
    measured.append((s, peak, seconds))
    del q, k, v
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()

print(f"B={mem_batch}, H={mem_heads}, D={mem_dim}, {str(mem_dtype)[6:]}, causal")
print(f"{'S':>6} {'score matrix (fp32)':>20} {'measured peak':>14} {'peak / matrix':>14} {'time':>10}")
for s, peak, seconds in measured:
    matrix = mem_batch * mem_heads * score_matrix_elements(s) * 4
    if peak is None:
        print(f"{s:6d} {matrix / 2**20:17.1f} MiB {'out of memory':>14}")
    else:
        print(f"{s:6d} {matrix / 2**20:17.1f} MiB {peak / 2**20:10.1f} MiB {peak / matrix:14.2f} "
              f"{seconds * 1e3:8.2f} ms")
long_context = 120_000
print(f"\nAt S = {long_context:,}, ONE head's score matrix holds {score_matrix_elements(long_context):,} numbers: "
      f"{score_matrix_elements(long_context) * 2 / 1e9:.1f} GB in bfloat16.")

# %%
ok = [(s, p, t) for s, p, t in measured if p is not None]
lens = [s for s, _, _ in ok]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(lens, [p / 2**20 for _, p, _ in ok], "o-", label="measured peak")
ax1.plot(mem_lens, [mem_batch * mem_heads * score_matrix_elements(s) * 4 / 2**20 for s in mem_lens], "--",
         color="gray", label="one fp32 score matrix, B*H*S^2*4 bytes")
ax1.set(xscale="log", yscale="log", xlabel="sequence length S", ylabel="MiB", title=f"{wall_fn.__name__}: memory")
ax1.legend(fontsize=8)
ax2.plot(lens, [t * 1e3 for _, _, t in ok], "o-", color="C1")
ax2.set(xscale="log", yscale="log", xlabel="sequence length S", ylabel="ms", title=f"{wall_fn.__name__}: time")
fig.suptitle(f"Measured on {settings.device_name}")
fig.tight_layout()

# %%
def loglog_slope(points):
    """Slope between the last two (x, y) points on log-log axes: the exponent of a power law."""
    (x1, y1), (x2, y2) = points[-2:]
    return math.log(y2 / y1) / math.log(x2 / x1)


if len(ok) >= 2:
    print(f"slope of memory between S={ok[-2][0]} and S={ok[-1][0]}: {loglog_slope([(s, p) for s, p, _ in ok]):.2f}")
    print(f"slope of time   between S={ok[-2][0]} and S={ok[-1][0]}: {loglog_slope([(s, t) for s, _, t in ok]):.2f}")

# %% [markdown]
# On log-log axes a power law is a straight line whose slope is its exponent. The memory line has
# slope 2: double the sequence, four times the memory. The peak is a small multiple of one score
# matrix (the scores and the softmax weights are alive together, plus the mask). Time is less
# tidy: it follows slope 2 once the $S^2$ arithmetic dominates, but fixed costs per call (kernel
# launches, Python) flatten it at small sizes, and on a CPU the matrices outgrowing the caches can
# make it steeper for a while. Compare the two slopes printed above. The last line
# of the table scales one head's matrix to a long context: no GPU holds that for every head of a
# layer. The cure is to never hold the matrix at all.

# %% [markdown]
# ## 3. Naive attention, yours
#
# The exponentials printed in section 1 show why a softmax of large numbers needs care: the exponential overflows
# to `inf` at modest scores, sooner in float16. Subtracting each row's maximum first changes
# nothing mathematically (the factor
# $e^{-m}$ cancels between numerator and denominator) and keeps every exponent at or below 0.
# `torch.softmax` does this for you; if you write the exponentials yourself, do it too.
#
# ### Exercise 1: naive attention
#
# Write `naive_attention(q, k, v, causal=False)` in plain torch: compute the `(B, H, S, S)` score
# matrix, mask it when `causal`, take the softmax over the keys, multiply by `v`. Return a tensor
# of the inputs' shape and dtype. Compute the scores and the softmax in float32 and cast back at
# the end: at float16 logits in the hundreds, scores rounded to float16 are off by up to 0.06 and
# the output visibly so (one case checks it). Mask with `-inf`, not a large finite number.
# `F.scaled_dot_product_attention` is off limits: the check will notice.

# %%
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    # BEGIN SOLUTION: scores = q @ k^T / sqrt(D), causal mask, softmax over keys, @ v
    d, s = q.shape[-1], q.shape[-2]
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(d)  # (B, H, S, S)
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # True above the diagonal
        scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # each row sums to 1 over the keys
    return (weights @ v.float()).to(q.dtype)  # (B, H, S, D)
    # END SOLUTION

# %% [markdown]
# The check runs lengths 1, 2, 17, 100 and 257, causal and not, float32 and float16, with
# signed inputs, large logits (float16 ones in the hundreds among them), a causal row whose only
# visible score is far below -1e4, several seeds, and a batch and head count above 1.

# %%
check_naive_attention(naive_attention)

# %% [markdown]
# ## 4. The online softmax
#
# Take one query row and split its keys into blocks. Suppose we have processed some blocks and
# kept three things: the largest score so far $m$, the sum $\ell = \sum_j e^{s_j - m}$ over the
# keys seen, and the unnormalised output $a = \sum_j e^{s_j - m} v_j$. A new block arrives with
# scores $s_j$ and values $v_j$:
#
# $$m' = \max\big(m, \max_j s_j\big), \qquad \alpha = e^{m - m'} ,$$
# $$\ell' = \alpha\,\ell + \sum_j e^{s_j - m'}, \qquad a' = \alpha\, a + \sum_j e^{s_j - m'}\, v_j .$$
#
# The factor $\alpha \le 1$ *rescales* what was accumulated against the old maximum so that
# every term is measured against the new one. After the last block, $o = a / \ell$ exactly, and
# $\log \sum_j e^{s_j} = m + \log \ell$, the **log-sum-exp** (lse) of the row, which the
# function also returns: a later kernel (the backward pass, or decode split over chunks of the
# cache) uses it to combine partial results. Nothing is approximated: every step is an identity.
#
# Two blocks by hand, for one row of four scores:

# %% tags=["nbval-check-output"]
scores_demo = torch.tensor([1.0, 3.0, 2.0, 5.0])
values_demo = torch.tensor([10.0, 20.0, 30.0, 40.0])
m, l_run, acc = float("-inf"), 0.0, 0.0
for block in (slice(0, 2), slice(2, 4)):
    s_b, v_b = scores_demo[block], values_demo[block]
    m_new = max(m, s_b.max().item())
    alpha = math.exp(m - m_new)  # 0.0 on the first block (m = -inf), then exp(3 - 5)
    p = torch.exp(s_b - m_new)
    l_run = alpha * l_run + p.sum().item()
    acc = alpha * acc + (p * v_b).sum().item()
    m = m_new
    print(f"after keys {block.start}..{block.stop - 1}: m={m:.0f}  alpha={alpha:.4f}  l={l_run:.4f}  a={acc:.4f}")
print(f"online: o = a / l = {acc / l_run:.6f}, lse = m + log l = {m + math.log(l_run):.6f}")
full = torch.softmax(scores_demo, 0)
print(f"direct: o = {(full * values_demo).sum().item():.6f}, lse = {torch.logsumexp(scores_demo, 0).item():.6f}")

# %% [markdown]
# The spec for the next two exercises is `labsupport.attention.attention_spec(q, k, v, causal)`:
# the same output as your naive attention, computed in float32, plus each row's log-sum-exp
# `lse[b, h, i] = log(sum_j exp(s_ij))`, shape `(B, H, S)`.

# %%
q, k, v = (torch.randn(1, 1, 6, 16) for _ in range(3))
out_spec, lse_spec = attention_spec(q, k, v, causal=True)
print("out", tuple(out_spec.shape), " lse", tuple(lse_spec.shape))
print("same output as your naive attention:", torch.allclose(out_spec, naive_attention(q, k, v, causal=True), atol=1e-6))
scores = (q @ k.transpose(-2, -1) / math.sqrt(16)).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
print("lse is the log of each row's softmax denominator:", torch.allclose(lse_spec, torch.logsumexp(scores, -1)))

# %% [markdown]
# ### Exercise 2: the online softmax, blockwise, in plain torch
#
# Write `online_softmax_attention(q, k, v, causal=False, block_n=64)` returning `(out, lse)`:
# `out` like naive attention's (the inputs' shape and dtype), `lse` of shape `(B, H, S)` (any float
# dtype; natural log). Loop over the keys in blocks of `block_n`, and do all query rows of all
# heads at once: your running `m` and `l` are `(B, H, S)`, your accumulator `(B, H, S, D)`, and the
# scores of one block `(B, H, S, block_n)`. The last block may be shorter than `block_n`.
#
# Hints: start with `m = -inf`, `l = 0`, `acc = 0`. With `causal`, mask scores where the key
# index exceeds the query index inside each block (the first block always contains key 0, which
# every query may see, so no row is ever fully masked there). You may `break` once a block starts
# after the last query: causal queries never see it.
#
# The check calls your function with its own small `block_n` (10, 16, 32) so that every case
# spans several blocks, and fails if your function ever creates an $S \times S$ float tensor.

# %%
def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                             block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    # BEGIN SOLUTION: loop over key blocks keeping the running max m, sum l and accumulator acc
    b, h, s, d = q.shape
    qf = q.float() / math.sqrt(d)  # fold the 1/sqrt(D) into q once
    m = torch.full((b, h, s), float("-inf"), device=q.device)  # running max, (B, H, S)
    l_run = torch.zeros((b, h, s), device=q.device)  # running sum of exp(s - m), (B, H, S)
    acc = torch.zeros((b, h, s, d), device=q.device)  # running sum of exp(s - m) * v, (B, H, S, D)
    query_pos = torch.arange(s, device=q.device)[:, None]  # (S, 1)
    for start in range(0, k.shape[2], block_n):
        if causal and start >= s:
            break
        k_blk = k[:, :, start:start + block_n].float()  # (B, H, n, D), n <= block_n
        v_blk = v[:, :, start:start + block_n].float()
        scores = qf @ k_blk.transpose(-2, -1)  # (B, H, S, n)
        if causal:
            key_pos = torch.arange(start, start + k_blk.shape[2], device=q.device)[None, :]  # (1, n)
            scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))  # (B, H, S)
        alpha = torch.exp(m - m_new)  # rescales the old sums to the new maximum
        p = torch.exp(scores - m_new[..., None])  # (B, H, S, n)
        l_run = alpha * l_run + p.sum(dim=-1)
        acc = alpha[..., None] * acc + p @ v_blk
        m = m_new
    out = acc / l_run[..., None]
    lse = m + torch.log(l_run)
    return out.to(q.dtype), lse
    # END SOLUTION

# %%
check_online_softmax(online_softmax_attention)

# %% [markdown]
# ## 5. FlashAttention in Triton
#
# The loop you just wrote is FlashAttention's forward pass (Dao et al. 2022), with the loop order
# of FlashAttention-2 (Dao 2023): each Triton program owns one block of `BLOCK_M` query rows of one
# (batch, head), keeps its `m`, `l` and `acc` in registers, and walks over the keys in blocks of
# `BLOCK_N`. Per step it loads one K tile and one V tile, computes a `BLOCK_M x BLOCK_N` tile of
# scores **on chip**, and updates its running state. The score matrix never reaches memory: each
# program writes only its `BLOCK_M x D` output tile and `BLOCK_M` log-sum-exps.
#
# * **Grid**: `(cdiv(S, BLOCK_M), B * H)`. `tl.program_id(0)` is the query block,
#   `tl.program_id(1)` the (batch, head) pair; with contiguous inputs, that pair's data starts at
#   `pid_bh * S * D` elements. Compute that offset in 64 bits, `pid_bh.to(tl.int64) * S * D`:
#   program ids and plain integers are 32-bit in Triton, and once `B * H * S * D` passes 2**31
#   elements (a batch of long sequences gets there), a 32-bit offset wraps around silently and
#   reads another head's data. The check's sizes are too small to catch this, so it is on you.
# * **Masks**: the last query block and the last key block are usually partial. Load them with a
#   mask (`other=0.0`), and give keys at or past `S` a score of `-inf`, or the zeros you loaded
#   count as real keys with score 0.
# * **Causal**: mask keys after the query inside each tile, and stop the loop at the end of this
#   program's query block: every later key block is entirely in the future, and skipping it
#   saves almost half the work.
# * **Precision**: load in the input dtype, accumulate in float32 (`tl.dot` does), and for float32
#   inputs pass `input_precision="ieee"` to `tl.dot`. On NVIDIA GPUs from Ampere on, Triton's
#   `tl.dot` multiplies float32 inputs in tf32 by default (10-bit mantissas), while PyTorch's own
#   float32 matmul, which the check's reference uses, does not (`torch.backends.cuda.matmul.allow_tf32`
#   is off by default): the check's float32 tolerance would notice the difference.
#
# A K tile loaded as `(D, BLOCK_N)` (rows of the tile = features) makes `tl.dot(q, kt)` the
# `(BLOCK_M, BLOCK_N)` score tile directly. The tile sizes come from
# `labsupport.attention.kernel_config`: on a GPU 128 x 64 (`BLOCK_M` x `BLOCK_N`), shrunk if shared
# memory is small; in the interpreter, where each step costs about the same whatever its size,
# 128 x 64 below 1,024 positions and 256 x 128 from there. The query tile is not the key tile:
# keep `BLOCK_M` and `BLOCK_N` apart everywhere (the causal loop stops at the end of the *query*
# tile).
#
# ### Exercise 3: the kernel and its wrapper
#
# Complete `flash_attention_kernel` (the body) and `flash_attention(q, k, v, causal=False)`, which
# returns `(out, lse)` like your online softmax: `out` in the inputs' dtype, `lse` in float32.
#
# The wrapper: check that q, k, v are `(B, H, S, D)` with a supported head dim, make them
# contiguous (the kernel's offsets assume it: a non-contiguous case is in the check), allocate
# `out` and `lse`, pick tiles with `cfg = kernel_config(S, S, D, q.dtype, interpreter=settings.interpreter)`,
# and launch `flash_attention_kernel[(triton.cdiv(S, cfg.block_m), B * H)](...)` with
# `BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages`.
#
# Write the kernel body first, then the wrapper. On a GPU, Triton compiles the kernel when the
# wrapper first launches it: a kernel that still contains its `raise NotImplementedError` line
# fails there with `unsupported AST node type: Raise`, which only means the body is not written yet.
# On a GPU the check also runs bfloat16 and reminds you about `input_precision="ieee"` if your
# float32 results carry tf32 rounding.

# %%
@triton.jit
def flash_attention_kernel(
    q_ptr,  # (B, H, S, D) queries, contiguous
    k_ptr,  # (B, H, S, D) keys, contiguous
    v_ptr,  # (B, H, S, D) values, contiguous
    out_ptr,  # (B, H, S, D) output
    lse_ptr,  # (B, H, S) float32 log-sum-exp
    seq_len,  # S
    sm_scale,  # 1 / sqrt(D)
    HEAD_DIM: tl.constexpr,  # D (a power of two, at least 16)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step of the loop
    CAUSAL: tl.constexpr,
):
    # BEGIN SOLUTION: load this program's Q tile, loop over K/V tiles with the online softmax, store out and lse
    pid_m = tl.program_id(0)  # which block of queries
    pid_bh = tl.program_id(1)  # which (batch, head)
    base = pid_bh.to(tl.int64) * seq_len * HEAD_DIM  # start of this (batch, head) in q, k, v and out
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query positions
    offs_d = tl.arange(0, HEAD_DIM)  # (D,)
    row_ok = offs_m < seq_len  # the last query block may be partial
    q = tl.load(q_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)  # running sum of p * v

    stop = seq_len
    if CAUSAL:
        stop = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)  # later key blocks are all in the future
    for start_n in range(0, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        key_ok = offs_n < seq_len
        kt = tl.load(k_ptr + base + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=key_ok[None, :], other=0.0)  # (D, BLOCK_N): K tile, transposed
        v = tl.load(v_ptr + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=key_ok[:, None], other=0.0)  # (BLOCK_N, D)
        s = tl.dot(q, kt, input_precision="ieee") * sm_scale  # (BLOCK_M, BLOCK_N) scores, fp32
        keep = key_ok[None, :]  # keys past the end do not exist
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])  # nor do keys in the future
        s = tl.where(keep, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # rescale factor for what was accumulated so far
        p = tl.exp(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(lse_ptr + pid_bh.to(tl.int64) * seq_len + offs_m, m_i + tl.log(l_i), mask=row_ok)
    # END SOLUTION


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # BEGIN SOLUTION: check shapes, make inputs contiguous, allocate out and lse, launch the grid
    assert q.shape == k.shape == v.shape and q.dim() == 4, "q, k, v must all be (B, H, S, D)"
    b, h, s, d = q.shape
    assert d in (16, 32, 64, 128, 256), "head dim must be a power of two between 16 and 256"
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the kernel assumes this layout
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    cfg = kernel_config(s, s, d, q.dtype, interpreter=settings.interpreter)
    grid = (triton.cdiv(s, cfg.block_m), b * h)
    flash_attention_kernel[grid](
        q, k, v, out, lse, s, 1.0 / math.sqrt(d),
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
    # END SOLUTION

# %% [markdown]
# The check runs the same cases as before through your kernel (in the interpreter on a CPU:
# expect it to take several seconds). On a GPU it adds bfloat16 cases and a sequence of 4,096
# tokens, and fails if the call's peak memory shows that an $S \times S$ matrix was allocated.

# %%
check_flash_attention(flash_attention)

# %% [markdown]
# ### The bytes your kernel moves
#
# Chapter 07 counts the traffic of one head in formulas: naive attention writes and reads the
# $S \times S$ scores, $4SD + 4S^2$ elements; the tiled kernel reads Q once, K and V once per
# query block, and writes the output and the log-sum-exps. In Triton's interpreter you can count
# what your own kernel loaded and stored instead: `labsupport.interpreter_bytes.count_bytes`
# adds up every active lane of every `tl.load` and `tl.store` (masked-off lanes excluded). It
# counts lanes, not distinct addresses: K and V re-read by every query block count every time, as
# in the pessimistic formula, so the count is an upper bound on the HBM traffic of the same kernel
# on a GPU, where L2 serves part of the re-reads. On a GPU kernels are compiled and nothing can be
# counted there: the formulas are the figure.

# %%
io_s, io_d = 256, 64
q, k, v = (torch.randn(1, 1, io_s, io_d, device=DEVICE, dtype=torch.float16) for _ in range(3))
io_block_m = kernel_config(io_s, io_s, io_d, torch.float16, interpreter=settings.interpreter).block_m
print(f"one head, S={io_s}, D={io_d}, float16 (2 bytes, as bf16)")
print(f"naive attention (formula):                  {naive_attention_hbm_bytes(io_s, io_d, 2):>12,.0f} bytes")
print(f"tiled, B_M={io_block_m}, every K/V re-read (formula): {flash_attention_hbm_bytes(io_s, io_d, io_block_m, 2):>12,.0f} bytes")
if settings.interpreter:
    with count_bytes() as counted:
        flash_attention(q, k, v)
    print(f"your kernel, counted in the interpreter:    {counted.total:>12,} bytes")
    for name, traffic in counted.by_argument.items():
        print(f"  {name:>8}: loaded {traffic.loaded:9,}  stored {traffic.stored:9,}")
else:
    print("your kernel: compiled on the GPU, so its bytes cannot be counted; the formula above is the figure")
del q, k, v

# %% [markdown]
# ## 6. Naive vs your kernel vs PyTorch's fused attention
#
# `F.scaled_dot_product_attention` (SDPA) is PyTorch's fused attention; on a GPU we pin its
# FlashAttention backend (Ampere or newer). The naive baseline is
# `labsupport.attention.naive_attention_reference`, attention as model code writes it, with every
# matmul in the inputs' dtype: your `naive_attention` computes in float32 for exactness, which on a
# GPU forgoes the tensor cores and would flatter your kernel. Throughput is counted in the usual way: $4 B H S^2 D$ FLOPs per forward
# pass (two matmuls of $2 B H S^2 D$ each), halved when causal since half the scores are never
# needed. On a GPU the sweep below reports TFLOP/s. In the interpreter it checks that the three
# agree; its timings are printed with a label because they time Python emulating the kernel,
# not the kernel.

# %%
bench_lens = settings.pick(small=[64, 128, 256], full=[1024, 2048, 4096, 8192])
bench_heads, bench_dim = settings.pick(small=(2, 64), full=(16, 128))
bench_dtype = settings.pick(small=torch.float32, full=torch.bfloat16 if AMPERE else torch.float16)
bench_tokens = settings.pick(small=256, full=16384)  # batch = tokens // S: same work per row


def sdpa(q, k, v, causal):
    if AMPERE:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


IMPLEMENTATIONS = {  # name: (function of (q, k, v, causal) returning out, runs Triton?)
    "naive": (naive_attention_reference, False),
    "yours": (lambda q, k, v, causal: flash_attention(q, k, v, causal)[0], True),
    "sdpa": (sdpa, False),
}
results = []  # one dict per (S, causal)
for s in tqdm(bench_lens, desc="attention sweep"):
    batch = max(1, bench_tokens // s)
    q, k, v = (torch.randn(batch, bench_heads, s, bench_dim, device=DEVICE, dtype=bench_dtype) for _ in range(3))
    for causal in (False, True):
        # The reference, in float32 one block of keys at a time: never an S x S matrix, so it fits.
        want = online_softmax_reference(q, k, v, causal, block_n=512)[0].float()
        row = {"S": s, "causal": causal, "batch": batch,
               "flops": attention_flops(batch, bench_heads, s, bench_dim, causal=causal)}
        for name, (impl, uses_triton) in IMPLEMENTATIONS.items():
            fn = functools.partial(impl, q, k, v, causal)
            try:
                row[f"{name}_err"] = (fn().float() - want).abs().max().item()
                row[f"{name}_time"] = benchmark(fn, uses_triton=uses_triton, max_time_s=0.5)
            except Exception as exc:  # out of GPU memory (naive, long S) is a result; so is a kernel
                if not (isinstance(exc, torch.cuda.OutOfMemoryError) or is_out_of_resources(exc)):
                    raise  # that needs more shared memory than this GPU has: say so and go on
                if is_out_of_resources(exc):
                    print(f"{name}, S={s}: the kernel needs more shared memory than this GPU gives one "
                          f"program ({str(exc).splitlines()[0][:120]}); launch it with smaller tiles")
                row[f"{name}_err"], row[f"{name}_time"] = None, None
                torch.cuda.empty_cache()
        results.append(row)
    del q, k, v, want

# %%
if settings.timings_meaningful:
    print(f"{'S':>6} {'causal':>6} {'naive':>8} {'yours':>8} {'SDPA':>8}  TFLOP/s   yours/SDPA")
    for r in results:
        tf = {n: (r["flops"] / r[f"{n}_time"].median_s / 1e12 if r[f"{n}_time"] else None)
              for n in ("naive", "yours", "sdpa")}
        cells = " ".join(f"{tf[n]:8.1f}" if tf[n] else f"{'OOM':>8}" for n in ("naive", "yours", "sdpa"))
        ratio = f"{tf['yours'] / tf['sdpa']:.2f}x" if tf["yours"] and tf["sdpa"] else "-"
        print(f"{r['S']:6d} {str(r['causal']):>6} {cells}   {ratio}")
    at_4k = [r for r in results if r["S"] == 4096 and not r["causal"]]
    if at_4k and at_4k[0]["sdpa_time"] and at_4k[0]["yours_time"]:
        ratio = at_4k[0]["sdpa_time"].median_s / at_4k[0]["yours_time"].median_s
        print(f"\nS=4096, non-causal: your kernel runs at {ratio:.2f}x SDPA "
              f"({'reaches' if ratio >= 0.5 else 'below'} the course's pass line of 0.5x)")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        rs = [r for r in results if r["causal"] == causal]
        for n, label in (("naive", "naive"), ("yours", "your kernel"), ("sdpa", "SDPA (flash)" if AMPERE else "SDPA")):
            pts = [(r["S"], r["flops"] / r[f"{n}_time"].median_s / 1e12) for r in rs if r[f"{n}_time"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax.set(xscale="log", xlabel="sequence length S", title="causal" if causal else "non-causal")
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend()
    fig.suptitle(f"Attention forward, {str(bench_dtype)[6:]}, D={bench_dim}, on {settings.device_name}")
    fig.tight_layout()
else:
    print("Correctness: largest |difference| from the float32 reference (online_softmax_reference)")
    print(f"{'S':>6} {'causal':>6} {'naive':>10} {'yours':>10} {'SDPA':>10}")
    for r in results:
        print(f"{r['S']:6d} {str(r['causal']):>6} {r['naive_err']:10.2e} {r['yours_err']:10.2e} {r['sdpa_err']:10.2e}")
    print("\nTimes (NOT meaningful for performance: your kernel runs in the Triton interpreter, on a CPU):")
    for r in results:
        print(f"S={r['S']:4d} causal={str(r['causal']):5}  naive {r['naive_time'].median_ms:8.2f} ms   "
              f"yours {r['yours_time'].median_ms:8.2f} ms{r['yours_time'].label()}   SDPA {r['sdpa_time'].median_ms:6.2f} ms")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# In the interpreter the file says its timings are not real: your kernel's time there is Python's.

# %%
convention = f"{str(bench_dtype)[6:]}, D={bench_dim}, {bench_heads} heads; 4*S^2*D FLOPs per head (halved if causal) over median time"
ledger.record("07_attention", [
    *(ledger.Figure(f"{name}_tflops_len{r['S']}_{'causal' if r['causal'] else 'full'}",
                    r["flops"] / r[f"{key}_time"].median_s / 1e12, "TFLOP/s", f"{label}; {convention}")
      for r in results for name, key, label in (("flash", "yours", "your kernel"), ("sdpa", "sdpa", "torch SDPA"),
                                                ("naive", "naive", "naive attention"))
      if r[f"{key}_time"]),
    *(ledger.Figure(f"flash_max_error_len{r['S']}_{'causal' if r['causal'] else 'full'}", r["yours_err"], "abs",
                    "largest |difference| of your kernel from the float32 reference", timing=False)
      for r in results if r["yours_err"] is not None),
])

# %% [markdown]
# ## What you built
#
# * Naive attention's memory grows as $S^2$; at long context it cannot even be allocated.
# * The online softmax computes the same result exactly, one block of keys at a time, holding
#   only $O(S \cdot D)$ numbers.
# * Your kernel runs that loop with each tile in on-chip memory, skips the tiles a causal mask
#   would zero entirely, and returns the log-sum-exp that lets a later kernel combine partial
#   results (chapter 07 shows how decode uses it).
#
# On a GPU, compare your numbers with the course's reference kernel:
# `python -m labsupport.bench_attention` prints the reference against SDPA and naive attention.
