"""Decode steps of 1 to 16 sequences on a CPU in one call: the whole forward pass in C
(``labsupport/csrc/cpu_decode.c``).

A decode step reads every weight once, so a step of one sequence is bound by the weights' bytes over
the rate the machine reads that many bytes (chapter 13: from memory, or from the last-level cache
where the weights fit). Through torch, a decode step of SmolLM2-135M on a CPU also dispatches
thousands of small operators from Python (norms, views, rotations, the cache write, attention's
pieces), which cost about as much as the matrix products, and the products themselves read below
the bandwidth (``python -m labsupport.bench_engine --cpu-real-model`` profiles both). A GPU engine
removes the dispatch cost with CUDA graphs (one launch replays the whole step); a CPU has no graphs,
and runtimes such as llama.cpp run the step in compiled code. :class:`FusedDecoder` does that for the
course's engine: one C function runs the step (embedding rows, every layer, final norm, output
head) for up to :data:`MAX_BATCH` sequences at once, every weight read once for all of them, the
threads splitting each matrix's rows and attention's chunks of positions, and returns the logits; the
engine samples them as usual.

* **What it reads**: the model's own weight tensors, not copies (float32 and bfloat16 layers,
  plain or packed by :func:`labsupport.cpu_linear.prepack`, and :class:`~labsupport.cpu_linear.Int8Linear`'s
  int8 codes with their per-row scales), and the engine's paged KV cache, where it writes the
  token's keys and values as torch would (bfloat16 rounded to nearest even).
* **Its numbers**: every activation in float32. A float32 model gives the torch path's logits up
  to the order and rounding of float32 sums (so the same greedy tokens, but for near-ties); with
  bfloat16 weights its logits sit closer to the float32 model's than the torch path's, which rounds
  every activation to bfloat16. With int8 weights a product's input is first rounded to int16 codes
  (one scale per row: :func:`int8_product`), and the products are exact integer sums, so an int8 step
  gives the same bits in a batch as alone, and its products the same bits whatever the instruction set;
  the weights' own rounding dominates (the bench's perplexities put the two int8 paths within a few
  hundredths of each other).
* **Its limits**: steps that only decode, at most :data:`MAX_BATCH` sequences, each sampling, no
  speculative drafts (the engine's other steps run torch), a
  Llama-style model without per-head query/key norms (Qwen3's), the course's rotation and step
  assembly (the engine takes the torch path while a learner's ``rope`` or ``assemble`` is plugged
  in), weights it knows the layout of. :func:`unsupported` says why a model is refused. The decoder
  reads the weight tensors it was made from; :meth:`FusedDecoder.stale` says when the model's have
  changed since (the engine then makes a new one).
* **Building it**: the C file is compiled once per machine with the system's C compiler
  (``cc -O3 -march=native -fopenmp``, about a second) into ``$LABSUPPORT_CACHE`` or
  ``~/.cache/labsupport``, keyed by the source, the compiler and what it takes ``native`` to mean
  (or the CPU's flags). Without a compiler, or when the build fails, it raises a RuntimeError that
  says so; the engine's torch path needs none.

Its OpenMP threads are torch's own where torch's Linux wheels ship ``libgomp.so.1``: torch loads it
first, and the library built here asks for the same name, which the loader resolves to the one
already loaded. Where two OpenMP runtimes end up in the process (a torch built with another one),
:func:`build` warns: two thread pools would share the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import nn

from .cpu_linear import Int8Linear, PackedLinear
from .paged_cache import PagedKVStore
from .transformer import Transformer, rope_cos_sin

__all__ = ["FusedDecoder", "unsupported", "build", "teacher_forced_logits", "read_floats", "int8_product", "SOURCE"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
MAX_BATCH = 16  # sequences one C step decodes at most (the engine runs larger decode steps through torch)
_GUARD, _GUARD_VALUE = 16, 12345.0  # floats past the workspace's end, and what they hold


class _Matrix(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("type", ctypes.c_int32),
                ("vec_type", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                *((name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int32) for name in ("n_layers", "d", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                                                       "vocab", "block_size", "num_blocks", "cache_type", "norm_type",
                                                       "threads", "max_batch")),
                ("eps", ctypes.c_float), ("embed", ctypes.c_void_p), ("embed_type", ctypes.c_int32),
                ("final_norm", ctypes.c_void_p), ("head", _Matrix), ("layers", ctypes.POINTER(_Layer)),
                ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p), ("rope_len", ctypes.c_int64),
                ("work", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("table_width", ctypes.c_int64), ("parts_floats", ctypes.c_int64),
                ("tokens", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
                ("logits", ctypes.c_void_p), ("parts", ctypes.c_void_p)]


# --- building the library ----------------------------------------------------------------------------

_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` if set (split as a shell would: ``ccache gcc``; None when its
    program is not found), else ``cc`` or ``gcc`` on the PATH."""
    if os.environ.get("CC"):
        words = shlex.split(os.environ["CC"])
        found = shutil.which(words[0]) if words else None
        return None if found is None else [found, *words[1:]]
    found = shutil.which("cc") or shutil.which("gcc")
    return None if found is None else [found]


def _target_key(cc: list[str]) -> str:
    """What ``-march=native`` means here: GCC's resolved target options where it answers, and the
    CPU's own description (x86 ``flags``, ARM ``Features`` and ``CPU part``, the model name)."""
    try:
        resolved = subprocess.run([*cc, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                                  timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        resolved = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = sorted({line.strip() for line in f if line.split(":")[0].strip() in
                          ("flags", "Features", "CPU part", "CPU implementer", "model name")})
    except OSError:
        cpu = [platform.machine(), platform.processor()]
    return resolved + "\n".join(cpu)


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return set()
    return {p for p in paths if Path(p).name.startswith(("libgomp", "libiomp", "libomp"))}


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
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(cc), version, " ".join(FLAGS),
                                        _target_key(cc)]).encode())
        target = _cache_root() / f"cpu_decode-{key.hexdigest()[:16]}.so"
        if not target.exists():
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, partial = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)  # a name no other build shares
                os.close(fd)
            except OSError as exc:
                raise RuntimeError(f"cannot write the compiled step into {target.parent} ({exc}): set "
                                   f"LABSUPPORT_CACHE to a folder you can write, or use cpu_decode='torch'") from exc
            done = subprocess.run([*cc, *FLAGS, "-o", partial, str(SOURCE), "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                Path(partial).unlink(missing_ok=True)
                hint = " (Apple's clang needs libomp for -fopenmp: brew install libomp)" if platform.system() == "Darwin" else ""
                raise RuntimeError(f"building {SOURCE.name} with {' '.join(cc)} failed{hint}; run the engine with "
                                   f"cpu_decode='torch' meanwhile:\n{done.stderr[-2000:]}")
            os.replace(partial, target)  # whole or absent: another process never loads half a file
        lib = ctypes.CDLL(str(target))
        runtimes = _openmp_runtimes()
        if len(runtimes) > 1:
            warnings.warn(f"two OpenMP runtimes are loaded ({', '.join(sorted(runtimes))}): the fused step's threads and "
                          f"torch's are separate pools on the same cores, which can slow both", RuntimeWarning,
                          stacklevel=2)
        lib.decode_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
        lib.decode_step.restype = ctypes.c_int
        lib.work_floats.argtypes = [ctypes.POINTER(_Model)]
        lib.work_floats.restype = ctypes.c_int64
        lib.chunk_positions.restype = ctypes.c_int64
        lib.read_floats.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        lib.read_floats.restype = ctypes.c_float
        _declare_int8_product(lib)
        _library = lib
        return lib


def read_floats(x: torch.Tensor, threads: int | None = None) -> float:
    """The sum of a contiguous float32 CPU tensor whose size is a multiple of 64, read by the C
    library's plain read loop (``read_floats`` in the C file: torch's threads by default, software-prefetching
    8 KiB ahead): what the bench times as the fastest read of that many bytes."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.numel() % 64:
        raise ValueError("read_floats reads a contiguous float32 CPU tensor of a multiple of 64 elements")
    return build().read_floats(x.data_ptr(), x.numel(), threads or torch.get_num_threads())


def _declare_int8_product(lib: ctypes.CDLL) -> None:
    lib.int8_product.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p]
    lib.int8_product.restype = None
    lib.int8_scratch_floats.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.int8_scratch_floats.restype = ctypes.c_int64


def int8_product(codes: torch.Tensor, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ codes.T`` (B, R) float32 as the fused step computes a product with int8 weights, before the
    rows' scales: each row of ``x`` (B, C) float32 rounded to int16 codes, ``x ~ s q`` with ``|q| <= 32767``
    and ``s = max|x| / 32767``, then ``s`` times the exact integer sums (the C file's note on int8 rows).
    ``codes``: (R, C) int8, C a multiple of 8. One row of ``x`` runs the one-row kernel, more the batched
    one. ``lib``: another build of the C file (tests compare builds for other instruction sets); the
    machine's own by default."""
    if codes.dtype != torch.int8 or codes.dim() != 2 or x.dtype != torch.float32 or x.dim() != 2 \
            or x.shape[1] != codes.shape[1] or codes.shape[1] % 8 or x.shape[0] < 1:
        raise ValueError(f"int8_product takes int8 codes (R, C) and float32 x (B, C), C a multiple of 8; got "
                         f"{tuple(codes.shape)} {codes.dtype} and {tuple(x.shape)} {x.dtype}")
    if lib is None:
        lib = build()
    elif lib.int8_product.argtypes is None:
        _declare_int8_product(lib)
    codes, x = codes.contiguous(), x.contiguous()
    (rows, cols), batch = codes.shape, x.shape[0]
    y = torch.empty(batch, rows, dtype=torch.float32)
    scratch = torch.empty(lib.int8_scratch_floats(batch, cols), dtype=torch.float32)
    lib.int8_product(codes.data_ptr(), rows, cols, x.data_ptr(), batch, y.data_ptr(), scratch.data_ptr())
    return y


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
    why = plugged_in(model)
    if why:
        return why
    for name, t in (("the embedding", model.tok_embeddings.weight), ("the final norm", model.norm.weight),
                    ("the output head", None if model.output is None else model.output.weight)):
        if t is not None and t.dtype not in (torch.float32, torch.bfloat16):
            return f"{name} holds {t.dtype} weights (it reads float32 or bfloat16)"
    for i, block in enumerate(model.layers):
        for name, layer in [*block.attention.named_children(), *block.feed_forward.named_children()]:
            if not isinstance(layer, (nn.Linear, PackedLinear, Int8Linear)) and name not in ("q_norm", "k_norm"):
                return f"layer {i}'s {name} is a {type(layer).__name__}, whose weights the C step cannot read"
            if isinstance(layer, (nn.Linear, PackedLinear)) and layer.weight.dtype not in (torch.float32, torch.bfloat16):
                return f"layer {i}'s {name} holds {layer.weight.dtype} weights"
    return None


def plugged_in(model: Transformer) -> str | None:
    """Why the C step would bypass a part plugged into ``model`` (a rotation other than the course's,
    on one layer or on the class), or None. Cheap: the engine asks before every fused step."""
    # the modules' own dictionaries: through nn.Module's attribute lookup this walk took 21 us a step, 3 so
    for i, block in enumerate(model.layers._modules.values()):
        if block._modules["attention"].rope is not None:
            return f"layer {i} rotates with a plugged-in rope function (a learner's part), which the C step would bypass"
    return None


class FusedDecoder:
    """Runs decode steps of ``model`` for 1 to ``max_batch`` sequences on the engine's paged cache
    ``k_cache``/``v_cache`` (``(L, num_blocks, block_size, Hkv, D)``, contiguous) in one C call each
    (module docstring): :meth:`step` for one, :meth:`step_batch` for several. ``max_len``: the longest
    sequence it will see (the rotation's table is made that long).

    It reads the model's own tensors in place (an in-place update is read at the next step) and keeps
    them alive: :meth:`stale` says when the model holds other tensors since (``model.to``, ``prepack``,
    a parameter or module swapped), and then a new decoder is needed; the engine makes one itself after
    ``model.to`` or ``prepack`` (:meth:`repacked`), not after a single parameter is swapped. One step at
    a time: a lock guards the workspace."""

    def __init__(self, model: Transformer, k_cache: torch.Tensor, v_cache: torch.Tensor, max_len: int,
                 threads: int | None = None, max_batch: int = MAX_BATCH):
        why = unsupported(model)
        if why:
            raise ValueError(f"the fused CPU decode step cannot run this model: {why}; use cpu_decode='torch'")
        cfg = model.cfg
        if k_cache.dim() != 5 or k_cache.shape != v_cache.shape or k_cache.shape[0] != cfg.n_layers \
                or tuple(k_cache.shape[3:]) != (cfg.n_kv_heads, cfg.head_dim):
            raise ValueError(f"the KV cache must be paged, (n_layers, num_blocks, block_size, n_kv_heads, head_dim) = "
                             f"({cfg.n_layers}, *, *, {cfg.n_kv_heads}, {cfg.head_dim}) for keys and values alike "
                             f"(the engine's PagedKVStore); got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        if k_cache.dtype != model.dtype or v_cache.dtype != model.dtype or not (k_cache.is_contiguous()
                                                                               and v_cache.is_contiguous()):
            raise ValueError("the KV cache must be contiguous and in the model's dtype (the engine's PagedKVStore)")
        self.lib = build()
        self.cfg, self.model = cfg, model
        self._lock = threading.Lock()
        self._keep: list[torch.Tensor] = []  # every tensor the C structures point into, kept alive
        m = self._c = _Model()
        m.n_layers, m.d, m.n_heads, m.n_kv_heads = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        m.head_dim, m.d_ff, m.vocab, m.block_size = cfg.head_dim, cfg.d_ff, cfg.vocab_size, k_cache.shape[2]
        m.num_blocks = k_cache.shape[1]
        m.cache_type, m.norm_type, m.eps = _TYPES[k_cache.dtype], _TYPES[model.norm.weight.dtype], cfg.rms_norm_eps
        m.threads = threads or torch.get_num_threads()
        if not 1 <= max_batch <= 256:
            raise ValueError(f"max_batch must be between 1 and 256, got {max_batch}")
        m.max_batch = self.max_batch = max_batch
        emb = self._hold(self._source(model.tok_embeddings.weight))
        m.embed, m.embed_type = emb.data_ptr(), _TYPES[emb.dtype]
        m.final_norm = self._vector(model.norm.weight, m.norm_type)
        if model.packed_head is not None:
            self._matrices(model.packed_head, (cfg.vocab_size,), [m.head])
        else:
            head = model.tok_embeddings.weight if model.output is None else model.output.weight
            self._matrices(head, (cfg.vocab_size,), [m.head])
        self._layers = (_Layer * cfg.n_layers)()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        for i, block in enumerate(model.layers):
            c, att, ff = self._layers[i], block.attention, block.feed_forward
            c.attn_norm = self._vector(block.attention_norm.weight, m.norm_type)
            c.ffn_norm = self._vector(block.ffn_norm.weight, m.norm_type)
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
        # the workspace, and past its end a few floats the step must never write (a test checks them)
        self._work = self._hold(torch.zeros(self.lib.work_floats(ctypes.byref(m)) + _GUARD, dtype=torch.float32))
        self._work[-_GUARD:] = _GUARD_VALUE
        m.work = self._work.data_ptr()
        self._chunk = self.lib.chunk_positions()
        self._parts = torch.empty(0, dtype=torch.float32)  # attention's partial results, grown to what a step needs
        self._step = _Step()
        self._layout = self._model_layout()
        self._quick = (model.dtype, id(model.packed_head), model.tok_embeddings.weight.data_ptr())

    def _source(self, t: torch.Tensor) -> torch.Tensor:
        """One of the model's tensors the step reads in place (so an in-place update is read too)."""
        if not t.is_contiguous():
            raise ValueError(f"a weight of shape {tuple(t.shape)} is not contiguous: the C step reads the model's "
                             f"tensors in place (make the model's parameters contiguous, or use cpu_decode='torch')")
        t = t.detach()
        return t

    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the same tensor where it is contiguous, as the model's weights are), kept alive."""
        t = t.contiguous()
        self._keep.append(t)
        return t

    def _vector(self, t: torch.Tensor, vec_type: int) -> int:
        """The address of one of the model's vectors (a norm's weight, scales, a bias), read in place."""
        if _TYPES.get(t.dtype) != vec_type:
            want = next(d for d, v in _TYPES.items() if v == vec_type)
            raise ValueError(f"a vector of {t.dtype} where the C step reads {want}: the model's norms and each "
                             f"layer's bias and scales must be in the dtype of the model's norms and that layer's weights")
        return self._hold(self._source(t)).data_ptr()

    def stale(self) -> bool:
        """Whether the model's tensors it reads have been replaced since it was made (``model.to``,
        ``prepack``, a module or a parameter swapped, ``load_state_dict(assign=True)``): then make a new
        decoder. In-place updates (``load_state_dict``, an optimizer's step) need none: the C step reads
        the model's own tensors. It walks every parameter (milliseconds on SmolLM2): the engine asks the
        cheaper :meth:`repacked` before each step."""
        return self._layout != self._model_layout()

    def repacked(self) -> bool:
        """Whether the model was moved to another dtype or packed (``prepack``) since: the changes that
        replace every weight, checked in microseconds (the engine asks before each fused step)."""
        m = self.model
        return (m.dtype, id(m.packed_head), m.tok_embeddings.weight.data_ptr()) != self._quick

    def _model_layout(self) -> tuple:
        """Where the model's parameters and buffers are now (a swapped module or parameter moves some)."""
        return tuple(t.data_ptr() for t in itertools.chain(self.model.parameters(), self.model.buffers()))

    def _matrices(self, layer, rows: tuple[int, ...], outs: list) -> None:
        """Fill ``outs`` with consecutive row ranges of ``rows`` of ``layer``'s weight (a fused layer
        splits into its parts: q, k, v or gate, up): pointers into the model's own tensors."""
        if isinstance(layer, Int8Linear):
            w, scale, bias, vec = layer.codes, layer.scales, layer.bias, layer.scales.dtype
        elif isinstance(layer, torch.Tensor):
            w, scale, bias, vec = layer, None, None, layer.dtype
        else:
            w, scale, bias, vec = layer.weight, None, layer.bias, layer.weight.dtype
        w = self._hold(self._source(w))
        vec_type = _TYPES[vec]
        scale = None if scale is None else self._vector(scale, vec_type)  # addresses
        bias = None if bias is None else self._vector(bias, vec_type)
        start, cols, size = 0, w.shape[1], torch.tensor([], dtype=vec).element_size()
        for n, out in zip(rows, outs):
            out.w = w.data_ptr() + start * cols * w.element_size()
            out.scale = None if scale is None else scale + start * size
            out.bias = None if bias is None else bias + start * size
            out.rows, out.cols, out.type, out.vec_type = n, cols, _TYPES[w.dtype], vec_type
            start += n
        if start != w.shape[0]:
            raise ValueError(f"a weight of {w.shape[0]} rows was read as {start}: not the model's shape")

    def step(self, token: int, position: int, block_table: torch.Tensor) -> torch.Tensor:
        """The logits (1, V) float32 of ``token`` at ``position`` of a sequence whose blocks are
        ``block_table`` (int32, contiguous, enough blocks for ``position``); its keys and values
        are written to the cache slot of ``position``."""
        if block_table.dtype != torch.int32 or block_table.dim() != 1:
            raise ValueError("block_table must be a contiguous 1-D int32 tensor covering the position")
        return self.step_batch(torch.tensor([token]), torch.tensor([position]), block_table[None])

    def step_batch(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """The logits (B, V) float32 of B sequences decoding one token each: ``tokens`` and ``positions``
        (B,) int64, ``block_tables`` (B, W) int32 (row b: sequence b's blocks, enough for its position;
        entries past that are not read). Each token's keys and values are written to its slot. The
        weights are read once for all B (the batched products), so a step of 16 costs far less than 16
        steps of one."""
        c = self._c
        n = tokens.shape[0] if tokens.dim() == 1 else -1
        if not 1 <= n <= self.max_batch or positions.shape != tokens.shape or block_tables.dim() != 2 \
                or block_tables.shape[0] != n or block_tables.dtype != torch.int32:
            raise ValueError(f"a step takes tokens and positions (B,) and int32 block_tables (B, W), 1 <= B <= "
                             f"{self.max_batch}; got {tuple(tokens.shape)}, {tuple(positions.shape)} and "
                             f"{tuple(block_tables.shape)} {block_tables.dtype}")
        tokens, positions = tokens.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        tables = block_tables.contiguous()
        ids, places = tokens.tolist(), positions.tolist()  # the checks in Python: a few torch ops each would cost more
        if not all(0 <= t < self.cfg.vocab_size for t in ids):
            raise ValueError(f"a token id of {ids} is outside the vocabulary [0, {self.cfg.vocab_size - 1}]")
        if not all(0 <= p < c.rope_len for p in places):
            raise ValueError(f"a position of {places} is outside [0, {c.rope_len - 1}], the positions "
                             f"this decoder was made for")
        if any(p // c.block_size >= tables.shape[1] for p in places):
            raise ValueError("each row of block_tables must cover its sequence's position (enough blocks for it)")
        logits = torch.empty(n, self.cfg.vocab_size, dtype=torch.float32)  # (B, V): a new tensor each step (the sampler may keep it)
        with self._lock:  # one workspace: one step at a time
            s = self._step
            need = sum(p // self._chunk + 1 for p in places) * self.cfg.n_heads * (self.cfg.head_dim + 2)
            if self._parts.numel() < need:  # grows with the context: (chunks, H, D + 2) of every sequence
                self._parts = torch.empty(max(need, 2 * self._parts.numel()), dtype=torch.float32)
            s.n, s.table_width, s.parts_floats, s.parts = n, tables.shape[1], self._parts.numel(), self._parts.data_ptr()
            s.tokens, s.positions, s.block_tables, s.logits = (tokens.data_ptr(), positions.data_ptr(),
                                                               tables.data_ptr(), logits.data_ptr())
            rc = self.lib.decode_step(ctypes.byref(self._c), ctypes.byref(s))
        if rc == 3:  # the C step checks the blocks it will read and write before it touches the cache
            used = [tables[b, :int(p) // c.block_size + 1].tolist() for b, p in enumerate(positions)]
            raise ValueError(f"the block tables' blocks up to each position ({used}) must be ids of the cache's "
                             f"{c.num_blocks} blocks")
        if rc:
            raise RuntimeError(f"the fused decode step refused the step (code {rc}: see decode_step in {SOURCE.name})")
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
