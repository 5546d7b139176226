# Lab 02 source of truth. Edit this file, then run `python -m labsupport release 02_anatomy` to
# regenerate labs/02_anatomy.ipynb (learners) and solutions/02_anatomy.ipynb (instructors).

# %% [markdown]
# # Lab 02: the anatomy of a decoder, counted and profiled
#
# A served model is a stack of a few kinds of layers, repeated. In this lab you will
#
# 1. follow one forward pass of the course model layer by layer and watch the shapes;
# 2. count what one prefill and one decode step should cost, part by part: FLOPs and bytes;
# 3. profile the same two steps with `torch.profiler` and compare where the time goes with where
#    the FLOPs and the bytes say it should;
# 4. write `param_count_by_component`, the exact number of weights in each part of a decoder of
#    any shape, tied embeddings, q/k/v biases and explicit head widths included, derived from the
#    module trees of real architectures (no table of formulas), and have it checked;
# 5. verify your count three ways: your formula, the course model's `numel()`, and Hugging Face
#    `transformers` building the real architectures (Llama 3.1, Mistral, Qwen2, Qwen3) on the
#    meta device, with no download and no memory;
# 6. see where the parameters of real models are, and what a mixture of experts changes;
# 7. read a real `config.json`, with each family's defaults for the fields it leaves out, into the
#    same count (checked);
# 8. count the bytes one decode step reads from a `config.json` (checked), predict the step's time
#    from them and this machine's memory bandwidth, and compare with the step measured in section 3.
#
# Everything runs on a CPU in well under a minute. The model's weights are random: the time a
# forward pass of a dense model takes does not depend on their values. (The time a *request* takes
# does: when it emits its end token, which experts a mixture of experts routes each token to, and
# how many draft tokens a speculative decoder accepts all depend on the weights.)
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written the exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. The profile (sections
# 2 and 3) comes before the exercise, so a first Run All already measures your device.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
from labsupport.serve import install_missing

# Hugging Face transformers, the reference this lab counts against, only where it is missing
installed = install_missing({"transformers": "transformers>=5"})

# %%
import matplotlib.pyplot as plt
import torch
import transformers

from labsupport import ledger
from labsupport.anatomy import (
    COMPONENTS,
    STEP_PARTS,
    hf_model,
    hf_param_counts,
    model_param_counts,
    moe_param_counts,
    profile_step,
    step_costs,
    time_step,
)
from labsupport.checks import (
    check_decode_bytes_from_config,
    check_hf_weight_names,
    check_param_count_by_component,
    check_params_from_config,
)
from labsupport.costs import param_count
from labsupport.device import device, lab_dtype
from labsupport.models import HF_CONFIGS, ModelConfig, get_model, hf_config, to_hf_config
from labsupport.roofline import measure_copy
from labsupport.timing import benchmark
from labsupport.transformer import Transformer

DEVICE = device()
if not settings.on_gpu:
    # One thread keeps CPU timings steady when other programs share the cores.
    torch.set_num_threads(1)

# %% [markdown]
# ## 1. One forward pass, layer by layer
#
# The course model (`labsupport.transformer.Transformer`) is a Llama-style decoder. Here is the
# smallest preset, `tiny-2m`, reading a prompt of 5 tokens. Forward hooks record what each module
# hands on: watch the last dimension change from the model width `d` to the query, key and value
# widths, to the feed-forward width and back, and finally to the vocabulary.

# %% tags=["nbval-check-output"]
TINY = get_model("tiny-2m")
tiny = Transformer(TINY, seed=0)
print(f"{TINY.name}: n_layers={TINY.n_layers}, d_model={TINY.d_model}, n_heads={TINY.n_heads}, "
      f"n_kv_heads={TINY.n_kv_heads}, head_dim={TINY.head_dim}, d_ff={TINY.d_ff}, vocab_size={TINY.vocab_size}, "
      f"tied_embeddings={TINY.tied_embeddings}\n")

seen = []  # (module name, class, output shape, parameters)
hooks = []
for name, module in tiny.named_modules():
    if name and (name.count(".") <= 3) and not name.startswith("layers.1"):  # layer 0 shows them all
        def record(mod, args, out, name=name):
            seen.append((name, type(mod).__name__, tuple(out.shape), sum(p.numel() for p in mod.parameters())))
        hooks.append(module.register_forward_hook(record))

prompt = tiny.random_prompt(batch=1, length=5, seed=0)  # (B=1, S=5) token ids
logits = tiny.forward_no_cache(prompt)  # (B, V): the last position's scores
for h in hooks:
    h.remove()

print(f"{'module':32s} {'class':12s} {'output shape':16s} {'parameters':>10s}")
for name, cls, shape, params in seen:
    print(f"{name:32s} {cls:12s} {str(shape):16s} {params:10,}")
print(f"{'output layer (tied to the table)':32s} {'x @ E.T':12s} {str(tuple(logits.shape)):16s} {0:10,}")
print("next token (greedy):", int(logits.argmax(-1)))

# %% [markdown]
# Read the table from the top:
#
# * **embedding**: each token id picks a row of a `V x d` table: `(1, 5)` ids become `(1, 5, d)`.
# * in every **block**, an RMSNorm, then the query projection `wq` to `n_heads * head_dim`, the key
#   and value projections `wk`, `wv` to `n_kv_heads * head_dim` only (grouped-query attention), the
#   rotation of queries and keys by position (chapter 08), attention, and `wo` back to `d`; the
#   residual adds the result to the block's input. Then a second RMSNorm and the SwiGLU feed-forward
#   (`w1` gate and `w3` up to `d_ff`, `w2` down to `d`), and a second residual add.
# * after the last block, the final **norm**, and the **output layer**: one score per vocabulary
#   entry. This preset ties it to the embedding table (`logits = x @ E.T`), so it has no weights of
#   its own, and the model computes it for the last position only, the one whose next token is chosen.
#
# The norms hold `d` weights each; everything else is a matrix. That is why the count below is
# almost entirely matrices, and why a step costs about 2 FLOPs per parameter per token.

# %% [markdown]
# ## 2. What one step should cost, by part
#
# `step_costs(cfg, batch, new_tokens, context)` counts the matrix FLOPs of a step (2 per multiply-add)
# and the bytes it must read (weights, and the keys and values attended to), by part. A prefill is
# `new_tokens=P`; a decode step is one token after `context` cached ones. The model profiled
# below: `small-63m` on a CPU (about 250 MB of fp32 weights, several times a CPU's cache, so decode
# streams them from memory as a GPU streams from HBM); Llama 3.1 8B on a GPU with room for it.

# %%
MODEL_NAME = settings.pick(small="small-63m", full="llama-3.1-8b")
DTYPE = lab_dtype()  # bf16 (fp16 before Ampere) on a GPU, fp32 on a CPU
if settings.on_gpu and torch.cuda.get_device_properties(0).total_memory < 2.5 * 2 * param_count(get_model(MODEL_NAME)):
    MODEL_NAME = "small-63m"
    print(f"this GPU has too little memory for the 8B shape; using {MODEL_NAME} instead")
CFG = get_model(MODEL_NAME)
DTYPE_BYTES = torch.empty((), dtype=DTYPE).element_size()
PROMPT = settings.pick(small=128, full=1024)

predicted = {
    "prefill": step_costs(CFG, batch=1, new_tokens=PROMPT, dtype_bytes=DTYPE_BYTES),
    "decode": step_costs(CFG, batch=1, new_tokens=1, context=PROMPT + 1, dtype_bytes=DTYPE_BYTES),
}

# %% tags=["nbval-check-output"]
for phase, parts in predicted.items():
    flops = sum(p["flops"] for p in parts.values())
    read = sum(p["bytes"] for p in parts.values())
    print(f"{CFG.name} {phase}: {flops / 1e9:,.2f} GFLOP, {read / 2**20:,.1f} MiB read, "
          f"{flops / read:,.1f} FLOP per byte")
    for part, p in parts.items():
        print(f"   {part:34s} {100 * p['flops'] / flops:5.1f}% of FLOPs  {100 * p['bytes'] / read:5.1f}% of bytes")

# %% [markdown]
# Every weight does 2 FLOPs per token it multiplies. A prefill of $P$ tokens reads each weight once
# and uses it $P$ times: about $2P$ FLOPs per weight, $P/2$ FLOPs per byte in fp32 ($P$ in bf16),
# so it is limited by arithmetic. A decode step uses each weight once: 0.5 FLOPs per byte in fp32,
# 1 in bf16, so it is limited by reading memory (chapters 04 and 05). The feed-forward dominates
# both. The output layer is computed for the last position only, so in prefill it is a sliver of
# the FLOPs but still all of its bytes; and the embedding table is barely read at all (one row per
# token), though a tied model reads the same table in full as its output layer.

# %% [markdown]
# ## 3. Where the time goes: `torch.profiler`
#
# `profile_step` runs the step under `torch.profiler.profile`, with a labelled range
# (`torch.profiler.record_function`) around each part of the model, put there by forward hooks.
# First the profiler's own view: the operators that took the most time.

# %%
model = Transformer(CFG, device=DEVICE, dtype=DTYPE, seed=0)
measured = {phase: profile_step(model, phase, PROMPT, repeats=3) for phase in ("prefill", "decode")}
unprofiled = {phase: time_step(model, phase, PROMPT) for phase in ("prefill", "decode")}
where = measured["decode"]["device"]
print(measured["decode"]["profiler"].key_averages().table(sort_by="self_cpu_time_total", row_limit=8))

# %% [markdown]
# `aten::addmm`/`aten::mm` (inside `aten::linear`) are the matrix multiplications; the rest are
# the small operations around them. Now the same profile by part, against the predictions of
# section 2. The times are measured on the device printed first (CPU or GPU); on a CPU they say
# how a CPU spends a step, not how a GPU would.

# %%
print(f"device: {where} ({'one thread' if where == 'CPU' else str(torch.cuda.get_device_name(0))}), "
      f"{CFG.name}, {str(DTYPE)[6:]}, prompt {PROMPT}")
for phase in ("prefill", "decode"):
    seconds, step = measured[phase]["seconds"], measured[phase]["step_s"]
    flops = sum(p["flops"] for p in predicted[phase].values())
    read = sum(p["bytes"] for p in predicted[phase].values())
    print(f"\n{phase}: {step * 1e3:.1f} ms per step profiled, {unprofiled[phase] * 1e3:.1f} ms without the profiler")
    print(f"   {'part':34s} {'time':>7s} {'FLOPs':>7s} {'bytes':>7s}")
    for part in STEP_PARTS:
        p = predicted[phase].get(part, {"flops": 0.0, "bytes": 0.0})
        print(f"   {part:34s} {100 * seconds[part] / step:6.1f}% {100 * p['flops'] / flops:6.1f}% "
              f"{100 * p['bytes'] / read:6.1f}%")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
ledger.record("02_anatomy", [
    ledger.Figure(f"{phase}_step_ms", unprofiled[phase] * 1e3, "ms",
                  f"{CFG.name}, {str(DTYPE)[6:]}, prompt {PROMPT}: one {phase} step without the profiler")
    for phase in ("prefill", "decode")
], timings_real=True)  # plain torch: real timings on a CPU too

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, phase in zip(axes, ("prefill", "decode")):
    seconds, step = measured[phase]["seconds"], measured[phase]["step_s"]
    flops = sum(p["flops"] for p in predicted[phase].values())
    read = sum(p["bytes"] for p in predicted[phase].values())
    ys = range(len(STEP_PARTS))
    ax.barh([y - 0.27 for y in ys], [100 * seconds[p] / step for p in STEP_PARTS], 0.27,
            label=f"time ({where}, measured)")
    ax.barh(list(ys), [100 * predicted[phase].get(p, {"flops": 0})["flops"] / flops for p in STEP_PARTS], 0.27,
            label="FLOPs")
    ax.barh([y + 0.27 for y in ys], [100 * predicted[phase].get(p, {"bytes": 0})["bytes"] / read for p in STEP_PARTS],
            0.27, label="bytes")
    ax.set_yticks(list(ys), STEP_PARTS)
    ax.set(xlabel="share of the step (%)", title=f"{phase}, {CFG.name}")
axes[0].invert_yaxis()
axes[1].legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# Read the two panels:
#
# * **Prefill** should follow the FLOPs: the feed-forward and the projections take nearly all of
#   the time, in proportion to their matrix sizes. Attention's share is small at this prompt
#   length and grows with it (its FLOPs grow with the square of the prompt, chapter 05).
# * **Decode** should follow the bytes, roughly: each part costs about what it must read. The
#   parts that read little but run many small operations (norms, the rotation and cache writes in
#   attention, the residual adds in "other") take more than their bytes say: at one token per
#   step, fixed per-operation costs matter. Note that in decode the FLOP and byte columns nearly
#   coincide (every weight is read once and used for 2 FLOPs), so shares alone cannot say whether
#   a part waits on memory or on arithmetic; a rate can (chapter 04): divide a part's bytes by its
#   time and compare with the device's memory bandwidth.
# * The profiler itself costs time (compare the two step times): use it to see *where* time goes,
#   and time the step without it to see *how much*.
#
# What a CPU profile cannot tell you about a GPU. A CPU core is slow at arithmetic and fast to
# start an operation, a GPU the reverse, so the shares move: on a GPU a decode step of a small
# model can be dominated by kernel launches (microseconds each, dozens per layer), which is why
# engines capture decode in CUDA graphs (chapter 13), and prefill's attention share depends on
# the attention kernel (chapter 07). On a GPU, `profile_step` synchronises at every label so
# that each part's CPU-side range includes its kernels; that removes the overlap of launching
# and running, so small parts look larger than in an unprofiled step. For a GPU's own view, add
# `ProfilerActivity.CUDA` and read the kernel times. Measurements of the course on a GPU: not
# yet made.

# %% [markdown]
# ## 4. Exercise: the parameters of any decoder, by component
#
# How many weights does a decoder hold, and where? No table of formulas here: the module tree says it. Below
# is layer 0 of each family the course serves, built by Hugging Face `transformers` from a small
# `config.json` on the meta device (shapes, no memory), with the fields that set each shape. Every
# `Linear(in_features=a, out_features=b, bias=...)` holds $a \cdot b$ weights, plus $b$ more when it has a
# bias; every `RMSNorm((w,))` holds $w$. Read them: which widths come from which field, which projections
# have a bias in which family, and which norms exist beyond the two of every layer.

# %%
def small(family, **fields):  # a small config.json of the family, for a short tree
    return {"model_type": family, "architectures": [family.capitalize() + "ForCausalLM"], "num_hidden_layers": 1,
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "vocab_size": 500, **fields}


TREES = {
    "llama (attention_bias true)": small("llama", attention_bias=True),
    "mistral": small("mistral"),
    "qwen2": small("qwen2"),
    "qwen3 (head_dim 32, tied)": small("qwen3", head_dim=32, tie_word_embeddings=True),
}
for label, config in TREES.items():
    built = hf_model(config)
    print(f"--- {label}: {', '.join(f'{k}={v}' for k, v in config.items() if k not in ('architectures', 'model_type'))}")
    print("embed_tokens:", built.model.embed_tokens, "| norm:", built.model.norm, "| lm_head:", built.lm_head,
          "| tied:", built.lm_head.weight is built.model.embed_tokens.weight)
    print(built.model.layers[0])

# %% [markdown]
# Complete `param_count_by_component(cfg)`. `cfg` is a `labsupport.models.ModelConfig` with fields
# `n_layers`, `d_model`, `n_heads`, `n_kv_heads`, `head_dim`, `d_ff`, `vocab_size`, and the flags in which
# real models differ: `tied_embeddings`, `qkv_bias` (biases on q, k and v), `o_bias` (a bias on the output
# projection) and `qk_norm` (Qwen3's norms on queries and keys). Return a dict with exactly these keys,
# each an `int`:
#
# * `"embedding"`: the token table;
# * `"attention"`: the q, k, v and output projections of all layers, with their biases;
# * `"feed_forward"`: SwiGLU's gate, up and down matrices of all layers;
# * `"norms"`: every RMSNorm weight vector (per layer, the final one, and any on queries and keys);
# * `"output"`: the output layer, or `0` when it is tied to the embedding table (one table, counted under
#   `"embedding"`).
#
# Use `cfg.head_dim`, never `d_model // n_heads`: the Qwen3 tree above has 4 heads of 32 on a width of 64
# (Qwen3-0.6B has 16 heads of 128 on a width of 1,024). Count from the fields with integer arithmetic; the
# check refuses a function that builds a model (that is section 5's cross-check).

# %%
def param_count_by_component(cfg) -> dict:
    # BEGIN SOLUTION: return a dict: each of the five components -> its number of parameters (an int)
    d, D, L, V = cfg.d_model, cfg.head_dim, cfg.n_layers, cfg.vocab_size
    q_width, kv_width = cfg.n_heads * D, cfg.n_kv_heads * D
    attention = d * q_width + 2 * d * kv_width + q_width * d  # wq, wk and wv, wo
    if cfg.qkv_bias:
        attention += q_width + 2 * kv_width
    if cfg.o_bias:
        attention += d
    norms = 2 * d * L + d + (2 * D * L if cfg.qk_norm else 0)
    return {
        "embedding": V * d,
        "attention": L * attention,
        "feed_forward": L * 3 * d * cfg.d_ff,
        "norms": norms,
        "output": 0 if cfg.tied_embeddings else V * d,
    }
    # END SOLUTION


# %%
check_param_count_by_component(param_count_by_component)

# %% [markdown]
# ## 5. Three ways to count
#
# A formula is only as good as its agreement with the real thing. For each shape, compare
#
# * **your formula**;
# * **the course model**: `Transformer(cfg, device="meta")` builds every layer with shapes and no
#   values, so even the 8B costs no memory; `model_param_counts` sums `numel()` by component;
# * **Hugging Face `transformers`**, building the architecture its own code defines (Llama, Mistral,
#   Qwen2, Qwen3) from the model's `config.json` on the meta device
#   (`with torch.device("meta"): AutoModelForCausalLM.from_config(...)`). The `config.json` dicts
#   of the real models ship with the course (`labsupport.models.HF_CONFIGS`, copied from each
#   model's page on the Hugging Face Hub): nothing is downloaded.

# %%
config = hf_config("qwen3-0.6b")  # a dict, as json.load(open("config.json")) gives it
print({k: config[k] for k in ("model_type", "hidden_size", "num_attention_heads", "head_dim",
                               "num_key_value_heads", "tie_word_embeddings")})
with torch.device("meta"):  # parameters get shapes, no memory and no values
    qwen = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
print(qwen.model.layers[0].self_attn)
print("a weight on the meta device:", qwen.model.layers[0].self_attn.q_proj.weight.device)

# %% tags=["nbval-check-output"]
shapes = {name: (get_model(name), hf_config(name)) for name in HF_CONFIGS}
for name in ("tiny-2m", "small-63m"):  # the course's presets, in transformers as Llama
    shapes[name] = (get_model(name), to_hf_config(get_model(name)))

print(f"{'model':16s} {'your formula':>16s} {'course numel':>16s} {'transformers':>16s}  agree")
for name, (cfg, hf_dict) in shapes.items():
    yours = param_count_by_component(cfg)
    course = model_param_counts(cfg)
    theirs = hf_param_counts(hf_dict)
    agree = yours == course == theirs
    print(f"{name:16s} {sum(yours.values()):16,} {sum(course.values()):16,} {sum(theirs.values()):16,}  {agree}")
    assert agree, (name, yours, course, theirs)

# %% [markdown]
# All three agree component by component, not just in total. Rounded, the totals are the sizes
# the Hugging Face Hub lists beside each checkpoint (counted from its weight files): 8.03B for
# Llama 3.1 8B, 7.24B for Mistral 7B v0.1, 7.62B for Qwen2-7B, 8.19B for Qwen3-8B. Announcements
# round differently (Mistral AI called its model 7.3B): trust the count, not the name.

# %% [markdown]
# ## 6. Where the parameters are
#
# The components of section 4 as shares of each model. In the 7-8B models the feed-forward holds
# two thirds to four fifths of the weights and attention a tenth to a fifth (grouped-query attention keeps
# the key and value projections small); the norms are a rounding error. In a small model with a
# 150k-entry vocabulary the embedding table is a quarter of everything, which is why small models
# tie it to the output layer; and Qwen3-0.6B's attention is large for its width, because its
# 16 heads of 128 make queries twice as wide as the model.

# %% tags=["nbval-check-output"]
names = list(HF_CONFIGS) + ["tiny-2m"]
shares = {}
print(f"{'model':16s}" + "".join(f"{c:>14s}" for c in COMPONENTS) + f"{'total':>16s}")
for name in names:
    parts = param_count_by_component(get_model(name))
    total = sum(parts.values())
    shares[name] = [parts[c] / total for c in COMPONENTS]
    print(f"{name:16s}" + "".join(f"{100 * s:13.1f}%" for s in shares[name]) + f"{total:16,}")

fig, ax = plt.subplots(figsize=(9, 3.6))
left = [0.0] * len(names)
for i, component in enumerate(COMPONENTS):
    widths = [100 * shares[n][i] for n in names]
    ax.barh(names, widths, left=left, label=component)
    left = [a + b for a, b in zip(left, widths)]
ax.set(xlabel="share of parameters (%)", xlim=(0, 100), title="Where the weights are")
ax.invert_yaxis()
ax.legend(ncol=5, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.1))
fig.tight_layout()

# %% [markdown]
# **Mixture of experts.** Mixtral 8x7B has the attention of Mistral 7B, but each layer's
# feed-forward is 8 experts, and a router sends every token to 2 of them. The memory holds all the
# experts; each token computes with two. (`moe_param_counts` counts it, and transformers' `mixtral`
# architecture, built on the meta device, must agree.)

# %% tags=["nbval-check-output"]
# the shape in the config.json of mistralai/Mixtral-8x7B-v0.1 (Hugging Face Hub), experts aside
mixtral_shape = ModelConfig("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, rope_theta=1e6)
moe = moe_param_counts(mixtral_shape, n_experts=8, experts_per_token=2)
mixtral_config = {**to_hf_config(mixtral_shape), "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                  "num_local_experts": 8, "num_experts_per_tok": 2}
hf_total = sum(p.numel() for p in hf_model(mixtral_config).parameters())
print(f"total {moe['total']:,} (transformers: {hf_total:,}); active per token {moe['active']:,} "
      f"({moe['active'] / moe['total']:.0%})")
assert hf_total == moe["total"], (hf_total, moe["total"])

# %% [markdown]
# ## 7. Exercise: read a real config.json
#
# An engine meets a model as its `config.json`, and so does a planner. Your count of section 4 took a
# `ModelConfig`, whose every field was filled in. A real file is terser: a field it leaves out takes the
# **default of the family's configuration class** in `transformers` (what transformers and vLLM build), and
# what a field means depends on the family. Two files from section 5:

# %%
for name in ("qwen3-0.6b", "mistral-7b-v0.1"):
    print(name, hf_config(name))
for family in ("llama", "mistral", "qwen2", "qwen3"):  # the defaults a file can rely on
    defaults = transformers.AutoConfig.for_model(family)
    print(f"{family:8s} defaults: num_key_value_heads={defaults.num_key_value_heads}, "
          f"head_dim={getattr(defaults, 'head_dim', None)} (of hidden_size={defaults.hidden_size}, "
          f"num_attention_heads={defaults.num_attention_heads}), tie_word_embeddings={defaults.tie_word_embeddings}")

# %% [markdown]
# Read them with care: Llama's `num_key_value_heads` follows `num_attention_heads` when it is missing, but
# Mistral's class puts 8 and Qwen's 32; Qwen3's `head_dim` is 128 unless the file says otherwise, the others'
# `hidden_size / num_attention_heads`. And the module trees of section 4 showed what the flags mean: which
# projections `attention_bias` switches (Llama, Qwen3), which Qwen2 always biases (its file has no switch), and
# the norms Qwen3 adds.
#
# Complete `params_from_config(config)`: `config` is a `config.json` as a dict (`json.load(open(...))`) of a
# `llama`, `mistral`, `qwen2` or `qwen3` model (`config["model_type"]`); return its parameters by component,
# the same dict as section 4's. You may build a `ModelConfig` and call your `param_count_by_component`, or count
# directly; reading the fields is the exercise, so the check refuses `labsupport.models.from_hf_config` (the
# course's reader) and anything that builds a model. (`transformers.AutoConfig.for_model(...)`, which only fills
# in defaults, is fine.)

# %%
def params_from_config(config):
    # BEGIN SOLUTION: read the fields (absent: the family's defaults), the bias and norm flags by family; count
    family = config["model_type"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or {"mistral": 8, "qwen2": 32, "qwen3": 32}.get(family, heads)
    head_dim = config.get("head_dim") or (128 if family == "qwen3" and "head_dim" not in config
                                          else config["hidden_size"] // heads)
    if family == "qwen2":
        qkv_bias, o_bias = True, False  # always, whatever the file says
    elif family == "mistral":
        qkv_bias = o_bias = False
    else:  # llama, qwen3: attention_bias switches q, k, v and o together
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    cfg = ModelConfig(config.get("_name_or_path", family), config["num_hidden_layers"], config["hidden_size"], heads,
                      kv_heads, config["intermediate_size"], config["vocab_size"],
                      tied_embeddings=bool(config.get("tie_word_embeddings", False)), head_dim=head_dim,
                      qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=family == "qwen3")
    return param_count_by_component(cfg)
    # END SOLUTION


# %%
check_params_from_config(params_from_config)

# %% [markdown]
# ## 8. Exercise: what a decode step reads, predicted and measured
#
# Section 2 said a decode step is limited by reading memory: its time should be about the bytes it reads
# over the memory bandwidth. Which bytes, exactly?
#
# * **Every weight it multiplies by, once per step**, whatever the batch: all sequences of the batch share
#   one read of each matrix. A **tied** table is read in full, as the output layer.
# * Of an **untied** input embedding table, one row per sequence: the embedding is a lookup, not a matmul,
#   and the other rows stay in memory untouched (about 1 GB of Llama 3.1 8B's 16 in bf16).
# * The **keys and values** of every cached token, of every layer and KV head, for every sequence in the
#   batch.
#
# Activations are a few KB per token: leave them out. Complete `decode_bytes_from_config(config, batch,
# context_tokens, dtype_bytes)`: the bytes one decode step of `batch` sequences, each attending over
# `context_tokens` cached tokens, reads, with the weights and the cache at `dtype_bytes` per element. You may
# use your `params_from_config` (chapter 05's `costs.decode_step_bytes` is refused: it charges the whole
# input table, the runbook's convention).

# %%
def decode_bytes_from_config(config, batch, context_tokens, dtype_bytes):
    # BEGIN SOLUTION: the weights once (an untied input table: one row per sequence) + every sequence's K and V
    parts = params_from_config(config)
    family, heads = config["model_type"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or {"mistral": 8, "qwen2": 32, "qwen3": 32}.get(family, heads)
    head_dim = config.get("head_dim") or (128 if family == "qwen3" and "head_dim" not in config
                                          else config["hidden_size"] // heads)
    weights = sum(parts.values())
    if parts["output"]:  # untied: the input table is looked up, one row per sequence
        weights -= parts["embedding"] - min(batch, config["vocab_size"]) * config["hidden_size"]
    cache = batch * context_tokens * 2 * config["num_hidden_layers"] * kv_heads * head_dim
    return (weights + cache) * dtype_bytes
    # END SOLUTION


# %%
check_decode_bytes_from_config(decode_bytes_from_config)

# %% [markdown]
# **The prediction.** Section 3 timed a decode step of `small-63m` (or the 8B on a GPU). Predict it from its
# bytes: your count, for its `config.json`, over the rate at which this machine reads memory. Which rate? The
# operation a decode step spends its bytes on is a matrix-vector product (one token's activations times a
# weight matrix), so time one on a matrix far larger than the caches, and divide the matrix's bytes by its
# time; chapter 04's copy rate (bytes read plus bytes written) is printed beside it. A prediction from bytes
# alone is a floor on the time: it leaves out every fixed cost of a step (launching its operations, the
# norms, the sampling).

# %%
size, rows = (512 * 2**20, 8192) if settings.on_gpu else (128 * 2**20, 4096)  # bytes: several times the caches


def matvec_read_rate(size, rows):
    """Bytes per second a matrix-vector product of a (rows, size / rows) matrix reads, median time."""
    weight = torch.randn(rows, size // (rows * DTYPE_BYTES), device=DEVICE, dtype=DTYPE)
    vector = torch.randn(weight.shape[1], device=DEVICE, dtype=DTYPE)
    return weight.numel() * DTYPE_BYTES / benchmark(lambda: weight @ vector, gpu=settings.on_gpu).median_s


read_rate = matvec_read_rate(size, rows)
copy_rate = max(measure_copy([size], progress=False))
step_bytes = decode_bytes_from_config(to_hf_config(CFG), 1, PROMPT + 1, DTYPE_BYTES)
predicted_s, measured_s = step_bytes / read_rate, unprofiled["decode"]
print(f"{CFG.name}, {str(DTYPE)[6:]}, context {PROMPT + 1} ({where}): {step_bytes / 2**20:,.1f} MiB read per step")
print(f"matrix-vector read rate {read_rate / 1e9:.1f} GB/s (copy rate {copy_rate / 1e9:.1f} GB/s, read + written)")
print(f"predicted {predicted_s * 1e3:.2f} ms from the bytes, measured {measured_s * 1e3:.2f} ms "
      f"(measured / predicted: {measured_s / predicted_s:.2f})")

# %% [markdown]
# The measured step should come out at or above the prediction: about equal when the step is all weight reads
# at the matrix-vector rate, and a few times above it when fixed costs weigh (one CPU thread running a few
# hundred small operations per step; on a GPU at batch 1, the launches that CUDA graphs remove, chapter 12).
# Two things can move it below 1 on a CPU: a machine busy while the matrix-vector product was timed (rerun the
# two cells), and a copy or read rate measured on a buffer that partly fits in the cache. Chapter 05 measures
# the same on an H200, where optimised engines reach most of the datasheet bandwidth at batch 1. Either way the
# bytes give the floor: no engine decodes faster than its model's bytes allow.

# %% [markdown]
# **Question.** In section 2 the output layer takes a visible share of a decode step's reads.
# Which real model of section 6 spends the largest share of a decode step's
# reads on its output layer, and why?
#
# <!-- BEGIN SOLUTION -->
# **Answer (instructor notes).** Qwen3-0.6B: its output layer (tied, but still read at every
# step as the output matrix) is 151,936 x 1,024 weights, about a quarter of the model, so about a
# quarter of each step's weight reads. The larger models spread the same kind of table over many more layer weights.
# <!-- END SOLUTION -->

# %% [markdown]
# ## 9. Exercise: a checkpoint's names, read into the course model
#
# A checkpoint is a dict of tensors named by the code that trained it. transformers names Llama's query
# projection of layer 3 `model.layers.3.self_attn.q_proj.weight`; the course model, whose module tree you
# printed in section 1, calls it `layers.3.attention.wq.weight`. Loading a real model (chapter 02's last
# section, `labsupport.checkpoints.load`) starts with this renaming. The tree below is transformers' own
# for a small Qwen3 (q/k norms) next to the course model of the same shape.

# %% tags=["nbval-check-output"]
qwen3_tiny = ModelConfig("tiny-qwen3", 2, 64, 4, 2, 96, 160, head_dim=32, qk_norm=True)
torch.manual_seed(0)
hf_tiny = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**to_hf_config(qwen3_tiny)))
course_tiny = Transformer(qwen3_tiny, seed=0)
def layer0_and_top(state):  # (name, shape) of the tensors outside the layers and of layer 0
    return [(k, tuple(v.shape)) for k, v in state.items() if ".layers." not in f".{k}" or ".0." in k]


for title, state in (("transformers", hf_tiny.state_dict()), ("course model", course_tiny.state_dict())):
    print(f"{title}:")
    for name, shape in layer0_and_top(state):
        print(f"  {name:48s} {shape}")

# %% [markdown]
# Write `course_state_dict(hf_state, cfg)`: the same tensors, unchanged (no transposing, no dtype change),
# under the course model's names.
#
# * `model.embed_tokens` is `tok_embeddings`, `model.norm` is `norm`, and `lm_head` is `output`; a model whose
#   embeddings are **tied** (`cfg.tied_embeddings`) has no `output`: its output layer reads `tok_embeddings`,
#   and transformers' `lm_head.weight` (the same tensor) is left out.
# * In `model.layers.{i}.` (which becomes `layers.{i}.`): `input_layernorm` is `attention_norm`,
#   `post_attention_layernorm` is `ffn_norm`; `self_attn.q_proj`, `k_proj`, `v_proj`, `o_proj` are
#   `attention.wq`, `wk`, `wv`, `wo` (their `.bias` too, where the model has them: Qwen2); `self_attn.q_norm`
#   and `k_norm` (Qwen3) are `attention.q_norm` and `k_norm`; `mlp.gate_proj`, `up_proj`, `down_proj` are
#   `feed_forward.w1`, `w3`, `w2` (the gate is the one passed through SiLU).
#
# The check renames the state dicts of five small models (Llama tied and untied, Qwen2 with biases, Qwen3
# with q/k norms, a 12-layer Llama in bfloat16; every norm and bias set to distinct values), tells you which
# tensor went where, then loads your dict into the course's `Transformer` and compares its logits with
# transformers'.

# %%
def course_state_dict(hf_state, cfg):
    # BEGIN SOLUTION: rename each transformers tensor; leave lm_head out when the embeddings are tied
    parts = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
             "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
             "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"}
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}
    out = {}
    for name, tensor in hf_state.items():
        if name in top:
            if not (name == "lm_head.weight" and cfg.tied_embeddings):
                out[top[name]] = tensor
            continue
        _, _, layer, rest = name.split(".", 3)  # model, layers, i, the module's path
        module, _, kind = rest.rpartition(".")
        out[f"layers.{layer}.{parts[module]}.{kind}"] = tensor
    return out
    # END SOLUTION


# %%
check_hf_weight_names(course_state_dict)

# %% [markdown]
# With your renaming, the small Qwen3 above runs in the course model and predicts what transformers predicts:

# %% tags=["nbval-check-output"]
course_tiny.load_state_dict(course_state_dict(hf_tiny.state_dict(), qwen3_tiny), strict=True)
tokens = torch.tensor([[1, 5, 9, 2]])
with torch.no_grad():
    print("course model's next token:", int(course_tiny.forward_no_cache(tokens).argmax()),
          "| transformers':", int(hf_tiny(tokens).logits[0, -1].argmax()))

# %% [markdown]
# ## What you measured
#
# * A decoder is embeddings, then a block repeated $L$ times (norm, attention with q/k/v/o
#   projections, residual, norm, SwiGLU feed-forward, residual), then a final norm and an output
#   layer. Your formula counts it exactly, for any shape, and agrees with the course model and with
#   transformers' own Llama, Mistral, Qwen2 and Qwen3.
# * Real models differ in details that change the count: tied embeddings, q/k/v biases, q/k norms,
#   a head width that is not $d / H$. A mixture of experts stores far more parameters than each
#   token uses.
# * A `config.json` leaves fields out: the family's configuration class fills them in, and a head width,
#   a KV head count or a bias read wrongly changes every number computed from it.
# * Prefill time follows FLOPs; decode time follows bytes, plus a fixed cost per operation that a
#   one-token step cannot hide. The bytes a step reads, over the memory bandwidth, are its floor.
