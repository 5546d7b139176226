"""Batch-1 decode on a CPU in one call: the whole forward pass in C (``labsupport/csrc/cpu_decode.c``).

A decode step reads every weight once, so its floor is the weights' bytes over the memory's read
bandwidth (chapter 13). On a CPU, torch's matrix products read at close to that rate, but the
same step also dispatches thousands of small operators from Python (norms, views, rotations,
the cache write, attention's pieces), which on SmolLM2-135M cost about as much as the products
(``python -m labsupport.bench_engine --cpu-real-model`` profiles it). A GPU engine removes that
cost with CUDA graphs (one launch replays the whole step); a CPU engine has no graphs, so vLLM's
CPU backend and llama.cpp run the step in compiled code. :class:`FusedDecoder` does the same for
the course's engine: one C function runs the step (embedding row, every layer, final norm,
output head), the threads splitting each matrix's rows, and returns the logits; the engine
samples them as usual.

* **What it reads**: the model's own weight tensors, not copies (float32 and bfloat16 layers,
  plain or packed by :func:`labsupport.cpu_linear.prepack`, and :class:`~labsupport.cpu_linear.Int8Linear`'s
  int8 codes with their per-row scales), and the engine's paged KV cache, where it writes the
  token's keys and values as torch would (bfloat16 rounded to nearest even).
* **Its numbers**: every activation in float32. A float32 model gives the torch path's logits up
  to the order of float32 sums; a bfloat16 or int8 model's logits are closer to float32 than
  the torch path's, which rounds every activation to bfloat16.
* **Its limits**: one sequence decoding (the engine's other steps run torch), a Llama-style
  model without per-head query/key norms (Qwen3's), the course's rotation (no learner ``rope``
  plugged in), weights it knows the layout of. :func:`unsupported` says why a model is refused.
* **Building it**: the C file is compiled once per machine with the system's C compiler
  (``cc -O3 -march=native -fopenmp``, about a second) into ``$LABSUPPORT_CACHE`` or
  ``~/.cache/labsupport``, keyed by the source, the compiler and the CPU's flags. Without a
  compiler it raises a RuntimeError that says so; the engine's torch path needs none.

Its OpenMP threads are torch's own: torch loads ``libgomp.so.1`` first, and the library built here
asks for the same name, which the loader resolves to the one already loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch
from torch import nn

from .cpu_linear import Int8Linear, PackedLinear
from .paged_cache import PagedKVStore
from .transformer import Attention, Transformer, rope_cos_sin

__all__ = ["FusedDecoder", "unsupported", "build", "teacher_forced_logits", "SOURCE"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


class _Matrix(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("type", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                *((name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int32) for name in ("n_layers", "d", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                                                       "vocab", "block_size", "cache_type", "threads")),
                ("eps", ctypes.c_float), ("embed", ctypes.c_void_p), ("embed_type", ctypes.c_int32),
                ("final_norm", ctypes.c_void_p), ("head", _Matrix), ("layers", ctypes.POINTER(_Layer)),
                ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p), ("rope_len", ctypes.c_int64),
                ("work", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [("token", ctypes.c_int64), ("position", ctypes.c_int64), ("block_table", ctypes.c_void_p),
                ("logits", ctypes.c_void_p)]


# --- building the library ----------------------------------------------------------------------------

_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _compiler() -> str | None:
    """The C compiler: ``$CC`` if set (None when it is not found), else ``cc`` or ``gcc`` on the PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _cache_root() -> Path:
    root = os.environ.get("LABSUPPORT_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "labsupport") / "cpu_decode"


def build() -> ctypes.CDLL:
    """The compiled step (built at the first call on this machine, then loaded from the cache).
    RuntimeError, saying what to do, without a C compiler or when the build fails."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        cc = _compiler()
        if cc is None:
            raise RuntimeError(f"the fused CPU decode step is C compiled on this machine, and no C compiler was found "
                               f"({'CC=' + os.environ['CC'] if os.environ.get('CC') else 'cc or gcc'}; set CC to "
                               f"another): install one (apt-get install gcc) or run the engine "
                               "with cpu_decode='torch'")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, " ".join(FLAGS), _cpu_flags()]).encode())
        target = _cache_root() / f"cpu_decode-{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run([cc, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                partial.unlink(missing_ok=True)
                raise RuntimeError(f"building {SOURCE.name} with {cc} failed (run the engine with cpu_decode='torch' "
                                   f"meanwhile):\n{done.stderr[-2000:]}")
            os.replace(partial, target)  # whole or absent: another process never loads half a file
        lib = ctypes.CDLL(str(target))
        lib.decode_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
        lib.decode_step.restype = ctypes.c_int
        lib.work_floats.argtypes = [ctypes.POINTER(_Model)]
        lib.work_floats.restype = ctypes.c_int64
        _library = lib
        return lib


# --- what it runs --------------------------------------------------------------------------------


def unsupported(model: Transformer) -> str | None:
    """Why :class:`FusedDecoder` cannot run ``model`` (None when it can)."""
    if not isinstance(model, Transformer):
        return f"it runs a labsupport.transformer.Transformer, not a {type(model).__name__}"
    if model.device.type != "cpu":
        return f"it runs on the CPU and the model is on {model.device} (a GPU's engine replays CUDA graphs instead)"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 or bfloat16 models, not {model.dtype}"
    cfg = model.cfg
    if cfg.qk_norm:
        return "the model normalises each query and key head (Qwen3's qk_norm), which the C step does not"
    if cfg.head_dim > 512 or cfg.head_dim % 8 or cfg.n_heads % cfg.n_kv_heads or cfg.n_heads // cfg.n_kv_heads > 16:
        return (f"head_dim {cfg.head_dim} with {cfg.n_heads} query and {cfg.n_kv_heads} key/value heads is not a shape "
                f"it runs (head_dim a multiple of 8 up to 512, at most 16 query heads per key/value head)")
    if cfg.d_model % 8 or cfg.d_ff % 8:
        return f"its widths (d_model {cfg.d_model}, d_ff {cfg.d_ff}) must be multiples of 8"
    for i, block in enumerate(model.layers):
        if block.attention.rope is not Attention.rope:
            return f"layer {i} rotates with a plugged-in rope function (a learner's part), which the C step would bypass"
        for name, layer in [*block.attention.named_children(), *block.feed_forward.named_children()]:
            if not isinstance(layer, (nn.Linear, PackedLinear, Int8Linear)) and name not in ("q_norm", "k_norm"):
                return f"layer {i}'s {name} is a {type(layer).__name__}, whose weights the C step cannot read"
            if isinstance(layer, (nn.Linear, PackedLinear)) and layer.weight.dtype not in (torch.float32, torch.bfloat16):
                return f"layer {i}'s {name} holds {layer.weight.dtype} weights"
    return None


class FusedDecoder:
    """Runs a batch-1 decode step of ``model`` on the engine's paged cache ``k_cache``/``v_cache``
    (``(L, num_blocks, block_size, Hkv, D)``, contiguous) in one C call (module docstring).
    ``max_len``: the longest sequence it will see (the rotation's table is made that long).

    It reads the weights the model holds when it is made, and keeps them alive: a model changed
    afterwards (``load_state_dict``, ``model.to``) needs a new decoder."""

    def __init__(self, model: Transformer, k_cache: torch.Tensor, v_cache: torch.Tensor, max_len: int,
                 threads: int | None = None):
        why = unsupported(model)
        if why:
            raise ValueError(f"the fused CPU decode step cannot run this model: {why}; use cpu_decode='torch'")
        if k_cache.dtype != model.dtype or v_cache.dtype != model.dtype or not (k_cache.is_contiguous()
                                                                               and v_cache.is_contiguous()):
            raise ValueError("the KV cache must be contiguous and in the model's dtype (the engine's PagedKVStore)")
        self.lib = build()
        cfg = self.cfg = model.cfg
        self.model = model
        self._keep: list[torch.Tensor] = []  # every tensor the C structures point into, kept alive
        m = self._c = _Model()
        m.n_layers, m.d, m.n_heads, m.n_kv_heads = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        m.head_dim, m.d_ff, m.vocab, m.block_size = cfg.head_dim, cfg.d_ff, cfg.vocab_size, k_cache.shape[2]
        m.cache_type, m.eps = _TYPES[k_cache.dtype], cfg.rms_norm_eps
        m.threads = threads or torch.get_num_threads()
        emb = self._hold(model.tok_embeddings.weight.detach())
        m.embed, m.embed_type = emb.data_ptr(), _TYPES[emb.dtype]
        m.final_norm = self._floats(model.norm.weight)
        if model.packed_head is not None:
            self._matrices(model.packed_head, (cfg.vocab_size,), [m.head])
        else:
            head = model.tok_embeddings.weight if model.output is None else model.output.weight
            self._matrices(head, (cfg.vocab_size,), [m.head])
        self._layers = (_Layer * cfg.n_layers)()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        for i, block in enumerate(model.layers):
            c, att, ff = self._layers[i], block.attention, block.feed_forward
            c.attn_norm, c.ffn_norm = self._floats(block.attention_norm.weight), self._floats(block.ffn_norm.weight)
            if att.wqkv is not None:
                self._matrices(att.wqkv, (H * D, Hkv * D, Hkv * D), [c.q, c.k, c.v])
            else:
                for layer, out in ((att.wq, c.q), (att.wk, c.k), (att.wv, c.v)):
                    self._matrices(layer, (layer.out_features,), [out])
            self._matrices(att.wo, (cfg.d_model,), [c.o])
            if ff.w13 is not None:
                self._matrices(ff.w13, (cfg.d_ff, cfg.d_ff), [c.gate, c.up])
            else:
                self._matrices(ff.w1, (cfg.d_ff,), [c.gate])
                self._matrices(ff.w3, (cfg.d_ff,), [c.up])
            self._matrices(ff.w2, (cfg.d_model,), [c.down])
            c.k_cache, c.v_cache = k_cache[i].data_ptr(), v_cache[i].data_ptr()
        self._keep += [k_cache, v_cache]
        m.layers = self._layers
        cos, sin = rope_cos_sin(torch.arange(max_len), D, torch.float32, cfg.rope_theta, cfg.rope_scaling)  # (max_len, D)
        m.rope_cos, m.rope_sin, m.rope_len = self._hold(cos).data_ptr(), self._hold(sin).data_ptr(), max_len
        m.work = self._hold(torch.zeros(self.lib.work_floats(ctypes.byref(m)))).data_ptr()
        self._step = _Step()

    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._keep.append(t)
        return t

    def _floats(self, t: torch.Tensor | None) -> int | None:
        """A float32 copy of a small vector (norm weights, scales, biases), kept; its address."""
        return None if t is None else self._hold(t.detach().float().reshape(-1)).data_ptr()

    def _matrices(self, layer, rows: tuple[int, ...], outs: list) -> None:
        """Fill ``outs`` with consecutive row ranges of ``rows`` of ``layer``'s weight (a fused layer
        splits into its parts: q, k, v or gate, up): pointers into the model's own tensors."""
        if isinstance(layer, Int8Linear):
            w, scale, bias = layer.codes, layer.scales.float(), layer.bias
        elif isinstance(layer, torch.Tensor):
            w, scale, bias = layer.detach(), None, None
        else:
            w, scale, bias = layer.weight.detach(), None, layer.bias
        w = self._hold(w)
        scale = None if scale is None else self._hold(scale)
        bias = None if bias is None else self._hold(bias.detach().float())
        start, cols = 0, w.shape[1]
        for n, out in zip(rows, outs):
            out.w = w.data_ptr() + start * cols * w.element_size()
            out.scale = None if scale is None else scale.data_ptr() + start * 4
            out.bias = None if bias is None else bias.data_ptr() + start * 4
            out.rows, out.cols, out.type = n, cols, _TYPES[w.dtype]
            start += n
        if start != w.shape[0]:
            raise ValueError(f"a weight of {w.shape[0]} rows was read as {start}: not the model's shape")

    def step(self, token: int, position: int, block_table: torch.Tensor) -> torch.Tensor:
        """The logits (1, V) float32 of ``token`` at ``position`` of a sequence whose blocks are
        ``block_table`` (int32, contiguous, enough blocks for ``position``); its keys and values
        are written to the cache slot of ``position``."""
        if not 0 <= token < self.cfg.vocab_size:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {self.cfg.vocab_size - 1}]")
        if position >= self._c.rope_len:
            raise ValueError(f"position {position} is past the longest sequence this decoder was made for "
                             f"({self._c.rope_len})")
        if block_table.dtype != torch.int32 or not block_table.is_contiguous() \
                or block_table.numel() * self._c.block_size <= position:
            raise ValueError("block_table must be a contiguous int32 tensor covering the position")
        logits = torch.empty(1, self.cfg.vocab_size)  # (1, V): a new tensor each step (the sampler may keep it)
        s = self._step
        s.token, s.position, s.block_table, s.logits = token, position, block_table.data_ptr(), logits.data_ptr()
        rc = self.lib.decode_step(ctypes.byref(self._c), ctypes.byref(s))
        if rc:
            raise RuntimeError(f"the fused decode step refused the step (code {rc})")
        return logits


@torch.no_grad()
def teacher_forced_logits(model: Transformer, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """The logits (S, V) after each of ``tokens``, every one computed by the C step from the ones
    before it (a fresh paged cache): what the fused decode path predicts, for a perplexity."""
    blocks = -(-len(tokens) // block_size)
    store = PagedKVStore(model.cfg, blocks, block_size, dtype=model.dtype)
    decoder = FusedDecoder(model, store.k, store.v, blocks * block_size)
    table = torch.arange(blocks, dtype=torch.int32)
    return torch.cat([decoder.step(int(t), i, table) for i, t in enumerate(tokens)])
