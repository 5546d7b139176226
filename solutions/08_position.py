# Lab 08 source of truth. Edit this file, then run `python -m labsupport release 08_position` to
# regenerate labs/08_position.ipynb (learners) and solutions/08_position.ipynb (instructors).

# %% [markdown]
# # Lab 08: rotary position embeddings, in torch and in one Triton launch
#
# Attention by itself does not know where a token sits. In this lab you will
#
# 1. see that attention without positions gives the same answer for any order of the tokens, and
#    measure what rotating positions costs on your device;
# 2. write rotary position embeddings (RoPE) in both layouts real checkpoints use, and have them
#    checked;
# 3. show numerically that the score of a query and a key depends only on their distance, and
#    how far bfloat16 rounding moves it;
# 4. write Llama 3.1's scaled frequencies, which stretch its context from 8,192 to 131,072
#    positions, and have them checked against the course's reference for several configs;
# 5. write a Triton kernel that rotates the queries and the keys in one launch, and count the
#    bytes it moves.
#
# Chapter 08 of the book explains the ideas in more depth. Run the cells from top to bottom; cells
# marked **Exercise** are yours, and the check after each one says precisely what is wrong.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. Sections 1 and 2 (a
# measurement on your device) need none of your code; the later sections use your functions, so
# each exercise's check must pass before the sections after it run.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import math

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

from labsupport import ledger
from labsupport.attention import naive_attention_reference
from labsupport.checks import check_apply_rope, check_fused_rope, check_llama3_inv_freq
from labsupport.device import device, gpu_has_bf16
from labsupport.interpreter_bytes import count_bytes
from labsupport.position import (
    LLAMA3_THETA,
    LLAMA31_ROPE_SCALING,
    ROFORMER_THETA,
    halves_order,
    interleaved_to_halves,
    rope_inv_freq,
    rope_kernel_bytes,
    rope_with_inv_freq,
)
from labsupport.timing import benchmark

DEVICE = device()

# %% [markdown]
# ## 1. Attention does not see order
#
# Scores are dot products of queries with keys, and the softmax and the weighted sum treat the
# keys as a set. Shuffle the tokens and every output row is shuffled the same way, unchanged:
# without something that marks positions, "dog bites man" and "man bites dog" look alike to a
# non-causal attention layer (a causal mask gives a little order, through what each token may
# see, but nothing about distance).

# %% tags=["nbval-check-output"]
gen = torch.Generator().manual_seed(0)
x = torch.randn(1, 1, 6, 16, generator=gen)  # (B, H, S, D): six tokens
order = torch.tensor([3, 0, 5, 1, 4, 2])  # a shuffle of the six
out = naive_attention_reference(x, x, x, False)
out_shuffled = naive_attention_reference(x[:, :, order], x[:, :, order], x[:, :, order], False)
print("shuffled input gives the shuffled output:", torch.allclose(out_shuffled, out[:, :, order], atol=1e-6))

# %% [markdown]
# ## 2. What rotating positions costs, measured
#
# Every layer rotates the queries and keys of every new token. Below, the course's plain-torch
# RoPE (`labsupport.position.rope_with_inv_freq`, several separate torch operations) rotates one
# layer's queries and keys for a batch of tokens with Llama 3.1 8B's heads: 32 query heads and
# 8 key heads of 128 features. A kernel that does this in one pass must read and write each
# element once; dividing those bytes by the time gives the bandwidth the unfused version achieves.
# Section 6 builds the fused kernel.

# %%
m_heads, m_kv_heads, m_dim = 32, 8, 128
m_tokens = settings.pick(small=256, full=8192)
m_dtype = torch.float32 if not settings.on_gpu else (torch.bfloat16 if gpu_has_bf16() else torch.float16)
mq = torch.randn(1, m_heads, m_tokens, m_dim, device=DEVICE, dtype=m_dtype)
mk = torch.randn(1, m_kv_heads, m_tokens, m_dim, device=DEVICE, dtype=m_dtype)
m_positions = torch.arange(m_tokens, device=DEVICE)
m_inv_freq = rope_inv_freq(m_dim, LLAMA3_THETA, LLAMA31_ROPE_SCALING).to(DEVICE)
timing = benchmark(lambda: (rope_with_inv_freq(mq, m_positions, m_inv_freq),
                            rope_with_inv_freq(mk, m_positions, m_inv_freq)))
needed_bytes = 2 * (mq.numel() + mk.numel()) * mq.element_size()  # read once, write once
print(f"{m_tokens} tokens, {str(m_dtype)[6:]}, on {settings.device_name}: {timing.median_ms:.3f} ms{timing.label()}")
print(f"a fused kernel must move {needed_bytes / 1e6:.1f} MB: the unfused torch version runs at "
      f"{needed_bytes / timing.median_s / 1e9:.2f} GB/s of useful traffic")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
ledger.record("08_position", [
    ledger.Figure("rope_unfused_bandwidth", needed_bytes / timing.median_s / 1e9, "GB/s",
                  f"unfused torch RoPE of q ({m_heads} heads) and k ({m_kv_heads} heads), {m_tokens} tokens, "
                  f"D={m_dim}, {str(m_dtype)[6:]}; bytes read once and written once over median time"),
], timings_real=True)  # plain torch: a real timing on a CPU too

# %% [markdown]
# ## 3. Rotary embeddings: rotate every pair by its position
#
# RoPE (Su et al., 2021) splits each query and key of $D$ features into $D/2$ pairs and turns
# pair $i$ of the token at position $m$ by the angle $m\,\omega_i$, with
#
# $$\omega_i = \theta^{-2i/D}, \qquad i = 0, 1, \dots, D/2 - 1,$$
#
# $$\begin{pmatrix} a' \\ b' \end{pmatrix} =
#   \begin{pmatrix} \cos m\omega_i & -\sin m\omega_i \\ \sin m\omega_i & \cos m\omega_i \end{pmatrix}
#   \begin{pmatrix} a \\ b \end{pmatrix}.$$
#
# Pair 0 turns by a full radian per position, the last pair by almost nothing. The base $\theta$
# is 10,000 in RoFormer and 500,000 in Llama 3. Which two features form a pair is a convention,
# and real checkpoints use both:
#
# * **halves**: pair $i$ is $(x_i, x_{i + D/2})$ (Hugging Face's Llama, vLLM's `is_neox_style=True`);
# * **interleaved**: pair $i$ is $(x_{2i}, x_{2i+1})$ (Meta's original Llama code, GPT-J, RoFormer).
#
# ### Exercise 1: `apply_rope`
#
# Write `apply_rope(x, positions, theta, layout)`: `x` is `(B, H, S, D)`, `positions` is `(S,)`
# int64 (token `s` of the sequence sits at `positions[s]`, which need not be `s`: in decode the
# new token sits after everything cached), `layout` is `"halves"` or `"interleaved"`. Compute the
# angles and the rotation in float32 and return a new tensor of `x`'s shape and dtype. The check
# tries both layouts, positions that do not start at 0 or are not in order, a position past
# 8,192, and float32, float16 and bfloat16 inputs.

# %%
def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, layout: str) -> torch.Tensor:
    # BEGIN SOLUTION: frequencies theta ** (-2i/D), angles positions x frequencies, rotate each pair
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device).float() / d)  # (D/2,)
    angles = positions.to(x.device).float()[:, None] * inv_freq[None, :]  # (S, D/2)
    cos, sin = angles.cos(), angles.sin()
    xf = x.float()
    if layout == "halves":
        a, b = xf[..., : d // 2], xf[..., d // 2 :]  # (B, H, S, D/2) each
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    elif layout == "interleaved":
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)  # a0 b0 a1 b1 ...
    else:
        raise ValueError(f"layout must be 'halves' or 'interleaved', got {layout!r}")
    return out.to(x.dtype)
    # END SOLUTION

# %%
check_apply_rope(apply_rope)

# %% [markdown]
# ### The two layouts compute the same model
#
# A checkpoint written for one layout runs in the other once the rows of its query and key
# projections are reordered inside each head: the interleaved order `0, 1, 2, 3, ...` becomes
# `0, 2, 4, ..., 1, 3, 5, ...`. That is the `permute` in transformers' Llama conversion script.
# Below, one head's query and key come from projection weights; RoPE in the interleaved layout on
# the original weights and RoPE in halves on the permuted weights give the same scores (the
# features come out in a different order, and a dot product does not mind).

# %% tags=["nbval-check-output"]
d_model, head_dim, n_heads = 32, 16, 2
gen = torch.Generator().manual_seed(1)
w_q = torch.randn(n_heads * head_dim, d_model, generator=gen) / math.sqrt(d_model)  # interleaved checkpoint
w_k = torch.randn(n_heads * head_dim, d_model, generator=gen) / math.sqrt(d_model)
tokens = torch.randn(1, 8, d_model, generator=gen)  # (B, S, d_model)
positions = torch.arange(8)


def scores(w_q, w_k, layout):
    q = (tokens @ w_q.T).view(1, 8, n_heads, head_dim).transpose(1, 2)  # (B, H, S, D)
    k = (tokens @ w_k.T).view(1, 8, n_heads, head_dim).transpose(1, 2)
    q, k = apply_rope(q, positions, ROFORMER_THETA, layout), apply_rope(k, positions, ROFORMER_THETA, layout)
    return q @ k.transpose(-2, -1)  # (B, H, S, S)


s_interleaved = scores(w_q, w_k, "interleaved")
s_halves = scores(interleaved_to_halves(w_q, n_heads), interleaved_to_halves(w_k, n_heads), "halves")
print("order of one head's rows:", halves_order(head_dim).tolist())
print("same scores:", torch.allclose(s_interleaved, s_halves, atol=1e-5))
print("without the permutation:", torch.allclose(s_interleaved, scores(w_q, w_k, "halves"), atol=1e-5))

# %% [markdown]
# ## 4. The score depends on the distance only
#
# Rotations compose: $R(m\omega)^\top R(n\omega) = R((n - m)\omega)$, so the dot product of a
# query rotated to position $m$ with a key rotated to $n$ is the dot product of the unrotated
# key with the unrotated query turned once, by $(m - n)\omega$. Shift both by the same amount and
# the score stays put. Below, 256 random query-key pairs 16 positions apart slide from positions (16, 0) to
# (100,016, 100,000), with your `apply_rope` (angles and rotation in float32, the result rounded
# to the dtype of the column); the table shows the largest change of a score $q \cdot k/\sqrt{D}$,
# summed in float32 (scores here have a standard deviation near 1). In exact arithmetic every
# entry is 0.

# %%
def score_change(dtype, starts, distance=16, head_dim=128, pairs=256):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(pairs, 1, 1, head_dim, generator=gen).to(dtype)  # (N, H=1, S=1, D)
    k = torch.randn(pairs, 1, 1, head_dim, generator=gen).to(dtype)

    def score(m, n):
        qm = apply_rope(q, torch.tensor([m]), LLAMA3_THETA, "halves").float()
        kn = apply_rope(k, torch.tensor([n]), LLAMA3_THETA, "halves").float()
        return (qm * kn).sum(dim=(-3, -2, -1)) / math.sqrt(head_dim)  # (N,)

    base = score(distance, 0)
    return [(score(s + distance, s) - base).abs().max().item() for s in starts]


starts = [0, 100, 1_000, 10_000, 100_000]
changes = {dtype: score_change(dtype, starts) for dtype in (torch.float32, torch.bfloat16)}
print(f"{'start':>8} {'float32':>10} {'bfloat16':>10}")
for i, s in enumerate(starts):
    print(f"{s:8d} {changes[torch.float32][i]:10.2e} {changes[torch.bfloat16][i]:10.2e}")

# %% [markdown]
# Two sources of error show. In float32, the angle $m\,\omega_i$ itself is rounded: at position
# 100,000 a float32 angle is off by up to about $100{,}000 \times 2^{-24} \approx 0.006$ radians,
# so the change grows with the position. In bfloat16 the rotated vectors are rounded to 8
# significant bits whatever the position, which moves every score by up to about a percent of its
# typical size: small beside the differences attention cares about, and the same at every position.
# (This runs in torch on the CPU, which computes in bfloat16 correctly; Triton's interpreter
# cannot, so the kernel below is tested in float32 and float16 here and in bfloat16 on a GPU.)

# %% [markdown]
# ## 5. The base and the wavelengths
#
# Pair $i$ completes a turn every $2\pi/\omega_i$ positions, its **wavelength**. The fastest pair
# repeats every $2\pi \approx 6.3$ positions; the slowest sets the longest distance the embedding
# can tell apart without ambiguity. Raising $\theta$ from 10,000 to 500,000 stretches the slow
# end:

# %% tags=["nbval-check-output"]
for theta in (ROFORMER_THETA, LLAMA3_THETA):
    wavelengths = 2 * math.pi / rope_inv_freq(128, theta).double()
    print(f"theta {theta:>9,.0f}, D=128: wavelengths from {wavelengths[0]:.2f} to {wavelengths[-1]:,.0f} positions")

# %% [markdown]
# ### Exercise 2: Llama 3.1's scaled frequencies
#
# Llama 3 was trained on 8,192 positions; Llama 3.1 reaches 131,072 by changing its frequencies
# with a rule in its `config.json`:

# %% tags=["nbval-check-output"]
print(LLAMA31_ROPE_SCALING)

# %% [markdown]
# With $L$ = `original_max_position_embeddings` and each pair's wavelength $\lambda_i = 2\pi/\omega_i$:
#
# * $\lambda_i < L / $ `high_freq_factor` (the pair turns many times within the trained context):
#   keep $\omega_i$;
# * $\lambda_i > L / $ `low_freq_factor` (the pair never completed a turn in training): divide
#   $\omega_i$ by `factor`, so positions up to `factor` times further map onto angles it has seen;
# * in between, blend: $s = (L/\lambda_i - \text{low}) / (\text{high} - \text{low})$ and
#   $\omega_i' = \omega_i \left((1 - s)/\text{factor} + s\right)$.
#
# Write `llama3_inv_freq(head_dim, theta, scaling)`, returning the `(head_dim // 2,)` frequencies
# (float32). The check compares it with the course's reference (which matches transformers'
# `ROPE_INIT_FUNCTIONS["llama3"]` exactly) on Llama 3.1's config, Llama 3.2's (factor 32), and
# made-up ones.

# %%
def llama3_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # BEGIN SOLUTION: wavelengths of the plain frequencies; keep the short, divide the long, blend between
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # (D/2,)
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = inv_freq * ((1 - smooth) / factor + smooth)
    out = torch.where(wavelength > original / low, inv_freq / factor, blended)
    return torch.where(wavelength < original / high, inv_freq, out)
    # END SOLUTION

# %%
check_llama3_inv_freq(llama3_inv_freq)

# %% [markdown]
# Which pairs moved: the fast ones are untouched (distances within a sentence keep their exact
# angles), the slow ones turn `factor` times slower, and a band in between is blended.

# %%
plain = 2 * math.pi / rope_inv_freq(128, LLAMA3_THETA).double()
scaled = 2 * math.pi / llama3_inv_freq(128, LLAMA3_THETA, LLAMA31_ROPE_SCALING).double()
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(plain, "o-", ms=3, label="theta 500,000")
ax.plot(scaled, "o-", ms=3, label="with Llama 3.1's scaling")
for value, name in ((8192 / 4, "L / high_freq_factor"), (8192 / 1, "L / low_freq_factor")):
    ax.axhline(value, color="grey", lw=0.8, ls="--")
    ax.text(1, value * 1.3, name, fontsize=8, color="grey")
ax.set(yscale="log", xlabel="pair i", ylabel="wavelength (positions)", title="RoPE wavelengths, D = 128")
ax.legend()
fig.tight_layout()

# %% [markdown]
# ## 6. One launch for q and k
#
# At serving time RoPE runs on every token's queries and keys, in every layer, before the keys
# go into the KV cache (the cache holds rotated keys, so decode never rotates them again). It is
# pure memory traffic: a handful of multiplications per element loaded. Engines therefore fuse
# the queries and the keys into one kernel (vLLM's `rotary_embedding` op rotates both, in place):
# one launch, and the angles of each position computed once for all heads.
#
# ### Exercise 3: the fused kernel
#
# Complete `fused_rope_kernel` and `fused_rope(q, k, positions, inv_freq)`: `q` is `(B, H, S, D)`,
# `k` is `(B, Hkv, S, D)` (grouped-query attention: fewer key heads), `inv_freq` `(D/2,)` float32
# (so the same kernel serves plain and scaled frequencies); halves layout; return `(q_rot, k_rot)`
# in the inputs' dtype. `positions` is `(B * S,)` int64, **one per token**, sequence after
# sequence: token `s` of sequence `b` sits at `positions[b * S + s]`. The requests of a batch are at
# different points of their lives (one starts its prompt, another resumes after 500 cached tokens,
# a third decodes its 4,000th token), so each sequence has positions of its own; vLLM's rotary
# kernel likewise takes one position per token (`positions` of shape `(num_tokens,)`). The design
# used by the solution:
#
# * **Grid** `(cdiv(S, BLOCK_S), B)`: each program owns `BLOCK_S` tokens of one sequence. It
#   loads their positions (sequence `b`'s start at `b * S`; masked: the last block is usually
#   partial) and the frequencies, computes the `(BLOCK_S, D/2)` angles, their cos and sin once,
#   then loops over the `H` query heads and the `Hkv` key heads, loading each head's two halves as
#   `(BLOCK_S, D/2)` tiles, rotating in float32 and storing.
# * **Offsets**: with contiguous inputs, element `(b, h, s, j)` of q sits at
#   `((b * H + h) * S + s) * D + j`; make the head's base offset 64-bit (`.to(tl.int64)`).
# * **Masks**: rows at or past `S` must be neither loaded nor stored.
#
# The check runs S of 1, 17, 37 and 100 with `BLOCK_S` of your choice, head counts 1 to 6, batches
# whose sequences each have their own positions, and Llama 3.1's scaled frequencies at positions
# past 8,192, in float32 and float16 (bfloat16 too on a GPU). In the interpreter it also counts launches: exactly one. You may rotate in place
# (as vLLM does) or into new tensors. Write the kernel body first, then the wrapper: on a GPU a
# kernel that still contains its `raise NotImplementedError` line fails to compile with
# `unsupported AST node type: Raise`, which only means the body is not written yet.

# %%
BLOCK_S = 32


@triton.jit
def fused_rope_kernel(
    q_ptr,  # (B, H, S, D) queries, contiguous
    k_ptr,  # (B, Hkv, S, D) keys, contiguous
    q_out_ptr,  # (B, H, S, D) rotated queries
    k_out_ptr,  # (B, Hkv, S, D) rotated keys
    positions_ptr,  # (B * S,) int64: one per token, token s of sequence b at b * S + s
    inv_freq_ptr,  # (D/2,) float32
    seq_len,  # S
    n_heads,  # H
    n_kv_heads,  # Hkv
    HALF: tl.constexpr,  # D / 2, a power of two
    BLOCK_S: tl.constexpr,  # positions per program
):
    # BEGIN SOLUTION: this block's own positions and their angles once, then rotate every q head and every k head
    pid_s = tl.program_id(0)  # which block of tokens
    b = tl.program_id(1)  # which sequence
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    row_ok = offs_s < seq_len  # the last block may be partial
    offs_f = tl.arange(0, HALF)  # (D/2,)
    pos = tl.load(positions_ptr + b.to(tl.int64) * seq_len + offs_s, mask=row_ok, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + offs_f)
    angle = pos[:, None] * inv_freq[None, :]  # (BLOCK_S, D/2)
    cos, sin = tl.cos(angle), tl.sin(angle)
    first = offs_s[:, None] * (2 * HALF) + offs_f[None, :]  # (BLOCK_S, D/2) offsets of the first halves
    mask = row_ok[:, None]
    for h in range(n_heads):
        base = (b.to(tl.int64) * n_heads + h) * seq_len * (2 * HALF)
        a = tl.load(q_ptr + base + first, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(q_ptr + base + first + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_out_ptr + base + first, (a * cos - c * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_out_ptr + base + first + HALF, (a * sin + c * cos).to(q_out_ptr.dtype.element_ty), mask=mask)
    for h in range(n_kv_heads):
        base = (b.to(tl.int64) * n_kv_heads + h) * seq_len * (2 * HALF)
        a = tl.load(k_ptr + base + first, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(k_ptr + base + first + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(k_out_ptr + base + first, (a * cos - c * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
        tl.store(k_out_ptr + base + first + HALF, (a * sin + c * cos).to(k_out_ptr.dtype.element_ty), mask=mask)
    # END SOLUTION


def fused_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # BEGIN SOLUTION: check shapes, make inputs contiguous, allocate both outputs, launch one grid
    b, h, s, d = q.shape
    assert k.dim() == 4 and k.shape[0] == b and k.shape[2] == s and k.shape[3] == d, "k must be (B, Hkv, S, D)"
    assert d in (4, 8, 16, 32, 64, 128, 256), "head dim must be a power of two"
    assert positions.shape == (b * s,), "positions must be (B * S,): one per token, sequence after sequence"
    assert inv_freq.shape == (d // 2,)
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    grid = (triton.cdiv(s, BLOCK_S), b)
    fused_rope_kernel[grid](q, k, q_out, k_out, positions.contiguous(), inv_freq.float().contiguous(),
                            s, h, k.shape[1], HALF=d // 2, BLOCK_S=BLOCK_S)
    return q_out, k_out
    # END SOLUTION

# %%
check_fused_rope(fused_rope)

# %% [markdown]
# ## 7. The bytes it moves
#
# A fused RoPE kernel must read every element of q and k once and write it once; the positions
# and the frequencies add a little. In Triton's interpreter, `labsupport.interpreter_bytes`
# counts what your kernel actually loaded and stored (every active lane of every `tl.load` and
# `tl.store`, masked-off lanes excluded), so on a CPU you can compare it with that formula. It
# counts lanes, not distinct addresses: a tile loaded twice counts twice, so the count is what the
# kernel asks of memory, an upper bound on the HBM traffic of the same kernel on a GPU (where
# caches may serve the repeats). On a GPU kernels are compiled and nothing can be counted: there
# the figure is the formula.

# %%
bytes_b, bytes_h, bytes_hkv, bytes_s, bytes_d = 2, 8, 2, 100, 64
gen = torch.Generator().manual_seed(3)
q = torch.randn(bytes_b, bytes_h, bytes_s, bytes_d, generator=gen, dtype=torch.float16).to(DEVICE)
k = torch.randn(bytes_b, bytes_hkv, bytes_s, bytes_d, generator=gen, dtype=torch.float16).to(DEVICE)
# one position per token: the second sequence resumes after 500 cached tokens
positions = torch.cat([torch.arange(bytes_s), 500 + torch.arange(bytes_s)]).to(DEVICE)
inv_freq = rope_inv_freq(bytes_d, LLAMA3_THETA, LLAMA31_ROPE_SCALING).to(DEVICE)
qk_bytes = 2 * bytes_b * (bytes_h + bytes_hkv) * bytes_s * bytes_d * 2  # q and k, read and written, fp16
programs = triton.cdiv(bytes_s, BLOCK_S) * bytes_b  # the solution's grid; yours may differ
needed = rope_kernel_bytes(bytes_b, bytes_h, bytes_hkv, bytes_s, bytes_d, dtype_bytes=2, programs=programs)
print(f"formula: q and k read once and written once: {qk_bytes:,} bytes")
print(f"         with the positions, and the frequencies read by each of {programs} programs: {needed:,} bytes")
if settings.interpreter:
    with count_bytes() as counted:
        fused_rope(q, k, positions, inv_freq)
    print(f"counted in the interpreter: loaded {counted.loaded:,}, stored {counted.stored:,}, "
          f"total {counted.total:,} bytes in {counted.launches} launch(es)")
    for name, traffic in counted.by_argument.items():
        print(f"  {name:>16}: loaded {traffic.loaded:8,}  stored {traffic.stored:8,}")
    moved_qk = sum(t.total for n, t in counted.by_argument.items() if n not in ("positions_ptr", "inv_freq_ptr"))
    print(f"q and k as counted: {moved_qk:,} bytes ({moved_qk / qk_bytes:.3f} x the formula)")
else:
    print("On a GPU the kernel is compiled, so its bytes cannot be counted; the formula above is the figure.")

# %% [markdown]
# A kernel that loads each element of q and k once and stores it once moves exactly the
# formula's bytes of q and k; one that loads a row twice (the whole row, then its swapped halves)
# counts more, although L2 would absorb most of that on a GPU. The rest is small change: the solution's programs each read the `D/2` frequencies once, and a kernel
# with one program per position would read them `B * S` times. A kernel that rotated q and k in
# two launches would move the same bytes but compute every angle twice and pay for a second launch.
#
# ## What you built
#
# * RoPE in both layouts, and the permutation that moves a checkpoint between them.
# * The evidence that the score depends on the distance alone, and the size of bf16's rounding.
# * Llama 3.1's frequency scaling, the rule behind its 131,072-position context.
# * A fused kernel that rotates queries and keys in one launch, and a count of its bytes.
