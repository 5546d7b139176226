"""Serve through a learner's assembled stack (``python -m labsupport.serve --stack my-labs/``, issue 31).

The assembly (:mod:`labsupport.course.stack`, instructor tooling: it needs the grader's splice and the
checks) runs in a subprocess, ``python -m labsupport stack``, and writes ``stack.json`` into its cache
folder; this module reads only that file and imports the learner's module files it names, so the
server imports nothing of the course tooling.

The wired slots (:func:`labsupport.stack.serving_slots`) plug in as follows:

* ``prepare_step`` (lab 12): ``engine.runner.assemble``; step-wide;
* ``scheduler`` (lab 13): the engine's step decision (``engine.scheduler.decide``); step-wide;
* ``sampler`` (lab 13): the engine's per-row sampler (``PerRowSampler``); step-wide;
* ``stop_strings`` (lab 01): the back end's stop-string filter (``Backend.stop_filter``); per request;
* ``detokenizer`` (lab 01): each request's incremental detokenizer (``Backend.detokenizer``), reading
  the model tokenizer's token bytes through :class:`TokenBytes`; per request;
* the engine-side slots of :mod:`.stack_engine`: ``block_allocator`` (lab 10) as the engine's block
  pool with prefix caching off, step-wide; ``speculative_accept`` (lab 13) as the engine's draft
  verification with ``--num-speculative-tokens``, step-wide (the learner's sampler is then left out:
  the engine samples every step with its own); ``prefix_cache`` (lab 10), checked while serving by
  replaying the engine's admissions on it (``GET /health``: ``stack_prefix_cache``).

The model-side slots act where the model is loaded, sized and run, so the server assembles the stack
*before* it loads the model (:mod:`labsupport.serve.stack_model`, ``plug_model_side``):

* ``dequantize_q8_0``, ``dequantize_q4_1`` (lab 09): read the GGUF file's blocks inside the loader,
  their conversion cached apart from the course's (keyed by a hash of the learner's module file); at load;
* ``kv_capacity`` (lab 12): the engine's number of KV blocks, from the budget ``--kv-memory-gib`` says;
  at start-up;
* ``rope`` (lab 08): every layer's ``Attention.rope`` hook; step-wide;
* ``fused_rope`` (lab 08), ``flash_attention`` (lab 07), ``paged_attention`` (lab 10): Triton kernels
  that serve on a GPU (the rope hook; steps of whole prompts; steps of decodes only) and on a CPU are
  checked beside the course's kernels on one forward pass at start-up, never served; step-wide.

A load-time part that raises stops the start-up with a message naming the slot and the learner's line
(there is no request yet to fail).

A part that cannot serve with the server's options is left out, and the server's description says
which and why. Every part is wrapped so that an exception it raises becomes a :class:`PartFailed`
(:mod:`.stack_guard`) whose message names the slot, the lab and the learner's line. The server's own
failure handling does the rest: a step-wide part that raises fails the requests of that step, a
per-request part fails its request, and the server goes on with the learner's part (the course's
part is never substituted mid-run).

**A profile by slot** (the capstone, lab 16): every guarded call also adds its time to
:data:`.stack_guard.PROFILE`, and so does every engine step, the learner's parts or not; ``GET /health``
then says, under ``stack_profile``, each slot's calls and seconds, the steps' and the prefix cache's
counts, so a client can tell what each of the learner's parts cost in the step.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from ..engine.sampler import PerRowSampler
from ..stack import BY_NAME, SLOTS, Slot
from .stack_engine import ENGINE_SLOTS, plug_engine_part
from .stack_guard import PROFILE, PartFailed, SlotProfile, guarded, learner_line  # noqa: F401 (PartFailed, learner_line: re-exported)

MANIFEST_NAME = "stack.json"  # as labsupport.course.stack writes it


class GuardedFilter:
    """A learner's stop-string filter, made on its first use (so its constructor raises where the
    request's tokens are sent, and fails that request alone), its ``push`` and ``flush`` guarded."""

    def __init__(self, slot: Slot, cls, file: str, stops):
        self._make = guarded(slot, lambda: cls(stops), file)
        self._slot, self._file, self._obj = slot, file, None

    def _filter(self):
        if self._obj is None:
            self._obj = self._make()
        return self._obj

    def push(self, text: str):
        return guarded(self._slot, self._filter().push, self._file)(text)

    def flush(self) -> str:
        return guarded(self._slot, self._filter().flush, self._file)()


def guarded_class(slot: Slot, cls, file: str):
    """A factory like ``cls`` whose objects' constructor and methods are guarded."""
    return lambda stops: GuardedFilter(slot, cls, file, stops)


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters (GPT-2's, used by SmolLM2 and Qwen): the
    printable Latin-1 bytes stand for themselves, the other 68 bytes for the characters from U+0100 on,
    in byte order. Returns character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    """Lab 01's detokenizer reads ``tokenizer.token_bytes(id)``; the model's tokenizer (byte-level BPE)
    spells each token's bytes as characters (:func:`_byte_alphabet`). This gives the bytes back; a
    special token's bytes are its string in UTF-8, as the course tokenizer's are."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "_backend", None)  # the tokenizers.Tokenizer of a ModelTokenizer
        if backend is None or not hasattr(tokenizer, "_special"):
            raise ValueError(f"your detokenizer reads token bytes, which the served tokenizer "
                             f"({type(tokenizer).__name__}) does not give")
        self._alphabet = _byte_alphabet()
        self._token = backend.id_to_token
        self._special = {i: s for s, i in tokenizer._special.items()}
        strange = [i for i in range(tokenizer.vocab_size) if i not in self._special
                   and any(c not in self._alphabet for c in (self._token(i) or "\x00"))]
        if strange:
            raise ValueError(f"the model's tokenizer is not byte-level BPE (token {strange[0]} is "
                             f"{self._token(strange[0])!r}): your detokenizer cannot read its tokens' bytes")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return self._special[token_id].encode("utf-8")
        return bytes(self._alphabet[c] for c in self._token(int(token_id)))


class GuardedDetokenizer:
    """A learner's detokenizer over the model tokenizer's bytes, made on its first use (as
    :class:`GuardedFilter`), its ``push`` and ``flush`` guarded."""

    def __init__(self, slot: Slot, cls, file: str, token_bytes: TokenBytes):
        self._make = guarded(slot, lambda: cls(token_bytes), file)
        self._slot, self._file, self._obj = slot, file, None

    def _detokenizer(self):
        if self._obj is None:
            self._obj = self._make()
        return self._obj

    def push(self, token_id: int) -> str:
        return guarded(self._slot, self._detokenizer().push, self._file)(token_id)

    def flush(self) -> str:
        return guarded(self._slot, self._detokenizer().flush, self._file)()


def load_parts(manifest: Path) -> dict[str, tuple[object, str]]:
    """slot -> (the learner's part, its module file) for every wired slot the manifest gives the learner
    (a GPU-only slot too: on a CPU its kernel is checked at start-up, :mod:`.stack_model`)."""
    data = json.loads(Path(manifest).read_text(encoding="utf-8"))
    wired = {s.name for s in SLOTS if s.wired}
    modules: dict[str, object] = {}
    parts = {}
    for name, where in data.get("parts", {}).items():
        if name not in wired:
            continue
        file = where["file"]
        if file not in modules:
            module_name = Path(file).stem
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                raise ValueError(f"--stack: your lab {where['lab']} module {file} raised when imported "
                                 f"({type(exc).__name__}: {exc}); run python -m labsupport stack again") from exc
            modules[file] = module
        parts[name] = (getattr(modules[file], where["name"]), file)
    return parts


def assemble_stack(labs_dir: str, cache_dir: str | None = None) -> tuple[Path, str]:
    """Run ``python -m labsupport stack`` on ``labs_dir`` in a subprocess; returns the manifest's path and
    the table it printed (a ValueError with its message if it failed)."""
    cache = Path(cache_dir).expanduser() if cache_dir else (
        Path(os.environ.get("LABSUPPORT_CACHE") or Path.home() / ".cache" / "labsupport").expanduser() / "stack")
    proc = subprocess.run([sys.executable, "-m", "labsupport", "stack", str(labs_dir), "--cache", str(cache)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise ValueError(f"--stack {labs_dir}: assembly failed: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return cache / MANIFEST_NAME, proc.stdout.strip()


def plug_in(backend, parts: dict[str, tuple[object, str]]) -> list[str]:
    """Plug the learner's parts into ``backend`` (a ContinuousBackend for the engine's slots); returns
    the slots plugged in. A ValueError where a part cannot go into this back end. A part that cannot
    serve with the back end's options is left out, and the back end's description says why."""
    done, left_out = [], {}
    engine = getattr(backend, "engine", None)
    engine_slots = [n for n in ("prepare_step", "scheduler", "sampler", *ENGINE_SLOTS) if n in parts]
    if engine_slots and engine is None:
        raise ValueError(f"--stack: your {', '.join(engine_slots)} part(s) serve in the continuous engine: "
                         f"add --engine continuous")
    if "sampler" in parts and getattr(engine, "speculative", None) is not None:
        left_out["sampler"] = ("speculative decoding (--num-speculative-tokens) verifies drafts, so the engine "
                               "samples every step with its own sampler")
    for name, (part, file) in parts.items():
        slot = BY_NAME[name]
        if name in left_out:
            continue
        if name == "prepare_step":
            engine.runner.assemble = guarded(slot, part, file)
        elif name == "scheduler":
            engine.scheduler.decide = guarded(slot, part, file)
        elif name == "sampler":
            engine.sampler = PerRowSampler(guarded(slot, part, file))
        elif name == "stop_strings":
            backend.stop_filter = guarded_class(slot, part, file)
        elif name == "detokenizer":
            tok = getattr(backend.tokenizer, "bpe", backend.tokenizer)  # the course model's: its BPE has token_bytes
            token_bytes = tok if callable(getattr(tok, "token_bytes", None)) else TokenBytes(tok)
            backend.detokenizer = functools.partial(GuardedDetokenizer, slot, part, file, token_bytes)
        elif name in ENGINE_SLOTS:
            why = plug_engine_part(backend, slot, part, file)
            if why:
                left_out[name] = why
                continue
        else:
            continue
        done.append(name)
    serving = [n for n in done if BY_NAME[n].serves]
    if serving:
        backend.description += f" Your stack's parts serve: {', '.join(serving)}."
    if left_out:
        backend.description += " Left out (the course's part serves): " + "; ".join(
            f"your {n} ({why})" for n, why in left_out.items()) + "."
    _profile(backend, PROFILE)
    return done


def _profile(backend, profile: SlotProfile) -> None:
    """Time every engine step too, and add ``stack_profile`` to the back end's stats (``/health``)."""
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.step = profile.timed("step", engine.step)
    own_stats = backend.stats

    def stats() -> dict:
        found = {"slots": profile.snapshot()}
        if engine is not None:
            found["prefix_cache"] = engine.block_manager.stats()  # queries and hits in prompt tokens
        return {**own_stats(), "stack_profile": found}
    backend.stats = stats
