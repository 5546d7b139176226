"""The model side of a learner's stack (issue 31): the slots that act where the model is loaded, sized
and run, plugged in by :func:`plug_model_side` for ``python -m labsupport.serve --stack``.

The engine side (:mod:`labsupport.serve.stack`) plugs into a back end that already exists; these
slots act earlier, so the server assembles the stack *before* it loads the model:

* ``dequantize_q8_0`` and ``dequantize_q4_1`` (lab 09): read the GGUF file's Q8_0 and Q4_1 blocks
  while the model loads (:class:`labsupport.checkpoints.Dequantizers`), in place of the ``gguf``
  package. Their conversion is cached apart from the course's, in the course's cache folder
  (``$LABSUPPORT_CACHE/checkpoints``, never the learner's folder), keyed by a hash of the learner's
  module file: the learner's weights never stand in for the course's, nor the other way round. A
  dequantiser that raises (or returns the wrong shape) stops the start-up with a message naming the
  slot and the learner's line: there is no request yet to fail. With the course model (no
  ``--model``) there is no GGUF file, and they are not used (the description says so);
* ``kv_capacity`` (lab 12): sizes the engine's number of KV blocks at start-up (:meth:`ModelSide.num_blocks`).
  The exercise budgets a GPU's memory; the server on a CPU has none to read, so it says what it
  budgets: ``--kv-memory-gib`` GiB for the weights and the cache together, at utilisation 1.0 with no
  reserve, the served dtype's bytes for both. Without the option the budget is the weights plus the
  course's default cache (``--max-running`` requests at the full ``--context``), so a right
  ``kv_capacity`` gives the course's own number of blocks and a wrong one shows. ``--num-blocks``
  given, the learner's part is not used (the description says so). A result that is not whole
  blocks, holds less than one request, or more than the machine's free memory stops the start-up;
* ``rope`` (lab 08's ``apply_rope(x, positions, theta, layout)``): every layer's
  :attr:`labsupport.transformer.Attention.rope` hook rotates the queries and keys with it (halves
  layout, the model's ``rope_theta``). A model that scales its frequencies (``rope_scaling``) keeps
  the course's rotation: the exercise's interface takes only a base. Step-wide.

The learner's parts run guarded as the engine side's are (:func:`labsupport.serve.stack.guarded`):
one that raises while serving becomes a :class:`~labsupport.serve.stack.PartFailed` naming the slot
and the learner's line, the engine fails the step's requests, and the server goes on.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..batch_attention import store_kv, store_kv_triton
from ..costs import param_count
from ..device import interpreter_mode
from ..engine.paged_batch import PagedBatch
from ..scheduler import blocks_for
from ..stack import BY_NAME
from ..transformer import apply_rope, rope_cos_sin
from .served_model import checkpoint_model
from .stack import PartFailed, guarded, learner_line

DEQUANTIZE_SLOTS = {"dequantize_q8_0": "Q8_0", "dequantize_q4_1": "Q4_1"}  # slot -> the GGUF block type it reads
KERNEL_SLOTS = ("fused_rope", "flash_attention", "paged_attention")  # Triton: serve on a GPU, checked on a CPU
MODEL_SLOTS = (*DEQUANTIZE_SLOTS, "kv_capacity", "rope", *KERNEL_SLOTS)


def _at_load(slot: str, fn, file: str):
    """A learner's load-time part: an exception it raises stops the start-up, as a ValueError naming
    the slot and the learner's line (the server's start-up errors are ValueErrors)."""
    s = BY_NAME[slot]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise ValueError(f"--stack: your {slot} part (lab {s.lab[:2]}, {s.part}) raised {type(exc).__name__}: "
                             f"{exc} at {learner_line(exc, file)} while the model's weights were read; the server "
                             f"cannot start with it: fix it and run python -m labsupport stack again") from exc
    return call


def owner_of(files, block_types=()) -> str:
    """Whose dequantisers: ``yours-`` and a hash of the learner's module files' text and of the block
    types they read (a changed cell is another owner, with a cache entry of its own; so is a stack where
    only one of the two dequantisers is the learner's, its other blocks read by the course's)."""
    digest = hashlib.sha256()
    for file in sorted(set(files)):
        digest.update(Path(file).read_bytes())
    digest.update(",".join(sorted(block_types)).encode())
    return f"yours-{digest.hexdigest()[:12]}"


def rope_hook(apply_rope, theta: float):
    """The :attr:`Attention.rope` hook of a learner's ``apply_rope(x, positions, theta, layout)``:
    queries and keys rotated alike, in the halves layout the course model's weights use."""
    def rope(q, k, positions):
        return apply_rope(q, positions, theta, "halves"), apply_rope(k, positions, theta, "halves")
    return rope


@dataclass
class ModelSide:
    """The model-side parts of an assembled stack (slot -> (part, its module file)), and what
    plugging them in said (:attr:`notes`: a line per slot whose part could not serve, and why)."""

    parts: dict[str, tuple[object, str]]
    notes: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)  # the slots that read the served model's weights
    checkpoint: bool = False  # load() was asked for a checkpoint (not the course model)
    sized: str = ""  # what the learner's kv_capacity gave (num_blocks), in a sentence

    def dequantizers(self):
        """The learner's dequantisers as the loader takes them, or None where none is the learner's."""
        from ..checkpoints import Dequantizers  # only with --model (served_model imports it so too)

        mine = {slot: self.parts[slot] for slot in DEQUANTIZE_SLOTS if slot in self.parts}
        if not mine:
            return None
        by_type = {DEQUANTIZE_SLOTS[slot]: _at_load(slot, part, file) for slot, (part, file) in mine.items()}
        return Dequantizers(by_type, owner_of((file for _, file in mine.values()), by_type))

    def load(self, source: str):
        """The checkpoint ``source`` as the server serves it (a ServedModel), its GGUF blocks read by
        the learner's dequantisers where they are the learner's."""
        from ..checkpoints import resolve

        self.checkpoint = True
        dequantizers = self.dequantizers()
        if dequantizers is not None and resolve(source)[1].suffix != ".gguf":
            self.notes.append(f"dequantize_q8_0, dequantize_q4_1: {source} is not a GGUF file, so your "
                              f"dequantisers are not used")
            dequantizers = None
        served = checkpoint_model(source, dequantizers=dequantizers)
        if dequantizers is not None:
            self.loaded = [slot for slot in DEQUANTIZE_SLOTS if slot in self.parts]
        return served

    def num_blocks(self, model, context: int, block_size: int, max_running: int,
                   memory_gib: float | None = None) -> int:
        """The KV blocks the learner's ``kv_capacity`` gives ``model`` (a course Transformer) for
        requests of ``context`` tokens, budgeting ``memory_gib`` (module docstring; None: the weights
        and the course's default cache); a ValueError saying what to change where they cannot serve."""
        part, file = self.parts["kv_capacity"]
        cfg, nbytes = model.cfg, model.dtype.itemsize
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * nbytes
        if memory_gib is None:
            default_cache = max_running * blocks_for(context, block_size) * block_size * per_token
            memory_gib = (param_count(cfg) * nbytes + default_cache) / 2**30  # exact: a power of two divides
            said = (f"{memory_gib:.3f} GiB (the weights and the course's default cache of {max_running} requests "
                    f"at {context} tokens; --kv-memory-gib budgets otherwise)")
        else:
            said = f"{memory_gib:g} GiB (--kv-memory-gib)"
        got = _at_load("kv_capacity", part, file)(
            cfg, memory_gib, context, gpu_memory_utilization=1.0, block_size=block_size,
            kv_dtype_bytes=nbytes, weight_dtype_bytes=nbytes, reserve_gib=0.0)
        blocks = got.get("num_blocks") if isinstance(got, dict) else None
        if isinstance(blocks, numbers.Real) and not isinstance(blocks, bool) and float(blocks).is_integer():
            blocks = int(blocks)  # the check takes a whole number in a float too
        else:
            raise ValueError(f"--stack: your kv_capacity returned {got!r}; it must return a dict whose "
                             f"num_blocks is a whole number")
        if blocks * block_size < context:
            raise ValueError(f"--stack: your kv_capacity gives {blocks} blocks of {block_size} tokens for a budget "
                             f"of {said}: fewer than one request of --context {context} tokens; raise --kv-memory-gib")
        from ..checkpoints import free_memory_bytes

        free = free_memory_bytes(model.device)
        if free is not None and blocks * block_size * per_token > free:
            raise ValueError(f"--stack: your kv_capacity gives {blocks} blocks for a budget of {said}: "
                             f"{blocks * block_size * per_token / 2**30:.2f} GiB of cache, more than the "
                             f"{free / 2**30:.2f} GiB free on {model.device}; lower --kv-memory-gib")
        self.sized = (f"kv_capacity sized the cache: {blocks} blocks of {block_size} tokens from a budget "
                      f"of {said}")
        return blocks

    def plug(self, model) -> list[str]:
        """Plug the parts that act on the model's forward pass into ``model`` (a course
        Transformer); returns the slots plugged in, with those that read its weights first."""
        done = list(self.loaded)
        if self.sized:
            done.append("kv_capacity")
            self.notes.insert(0, self.sized)
        elif "kv_capacity" in self.parts:
            self.notes.append("kv_capacity: yours passed its check, but --num-blocks sizes the cache (or the "
                              "engine is not the continuous one), so it is not used")
        unused = [slot for slot in DEQUANTIZE_SLOTS if slot in self.parts and slot not in self.loaded]
        if unused and not self.checkpoint:
            self.notes.append(f"{', '.join(unused)}: the course model is not read from a GGUF file, so your "
                              f"dequantisers are not used (serve one with --model smollm2-135m-instruct)")
        if "rope" in self.parts:
            part, file = self.parts["rope"]
            if model.cfg.rope_scaling is not None:
                self.notes.append(f"rope: {model.cfg.name} scales its RoPE frequencies ({model.cfg.rope_scaling}); "
                                  f"your apply_rope takes only a base, so the course's rotation serves")
            else:
                hook = guarded(BY_NAME["rope"], rope_hook(part, model.cfg.rope_theta), file)
                for layer in model.layers:
                    layer.attention.rope = hook
                done.append("rope")
        return done


def model_side(parts: dict[str, tuple[object, str]]) -> ModelSide:
    """The model-side slots of ``parts`` (what :func:`labsupport.serve.stack.load_parts` returned)."""
    return ModelSide({name: parts[name] for name in MODEL_SLOTS if name in parts})


def plug_model_side(backend, side: ModelSide) -> list[str]:
    """Plug ``side``'s parts into ``backend``'s model (and engine); returns the slots plugged in and adds
    a sentence saying so (and what could not serve, and how each kernel was checked on a CPU) to the
    back end's description."""
    model, engine = backend.model, getattr(backend, "engine", None)
    kernels = {name: side.parts[name] for name in KERNEL_SLOTS if name in side.parts}
    serve_kernels = bool(kernels) and kernels_serve(model.device) and engine is not None
    if serve_kernels and "fused_rope" in kernels and "rope" in side.parts:
        side.notes.append("rope: your fused_rope rotates on this GPU (the same hook); apply_rope is not used")
        side.parts.pop("rope")
    done = side.plug(model)
    if serve_kernels:
        done += plug_kernels(engine, kernels)
    elif kernels:
        if engine is None and kernels_serve(model.device):
            side.notes.append(f"{', '.join(kernels)}: your kernels serve in the continuous engine (--engine "
                              f"continuous); here they are checked")
        for name, said in check_kernels_on_cpu(model, kernels).items():
            side.notes.append(f"{name}: {said}")
    if done:
        backend.description += f" Your stack's model-side parts serve: {', '.join(done)}."
    for note in side.notes:
        backend.description += f" {note}."
    return done


# --- the Triton kernels' slots (lab 07's flash_attention, lab 08's fused_rope, lab 10's paged_attention) ---
CPU_CHECK_PROMPT = 6  # tokens of the start-up check's prompt on a CPU (its prefill is flash's forward pass)
CPU_CHECK_LAYERS = 4  # the layers whose kernels run in that check (the interpreter is slow; the shapes repeat)
CPU_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # max |yours - course's|, relative


def kernels_serve(device) -> bool:
    """Whether the Triton kernels' slots serve on ``device``: a CUDA GPU with Triton compiling (not the
    interpreter). Elsewhere they are checked on one forward pass (:func:`check_kernels_on_cpu`)."""
    return torch.device(device).type == "cuda" and not interpreter_mode()


def fused_rope_hook(fused_rope, model):
    """The :attr:`Attention.rope` hook of a learner's ``fused_rope(q, k, positions, inv_freq)``: one
    launch for the queries and keys, with ``model``'s own frequencies (read at each call: the model
    moves them to its device at its first forward pass); the kernel takes one position per token of
    the whole batch (``(B * S,)``), so the step's positions (the same for every row) are repeated per row."""
    def rope(q, k, positions):
        return fused_rope(q, k, positions.repeat(q.shape[0]), model._inv_freq)
    return rope


def _store(k, v, k_cache, v_cache, slot_mapping, backend: str) -> None:
    (store_kv_triton if backend == "triton" else store_kv)(k, v, k_cache, v_cache, slot_mapping)


class StackPagedBatch(PagedBatch):
    """The engine's KV batch with the learner's attention kernels where they serve (a GPU; the
    interpreter on a CPU in the tests' dry run):

    * ``paged`` (lab 10's ``paged_attention(q, k_cache, v_cache, block_tables, seq_lens)``): steps of
      decodes only; the engine's block tables and cache layout are the kernel's own;
    * ``flash`` (lab 07's ``flash_attention(q, k, v, causal)``): steps whose every sequence is a whole
      prompt with no cache hit (no cached tokens, no chunk after the first); the kernel takes
      equal-length sequences without grouped-query heads, so the step's sequences are grouped by
      length and each group runs as one batch, its keys and values repeated to the query heads (the
      adapter ``ContiguousBatch`` uses for attention callables);
    * any other step: the course's attention (the kernel's interface cannot run it).

    The keys and values are stored by the course's store (the kernels only read). ``check``: a dict
    to fill instead (the CPU's start-up check): the course's attention serves, and each learner kernel
    runs beside it on the same inputs, its largest difference recorded per slot."""

    def __init__(self, k_cache, v_cache, meta, backend: str = "torch", *, flash=None, paged=None,
                 check: dict | None = None):
        super().__init__(k_cache, v_cache, meta, backend)
        self.flash, self.paged, self.check = flash, paged, check
        self.groups = None  # flash's equal-length groups: [(length, [(start, end), ...]), ...]
        if flash is not None and not meta.decode_only:
            starts = meta.cu_seqlens_q.tolist()  # one host sync per step, not per layer
            lens = meta.seq_lens.tolist()
            spans = list(zip(starts[:-1], starts[1:]))
            if all(e - s == n for (s, e), n in zip(spans, lens)):  # every sequence a whole prompt, nothing cached
                by_len: dict[int, list] = {}
                for s, e in spans:
                    by_len.setdefault(e - s, []).append((s, e))
                self.groups = sorted(by_len.items())

    def _flash(self, q, k, v):
        """Flash attention over the step's whole prompts: q (N, H, D), k and v (N, Hkv, D) -> (N, H, D)."""
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for length, spans in self.groups:
            idx = torch.cat([torch.arange(s, e, device=q.device) for s, e in spans])  # rows of this group
            qg = q[idx].view(len(spans), length, *q.shape[1:]).transpose(1, 2)  # (B', H, S, D)
            kg = k[idx].view(len(spans), length, *k.shape[1:]).transpose(1, 2).repeat_interleave(group, dim=1)
            vg = v[idx].view(len(spans), length, *v.shape[1:]).transpose(1, 2).repeat_interleave(group, dim=1)
            got = _kernel_output("flash_attention", self.flash(qg, kg, vg, True), qg.shape)  # (B', H, S, D)
            out[idx] = got.transpose(1, 2).reshape(len(idx), *q.shape[1:]).to(q.dtype)
        return out

    def attend(self, layer: int, q, k, v):
        m = self.meta
        use_paged = self.paged is not None and m.decode_only
        use_flash = self.groups is not None
        if self.check is not None:  # the course's attention serves; the learner's kernels run beside it
            out = super().attend(layer, q, k, v)  # (1, H, N, D), stores k and v
            if layer >= CPU_CHECK_LAYERS:
                return out
            q3, k3, v3 = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
            if use_paged:
                mine = self.paged(q3, self.k_cache[layer], self.v_cache[layer], m.block_tables, m.seq_lens)
                _record(self.check, "paged_attention", layer, mine, out[0].transpose(0, 1))
            if use_flash:
                _record(self.check, "flash_attention", layer, self._flash(q3, k3, v3), out[0].transpose(0, 1))
            return out
        if not (use_paged or use_flash):
            return super().attend(layer, q, k, v)
        q3, k3, v3 = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, heads, D) views
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]  # (num_blocks, block_size, Hkv, D)
        _store(k3, v3, k_cache, v_cache, m.slot_mapping, self.backend)
        if use_paged:
            out = _kernel_output("paged_attention", self.paged(q3, k_cache, v_cache, m.block_tables, m.seq_lens),
                                 q3.shape)  # (B, H, D): a row per sequence (decode: one token each)
        else:
            out = self._flash(q3, k3, v3)
        return out.to(q.dtype).transpose(0, 1)[None]  # (1, H, N, D)


def _kernel_output(name: str, got, shape) -> torch.Tensor:
    """A learner kernel's output, or a PartFailed naming the slot where it is not a tensor of ``shape``
    (the step's requests fail, the server goes on)."""
    if isinstance(got, (tuple, list)) and got and isinstance(got[0], torch.Tensor):
        got = got[0]  # lab 07's returns (out, lse)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(shape):
        slot = BY_NAME[name]
        what = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise PartFailed(f"your {name} part (lab {slot.lab[:2]}, {slot.part}) returned {what} where the step needs "
                         f"a tensor of shape {tuple(shape)}; the step's requests fail, the server goes on with your part")
    return got


def _record(check: dict, slot: str, layer: int, mine, course) -> None:
    """The largest relative difference of a learner kernel's output from the course's, kept per slot."""
    if not isinstance(mine, torch.Tensor) or mine.shape != course.shape:
        got = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
        raise ValueError(f"returned {got} where the course's attention gives {tuple(course.shape)}")
    err = ((mine.float() - course.float()).abs().max() / (1 + course.float().abs().max())).item()
    if err > check.get(slot, (-1.0, 0))[0] or err != err:
        check[slot] = (err, layer)


def plug_kernels(engine, kernels: dict[str, tuple[object, str]]) -> list[str]:
    """Serve the learner's kernels (slot -> (part, file)) in ``engine`` (a course Engine on a GPU, or in
    the interpreter for a dry run): ``fused_rope`` as every layer's rope hook, ``flash_attention`` and
    ``paged_attention`` in the steps :class:`StackPagedBatch` gives them. The engine's CUDA graphs are
    dropped: they were captured with the course's kernels (and a replay would bypass the learner's).
    Returns the slots plugged in."""
    runner, model = engine.runner, engine.model
    fn = {name: guarded(BY_NAME[name], part, file) for name, (part, file) in kernels.items() if name in KERNEL_SLOTS}
    if not fn:
        return []
    runner._graphs.clear()
    runner.graph_sizes = []
    if "fused_rope" in fn:
        hook = fused_rope_hook(fn["fused_rope"], model)
        for layer in model.layers:
            layer.attention.rope = hook
    if "flash_attention" in fn or "paged_attention" in fn:
        flash, paged = fn.get("flash_attention"), fn.get("paged_attention")

        def forward(meta):  # ModelRunner.forward without graphs, through the learner's kernels
            kv = StackPagedBatch(runner.store.k, runner.store.v, meta, runner.attention, flash=flash, paged=paged)
            return runner.model(meta.input_ids[None], kv)[0][meta.logits_indices]  # (R, d)

        runner.forward = forward
    return [name for name in KERNEL_SLOTS if name in fn]


@torch.no_grad()
def check_kernels_on_cpu(model, kernels: dict[str, tuple[object, str]], prompt_len: int = CPU_CHECK_PROMPT) -> dict:
    """Run the learner's kernels once beside the course's on the served ``model``: one short prompt
    through a throwaway engine (its prefill is flash_attention's forward pass, its one decode
    paged_attention's), the outputs of the first :data:`CPU_CHECK_LAYERS` layers compared, and
    fused_rope's rotation of those layers' queries and keys compared with the rotation that serves. Returns slot -> a sentence: ``"checked on CPU:
    ..."`` (with the largest difference and its tolerance) or what went wrong (a raise, named by slot
    and line, or a difference past the tolerance). Nothing here serves."""
    from ..engine import Engine
    from ..sampling import SamplingParams

    fn = {name: guarded(BY_NAME[name], part, file) for name, (part, file) in kernels.items() if name in KERNEL_SLOTS}
    tol = CPU_CHECK_TOLERANCE.get(model.dtype, 2e-2)
    errors: dict[str, tuple[float, int]] = {}
    raised: dict[str, str] = {}
    saved = [layer.attention.__dict__.get("rope") for layer in model.layers]
    if "fused_rope" in fn:
        for i, layer in enumerate(model.layers[:CPU_CHECK_LAYERS]):
            layer.attention.rope = _checking_rope(fn["fused_rope"], model, saved[i], errors, raised, i)
    engine = Engine(model, num_blocks=max(2, -(-(prompt_len + 2) // 16)), block_size=16, attention="torch",
                    cuda_graphs=False, prefix_caching=False)
    flash, paged = fn.get("flash_attention"), fn.get("paged_attention")

    def forward(meta):
        kv = _CheckingBatch(engine.runner.store.k, engine.runner.store.v, meta, "torch", flash=flash, paged=paged,
                            check=errors, raised=raised)
        return model(meta.input_ids[None], kv)[0][meta.logits_indices]

    engine.runner.forward = forward
    prompt = torch.arange(prompt_len).mul(7919).remainder(model.cfg.vocab_size).tolist()  # any tokens will do
    try:
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    finally:
        for layer, rope in zip(model.layers, saved):
            if rope is None:
                layer.attention.__dict__.pop("rope", None)
            else:
                layer.attention.rope = rope
    said = {}
    for name in fn:
        if name in raised:
            said[name] = raised[name]
        elif name not in errors:
            said[name] = "not run by the check's forward pass"
        else:
            err, layer = errors[name]
            verdict = "checked on CPU" if err <= tol else "FAILED the check on CPU"
            said[name] = (f"{verdict}: largest difference from the course's {err:.2g} (layer {layer}; tolerance "
                          f"{tol:g}) on one forward pass, its first {CPU_CHECK_LAYERS} layers; it serves on a GPU")
    return said


class _CheckingBatch(StackPagedBatch):
    """:class:`StackPagedBatch` in its checking mode, a learner kernel's raise recorded (not raised)."""

    def __init__(self, *args, raised: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.raised = raised

    def attend(self, layer: int, q, k, v):
        try:
            return super().attend(layer, q, k, v)
        except Exception as exc:  # whatever the learner's kernel does, the start-up check reports it
            name = "paged_attention" if self.meta.decode_only else "flash_attention"
            self.raised.setdefault(name, str(exc) if isinstance(exc, PartFailed) else f"your {name} part {exc}")
            if name == "paged_attention":
                self.paged = None
            else:
                self.groups = None
            return PagedBatch.attend(self, layer, q, k, v)


def _checking_rope(fused, model, serving, errors: dict, raised: dict, layer: int):
    """A rope hook for the check's one forward pass: it rotates with the course's rotation (the
    reference, also where the learner's ``apply_rope`` serves: ``serving`` is not used here, so the
    check never compares the learner's kernel with the learner's own rotation) and runs the learner's
    fused_rope beside it, recording the largest difference."""
    def rope(q, k, positions):
        cos, sin = rope_cos_sin(positions, model.cfg.head_dim, model.dtype, inv_freq=model._inv_freq)
        q_ref, k_ref = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if "fused_rope" not in raised:
            try:
                mine = fused_rope_hook(fused, model)(q, k, positions)
                _record(errors, "fused_rope", layer, mine[0], q_ref)
                _record(errors, "fused_rope", layer, mine[1], k_ref)
            except Exception as exc:  # whatever the learner's kernel does, the start-up check reports it
                raised["fused_rope"] = str(exc) if isinstance(exc, PartFailed) else f"your fused_rope part: {exc}"
        return q_ref, k_ref
    return rope
